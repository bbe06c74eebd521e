/* The pointwise and row-wise steps of pyattn.nn's layers: SiLU (and the sigmoid), SwiGLU's
 * product, RMSNorm's normalisation, rotary embedding and the short causal convolution,
 * forward and backward. Template body (see dtype.h).
 *
 * In NumPy each of these is several passes over memory with a temporary per operation, on one
 * core, while the GEMMs and attention kernels around them run on every thread; here each is
 * one vectorised pass over blocks of elements or rows shared by the threads. Every
 * element is computed the same way at any thread count. Outputs must not overlap inputs.
 */

/* Elements (or row elements) a task: large enough to amortise scheduling, small enough that
 * a 2-thread team splits a [4096, 256] activation evenly. */
#define PW_BLOCK 8192

static int PA_FN(pw_threads)(int64_t n, int64_t per_element)
{
    return pa_threads_for((double)n * per_element, (n + PW_BLOCK - 1) / PW_BLOCK);
}

/* Rows of `width` elements a task (at least one; a zero width counts as one element). */
static int64_t PA_FN(pw_rows_per_task)(int64_t width)
{
    return width > 0 && width < PW_BLOCK ? PW_BLOCK / width : 1;
}

/* silu'(x) = s + y (1 - s) from s = sigmoid(x) and y = silu(x) = x s */
static inline real PA_FN(dsilu)(real s, real y) { return s + y * (1 - s); }

/* One span of n elements: s = sigmoid(x) = 1 / (1 + exp(-x)) and, when y is not NULL,
 * y = silu(x) = x s, times mul when that is not NULL (SwiGLU's product). y may be x. */
static inline void PA_FN(silu_span)(int64_t n, const real *x, const real *mul, real *y, real *s)
{
    const vreal one = PA_FN(vset)(1);
    for (int64_t i = 0; i < n; i += VL) {
        int r = n - i < VL ? (int)(n - i) : VL;
        vreal xv = r == VL ? PA_FN(vload)(x + i) : PA_FN(vload_part)(x + i, r, 0);
        vreal sv = one / (one + PA_FN(vexp)(-xv)), yv = xv * sv;
        if (mul) yv = yv * (r == VL ? PA_FN(vload)(mul + i) : PA_FN(vload_part)(mul + i, r, 0));
        if (r == VL) {
            PA_FN(vstore)(s + i, sv);
            if (y) PA_FN(vstore)(y + i, yv);
        } else {
            PA_FN(vstore_part)(s + i, sv, r);
            if (y) PA_FN(vstore_part)(y + i, yv, r);
        }
    }
}

/* silu_span over n elements, in blocks over the threads; mul and y may be NULL. */
static void PA_FN(silu_forward)(int64_t n, const void *xv, const void *mulv, void *yv, void *sv_)
{
    const real *x = xv, *mul = mulv;
    real *y = yv, *s = sv_;
    int threads = PA_FN(pw_threads)(n, 16);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n; b += PW_BLOCK)
        PA_FN(silu_span)(n - b < PW_BLOCK ? n - b : PW_BLOCK, x + b, mul ? mul + b : NULL,
                         y ? y + b : NULL, s + b);
}

/* SwiGLU's product h = silu(a) b backward: da = dh b silu'(a), db = dh silu(a) = dh a s. */
static void PA_FN(swiglu_backward)(int64_t n, const void *dhv, const void *av, const void *bv,
                                   const void *sv, void *dav, void *dbv)
{
    const real *dh = dhv, *a = av, *b = bv, *s = sv;
    real *da = dav, *db = dbv;
    int threads = PA_FN(pw_threads)(n, 6);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < n; k += PW_BLOCK) {
        int64_t e = n - k < PW_BLOCK ? n : k + PW_BLOCK;
        for (int64_t i = k; i < e; i++) {
            real as = a[i] * s[i];
            da[i] = dh[i] * b[i] * PA_FN(dsilu)(s[i], as);
            db[i] = dh[i] * as;
        }
    }
}

