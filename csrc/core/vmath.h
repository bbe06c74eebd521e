/* Vectorised exp and the row primitives built on it. Template body (see dtype.h): included
 * once per (dtype, ISA). No -ffast-math: every special value is handled explicitly.
 *
 * vexp(x): x = n ln2 + r with n = round(x / ln2) and a two-constant (Cody-Waite) ln2 so r is
 * exact to working precision, |r| <= ln2/2; exp(r) by its Taylor polynomial (degree 7 for
 * float, 13 for double: truncation below 0.05 ulp); 2^n applied as two factors 2^(n/2) so
 * subnormal results are rounded, not flushed. exp(-inf) = 0, exp(+inf) = inf, NaN -> NaN.
 * Measured worst-case relative error, normal results only (tests/test_core.py measures it
 * again): float 7.8e-08 (0.93 ulp) over 4e6 points in [-87.3, 88.7] against float64 exp;
 * double 2.2e-16 (1 ulp) over 4e6 points in [-708, 709] against NumPy's exp (the generic
 * build, without FMA, measures 1.0e-07 in float).
 *
 * vexp_nonpos(x): the softmax passes' exp (row_exp_sum, vec_exp_sub_acc, col_exp_sub_acc,
 * the sparse and decode backwards), whose arguments are x - max or s - lse:
 * vexp's reduction and polynomial, so the same bits on normal results, without the overflow
 * clamp and with 2^n as one factor. Exactly 0 below -87.6 (-708.7 in double), where 2^n would
 * be subnormal; a subnormal rounded once between there and the least normal result. Correct
 * up to x = 88.37 (709.43), undefined above (+inf gives NaN).
 */
#include "dtype.h"

/* Broadcast: -0 + a == a for every a (also -0), so the compiler emits a bare broadcast;
 * `(vreal){0} + a` would keep a scalar add (+0 + -0 is +0), a lane loop masked moves. */
static inline vreal PA_FN(vset)(real a) { return -(vreal){0} + a; }

