/* What the delta-rule engine (ops/delta_rule.c) shares with the gated linear engine
 * (ops/linear_attn.c): a block's gate side (cumulative gates as hi + lo parts, a scalar
 * gate's mask, a vector gate's factors) and the products over it (the rows' factors, the
 * gated Gram, the triangular products), the scan of a block for its non-finite rows, the
 * layout of the states a chunk forward keeps, a block's rows staged contiguous and large
 * outputs put with non-temporal stores (rows_put), and the group sums of dq and dk. Template body
 * (see core/dtype.h); needs core/vmath.h, core/gemm.c, ops/rows.h and ops/decay.h before it. */

#define LA_SUB 16     /* rows of a vector-gate sub-block: e^(gate sums over 16 steps) */
#define LA_TRI (2 * MR) /* row block of the triangular products */
#define LA_FACTOR 20  /* the most log decay (per channel) a block's vector gate is factored over */

/* A block's gate on one side (the keys' K channels or the values' V), as its products take it */
typedef struct {
    int kind;         /* PA_GATE_* */
    int64_t D;        /* K or V */
    const real *G;    /* vector: L x D inclusive cumulative gate of the block, as hi + lo */
    int64_t lo;       /* vector: G + lo holds the lo parts (the sum is kept in double) */
    const double *Gs, *Gl; /* scalar: L of them as hi + lo doubles (gate_sum2), so G_i - G_j
                            * keeps its digits */
    const real *Dm;   /* scalar: L x L, e^(G_i - G_j) on and below the diagonal, 0 above */
    const real *Ep, *Em; /* vector, factored: L x D, e^(G_i - G_0) and e^(G_0 - G_i); else NULL */
    const real *E0;      /* vector, factored: D, e^G_0 */
} PA_FN(la_side);

/* The buffers of the gated Gram and the triangular products with a side (la_gram, la_apply)
 * over blocks of up to L rows of D columns, apart from any engine's scratch so that the
 * delta-rule engine's blocks use the same products. */
typedef struct {
    real *Tm, *U;   /* L x D each: rows rescaled to a common row */
    real *M;        /* L x L: a scalar side's mask applied (la_masked) */
    real *Bp;       /* one operand packed once for the row-block products: L x max(L, D) */
    int64_t *rows;  /* L: the non-finite rows of a triangular product's operand */
    real *work;     /* GEMM packing */
} PA_FN(la_bufs);

/* ---- vector helpers: y = beta y + alpha x e^(ga - gb), a NULL exponent counting as 0 ---- */

/* e^(ga - gb) from hi/lo pairs (lo parts `lo` further on): (hi_a - hi_b) + (lo_a - lo_b) keeps
 * the digits of a small difference between two large cumulative gates. */
static inline vreal PA_FN(la_decay)(const real *ga, const real *gb, int64_t lo, int64_t d,
                                    int64_t left)
{
    vreal e = ga ? PA_FN(row_ld)(ga + d, left) : PA_FN(vset)(0);
    vreal f = ga ? PA_FN(row_ld)(ga + lo + d, left) : PA_FN(vset)(0);
    if (gb) {
        e -= PA_FN(row_ld)(gb + d, left);
        f -= PA_FN(row_ld)(gb + lo + d, left);
    }
    return PA_FN(vexp)(e + f);
}

static inline void PA_FN(la_gated)(real *y, const real *x, const real *ga, const real *gb,
                                   int64_t lo, int64_t D, real alpha, real beta)
{
    for (int64_t d = 0; d < D; d += VL) {
        vreal r = alpha * PA_FN(row_ld)(x + d, D - d);
        if (ga || gb) r *= PA_FN(la_decay)(ga, gb, lo, d, D - d);
        if (beta != 0) r += beta * PA_FN(row_ld)(y + d, D - d);
        PA_FN(row_st)(y + d, r, D - d);
    }
}

static inline real PA_FN(la_dot_gated)(const real *x, const real *y, const real *ga,
                                       const real *gb, int64_t lo, int64_t D)
{
    vreal s = PA_FN(vset)(0);
    for (int64_t d = 0; d < D; d += VL)
        s += PA_FN(row_ld)(x + d, D - d) * PA_FN(row_ld)(y + d, D - d) *
             PA_FN(la_decay)(ga, gb, lo, d, D - d);
    return PA_FN(hsum)(s);
}

/* The factor f_i of row i of a block: e^G_i (to_end = 0) or e^(G_{L-1} - G_i) (to_end = 1).
 * la_row_scalar is it for a scalar gate (1 otherwise); la_row_exps the exponent pair of a
 * vector gate (NULL, NULL otherwise). */
/* G_i - G_j of a scalar side from its hi and lo parts; j < 0: G_i */
static inline double PA_FN(la_gs)(const PA_FN(la_side) *s, int64_t i, int64_t j)
{
    return PA_FN(gate_diff)(s->Gs, s->Gl, i, j);
}

/* A row's decay to itself is e^0 = 1 exactly: here and in the diagonals below it is never
 * formed as e^(G_i - G_i), which a NaN gate earlier in the block would make NaN. */
