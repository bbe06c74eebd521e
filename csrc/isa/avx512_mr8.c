/* The AVX-512 instantiation with a GEMM tile of 8 rows by 3 vectors (8 x 48 floats), chosen
 * at run time on Intel CPUs with AVX-512. On a 16-core Intel Xeon (family 6, model 207) the
 * 12 x 2 tile of avx512.c ran a 256-cube at 42-56% of the FMA peak and this one faster (the
 * flash forward 20% faster); on AMD Zen 4 the 12-row tile is the faster (97% against 84%). */
#define PA_ISA avx512_mr8
#define PA_TILE_ROWS 8
#define PA_TILE_VECS 3
#include "avx512_target.h"
