#define SMDDP_ISA_NS avx512
#define SMDDP_ISA_AVX512 1
#include "core/reduce_kernels.inc"
