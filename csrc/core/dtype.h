/* The float/double x ISA templating used by every kernel.
 *
 * A template body (core/gemm.c and the files in ops/) is written once against the names below and is
 * included by csrc/isa/instantiate.h once per (dtype, ISA). Before each inclusion the
 * includer defines:
 *   PA_DOUBLE   0 for float, 1 for double
 *   PA_ISA      avx512 | avx2 | generic   (a bare token, used in symbol names)
 *   PA_VBYTES   64 | 32 | 16              (bytes per SIMD register)
 * and this header (re)defines:
 *   real        the scalar type;  vreal  a GCC vector of PA_VBYTES bytes of real
 *   vint        the same-sized integer vector (int32 lanes for float, int64 for double)
 *   vuint       its unsigned twin (shifts that drop bits off the top)
 *   VL          lanes per vreal
 *   PA_FN(x)    x mangled with dtype and ISA, so every instantiation has its own symbols
 * Vector extensions (not intrinsics) let one source compile to zmm, ymm or xmm code under
 * the target attribute in force, and to NEON or plain scalars elsewhere.
 */
#undef real
#undef vreal
#undef vint
#undef vuint
#undef ivec_elem
#undef VL
#undef PA_FN
#undef PA_DT
#undef PA_REAL_MAX
#undef PA_CAT3
#undef PA_SQRT
#undef PA_CAT3_

#define PA_CAT3_(a, b, c) a##_##b##_##c
#define PA_CAT3(a, b, c) PA_CAT3_(a, b, c)

#if PA_DOUBLE
#define real double
#define ivec_elem long long
#define PA_DT f64
#define PA_REAL_MAX 1.7976931348623157e308
#define PA_SQRT sqrt
#else
#define real float
#define ivec_elem int
#define PA_DT f32
#define PA_REAL_MAX 3.4028234663852886e38f
#define PA_SQRT sqrtf
#endif

#define PA_FN(x) PA_CAT3(x, PA_DT, PA_ISA)
#define VL ((int)(PA_VBYTES / sizeof(real)))
#define vreal PA_FN(vreal_t)
#define vint PA_FN(vint_t)
#define vuint PA_FN(vuint_t)

typedef real vreal __attribute__((vector_size(PA_VBYTES)));
typedef ivec_elem vint __attribute__((vector_size(PA_VBYTES)));
typedef unsigned ivec_elem vuint __attribute__((vector_size(PA_VBYTES)));
