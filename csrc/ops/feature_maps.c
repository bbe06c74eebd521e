/* Feature maps phi of linear attention (docs/ops.md), forward and backward.
 * Template body (see core/dtype.h); needs core/vmath.h, core/gemm.c and ops/rows.h before it.
 *
 * x is [rows, D] (every axis but the last flattened), y = phi(x) is [rows, F] (kernels.h).
 * Every row is independent, so work is split over rows (identity, elu1 and relu over flat
 * chunks of elements) and results do not depend on the thread count. The backward recomputes
 * what it needs of the forward instead of storing it.
 *
 *   identity  y = x                             dx = dy
 *   elu1      y = x > 0 ? x + 1 : exp(x)        dx = dy * (x > 0 ? 1 : exp(x))
 *   relu      y = max(x, 0)                     dx = dy * (x > 0)
 *   softmax   y = exp(x - max) / sum            dx = y * (dy - dy.y)
 *   focused   y = |r| r^p / |r^p|, r = relu(x), 0 where r = 0 (see the focused section)
 *   taylor    y = [1, x, vec(x x^T) / sqrt(2)]  dx = dy_x + (G + G^T) x / sqrt(2), G the
 *             D x D block of dy
 *   performer y = exp(W x - |x|^2 / 2) / sqrt(m); with g = dy * y: dx = W^T g - x sum(g),
 *             dW = sum over rows of g x^T
 *   cosformer y = [relu(x) cos a_t, relu(x) sin a_t], a_t = pi t / (2 max_len)
 */

#define FM_CHUNK 4096   /* elements per work item of the elementwise kinds */
#define FM_BLOCK 256    /* rows per performer GEMM: packing W costs 1/FM_BLOCK of the product */
#define FM_MAX_PARTS 64 /* performer's dW is summed from at most this many partial products */
#define FM_EXP_COST 16  /* multiply-adds of one vexp, for the thread count */

/* Element loops, not memcpy: the caller's buffers may overlap. */
static inline void PA_FN(fm_copy)(real *dst, const real *src, int64_t n)
{
    for (int64_t j = 0; j < n; j += VL) PA_FN(row_st)(dst + j, PA_FN(row_ld)(src + j, n - j), n - j);
}

static inline void PA_FN(fm_zero)(real *dst, int64_t n)
{
    for (int64_t j = 0; j < n; j++) dst[j] = 0;
}

/* max(v, 0) that keeps NaN, as NumPy's maximum does */
static inline vreal PA_FN(fm_relu)(vreal v)
{
    return PA_FN(vselect)(v < PA_FN(vset)(0), PA_FN(vset)(0), v);
}

/* u^p by repeated squaring (p >= 0); the callers keep u in [0, 1], so nothing overflows */
static inline vreal PA_FN(fm_ipow)(vreal u, int64_t p)
{
    vreal r = PA_FN(vset)(1);
    while (p) {
        if (p & 1) r *= u;
        p >>= 1;
        if (p) u *= u;
    }
    return r;
}

/* ---- identity, elu1, relu: elementwise over n values ---- */

static void PA_FN(fm_pointwise_forward)(int kind, const real *x, real *y, int64_t n)
{
    const vreal zero = PA_FN(vset)(0), one = PA_FN(vset)(1);
    for (int64_t i = 0; i < n; i += VL) {
        vreal v = PA_FN(row_ld)(x + i, n - i);
        if (kind == PA_FM_RELU) {
            v = PA_FN(fm_relu)(v);
        } else if (kind == PA_FM_ELU1) {
            vint pos = v > zero;
            /* exp of min(x, 0): the positive lanes are discarded, and need not overflow */
            v = PA_FN(vselect)(pos, v + one, PA_FN(vexp)(PA_FN(vselect)(pos, zero, v)));
        }
        PA_FN(row_st)(y + i, v, n - i);
    }
}

