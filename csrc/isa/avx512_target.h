/* The AVX-512 instantiations (zmm vectors): included by avx512.c and avx512_mr8.c, which
 * name PA_ISA (and the second its GEMM tile) first. */
#if defined(__x86_64__) && defined(__GNUC__)
#include "prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
#endif

#define PA_VBYTES 64
#include "instantiate.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
