/* System headers every instantiation needs, included before any target pragma so they
 * keep their default target. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "../core/gemm_bf16.h"
#include "../core/parallel.h"
#include "../kernels.h"

#define PA_STR_(x) #x
#define PA_STR(x) PA_STR_(x)