static inline vreal PA_FN(vload)(const real *p)
{
    vreal v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void PA_FN(vstore)(real *p, vreal v) { memcpy(p, &v, sizeof v); }

/* First n (< VL) lanes from p, the rest set to fill. */
static inline vreal PA_FN(vload_part)(const real *p, int n, real fill)
{
    real buf[PA_VBYTES / sizeof(real)];
    for (int i = 0; i < VL; i++) buf[i] = i < n ? p[i] : fill;
    return PA_FN(vload)(buf);
}

static inline void PA_FN(vstore_part)(real *p, vreal v, int n)
{
    real buf[PA_VBYTES / sizeof(real)];
    PA_FN(vstore)(buf, v);
    for (int i = 0; i < n; i++) p[i] = buf[i];
}

static inline vreal PA_FN(vselect)(vint mask, vreal a, vreal b)
{
    return (vreal)(((vint)a & mask) | ((vint)b & ~mask));
}

/* Horizontal sum as a tree: the upper half of the vector added to the lower, down to 16
 * bytes, then lane by lane. A loop over the lanes would be a serial chain of VL scalar adds
 * (nothing may reorder it without -ffast-math), the largest cost of a short dot product. */
#define PA_LO(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
static inline real PA_FN(hsum)(vreal v)
{
#if PA_VBYTES == 64 && !PA_DOUBLE
    __typeof__(PA_LO(v, 0, 1, 2, 3, 4, 5, 6, 7)) h8 =
        PA_LO(v, 0, 1, 2, 3, 4, 5, 6, 7) + PA_LO(v, 8, 9, 10, 11, 12, 13, 14, 15);
    __typeof__(PA_LO(h8, 0, 1, 2, 3)) q = PA_LO(h8, 0, 1, 2, 3) + PA_LO(h8, 4, 5, 6, 7);
#elif PA_VBYTES == 64 || (PA_VBYTES == 32 && !PA_DOUBLE)
    __typeof__(PA_LO(v, 0, 1, 2, 3)) h4 = PA_LO(v, 0, 1, 2, 3) + PA_LO(v, 4, 5, 6, 7);
#if PA_DOUBLE
    __typeof__(PA_LO(h4, 0, 1)) q = PA_LO(h4, 0, 1) + PA_LO(h4, 2, 3);
#else
    __typeof__(h4) q = h4;
#endif
#elif PA_VBYTES == 32
    __typeof__(PA_LO(v, 0, 1)) q = PA_LO(v, 0, 1) + PA_LO(v, 2, 3);
#else
    vreal q = v;
#endif
#if PA_DOUBLE
    return q[0] + q[1];
#else
    return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}
#undef PA_LO

static inline real PA_FN(hmax)(vreal v)
{
    real m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* The shared core of vexp and vexp_nonpos: exp(r) by the Taylor polynomial, where x = n ln2
 * + r, and t = shifter + n, whose low mantissa bits hold n. n is right for finite x within
 * 2^22 ln2 (2^51 ln2 in double) of 0; vexp clamps both ends, vexp_nonpos masks x < lo and
 * needs x <= 88.37 (709.43). */
#if PA_DOUBLE
#define PA_EXP_SHIFTER 6755399441055744.0 /* 1.5 * 2^52: adding it rounds to an integer */
#define PA_EXP_MANT 52
#define PA_EXP_BIAS 1023LL
#else
#define PA_EXP_SHIFTER 12582912.0f /* 1.5 * 2^23 */
#define PA_EXP_MANT 23
#define PA_EXP_BIAS 127
#endif
static inline vreal PA_FN(vexp_reduced)(vreal x, vreal *t)
{
#if PA_DOUBLE
    const real ln2_hi = 0.693147180559890330187, ln2_lo = 5.4979230187083711552e-14;
    static const real c[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0,
                             1.0 / 3628800.0,    1.0 / 362880.0,    1.0 / 40320.0,
                             1.0 / 5040.0,       1.0 / 720.0,       1.0 / 120.0,
                             1.0 / 24.0,         1.0 / 6.0,         0.5,
                             1.0,                1.0};
#else
    const real ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187045e-06f;
    static const real c[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                             1.0f / 6.0f,    0.5f,          1.0f,          1.0f};
#endif
    const real log2e = (real)1.44269504088896340736;
    *t = x * log2e + PA_EXP_SHIFTER;
    vreal n = *t - PA_EXP_SHIFTER;
    vreal r = x - n * ln2_hi;
    r = r - n * ln2_lo;
    vreal p = PA_FN(vset)(c[0]);
    for (size_t i = 1; i < sizeof c / sizeof c[0]; i++) p = p * r + c[i];
    return p;
}

static inline vreal PA_FN(vexp)(vreal x)
{
#if PA_DOUBLE
    const real lo = -745.2, hi = 710.0;
#else
    const real lo = -104.0f, hi = 89.0f;
#endif
    vint underflow = x < PA_FN(vset)(lo);
    x = PA_FN(vselect)(underflow, PA_FN(vset)(lo), x);
    x = PA_FN(vselect)(x > PA_FN(vset)(hi), PA_FN(vset)(hi), x);
    vreal t;
    vreal p = PA_FN(vexp_reduced)(x, &t);
    vint ni = (vint)t - (vint)PA_FN(vset)(PA_EXP_SHIFTER);
    vint n1 = ni >> 1;
    vint n2 = ni - n1;
    vreal s1 = (vreal)((n1 + PA_EXP_BIAS) << PA_EXP_MANT);
    vreal s2 = (vreal)((n2 + PA_EXP_BIAS) << PA_EXP_MANT);
    vreal y = p * s1 * s2;
    return PA_FN(vselect)(underflow, PA_FN(vset)(0), y);
}

/* exp(x) for a softmax's x = s - max s <= 0 (correct up to 88.37, 709.43 in double; undefined
 * above): the same polynomial as vexp, without the overflow clamp and with 2^n as one
 * factor, a third fewer operations. x below lo, where 2^n would be subnormal, gives exactly
 * 0; results between exp(lo) and the least normal number are subnormals rounded once. Beside
 * the row's largest weight, 1, such a weight is below the sum's last bit. NaN -> NaN, -inf
 * -> 0. tests/test_core.py measures it through _core.exp_nonpos. */
static inline vreal PA_FN(vexp_nonpos)(vreal x)
{
#if PA_DOUBLE
    const real lo = -708.7; /* n = round(x / ln2) >= -1022 above it: 2^n is normal */
#else
    const real lo = -87.6f; /* n >= -126 */
#endif
    vreal t;
    vreal p = PA_FN(vexp_reduced)(x, &t);
    /* the shifter's low mantissa bits are 0, so t shifted into the exponent field is n's
     * (unsigned: the shift drops the shifter's bits off the top) */
    vreal scale = (vreal)(((vuint)t << PA_EXP_MANT) + ((vuint){0} + (PA_EXP_BIAS << PA_EXP_MANT)));
    return PA_FN(vselect)(x < PA_FN(vset)(lo), PA_FN(vset)(0), p * scale);
}
#undef PA_EXP_SHIFTER
#undef PA_EXP_MANT
#undef PA_EXP_BIAS

/* y[i] = exp(x[i]), by vexp_nonpos when nonpos (a constant where inlined) */
static inline __attribute__((always_inline)) void PA_FN(exp_array_by)(const real *x, real *y,
                                                                       int64_t n, int nonpos)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal v = PA_FN(vload)(x + i);
        PA_FN(vstore)(y + i, nonpos ? PA_FN(vexp_nonpos)(v) : PA_FN(vexp)(v));
    }
    if (i < n) {
        int r = (int)(n - i);
        vreal v = PA_FN(vload_part)(x + i, r, 0);
        PA_FN(vstore_part)(y + i, nonpos ? PA_FN(vexp_nonpos)(v) : PA_FN(vexp)(v), r);
    }
}