static void PA_FN(fm_pointwise_backward)(int kind, const real *x, const real *dy, real *dx,
                                         int64_t n)
{
    const vreal zero = PA_FN(vset)(0);
    for (int64_t i = 0; i < n; i += VL) {
        vreal g = PA_FN(row_ld)(dy + i, n - i);
        if (kind != PA_FM_IDENTITY) {
            vreal v = PA_FN(row_ld)(x + i, n - i);
            vint pos = v > zero;
            vreal neg = kind == PA_FM_ELU1 ? g * PA_FN(vexp)(PA_FN(vselect)(pos, zero, v)) : zero;
            g = PA_FN(vselect)(pos, g, neg);
        }
        PA_FN(row_st)(dx + i, g, n - i);
    }
}

/* ---- softmax over the D features of one row ---- */

static void PA_FN(fm_softmax_forward)(const real *x, real *y, int64_t D)
{
    PA_FN(fm_copy)(y, x, D);
    PA_FN(softmax_inplace)(y, D);
}

static void PA_FN(fm_softmax_backward)(const real *x, const real *dy, real *dx, int64_t D)
{
    PA_FN(fm_softmax_forward)(x, dx, D); /* y, recomputed in place of dx */
    PA_FN(softmax_vjp)(dx, dy, dx, D, 1);
}

/* ---- focused (FLatten) ----
 * phi is homogeneous of degree 1 in r, so it is computed from u = r / max(r) in [0, 1]:
 * phi = max(r) |u| u^p / |u^p| with |u^p| >= 1, and r^p never overflows (nor underflows to
 * 0/0) however large or small x is. The gradient is homogeneous of degree 0: with
 * n = u^p / |u^p| and c = dy.n,
 *   dx_j = [x_j > 0] (u_j c / |u| + (p |u| u_j^(p-1) / |u^p|) (dy_j - n_j c)).
 * A row with no positive entry maps to 0 (0/0 := 0, as the oracle) with gradient 0. */

static void PA_FN(fm_focused_forward)(const real *x, real *y, int64_t D, int64_t p)
{
    real s = PA_FN(row_max)(x, D);
    if (!(s > 0)) {
        PA_FN(fm_zero)(y, D);
        return;
    }
    const vreal vs = PA_FN(vset)(s);
    vreal a2 = PA_FN(vset)(0), b2 = PA_FN(vset)(0);
    for (int64_t j = 0; j < D; j += VL) {
        vreal u = PA_FN(fm_relu)(PA_FN(row_ld)(x + j, D - j)) / vs;
        vreal up = PA_FN(fm_ipow)(u, p);
        a2 += u * u;
        b2 += up * up;
        PA_FN(row_st)(y + j, up, D - j);
    }
    real c = (real)sqrt((double)PA_FN(hsum)(a2)) / (real)sqrt((double)PA_FN(hsum)(b2));
    /* (u^p c) <= sqrt(D) first, then times max(r): no intermediate overflow */
    for (int64_t j = 0; j < D; j += VL)
        PA_FN(row_st)(y + j, PA_FN(row_ld)(y + j, D - j) * c * s, D - j);
}