static inline real PA_FN(la_row_scalar)(const PA_FN(la_side) *s, int64_t L, int to_end, int64_t i)
{
    if (s->kind != PA_GATE_SCALAR || (to_end && i == L - 1)) return 1;
    return (real)exp(to_end ? PA_FN(la_gs)(s, L - 1, i) : PA_FN(la_gs)(s, i, -1));
}

static inline void PA_FN(la_row_exps)(const PA_FN(la_side) *s, int64_t L, int to_end, int64_t i,
                                      const real **ga, const real **gb)
{
    *ga = *gb = NULL;
    if (s->kind != PA_GATE_VECTOR || (to_end && i == L - 1)) return;
    *ga = to_end ? s->G + (L - 1) * s->D : s->G + i * s->D;
    *gb = to_end ? s->G + i * s->D : NULL;
}

/* y = beta y + alpha x f_i, f_i the factor of row i of a block (a row of the side's width). A
 * factored vector gate takes it from its factors, without an exp: e^G_i = e^(G_i - G_0) e^G_0
 * and e^(G_{L-1} - G_i) = e^(G_0 - G_i) e^(G_{L-1} - G_0). */
static inline void PA_FN(la_side_row)(const PA_FN(la_side) *s, int64_t L, int to_end, int64_t i,
                                      real *y, const real *x, real alpha, real beta)
{
    const real *ga, *gb;
    PA_FN(la_row_exps)(s, L, to_end, i, &ga, &gb);
    alpha *= PA_FN(la_row_scalar)(s, L, to_end, i);
    if (!ga || !s->Ep) {
        PA_FN(la_gated)(y, x, ga, gb, s->lo, s->D, alpha, beta);
        return;
    }
    const int64_t D = s->D;
    const real *f = (to_end ? s->Em : s->Ep) + i * D, *c = to_end ? s->Ep + (L - 1) * D : s->E0;
    for (int64_t d = 0; d < D; d += VL) {
        vreal r = alpha * PA_FN(row_ld)(x + d, D - d) * PA_FN(row_ld)(f + d, D - d) *
                  PA_FN(row_ld)(c + d, D - d);
        if (beta != 0) r += beta * PA_FN(row_ld)(y + d, D - d);
        PA_FN(row_st)(y + d, r, D - d);
    }
}

/* f[0..D) = e^(G_{L-1}): the block's total decay on this side */
static void PA_FN(la_total_decay)(const PA_FN(la_side) *s, int64_t L, real *f)
{
    /* a scalar side's one decay taken once, not once per channel */
    const real one = s->kind == PA_GATE_SCALAR ? (real)exp(PA_FN(la_gs)(s, L - 1, -1)) : 1;
    for (int64_t d = 0; d < s->D; d++)
        f[d] = s->kind == PA_GATE_VECTOR ? (real)exp((double)s->G[(L - 1) * s->D + d] +
                                                 s->G[s->lo + (L - 1) * s->D + d])
                                         : one;
}

/* ---- a block's cumulative gates ---- */

/* Before row i of a pass over a block's L rows of D (ldx apart), row i + 4 into L1. The first
 * pass over a head's rows (of q, k, v or a gate: [T, H, D] rows lie H D apart, 4 KiB at
 * H D = 1024 floats) waited on them: the block-ahead prefetch (la_prefetch_rows) brings them
 * to L2 only, where rows 4 KiB apart share sets with the rest of the block's rows. */
static inline __attribute__((always_inline)) void PA_FN(la_prefetch_ahead)(const real *X,
                                                                          int64_t ldx, int64_t D,
                                                                          int64_t L, int64_t i)
{
    if (i + 4 < L) PA_FN(prefetch_span)(X + (i + 4) * ldx, D, 1);
}

/* Rows r0 .. r0+n-1 (those before T) of X (D values, ldx apart) into L2: the next block's
 * rows while this one computes, for the engines whose units read one head's rows, H rows
 * apart, where hardware prefetchers stop. */
static inline __attribute__((always_inline)) void PA_FN(prefetch_block_rows)(const real *X,
                                                                            int64_t ldx, int64_t D,
                                                                            int64_t r0, int64_t n,
                                                                            int64_t T)
{
    for (int64_t t = r0; t < r0 + n && t < T; t++) PA_FN(prefetch_span)(X + t * ldx, D, 0);
}

/* n rows of D reals: X's (ldx apart) into Y (ldy apart). A block's rows are staged
 * contiguous (and its output rows written back) this way: a unit of the [B, T, H, D] layout
 * reads rows H D reals apart, 4 KiB at H D = 1024 floats, so they all fall into the same
 * few L1 sets and the block's many passes over its rows kept missing L1. */
static inline void PA_FN(rows_copy)(const real *X, int64_t ldx, int64_t n, int64_t D, real *Y,
                                    int64_t ldy)
{
    if (D == 1) /* a column (beta, a scalar gate): no call per value */
        for (int64_t t = 0; t < n; t++) Y[t * ldy] = X[t * ldx];
    else
        for (int64_t t = 0; t < n; t++) memcpy(Y + t * ldy, X + t * ldx, sizeof(real) * D);
}