static void PA_FN(exp_array)(const real *x, real *y, int64_t n) { PA_FN(exp_array_by)(x, y, n, 0); }

static inline real PA_FN(row_max)(const real *x, int64_t n)
{
    vreal m = PA_FN(vset)(-(real)INFINITY);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal v = PA_FN(vload)(x + i);
        m = PA_FN(vselect)(v > m, v, m);
    }
    if (i < n) {
        vreal v = PA_FN(vload_part)(x + i, (int)(n - i), -(real)INFINITY);
        m = PA_FN(vselect)(v > m, v, m);
    }
    return PA_FN(hmax)(m);
}

/* x[i] = exp(x[i] - m) in place; returns the sum. The fused exp+sum pass of the softmax: m is
 * the row's maximum (0 for a row of -inf), or its log-sum-exp, which a recomputed score may
 * exceed only by rounding; x[i] - m must stay <= 88.37 (709.43: vexp_nonpos). */
static inline real PA_FN(row_exp_sum)(real *x, int64_t n, real m)
{
    vreal s = PA_FN(vset)(0), vm = PA_FN(vset)(m);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal e = PA_FN(vexp_nonpos)(PA_FN(vload)(x + i) - vm);
        PA_FN(vstore)(x + i, e);
        s += e;
    }
    if (i < n) {
        int r = (int)(n - i);
        vreal e = PA_FN(vexp_nonpos)(PA_FN(vload_part)(x + i, r, -(real)INFINITY) - vm);
        PA_FN(vstore_part)(x + i, e, r);
        s += e;
    }
    return PA_FN(hsum)(s);
}