static void PA_FN(fm_focused_backward)(const real *x, const real *dy, real *dx, int64_t D,
                                       int64_t p)
{
    real s = PA_FN(row_max)(x, D);
    if (!(s > 0)) {
        PA_FN(fm_zero)(dx, D);
        return;
    }
    const vreal vs = PA_FN(vset)(s), zero = PA_FN(vset)(0);
    vreal a2 = zero, b2 = zero, cd = zero;
    for (int64_t j = 0; j < D; j += VL) {
        vreal u = PA_FN(fm_relu)(PA_FN(row_ld)(x + j, D - j)) / vs;
        vreal up = PA_FN(fm_ipow)(u, p - 1) * u;
        a2 += u * u;
        b2 += up * up;
        cd += PA_FN(row_ld)(dy + j, D - j) * up;
    }
    const real a = (real)sqrt((double)PA_FN(hsum)(a2)), b = (real)sqrt((double)PA_FN(hsum)(b2));
    const real c = PA_FN(hsum)(cd) / b;
    const vreal k1 = PA_FN(vset)(c / a), k2 = PA_FN(vset)(a * (real)p / b);
    const vreal nc = PA_FN(vset)(c / b); /* n_j c = u_j^p nc */
    for (int64_t j = 0; j < D; j += VL) {
        vreal u = PA_FN(fm_relu)(PA_FN(row_ld)(x + j, D - j)) / vs;
        vreal upm1 = PA_FN(fm_ipow)(u, p - 1);
        vreal g = PA_FN(row_ld)(dy + j, D - j);
        PA_FN(row_st)(dx + j, u * k1 + k2 * upm1 * (g - upm1 * u * nc), D - j);
    }
    /* [x_j > 0] in a pass of its own: in the loop above, GCC 12 fails (internal compiler
     * error) on the select after fm_ipow's data-dependent loop with 16-byte vectors */
    for (int64_t j = 0; j < D; j += VL) {
        vreal v = PA_FN(row_ld)(x + j, D - j);
        PA_FN(row_st)(dx + j, PA_FN(vselect)(v > zero, PA_FN(row_ld)(dx + j, D - j), zero), D - j);
    }
}

/* ---- taylor (Based): y = [1, x, vec(x x^T) / sqrt(2)], the full D x D block row-major ---- */

static void PA_FN(fm_taylor_forward)(const real *x, real *y, int64_t D)
{
    const real c = (real)(1 / sqrt(2.0));
    y[0] = 1;
    PA_FN(fm_copy)(y + 1, x, D);
    real *quad = y + 1 + D;
    for (int64_t i = 0; i < D; i++) {
        const vreal xi = PA_FN(vset)(x[i] * c);
        for (int64_t j = 0; j < D; j += VL)
            PA_FN(row_st)(quad + i * D + j, PA_FN(row_ld)(x + j, D - j) * xi, D - j);
    }
}

static void PA_FN(fm_taylor_backward)(const real *x, const real *dy, real *dx, int64_t D)
{
    const real c = (real)(1 / sqrt(2.0));
    const real *G = dy + 1 + D;
    PA_FN(fm_copy)(dx, dy + 1, D);
    for (int64_t i = 0; i < D; i++) {
        dx[i] += c * PA_FN(dot)(G + i * D, x, D); /* (G x)_i */
        PA_FN(axpy)(dx, G + i * D, D, c * x[i]);  /* (G^T x) += G_i x_i */
    }
}

/* ---- cosformer: [relu(x) cos a_t, relu(x) sin a_t] ---- */

static void PA_FN(fm_cos_sin)(const pa_feature_map_desc *d, int64_t row, real *cs, real *sn)
{
    const double pi = 3.14159265358979323846;
    double a = pi * (double)((row / d->H) % d->T) / (2.0 * d->max_len);
    *cs = (real)cos(a);
    *sn = (real)sin(a);
}

static void PA_FN(fm_cosformer_forward)(const pa_feature_map_desc *d, int64_t row,
                                        const real *x, real *y)
{
    const int64_t D = d->D;
    real cs, sn;
    PA_FN(fm_cos_sin)(d, row, &cs, &sn);
    const vreal vc = PA_FN(vset)(cs), vsn = PA_FN(vset)(sn);
    for (int64_t j = 0; j < D; j += VL) {
        vreal r = PA_FN(fm_relu)(PA_FN(row_ld)(x + j, D - j));
        PA_FN(row_st)(y + j, r * vc, D - j);
        PA_FN(row_st)(y + D + j, r * vsn, D - j);
    }
}