/* dx = dy silu'(x) = dy (s + y (1 - s)), from y = silu(x) and s = sigmoid(x). */
static void PA_FN(silu_backward)(int64_t n, const void *dyv, const void *yv, const void *sv,
                                 void *dxv)
{
    const real *dy = dyv, *y = yv, *s = sv;
    real *dx = dxv;
    int threads = PA_FN(pw_threads)(n, 4);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n; b += PW_BLOCK) {
        int64_t e = n - b < PW_BLOCK ? n : b + PW_BLOCK;
        for (int64_t i = b; i < e; i++) dx[i] = dy[i] * PA_FN(dsilu)(s[i], y[i]);
    }
}

/* One AdamW step over n parameters in place, in torch.optim.AdamW's order: m = b1 m +
 * (1 - b1) g, v = b2 v + (1 - b2) g^2, p = decay p (decay = 1 - lr wd, or 1), then
 * p -= lr_c1 m / (sqrt(v / c2) + eps) with lr_c1 = lr / (1 - b1^t), c2 = 1 - b2^t. In NumPy
 * this is a dozen passes over the parameters on one core. */
static void PA_FN(adamw_step)(int64_t n, const void *gv, void *pv, void *mv, void *vv, double b1,
                              double b2, double eps, double decay, double lr_c1, double c2)
{
    const real *g = gv;
    real *p = pv, *m = mv, *v = vv;
    const real rb1 = (real)b1, rb2 = (real)b2, ra = (real)(1 - b1), rb = (real)(1 - b2);
    const real reps = (real)eps, rdecay = (real)decay, rlr = (real)lr_c1, rc2 = (real)c2;
    int threads = PA_FN(pw_threads)(n, 12);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < n; k += PW_BLOCK) {
        int64_t e = n - k < PW_BLOCK ? n : k + PW_BLOCK;
        for (int64_t i = k; i < e; i++) {
            real mi = rb1 * m[i] + ra * g[i], vi = rb2 * v[i] + rb * (g[i] * g[i]);
            m[i] = mi;
            v[i] = vi;
            p[i] = rdecay * p[i] - rlr * mi / (PA_SQRT(vi / rc2) + reps);
        }
    }
}

/* Rows of d: rstd = 1 / sqrt(mean(x^2) + eps), xhat = x rstd (RMSNorm); with mean = 0 the
 * sum instead of the mean, rstd = 1 / sqrt(sum(x^2) + eps) (the delta rule's L2 norm). */
static void PA_FN(rms_norm_forward)(int64_t rows, int64_t d, double eps, int mean, const void *xv,
                                    void *xhatv, void *rstdv)
{
    const real *x = xv;
    real *xhat = xhatv, *rstd = rstdv;
    const real den = mean ? (real)d : 1;
    int64_t per = PA_FN(pw_rows_per_task)(d);
    int threads = pa_threads_for((double)rows * d * 4, (rows + per - 1) / per);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < rows; b += per)
        for (int64_t r = b; r < rows && r < b + per; r++) {
            const real *xr = x + r * d;
            real inv = (real)(1 / sqrt(PA_FN(dot)(xr, xr, d) / den + (real)eps));
            rstd[r] = inv;
            for (int64_t i = 0; i < d; i++) xhat[r * d + i] = xr[i] * inv;
        }
}

/* dx = (dxhat - xhat mean(dxhat xhat)) rstd, row by row (the sum for mean = 0). */
static void PA_FN(rms_norm_backward)(int64_t rows, int64_t d, int mean, const void *dxhatv,
                                     const void *xhatv, const void *rstdv, void *dxv)
{
    const real *dxhat = dxhatv, *xhat = xhatv, *rstd = rstdv;
    real *dx = dxv;
    const real den = mean ? (real)d : 1;
    int64_t per = PA_FN(pw_rows_per_task)(d);
    int threads = pa_threads_for((double)rows * d * 4, (rows + per - 1) / per);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < rows; b += per)
        for (int64_t r = b; r < rows && r < b + per; r++) {
            const real *g = dxhat + r * d, *h = xhat + r * d;
            real avg = PA_FN(dot)(g, h, d) / den, inv = rstd[r];
            for (int64_t i = 0; i < d; i++) dx[r * d + i] = (g[i] - h[i] * avg) * inv;
        }
}