static inline void PA_FN(row_scale)(real *x, int64_t n, real a)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL) PA_FN(vstore)(x + i, PA_FN(vload)(x + i) * a);
    for (; i < n; i++) x[i] *= a;
}

static inline real PA_FN(row_sum)(const real *x, int64_t n)
{
    vreal s = PA_FN(vset)(0);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) s += PA_FN(vload)(x + i);
    real r = PA_FN(hsum)(s);
    for (; i < n; i++) r += x[i];
    return r;
}

static inline real PA_FN(dot)(const real *x, const real *y, int64_t n)
{
    vreal s = PA_FN(vset)(0);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) s += PA_FN(vload)(x + i) * PA_FN(vload)(y + i);
    real r = PA_FN(hsum)(s);
    for (; i < n; i++) r += x[i] * y[i];
    return r;
}

/* x = softmax(x) over its n entries, in place. A NaN or +inf entry, or all entries -inf,
 * give NaN everywhere, as exp(x - max x) does in float64: row_max skips NaN, but then
 * exp(NaN - m), exp(inf - inf) and the sum are NaN; never a silent 0. */
static inline void PA_FN(softmax_inplace)(real *x, int64_t n)
{
    PA_FN(row_scale)(x, n, 1 / PA_FN(row_exp_sum)(x, n, PA_FN(row_max)(x, n)));
}

/* dx = alpha y (dy - y.dy): the softmax's backward from its output y (dx may be y); a NaN in
 * y or dy reaches every dx through y.dy */
static inline void PA_FN(softmax_vjp)(const real *y, const real *dy, real *dx, int64_t n,
                                      real alpha)
{
    const real s = PA_FN(dot)(y, dy, n);
    for (int64_t i = 0; i < n; i++) dx[i] = alpha * y[i] * (dy[i] - s);
}


/* Prefetch n reals from p for reading, into L2 (l1 = 0: ahead of a block) or L1 (l1 = 1: a
 * few rows ahead of a pass): rows that lie pages apart (one head's row of a [T, H, D] array),
 * which hardware prefetchers do not run ahead along. Always inlined, as must be any function
 * whose only work is to call it: GCC's IPA takes a function that only prefetches for pure
 * and deletes its calls; inlined, l1 is a constant, as the builtin's hint must be. */
#ifndef PA_PREFETCH_LINE
#define PA_PREFETCH_LINE(p, l1) ((l1) ? __builtin_prefetch((p), 0, 3) : __builtin_prefetch((p), 0, 2))
#endif
static inline __attribute__((always_inline)) void PA_FN(prefetch_span)(const real *p, int64_t n,
                                                                       int l1)
{
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(real)) PA_PREFETCH_LINE(p + i, l1);
    if (n > 0) PA_PREFETCH_LINE(p + n - 1, l1); /* the last line of a row not 64-byte aligned */
}

/* y += a x */
static inline void PA_FN(axpy)(real *y, const real *x, int64_t n, real a)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL)
        PA_FN(vstore)(y + i, PA_FN(vload)(y + i) + a * PA_FN(vload)(x + i));
    for (; i < n; i++) y[i] += a * x[i];
}

/* m[i] = max(m[i], x[i]): a running column maximum, vectorised across columns. */
static inline void PA_FN(vec_max_into)(real *m, const real *x, int64_t n)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal a = PA_FN(vload)(m + i), b = PA_FN(vload)(x + i);
        PA_FN(vstore)(m + i, PA_FN(vselect)(b > a, b, a));
    }
    for (; i < n; i++) m[i] = x[i] > m[i] ? x[i] : m[i];
}

/* x[i] = exp(x[i] - m[i]) in place and s[i] += x[i]: the exp+sum pass of a softmax taken
 * down columns, m[i] a column maximum (x[i] - m[i] <= 88.37, 709.43: vexp_nonpos). */