static void PA_FN(fm_cosformer_backward)(const pa_feature_map_desc *d, int64_t row,
                                         const real *x, const real *dy, real *dx)
{
    const int64_t D = d->D;
    real cs, sn;
    PA_FN(fm_cos_sin)(d, row, &cs, &sn);
    const vreal vc = PA_FN(vset)(cs), vsn = PA_FN(vset)(sn), zero = PA_FN(vset)(0);
    for (int64_t j = 0; j < D; j += VL) {
        vreal v = PA_FN(row_ld)(x + j, D - j);
        vreal g = PA_FN(row_ld)(dy + j, D - j) * vc + PA_FN(row_ld)(dy + D + j, D - j) * vsn;
        PA_FN(row_st)(dx + j, PA_FN(vselect)(v > zero, g, zero), D - j);
    }
}

/* ---- performer (FAVOR+) ---- */

/* z = exp(z - sq) / sqrt(m) in place over the m features of one row: z - sq <= |w|^2 / 2
 * for every x, so nothing overflows that the result itself does not. */
static void PA_FN(fm_performer_exp)(real *z, int64_t m, real sq, real inv)
{
    const vreal vsq = PA_FN(vset)(sq), vinv = PA_FN(vset)(inv);
    for (int64_t j = 0; j < m; j += VL)
        PA_FN(row_st)(z + j, PA_FN(vexp)(PA_FN(row_ld)(z + j, m - j) - vsq) * vinv, m - j);
}

/* z = dy * exp(z - sq) / sqrt(m) (the cotangent g of W x) in place; returns sum(g) */
static real PA_FN(fm_performer_grad)(real *z, const real *dy, int64_t m, real sq, real inv)
{
    const vreal vsq = PA_FN(vset)(sq), vinv = PA_FN(vset)(inv);
    vreal s = PA_FN(vset)(0);
    for (int64_t j = 0; j < m; j += VL) {
        vreal e = PA_FN(vexp)(PA_FN(row_ld)(z + j, m - j) - vsq) * vinv;
        vreal g = PA_FN(row_ld)(dy + j, m - j) * e; /* 0 in the padding lanes */
        s += g;
        PA_FN(row_st)(z + j, g, m - j);
    }
    return PA_FN(hsum)(s);
}

/* Multiply-adds of a call, for the thread count (backward: about twice; performer's three
 * GEMMs: three times). */
static double PA_FN(fm_work)(const pa_feature_map_desc *d, int backward)
{
    const double rows = (double)d->rows, D = (double)d->D;
    double w;
    switch (d->kind) {
    case PA_FM_ELU1:
    case PA_FM_SOFTMAX: w = rows * D * FM_EXP_COST; break;
    case PA_FM_FOCUSED: w = rows * D * (4 + 2 * log2((double)d->p + 1)); break;
    case PA_FM_TAYLOR: w = rows * D * (D + 1); break;
    case PA_FM_PERFORMER: w = rows * (double)d->m * (D + FM_EXP_COST) * (backward ? 1.5 : 1); break;
    case PA_FM_COSFORMER: w = rows * D * 2; break;
    default: w = rows * D;
    }
    return backward ? 2 * w : w;
}

static int PA_FN(fm_performer_forward)(const pa_feature_map_desc *d, const real *x, real *y)
{
    const int64_t rows = d->rows, D = d->D, m = d->m, nblk = (rows + FM_BLOCK - 1) / FM_BLOCK;
    const real *W = d->projection;
    const real inv = (real)(1 / sqrt((double)m));
    int failed = 0;
#pragma omp parallel num_threads(pa_threads_for(PA_FN(fm_work)(d, 0), nblk))
    {
        real *work = pa_alloc(sizeof(real) * PA_FN(gemm_work_elems)(FM_BLOCK, m, D));
        pa_scratch_ok(work != NULL, &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < nblk; b++) {
            if (!work) continue;
            const int64_t r0 = b * FM_BLOCK, n = rows - r0 < FM_BLOCK ? rows - r0 : FM_BLOCK;
            /* Z = X W^T into y: B(p, j) = W[j, p] */
            PA_FN(gemm)(n, m, D, 1, x + r0 * D, D, 1, W, 1, D, 0, y + r0 * m, m, work);
            for (int64_t r = r0; r < r0 + n; r++) {
                real sq = (real)0.5 * PA_FN(dot)(x + r * D, x + r * D, D);
                PA_FN(fm_performer_exp)(y + r * m, m, sq, inv);
            }
        }
        free(work);
    }
    return failed ? PA_ENOMEM : PA_OK;
}

