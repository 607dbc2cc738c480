#define SMDDP_ISA_NS avx2
#define SMDDP_ISA_AVX2 1
#include "core/reduce_kernels.inc"