/* Whether an engine stages its blocks (rows_copy), its rows being ldq (q, k) and ldv (v) reals
 * apart: rows 1 KiB or more apart by a multiple of 1 KiB fall into a quarter or less of L1's
 * sets (at 4 KiB, all into the same few). Closer rows stay apart in L1, and for their small
 * blocks the copies would cost more than they save. */
static inline int PA_FN(rows_staged)(int64_t ldq, int64_t ldv)
{
    const int64_t bq = ldq * (int64_t)sizeof(real), bv = ldv * (int64_t)sizeof(real);
    return (bq >= 1024 && bq % 1024 == 0) || (bv >= 1024 && bv % 1024 == 0);
}

/* Calls whose outputs (output rows, kept states) pass PA_STREAM_BYTES write them with
 * non-temporal stores (rows_put): they are not read again before the call ends, and at
 * this size they would not stay in cache; a plain store first fetches each line of a fresh
 * page from memory. Smaller outputs stay in cache for the caller's next op. */
#define PA_STREAM_BYTES ((size_t)16 << 20)

/* rows_copy, with non-temporal stores where stream (x86-64; the 16-byte aligned part of each
 * row), then a store fence: the rows are complete before anything this thread does next. */
static inline void PA_FN(rows_put)(const real *X, int64_t ldx, int64_t n, int64_t D, real *Y,
                                   int64_t ldy, int stream)
{
#if defined(__x86_64__)
    if (stream) {
        const int64_t step = 16 / (int64_t)sizeof(real);
        for (int64_t t = 0; t < n; t++) {
            real *y = Y + t * ldy;
            const real *x = X + t * ldx;
            int64_t j = 0;
            for (; j < D && ((uintptr_t)(y + j) & 15); j++) y[j] = x[j];
            for (; j + step <= D; j += step)
#if PA_DOUBLE
                _mm_stream_pd(y + j, _mm_loadu_pd(x + j));
#else
                _mm_stream_ps(y + j, _mm_loadu_ps(x + j));
#endif
            for (; j < D; j++) y[j] = x[j];
        }
        _mm_sfence();
        return;
    }
#endif
    PA_FN(rows_copy)(X, ldx, n, D, Y, ldy);
}

/* Whether a call of d puts its outputs with non-temporal stores (rows_put): its rows' K + V
 * values per head (about what it writes) pass PA_STREAM_BYTES */
static inline int PA_FN(la_streams)(const pa_linear_desc *d)
{
    return (double)d->cu[d->nseq] * (double)(d->H * (d->K + d->V)) * sizeof(real) >=
           (double)PA_STREAM_BYTES;
}

/* With kept states (*slot not NULL), S into the slot at *slot, which moves to the next: a
 * chunk forward keeps the state entering each block, and the last. */
static inline void PA_FN(la_keep_state)(real **slot, const real *S, int64_t KV, int stream)
{
    if (!*slot) return;
    PA_FN(rows_put)(S, KV, 1, KV, *slot, KV, stream);
    *slot += KV;
}

/* Rows c0 .. c0+l-1 of n inputs (src[i], rows ld[i] reals apart, width[i] each; NULL: none)
 * copied contiguous into a block's stage at *p (rows_copy), which moves past them; *dst[i]
 * points to the copy */
static inline void PA_FN(stage_rows_in)(int n, const real *const *src, const int64_t *ld,
                                        const int64_t *width, int64_t c0, int64_t l,
                                        const real **const *dst, real **p)
{
    for (int i = 0; i < n; i++)
        if (src[i]) {
            PA_FN(rows_copy)(src[i] + c0 * ld[i], ld[i], l, width[i], *p, width[i]);
            *dst[i] = *p;
            *p += l * width[i];
        }
}

/* Room in a block's stage at *p for l rows of width[i] for each of n outputs the unit has
 * (out[i] not NULL): *dst[i] */
static inline void PA_FN(stage_rows_out)(int n, real *const *out, const int64_t *width, int64_t l,
                                         real **const *dst, real **p)
{
    for (int i = 0; i < n; i++)
        if (out[i]) {
            *dst[i] = *p;
            *p += l * width[i];
        }
}

/* A staged block's l output rows back (rows_put): from[i] (rows of width[i], contiguous) into
 * rows c0 .. of to[i] (ld[i] apart), for the outputs present */
static inline void PA_FN(unstage_rows)(int n, real *const *from, const int64_t *width,
                                       real *const *to, const int64_t *ld, int64_t c0, int64_t l,
                                       int stream)
{
    for (int i = 0; i < n; i++)
        if (from[i])
            PA_FN(rows_put)(from[i], width[i], l, width[i], to[i] + c0 * ld[i], ld[i], stream);
}

/* G (L x D) = the inclusive cumulative sum of g's clamped rows (gate_step), summed as
 * double hi + lo pairs (gate_sum2) and stored as real hi + lo parts (lo at G + lo); acc: 2 D
 * doubles of scratch. suffix: G_i = -(the sum over the rows after i) instead, the same
 * differences G_i - G_j, but NaN only before a NaN gate rather than from it on. */
