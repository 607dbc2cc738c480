#define SMDDP_ISA_NS avx512
#include "core/reduce_kernels.inc"
