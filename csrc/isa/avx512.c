/* The AVX-512 instantiation with the GEMM's 12-row tile, chosen at run time when the CPU has
 * AVX-512 and is not an Intel one (csrc/dispatch.c). */
#define PA_ISA avx512
#include "avx512_target.h"