static void PA_FN(la_cumsum_hilo)(const real *restrict g, int64_t ldg, int64_t L, int64_t D,
                                  int suffix, real *restrict G, int64_t lo, double *acc)
{
    double *restrict hs = acc, *restrict ls = acc + D;
    for (int64_t j = 0; j < D; j++) hs[j] = ls[j] = 0;
    if (!suffix) { /* the common case as its own loop, vectorised across channels */
        for (int64_t i = 0; i < L; i++) {
            const real *restrict gi = g + i * ldg;
            real *restrict Gh = G + i * D, *restrict Gl = G + lo + i * D;
            PA_FN(la_prefetch_ahead)(g, ldg, D, L, i);
            for (int64_t j = 0; j < D; j++) {
                PA_FN(gate_sum2)(hs + j, ls + j, PA_FN(gate_step)(gi[j]));
                const real hi = (real)hs[j];
                Gh[j] = hi;
                Gl[j] = (real)((hs[j] - hi) + ls[j]);
            }
        }
        return;
    }
    for (int64_t i = L - 1; i >= 0; i--)
        for (int64_t j = 0; j < D; j++) {
            const real hi = (real)-hs[j];
            G[i * D + j] = hi;
            G[lo + i * D + j] = (real)((-hs[j] - hi) - ls[j]);
            PA_FN(gate_sum2)(hs + j, ls + j, PA_FN(gate_step)(g[i * ldg + j]));
        }
}

/* A scalar side over L rows of g (stride ldg): its cumulative gates as la_cumsum_hilo's (hi in
 * Gs, lo at Gs + Lmax, as doubles) and, with Dm, its mask e^(G_i - G_j) on and below the
 * diagonal, 0 above. */
static void PA_FN(la_scalar_side)(PA_FN(la_side) *s, const real *g, int64_t ldg, int64_t L,
                                  int suffix, double *Gs, int64_t Lmax, real *Dm)
{
    s->Gs = Gs;
    s->Gl = Gs + Lmax;
    s->Dm = Dm;
    PA_FN(gate_cumsum)(g, ldg, L, suffix, Gs, Gs + Lmax);
    if (Dm) PA_FN(decay_mask)(Gs, Gs + Lmax, L, Dm);
}

/* Whether rows r0 .. r0+n-1 of the cnt row arrays x[i] (NULL: absent; rows ld[i] apart, w[i]
 * wide) hold a value that is not finite, or with nan_only a NaN (a gate of -inf, a reset, is
 * then clean) */
static int PA_FN(la_rows_bad)(int cnt, const real *const *x, const int64_t *ld, const int64_t *w,
                              int64_t r0, int64_t n, int nan_only)
{
    vint bad = (vint){0};
    for (int i = 0; i < cnt; i++)
        for (int64_t t = r0; x[i] && t < r0 + n; t++)
            for (int64_t c = 0; c < w[i]; c += VL) {
                const vreal y = PA_FN(row_ld)(x[i] + t * ld[i] + c, w[i] - c);
                const vreal z = nan_only ? y : y * 0; /* x * 0 is NaN exactly where x is not finite */
                bad |= z != z;
            }
    for (int l = 0; l < VL; l++)
        if (bad[l]) return 1;
    return 0;
}

/* Whether a block of rows r0 .. r0+n-1 that starts a unit without h0 may leave out its zero
 * state's products: only where its cnt inputs (as la_rows_bad's) and, in a backward, dS (K x
 * V, or NULL) are finite. An inf or NaN there (a NaN gate, a -inf one too) times the zero
 * state is NaN, which the products would have carried into the results; such a block
 * computes them. */
static int PA_FN(la_zero_start)(int cnt, const real *const *x, const int64_t *ld,
                                const int64_t *w, int64_t r0, int64_t n, const real *dS,
                                int64_t K, int64_t V)
{
    return !PA_FN(la_rows_bad)(cnt, x, ld, w, r0, n, 0) &&
           !(dS && PA_FN(la_rows_bad)(1, &dS, &V, &V, 0, K, 0));
}

/* Whether rows r0 .. r1-1 of a vector side's gate stay within LA_FACTOR of row r0 in every
 * channel, so that the factors e^(G_i - G_r0) and e^(G_r0 - G_i) are at most e^LA_FACTOR: the
 * hi part of G_i - G_r0 (as la_decay takes it) bounds both, whatever the signs. A NaN gate
 * counts as in range (a block factors as it would without it). */
static int PA_FN(la_in_range)(const PA_FN(la_side) *s, int64_t r0, int64_t r1)
{
    const int64_t D = s->D;
    const real *G = s->G, *Gr = s->G + r0 * D;
    const vreal lim = PA_FN(vset)(LA_FACTOR);
    for (int64_t i = r0 + 1; i < r1; i++) {
        vint out = (vint){0};
        for (int64_t d = 0; d < D; d += VL) {
            const vreal hi = PA_FN(row_ld)(G + i * D + d, D - d) - PA_FN(row_ld)(Gr + d, D - d);
            out |= (hi > lim) | (-hi > lim);
        }
        for (int l = 0; l < VL; l++)
            if (out[l]) return 0;
    }
    return 1;
}