/* Row blocks are grouped into at most FM_MAX_PARTS parts, fixed by the row count alone; each
 * part's dW = sum g x^T goes to its own buffer (or to dW when there is one part), and the
 * parts are added in order at the end, so dW does not depend on the thread count. */
static int PA_FN(fm_performer_backward)(const pa_feature_map_desc *d, const real *x,
                                        const real *dy, real *dx, real *dW)
{
    const int64_t rows = d->rows, D = d->D, m = d->m, nblk = (rows + FM_BLOCK - 1) / FM_BLOCK;
    const real *W = d->projection;
    const real inv = (real)(1 / sqrt((double)m));
    if (nblk == 0) {
        PA_FN(fm_zero)(dW, m * D);
        return PA_OK;
    }
    const int64_t per = (nblk + FM_MAX_PARTS - 1) / FM_MAX_PARTS; /* blocks per part */
    const int64_t nparts = (nblk + per - 1) / per;
    real *parts = nparts == 1 ? dW : pa_alloc(sizeof(real) * nparts * m * D);
    if (!parts) return PA_ENOMEM;
    int64_t wz = PA_FN(gemm_work_elems)(FM_BLOCK, m, D), wx = PA_FN(gemm_work_elems)(FM_BLOCK, D, m),
            ww = PA_FN(gemm_work_elems)(m, D, FM_BLOCK);
    const int64_t wmax = wz > wx ? (wz > ww ? wz : ww) : (wx > ww ? wx : ww);
    int failed = 0;
#pragma omp parallel num_threads(pa_threads_for(PA_FN(fm_work)(d, 1), nparts))
    {
        real *G = pa_alloc(sizeof(real) * FM_BLOCK * m), *work = pa_alloc(sizeof(real) * wmax);
        const int ok = pa_scratch_ok(G && work, &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < nparts; c++) {
            if (!ok) continue;
            real *dWc = parts + c * m * D;
            const int64_t bend = (c + 1) * per < nblk ? (c + 1) * per : nblk;
            for (int64_t b = c * per; b < bend; b++) {
                const int64_t r0 = b * FM_BLOCK, n = rows - r0 < FM_BLOCK ? rows - r0 : FM_BLOCK;
                const real *xb = x + r0 * D;
                PA_FN(gemm)(n, m, D, 1, xb, D, 1, W, 1, D, 0, G, m, work); /* Z = X W^T */
                for (int64_t i = 0; i < n; i++) {
                    const real *xr = xb + i * D;
                    real sq = (real)0.5 * PA_FN(dot)(xr, xr, D);
                    real s = PA_FN(fm_performer_grad)(G + i * m, dy + (r0 + i) * m, m, sq, inv);
                    real *dxr = dx + (r0 + i) * D;
                    for (int64_t j = 0; j < D; j += VL)
                        PA_FN(row_st)(dxr + j, PA_FN(row_ld)(xr + j, D - j) * -s, D - j);
                }
                /* dx += G W;  dW_c (+)= G^T X */
                PA_FN(gemm)(n, D, m, 1, G, m, 1, W, D, 1, 1, dx + r0 * D, D, work);
                PA_FN(gemm)(m, D, n, 1, G, 1, m, xb, D, 1, b == c * per ? 0 : 1, dWc, D, work);
            }
        }
        free(G);
        free(work);
        int any_failed; /* read after the loop's barrier: the same for every thread */
#pragma omp atomic read
        any_failed = failed;
        if (nparts > 1 && !any_failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                real *row = dW + i * D;
                PA_FN(fm_copy)(row, parts + i * D, D);
                for (int64_t c = 1; c < nparts; c++) PA_FN(axpy)(row, parts + (c * m + i) * D, D, 1);
            }
        }
    }
    if (parts != dW) free(parts);
    return failed ? PA_ENOMEM : PA_OK;
}