/* Rotary embedding of x [rows, H, D] (half-split pairs): row r uses the tables' row
 * r % table_rows, cos [table_rows, D] (cos(a) on both halves) and sin [table_rows, D]
 * (-sin(a) on the first half, sin(a) on the second), so y_i = x_i cos_i + x_{i+-D/2} sin_i.
 * sign -1 rotates by the opposite angles (the transpose: the backward). */
static void PA_FN(rotary)(int64_t rows, int64_t H, int64_t D, int64_t table_rows,
                          const void *cosv, const void *sinv, int sign, const void *xv, void *yv)
{
    const real *cos = cosv, *sin = sinv, *x = xv;
    real *y = yv;
    int64_t half = D / 2, row = H * D;
    int64_t per = PA_FN(pw_rows_per_task)(row);
    int threads = pa_threads_for((double)rows * row * 2, (rows + per - 1) / per);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < rows; b += per)
        for (int64_t r = b; r < rows && r < b + per; r++) {
            const real *c = cos + r % table_rows * D, *s = sin + r % table_rows * D;
            for (int64_t h = 0; h < H; h++) {
                const real *xr = x + (r * H + h) * D;
                real *yr = y + (r * H + h) * D;
                for (int64_t i = 0; i < half; i++) {
                    yr[i] = xr[i] * c[i] + sign * xr[i + half] * s[i];
                    yr[i + half] = xr[i + half] * c[i + half] + sign * xr[i] * s[i + half];
                }
            }
        }
}

/* Causal depthwise convolution over time with a SiLU (pyattn.nn's ShortConv), x [B, T, C]:
 * u[b, t, c] = bias[c] + sum_i w[i, c] in(b, t - K + 1 + i, c), y = silu(u), s = sigmoid(u),
 * where in(b, t') is x's row (b, t') for t' >= 0 and state's row (b, K - 1 + t') before
 * (zeros when state is NULL). w is [K, C] (the layer's [C, K] transposed), bias may be NULL.
 * Rows (b, t) are split in blocks over the threads, each row vectorised over channels and
 * through its SiLU while it is in cache. */
static inline const real *PA_FN(conv_row)(const real *x, const real *state, int64_t T,
                                          int64_t C, int64_t K, int64_t b, int64_t t)
{
    if (t >= 0) return x + (b * T + t) * C;
    return state ? state + (b * (K - 1) + K - 1 + t) * C : NULL;
}

static void PA_FN(short_conv_forward)(int64_t B, int64_t T, int64_t C, int64_t K,
                                      const void *xv, const void *statev, const void *wv,
                                      const void *biasv, void *yv, void *sv_)
{
    const real *x = xv, *state = statev, *w = wv, *bias = biasv;
    real *y = yv, *s = sv_;
    int64_t rows = B * T, per = PA_FN(pw_rows_per_task)(C);
    int threads = pa_threads_for((double)rows * C * K, (rows + per - 1) / per);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += per)
        for (int64_t r = r0; r < rows && r < r0 + per; r++) {
            real *restrict u = y + r * C;
            for (int64_t c = 0; c < C; c++) u[c] = bias ? bias[c] : 0;
            for (int64_t i = 0; i < K; i++) {
                const real *restrict in = PA_FN(conv_row)(x, state, T, C, K, r / T, r % T - K + 1 + i);
                const real *restrict wi = w + i * C;
                if (in)
                    for (int64_t c = 0; c < C; c++) u[c] += wi[c] * in[c];
            }
            PA_FN(silu_span)(C, u, NULL, u, s + r * C);
        }
}

