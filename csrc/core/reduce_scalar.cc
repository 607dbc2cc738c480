#define SMDDP_ISA_NS scalar
#include "core/reduce_kernels.inc"
