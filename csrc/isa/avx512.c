/* The AVX-512 instantiation (zmm vectors), chosen at run time when the CPU has it. */
#if defined(__x86_64__) && defined(__GNUC__)
#include "prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
#endif

#define PA_ISA avx512
#define PA_VBYTES 64
#include "instantiate.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