/* Whether rows r0 .. r1-1 of a vector side's block (a sub-block) can be rescaled to row r,
 * one of them: in range of it (la_in_range), and row r's gate a number in every channel (the
 * side summed from the block's end is NaN before a NaN gate: rescaled to such a row, the pairs
 * after the NaN would be NaN too). */
static int PA_FN(la_rescalable)(const PA_FN(la_side) *s, int64_t r0, int64_t r1, int64_t r)
{
    for (int64_t d = 0; d < s->D; d++)
        if (s->G[r * s->D + d] != s->G[r * s->D + d]) return 0;
    return PA_FN(la_in_range)(s, r0, r1);
}

/* A vector side's factors e^(G_i - G_0), e^(G_0 - G_i) and e^G_0 into E ((2 L + 1) x D) when
 * the block's gate spans at most LA_FACTOR in every channel (then s->Ep, s->Em, s->E0 point
 * there). The second is the reciprocal of the first, a division being cheaper than an exp. */
static void PA_FN(la_factor)(PA_FN(la_side) *s, int64_t L, real *E)
{
    const int64_t D = s->D;
    const real *G = s->G, *Gl = s->G + s->lo;
    const vreal lim = PA_FN(vset)(LA_FACTOR);
    vint out = (vint){0};
    /* the factors made as la_in_range(s, 0, L) checks the span (one pass over G, not two);
     * a block out of range drops them */
    for (int64_t i = 0; i < L; i++)
        for (int64_t d = 0; d < D; d += VL) { /* G_i - G_0 as la_decay takes it */
            const vreal hi = PA_FN(row_ld)(G + i * D + d, D - d) - PA_FN(row_ld)(G + d, D - d);
            const vreal x = hi + (PA_FN(row_ld)(Gl + i * D + d, D - d) - PA_FN(row_ld)(Gl + d, D - d));
            const vreal e = PA_FN(vexp)(x);
            out |= (hi > lim) | (-hi > lim);
            PA_FN(row_st)(E + i * D + d, e, D - d);
            PA_FN(row_st)(E + (L + i) * D + d, 1 / e, D - d);
        }
    for (int l = 0; l < VL; l++)
        if (out[l]) return;
    for (int64_t d = 0; d < D; d += VL)
        PA_FN(row_st)(E + 2 * L * D + d, PA_FN(la_decay)(G, NULL, s->lo, d, D - d), D - d);
    s->Ep = E;
    s->Em = E + L * D;
    s->E0 = E + 2 * L * D;
}

/* ---- the products over a block's rows, for any gate on their side ---- */

/* Y_i = X_i * E_i (beta = 0) or Y_i += X_i * E_i (beta = 1) for L rows of D */
static void PA_FN(la_rows_mul)(const real *X, int64_t ldx, const real *E, int64_t L, int64_t D,
                               real beta, real *Y, int64_t ldy)
{
    for (int64_t i = 0; i < L; i++)
        for (int64_t d = 0; d < D; d += VL) {
            vreal r = PA_FN(row_ld)(X + i * ldx + d, D - d) * PA_FN(row_ld)(E + i * D + d, D - d);
            if (beta != 0) r += PA_FN(row_ld)(Y + i * ldy + d, D - d);
            PA_FN(row_st)(Y + i * ldy + d, r, D - d);
        }
}

/* The rows of U (L x D) holding a NaN or an infinity, in order, into rows; returns their count */
static int64_t PA_FN(la_nonfinite_rows)(const real *U, int64_t ldu, int64_t L, int64_t D,
                                        int64_t *rows)
{
    int64_t n = 0;
    for (int64_t i = 0; i < L; i++) {
        vreal z = PA_FN(vset)(0); /* x * 0 is NaN exactly when x is not finite */
        for (int64_t d = 0; d < D; d += VL) z += PA_FN(row_ld)(U + i * ldu + d, D - d) * 0;
        const real t = PA_FN(hsum)(z);
        if (t != t) rows[n++] = i;
    }
    return n;
}

/* Row p of pack_b(L, D, U, ldu, 1, Bp): U's (zero = 0) or zeros (zero = 1) */
static void PA_FN(la_repack_row)(real *Bp, int64_t L, int64_t D, const real *U, int64_t ldu,
                                 int64_t p, int zero)
{
    for (int64_t c = 0; c < D; c++)
        Bp[c / NR * L * NR + p * NR + c % NR] = zero ? 0 : U[p * ldu + c];
}

/* Z (rows of ldz) = beta Z + alpha W U over the triangle of W: rows i of W up to i
 * (trans = 0, W lower), or W^T, rows j from j (trans = 1); U is L x D, packed here into bufs->Bp.
 * A row block's GEMM also multiplies the zeros above the diagonal of its diagonal block, and
 * 0 * NaN or 0 * inf would carry a non-finite row of U to the rows that cannot see it. So the
 * packing looks for non-finite rows (one pass over U), and a block that meets one inside its
 * diagonal block runs with those rows zeroed in the packing, then adds them to the rows that
 * see them. Finite rows take the one GEMM per block, and the rows that cannot see a non-finite
 * one get the same bits as in a run without it: the zeroed terms are exact zeros either way. */