/* The backward of short_conv_forward from dy and the forward's y, s: du = dy silu'(u);
 * dx[b, t] = sum_j du[b, t + j] w[K - 1 - j] (t + j < T); dw [K, C] and dbias [C] (NULL: not
 * wanted) overwritten with the sums over (b, t). A block of rows forms du for its rows and
 * the K - 1 after them in a buffer of its own, and its partial sums of dw and dbias, which
 * are added in block order: the bits do not depend on the thread count. The state's gradient
 * is not formed. Returns PA_ENOMEM when the buffers cannot be allocated. */
static int PA_FN(short_conv_backward)(int64_t B, int64_t T, int64_t C, int64_t K,
                                      const void *xv, const void *statev, const void *wv,
                                      const void *dyv, const void *yv, const void *sv,
                                      void *dxv, void *dwv, void *dbiasv)
{
    const real *x = xv, *state = statev, *w = wv, *dy = dyv, *y = yv, *s = sv;
    real *dx = dxv, *dw = dwv, *dbias = dbiasv;
    /* at most 256 blocks, so the partial sums stay a small multiple of dw's size */
    int64_t rows = B * T, per = PA_FN(pw_rows_per_task)(C);
    if ((rows + per - 1) / per > 256) per = (rows + 255) / 256;
    int64_t blocks = (rows + per - 1) / per;
    int threads = pa_threads_for((double)rows * C * 2 * K, blocks);
    real *part, *dus;
    void **parts[2] = {(void **)&part, (void **)&dus};
    size_t bytes[2] = {sizeof(real) * (size_t)blocks * (K + 1) * C,
                       sizeof(real) * (size_t)threads * (per + K - 1) * C};
    void *block = pa_alloc_parts(parts, bytes, 2);
    if (!block) return PA_ENOMEM;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        real *restrict pw = part + blk * (K + 1) * C, *restrict pb = pw + K * C;
        real *restrict du = dus + pa_thread_id() * (per + K - 1) * C;
        int64_t r0 = blk * per, r1 = r0 + per < rows ? r0 + per : rows;
        /* du of rows r0 .. r1 + K - 2 of the same sequences (the rows dx of r0 .. r1 reads) */
        int64_t r2 = r1 + K - 1 < rows ? r1 + K - 1 : rows;
        for (int64_t e = r0 * C; e < r2 * C; e++)
            du[e - r0 * C] = dy[e] * PA_FN(dsilu)(s[e], y[e]);
        for (int64_t i = 0; i < (K + 1) * C; i++) pw[i] = 0;
        for (int64_t r = r0; r < r1; r++) {
            int64_t b = r / T, t = r % T;
            const real *restrict g = du + (r - r0) * C;
            for (int64_t c = 0; c < C; c++) pb[c] += g[c];
            for (int64_t i = 0; i < K; i++) {
                const real *restrict in = PA_FN(conv_row)(x, state, T, C, K, b, t - K + 1 + i);
                real *restrict pwi = pw + i * C;
                if (in)
                    for (int64_t c = 0; c < C; c++) pwi[c] += g[c] * in[c];
            }
            real *restrict d = dx + r * C;
            for (int64_t c = 0; c < C; c++) d[c] = 0;
            for (int64_t j = 0; j < K && t + j < T; j++) {
                const real *restrict gj = du + (r - r0 + j) * C, *restrict wj = w + (K - 1 - j) * C;
                for (int64_t c = 0; c < C; c++) d[c] += gj[c] * wj[c];
            }
        }
    }
    for (int64_t i = 0; i < K * C; i++) dw[i] = 0;
    if (dbias)
        for (int64_t c = 0; c < C; c++) dbias[c] = 0;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const real *pw = part + blk * (K + 1) * C;
        for (int64_t i = 0; i < K * C; i++) dw[i] += pw[i];
        if (dbias)
            for (int64_t c = 0; c < C; c++) dbias[c] += pw[K * C + c];
    }
    free(block);
    return PA_OK;
}
