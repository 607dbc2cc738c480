#define SMDDP_ISA_NS avx2
#include "core/reduce_kernels.inc"