static void PA_FN(la_tri_product)(int64_t L, int64_t D, real alpha, const real *W, int trans,
                                  real beta, real *Z, int64_t ldz, const real *U, int64_t ldu,
                                  PA_FN(la_bufs) *bufs)
{
    PA_FN(pack_b)(L, D, U, ldu, 1, bufs->Bp);
    const int64_t nbad = PA_FN(la_nonfinite_rows)(U, ldu, L, D, bufs->rows);
    int64_t b = 0; /* the first non-finite row not before the block */
    for (int64_t i0 = 0; i0 < L; i0 += LA_TRI) {
        const int64_t i1 = i0 + LA_TRI < L ? i0 + LA_TRI : L;
        while (b < nbad && bufs->rows[b] < i0) b++;
        /* rows [lo, hi) of U reach rows of the block that cannot see them */
        const int64_t lo = trans ? i0 : i0 + 1, hi = trans ? i1 - 1 : i1;
        int64_t b1 = b;
        for (; b1 < nbad && bufs->rows[b1] < hi; b1++)
            if (bufs->rows[b1] >= lo) PA_FN(la_repack_row)(bufs->Bp, L, D, U, ldu, bufs->rows[b1], 1);
        if (trans)
            PA_FN(gemm_packed_b)(i1 - i0, D, L - i0, alpha, W + i0 * L + i0, 1, L,
                                 bufs->Bp + i0 * NR, L * NR, beta, Z + i0 * ldz, ldz, bufs->work);
        else
            PA_FN(gemm_packed_b)(i1 - i0, D, i1, alpha, W + i0 * L, L, 1, bufs->Bp, L * NR, beta,
                                 Z + i0 * ldz, ldz, bufs->work);
        for (int64_t r = b; r < b1; r++) {
            const int64_t p = bufs->rows[r];
            if (p < lo) continue;
            PA_FN(la_repack_row)(bufs->Bp, L, D, U, ldu, p, 0);
            /* trans = 0: rows p .. i1-1 see U_p through W_ip; trans = 1: rows i0 .. p through W_pj */
            for (int64_t i = trans ? i0 : p; i < (trans ? p + 1 : i1); i++)
                PA_FN(axpy)(Z + i * ldz, U + p * ldu, D, alpha * (trans ? W[p * L + i] : W[i * L + p]));
        }
    }
}

/* W (L x L, ld L) = lower triangle of alpha sum_d X_id Y_jd e^(G_id - G_jd); 0 above, and on
 * the diagonal too when strict. */
/* la_gram's products where no gate is left inside the sum: X and Y are the rows as they
 * multiply (a factored vector gate's factors already applied), a scalar gate's mask follows.
 * Y^T is packed once; the row blocks stop at the diagonal. */
static void PA_FN(la_gram_rows)(const PA_FN(la_side) *s, int64_t L, real alpha, const real *X,
                                int64_t ldx, const real *Y, int64_t ldy, int strict, real *W,
                                PA_FN(la_bufs) *bufs)
{
    const int64_t D = s->D;
    PA_FN(pack_b)(D, L, Y, 1, ldy, bufs->Bp);
    for (int64_t i0 = 0; i0 < L; i0 += LA_TRI) {
        int64_t i1 = i0 + LA_TRI < L ? i0 + LA_TRI : L;
        PA_FN(gemm_packed_b)(i1 - i0, i1, D, alpha, X + i0 * ldx, ldx, 1, bufs->Bp, D * NR, 0,
                             W + i0 * L, L, bufs->work);
    }
    for (int64_t i = 0; i < L; i++) {
        real *w = W + i * L;
        if (s->kind == PA_GATE_SCALAR)
            for (int64_t j = 0; j <= i; j++) w[j] *= s->Dm[i * L + j];
        for (int64_t j = strict ? i : i + 1; j < L; j++) w[j] = 0;
    }
}