/* ---- entry points ---- */

static int PA_FN(feature_map_forward)(const pa_feature_map_desc *d, const void *xv, void *yv)
{
    const real *x = xv;
    real *y = yv;
    const int kind = d->kind;
    const int64_t rows = d->rows, D = d->D, F = d->F;
    if (kind == PA_FM_PERFORMER) return PA_FN(fm_performer_forward)(d, x, y);
    if (kind == PA_FM_IDENTITY || kind == PA_FM_ELU1 || kind == PA_FM_RELU) {
        const int64_t n = rows * D, items = (n + FM_CHUNK - 1) / FM_CHUNK;
#pragma omp parallel for schedule(static) num_threads(pa_threads_for(PA_FN(fm_work)(d, 0), items))
        for (int64_t c = 0; c < items; c++) {
            const int64_t i0 = c * FM_CHUNK;
            PA_FN(fm_pointwise_forward)(kind, x + i0, y + i0, n - i0 < FM_CHUNK ? n - i0 : FM_CHUNK);
        }
        return PA_OK;
    }
#pragma omp parallel for schedule(static) num_threads(pa_threads_for(PA_FN(fm_work)(d, 0), rows))
    for (int64_t r = 0; r < rows; r++) {
        const real *xr = x + r * D;
        real *yr = y + r * F;
        if (kind == PA_FM_SOFTMAX)
            PA_FN(fm_softmax_forward)(xr, yr, D);
        else if (kind == PA_FM_FOCUSED)
            PA_FN(fm_focused_forward)(xr, yr, D, d->p);
        else if (kind == PA_FM_TAYLOR)
            PA_FN(fm_taylor_forward)(xr, yr, D);
        else
            PA_FN(fm_cosformer_forward)(d, r, xr, yr);
    }
    return PA_OK;
}

static int PA_FN(feature_map_backward)(const pa_feature_map_desc *d, const void *xv,
                                       const void *dyv, void *dxv, void *dWv)
{
    const real *x = xv, *dy = dyv;
    real *dx = dxv;
    const int kind = d->kind;
    const int64_t rows = d->rows, D = d->D, F = d->F;
    if (kind == PA_FM_PERFORMER) return PA_FN(fm_performer_backward)(d, x, dy, dx, dWv);
    if (kind == PA_FM_IDENTITY || kind == PA_FM_ELU1 || kind == PA_FM_RELU) {
        const int64_t n = rows * D, items = (n + FM_CHUNK - 1) / FM_CHUNK;
#pragma omp parallel for schedule(static) num_threads(pa_threads_for(PA_FN(fm_work)(d, 1), items))
        for (int64_t c = 0; c < items; c++) {
            const int64_t i0 = c * FM_CHUNK;
            PA_FN(fm_pointwise_backward)(kind, x + i0, dy + i0, dx + i0,
                                         n - i0 < FM_CHUNK ? n - i0 : FM_CHUNK);
        }
        return PA_OK;
    }
#pragma omp parallel for schedule(static) num_threads(pa_threads_for(PA_FN(fm_work)(d, 1), rows))
    for (int64_t r = 0; r < rows; r++) {
        const real *xr = x + r * D, *dyr = dy + r * F;
        real *dxr = dx + r * D;
        if (kind == PA_FM_SOFTMAX)
            PA_FN(fm_softmax_backward)(xr, dyr, dxr, D);
        else if (kind == PA_FM_FOCUSED)
            PA_FN(fm_focused_backward)(xr, dyr, dxr, D, d->p);
        else if (kind == PA_FM_TAYLOR)
            PA_FN(fm_taylor_backward)(xr, dyr, dxr, D);
        else
            PA_FN(fm_cosformer_backward)(d, r, xr, dyr, dxr);
    }
    return PA_OK;
}