static inline void PA_FN(vec_exp_sub_acc)(real *x, const real *m, real *s, int64_t n)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal e = PA_FN(vexp_nonpos)(PA_FN(vload)(x + i) - PA_FN(vload)(m + i));
        PA_FN(vstore)(x + i, e);
        PA_FN(vstore)(s + i, PA_FN(vload)(s + i) + e);
    }
    if (i < n) {
        int r = (int)(n - i);
        vreal e = PA_FN(vexp_nonpos)(PA_FN(vload_part)(x + i, r, 0) - PA_FN(vload_part)(m + i, r, 0));
        PA_FN(vstore_part)(x + i, e, r);
        PA_FN(vstore_part)(s + i, PA_FN(vload_part)(s + i, r, 0) + e, r);
    }
}

/* A softmax taken down the columns of a tile X [rows x n] (row x at X + x * ld), vectorised
 * across columns: blocks of PA_COL_VECS vectors of columns keep their running maxima (sums)
 * in registers down all rows, the columns after the last whole block go row by row through
 * vec_max_into (vec_exp_sub_acc); the same operations in the same order either way. A
 * multiple of PA_COL_VECS vectors covers the flash forward's query blocks (96 columns). */
#define PA_COL_VECS 3

/* m[c] = max(m[c], X[x, c]) over the rows x, NaN skipped */
static inline __attribute__((always_inline)) void PA_FN(col_max_into)(real *m, const real *X,
                                                                     int64_t ld, int64_t rows,
                                                                     int64_t n)
{
    enum { W = PA_COL_VECS * VL };
    const int64_t nb = n / W * W;
    for (int64_t c0 = 0; c0 < nb; c0 += W) {
        vreal mx[PA_COL_VECS];
        for (int j = 0; j < PA_COL_VECS; j++) mx[j] = PA_FN(vload)(m + c0 + j * VL);
        for (int64_t x = 0; x < rows; x++)
            for (int j = 0; j < PA_COL_VECS; j++) {
                vreal v = PA_FN(vload)(X + x * ld + c0 + j * VL);
                mx[j] = PA_FN(vselect)(v > mx[j], v, mx[j]);
            }
        for (int j = 0; j < PA_COL_VECS; j++) PA_FN(vstore)(m + c0 + j * VL, mx[j]);
    }
    if (nb < n)
        for (int64_t x = 0; x < rows; x++) PA_FN(vec_max_into)(m + nb, X + x * ld + nb, n - nb);
}

/* X[x, c] = exp(X[x, c] - m[c]) in place and s[c] += X[x, c] over the rows x, m[c] the
 * column's maximum (vec_exp_sub_acc's condition) */
static inline __attribute__((always_inline)) void PA_FN(col_exp_sub_acc)(real *X, int64_t ld,
                                                                        int64_t rows, const real *m,
                                                                        real *s, int64_t n)
{
    enum { W = PA_COL_VECS * VL };
    const int64_t nb = n / W * W;
    for (int64_t c0 = 0; c0 < nb; c0 += W) {
        vreal ms[PA_COL_VECS], sum[PA_COL_VECS];
        for (int j = 0; j < PA_COL_VECS; j++) {
            ms[j] = PA_FN(vload)(m + c0 + j * VL);
            sum[j] = PA_FN(vload)(s + c0 + j * VL);
        }
        for (int64_t x = 0; x < rows; x++)
            for (int j = 0; j < PA_COL_VECS; j++) {
                real *p = X + x * ld + c0 + j * VL;
                vreal e = PA_FN(vexp_nonpos)(PA_FN(vload)(p) - ms[j]);
                PA_FN(vstore)(p, e);
                sum[j] += e;
            }
        for (int j = 0; j < PA_COL_VECS; j++) PA_FN(vstore)(s + c0 + j * VL, sum[j]);
    }
    if (nb < n)
        for (int64_t x = 0; x < rows; x++)
            PA_FN(vec_exp_sub_acc)(X + x * ld + nb, m + nb, s + nb, n - nb);
}