static void PA_FN(la_gram)(const PA_FN(la_side) *s, int64_t L, real alpha, const real *X,
                           int64_t ldx, const real *Y, int64_t ldy, int strict, real *W,
                           PA_FN(la_bufs) *bufs)
{
    const int64_t D = s->D;
    if (s->kind != PA_GATE_VECTOR || s->Ep) {
        if (s->Ep) {
            PA_FN(la_rows_mul)(X, ldx, s->Ep, L, D, 0, bufs->Tm, D);
            PA_FN(la_rows_mul)(Y, ldy, s->Em, L, D, 0, bufs->U, D);
            X = bufs->Tm;
            Y = bufs->U;
            ldx = ldy = D;
        }
        PA_FN(la_gram_rows)(s, L, alpha, X, ldx, Y, ldy, strict, W, bufs);
        return;
    }
    for (int64_t i0 = 0; i0 < L; i0 += LA_SUB) {
        int64_t i1 = i0 + LA_SUB < L ? i0 + LA_SUB : L;
        const real *Gn = s->G + i0 * D;
        /* rows i0.. against rows ..n-1, both rescaled to row i0: the earlier sub-blocks' rows,
         * and the sub-block's own when its gate spans at most LA_FACTOR (its factors to row i0
         * are then bounded both ways; each entry is its own sum, so a NaN stays in its own) */
        const int64_t n = PA_FN(la_rescalable)(s, i0, i1, i0) ? i1 : i0;
        if (n > 0) {
            for (int64_t i = i0; i < i1; i++)
                PA_FN(la_gated)(bufs->Tm + (i - i0) * D, X + i * ldx, s->G + i * D, Gn, s->lo, D, alpha, 0);
            for (int64_t j = 0; j < n; j++)
                PA_FN(la_gated)(bufs->U + j * D, Y + j * ldy, Gn, s->G + j * D, s->lo, D, 1, 0);
            PA_FN(gemm)(i1 - i0, n, D, 1, bufs->Tm, D, 1, bufs->U, 1, D, 0, W + i0 * L, L, bufs->work);
        }
        for (int64_t i = i0; i < i1; i++) {
            for (int64_t j = n; j < i + !strict; j++)
                W[i * L + j] = alpha * PA_FN(la_dot_gated)(X + i * ldx, Y + j * ldy,
                                                           j < i ? s->G + i * D : NULL,
                                                           j < i ? s->G + j * D : NULL, s->lo, D);
            for (int64_t j = strict ? i : i + 1; j < L; j++) W[i * L + j] = 0;
        }
    }
}

/* The scalar side's mask applied to W (lower triangular), into bufs->M; W itself otherwise. */
static const real *PA_FN(la_masked)(const PA_FN(la_side) *s, int64_t L, const real *W,
                                    PA_FN(la_bufs) *bufs)
{
    if (s->kind != PA_GATE_SCALAR) return W;
    for (int64_t i = 0; i < L * L; i++) bufs->M[i] = W[i] * s->Dm[i];
    return bufs->M;
}

/* Z_out += alpha W_ij e^(G_i - G_j) U_in elementwise, (out, in) = (i, j) (trans = 0) or
 * (j, i) (trans = 1), for the pairs i >= j of rows i0 .. i1-1 and j0 .. j1-1 */
static void PA_FN(la_apply_pairs)(const PA_FN(la_side) *s, int64_t L, real alpha, const real *W,
                                  int trans, const real *U, int64_t ldu, real *Z, int64_t ldz,
                                  int64_t i0, int64_t i1, int64_t j0, int64_t j1)
{
    const int64_t D = s->D;
    const real *G = s->G;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t j = j0; j < j1 && j <= i; j++) {
            const int64_t out = trans ? j : i, in = trans ? i : j;
            PA_FN(la_gated)(Z + out * ldz, U + in * ldu, j < i ? G + i * D : NULL,
                            j < i ? G + j * D : NULL, s->lo, D, alpha * W[i * L + j], 1);
        }
}

/* The sub-block form of la_apply for a vector gate that is not factored: across sub-blocks a
 * GEMM of rows rescaled to a row of the later (trans = 0: its first) or the earlier (trans =
 * 1: its last) sub-block; inside one the same GEMM when its gate spans at most LA_FACTOR,
 * else the sum elementwise. The GEMM multiplies the zeros above W's diagonal with the
 * sub-block's own rows, so a non-finite one is zeroed there and added elementwise to the rows
 * that see it, as la_tri_product does: the others get the bits of a run without it. */
static void PA_FN(la_apply_sub)(const PA_FN(la_side) *s, int64_t L, real alpha, const real *W,
                                int trans, const real *U, int64_t ldu, real *Z, int64_t ldz,
                                PA_FN(la_bufs) *bufs)
{
    const int64_t D = s->D, lo = s->lo;
    const real *G = s->G;
    for (int64_t b0 = 0; b0 < L; b0 += LA_SUB) {
        int64_t b1 = b0 + LA_SUB < L ? b0 + LA_SUB : L, nbad = 0;
        /* the sub-block's own pairs in the GEMM */
        const int own = PA_FN(la_rescalable)(s, b0, b1, trans ? b1 - 1 : b0);
        /* the rows rescaled, from `first` on: to row b0 the rows before the sub-block (and its
         * own last), to row b1-1 its own rows (first) and those after */
        const int64_t first = trans ? (own ? b0 : b1) : 0, last = trans ? L : (own ? b1 : b0);
        const real *Gs = G + (trans ? b1 - 1 : b0) * D;
        for (int64_t r = first; r < last; r++) {
            real *u = bufs->U + (r - first) * D;
            if (trans)
                PA_FN(la_gated)(u, U + r * ldu, G + r * D, Gs, lo, D, 1, 0);
            else
                PA_FN(la_gated)(u, U + r * ldu, Gs, G + r * D, lo, D, 1, 0);
        }
        real *ownrows = bufs->U + (b0 - first) * D;
        if (own) {
            nbad = PA_FN(la_nonfinite_rows)(ownrows, D, b1 - b0, D, bufs->rows);
            for (int64_t r = 0; r < nbad; r++) memset(ownrows + bufs->rows[r] * D, 0, sizeof(real) * D);
        }
        if (last > first) {
            if (trans)
                PA_FN(gemm)(b1 - b0, D, L - first, alpha, W + first * L + b0, 1, L, bufs->U, D, 1,
                            0, bufs->Tm, D, bufs->work);
            else
                PA_FN(gemm)(b1 - b0, D, last, alpha, W + b0 * L, L, 1, bufs->U, D, 1, 0, bufs->Tm,
                            D, bufs->work);
            for (int64_t r = b0; r < b1; r++) {
                const real *t = bufs->Tm + (r - b0) * D;
                if (trans)
                    PA_FN(la_gated)(Z + r * ldz, t, Gs, G + r * D, lo, D, 1, 1);
                else
                    PA_FN(la_gated)(Z + r * ldz, t, G + r * D, Gs, lo, D, 1, 1);
            }
        }
        if (!own) /* the pairs i >= j inside the sub-block */
            PA_FN(la_apply_pairs)(s, L, alpha, W, trans, U, ldu, Z, ldz, b0, b1, b0, b1);
        for (int64_t r = 0; r < nbad; r++) { /* a non-finite row's pairs: its column (trans = 0) or row */
            const int64_t p = b0 + bufs->rows[r];
            if (trans)
                PA_FN(la_apply_pairs)(s, L, alpha, W, 1, U, ldu, Z, ldz, p, p + 1, b0, b1);
            else
                PA_FN(la_apply_pairs)(s, L, alpha, W, 0, U, ldu, Z, ldz, b0, b1, p, p + 1);
        }
    }
}

/* Z_i += alpha sum_{j<=i} W_ij e^(G_i - G_j) U_j (trans = 0), or the transposed product
 * Z_j += alpha sum_{i>=j} W_ij e^(G_i - G_j) U_i (trans = 1); Z, U: L x D. */
static void PA_FN(la_apply)(const PA_FN(la_side) *s, int64_t L, real alpha, const real *W,
                            int trans, const real *U, int64_t ldu, real *Z, int64_t ldz,
                            PA_FN(la_bufs) *bufs)
{
    const int64_t D = s->D;
    if (s->kind != PA_GATE_VECTOR) {
        PA_FN(la_tri_product)(L, D, alpha, PA_FN(la_masked)(s, L, W, bufs), trans, 1, Z, ldz, U,
                              ldu, bufs);
    } else if (s->Ep) { /* e^(G_i - G_j) = e^(G_i - G_0) e^(G_0 - G_j): U's side, then Z's */
        PA_FN(la_rows_mul)(U, ldu, trans ? s->Ep : s->Em, L, D, 0, bufs->U, D);
        PA_FN(la_tri_product)(L, D, alpha, W, trans, 0, bufs->Tm, D, bufs->U, D, bufs);
        PA_FN(la_rows_mul)(bufs->Tm, D, trans ? s->Em : s->Ep, L, D, 1, Z, ldz);
    } else {
        PA_FN(la_apply_sub)(s, L, alpha, W, trans, U, ldu, Z, ldz, bufs);
    }
}

/* ---- kept states, groups ---- */

/* The kept-states layout (pa_linear_kept_states): first[u] is unit u's first slot, a slot per
 * block of L rows and one for the final state; NULL when out of memory. */
static int64_t *PA_FN(la_slots)(const pa_linear_desc *d, int64_t L)
{
    const int64_t units = d->nseq * d->H;
    int64_t *first = malloc(sizeof(int64_t) * (units + 1));
    if (!first) return NULL;
    first[0] = 0;
    for (int64_t u = 0; u < units; u++)
        first[u + 1] = first[u] + pa_linear_unit_states(d, u / d->H, L);
    return first;
}

/* With groups (H != Hqk) a backward writes each head's dq and dk into a buffer of H heads
 * ([rows, H, K] each, dq's then dk's; la_group_heads: NULL without groups, and *nomem set
 * when it cannot be had), then sums the heads of each group into dq and dk [rows, Hqk, K]
 * (la_sum_groups: a sum of none, zeros, when there are no value heads). */
static real *PA_FN(la_group_heads)(const pa_linear_desc *d, int *nomem)
{
    *nomem = 0;
    if (d->H == d->Hqk) return NULL;
    real *heads = pa_alloc(sizeof(real) * (size_t)(2 * d->cu[d->nseq] * d->H * d->K + 1));
    *nomem = heads == NULL;
    return heads;
}

static void PA_FN(la_sum_groups)(const pa_linear_desc *d, const real *heads, real *dq, real *dk)
{
    const int64_t rows = d->cu[d->nseq], G = d->H / d->Hqk, K = d->K, nq = rows * d->Hqk * K;
    real *dst[2] = {dq, dk};
    const real *src[2] = {heads, heads + rows * d->H * K};
#pragma omp parallel for num_threads(pa_threads_for((double)rows * d->H * K, rows)) schedule(static)
    for (int64_t x = 0; x < nq; x += K) /* x: (row, group) at x / K; its G heads in order */
        for (int w = 0; w < 2; w++) {
            const real *from = src[w] + x * G;
            memset(dst[w] + x, 0, sizeof(real) * K);
            for (int64_t j = 0; j < G; j++) PA_FN(axpy)(dst[w] + x, from + j * K, K, 1);
        }
}
