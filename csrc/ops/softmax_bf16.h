/* Softmax attention's flash and parallel forms with bf16 products (d->bf16, on a CPU with a
 * pa_bf16 kind: AMX or AVX512-BF16). Part of softmax_attn.c, in its float AVX-512
 * instantiation only (the bf16 paths run the AVX-512 tables).
 *
 * The inputs are bf16 values widened to float, so packing them as bf16 is exact. What is
 * computed in a tile (P, dS) is rounded to bf16 for its products, as PyTorch's bf16 flash
 * kernels do; scores, the softmax, the accumulators and the gradients' sums stay float. The
 * tiles and their masks, transforms and softmax are softmax_attn.c's; only the products and
 * their operands' packing differ:
 *   forward  S^T = scale K Q^T, and the accumulator kept transposed, O^T [Dv x queries] +=
 *            V^T P^T, so that P^T is a B operand straight from pairs of rows of S^T, and V^T,
 *            packed once, the A operand;
 *   backward S = scale Q K^T, dV += P^T dO, dP = dO V^T, dQ += scale dS K, dK += scale dS^T Q,
 *            each tile's P and dS packed for their products, Q, K, V and dO once per call.
 * Key blocks start at multiples of PA_BF16_PAD, where the packed keys' pairs and AMX's K
 * steps begin. A call whose inputs are not all finite takes the float kernels: a masked
 * pair's 0 times a non-finite value must not reach the output (sm_add_nonfinite_rows). */

/* the backward's key blocks start at multiples of NR (sm_backward_tile), where the packed
 * keys' panels of 16 and pairs begin */
_Static_assert(NR % PA_BF16_PAD == 0, "key blocks must start on the bf16 packings' panels");

/* How an array [rows, heads, D] is packed, per (sequence, head), for pa_bf16_gemm */
enum {
    SM_BF16_ROWS_A,  /* rows as A rows, pairs along D (pa_bf16_rows_a) */
    SM_BF16_ROWS_B,  /* rows as B columns, pairs along D (pa_bf16_rows_b) */
    SM_BF16_PAIRS_A, /* D as A rows, pairs of rows (pa_bf16_pairs_a) */
    SM_BF16_PAIRS_B  /* D as B columns, pairs of rows (pa_bf16_pairs_b) */
};

typedef struct {
    uint32_t *data;
    int64_t *offset; /* per (sequence, head) */
    const float *x;
    int64_t D, heads, extra; /* extra: zero rows past a sequence's rows rounded to PA_BF16_PAD */
    const int64_t *cu;
    int layout;
} sm_bf16_pack;

static void sm_bf16_pack_free(sm_bf16_pack *pk)
{
    free(pk->data);
    free(pk->offset);
    pk->data = NULL;
    pk->offset = NULL;
}

/* A sequence's rows as packed: rounded up to PA_BF16_PAD, plus extra */
static inline int64_t sm_bf16_rows(const sm_bf16_pack *pk, int64_t n)
{
    return pa_bf16_round(pk->cu[n + 1] - pk->cu[n], PA_BF16_PAD) + pk->extra;
}

/* The leading dimension of (sequence n)'s packing: lda of an A operand, bps of a B one */
static inline int64_t sm_bf16_ld(const sm_bf16_pack *pk, int64_t n)
{
    switch (pk->layout) {
    case SM_BF16_ROWS_A: return pa_bf16_dp(pk->D) / 2;
    case SM_BF16_ROWS_B: return pa_bf16_dp(pk->D) / 2 * 16;
    case SM_BF16_PAIRS_A: return sm_bf16_rows(pk, n) / 2;
    default: return sm_bf16_rows(pk, n) / 2 * 16;
    }
}

/* Lays out and allocates the packing of x (queries: over d's query rows and heads, else its
 * keys and KV heads); 0 if out of memory. */
static int sm_bf16_pack_alloc(sm_bf16_pack *pk, const pa_softmax_desc *d, const float *x,
                              int64_t D, int queries, int layout, int64_t extra)
{
    *pk = (sm_bf16_pack){NULL, NULL, x, D, queries ? d->H : d->Hk, extra,
                         queries ? d->cu_q : d->cu_k, layout};
    const int64_t units = d->nseq * pk->heads;
    if (!(pk->offset = malloc(sizeof(int64_t) * (units + 1)))) return 0;
    int64_t total = 0;
    for (int64_t u = 0; u < units; u++) {
        pk->offset[u] = total;
        total += sm_bf16_rows(pk, u / pk->heads) * pa_bf16_round(D, 2 * PA_BF16_KSTEP) / 2;
    }
    pk->offset[units] = total;
    if ((pk->data = pa_alloc(sizeof(uint32_t) * (total + 1)))) return 1;
    sm_bf16_pack_free(pk);
    return 0;
}

/* Fills packings (count of them), one (sequence, head) per iteration of a work-shared loop:
 * called by every thread of the kernel's parallel region; ends with the loop's barrier. */
static void sm_bf16_pack_fill(sm_bf16_pack *const *pks, int count, const pa_softmax_desc *d)
{
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += d->nseq * pks[i]->heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < total; t++) {
        int i = 0;
        int64_t u = t;
        while (u >= d->nseq * pks[i]->heads) u -= d->nseq * pks[i++]->heads;
        const sm_bf16_pack *pk = pks[i];
        const int64_t n = u / pk->heads, r0 = pk->cu[n], len = pk->cu[n + 1] - r0;
        const int64_t rows = sm_bf16_rows(pk, n), ld = pk->heads * pk->D;
        const float *X = pk->x + (r0 * pk->heads + u % pk->heads) * pk->D;
        uint32_t *dst = pk->data + pk->offset[u];
        switch (pk->layout) {
        case SM_BF16_ROWS_A: pa_bf16_rows_a(len, rows, pk->D, X, ld, dst); break;
        case SM_BF16_ROWS_B: pa_bf16_rows_b(len, rows, pk->D, X, ld, dst); break;
        case SM_BF16_PAIRS_A: pa_bf16_pairs_a(len, rows, pk->D, X, ld, dst); break;
        default: pa_bf16_pairs_b(len, rows, pk->D, X, ld, dst); break;
        }
    }
}

/* The operand of rows r0.. (a multiple of 16 for ROWS_B, even for the pair layouts) of
 * (sequence n, head hd); *ld gets its leading dimension (sm_bf16_ld). */
static inline const uint32_t *sm_bf16_at(const sm_bf16_pack *pk, int64_t n, int64_t hd,
                                         int64_t r0, int64_t *ld)
{
    const uint32_t *base = pk->data + pk->offset[n * pk->heads + hd];
    *ld = sm_bf16_ld(pk, n);
    switch (pk->layout) {
    case SM_BF16_ROWS_A: return base + r0 * *ld;
    case SM_BF16_ROWS_B: return base + r0 / 16 * *ld;
    case SM_BF16_PAIRS_A: return base + r0 / 2;
    default: return base + r0 / 2 * 16;
    }
}

/* Whether a call's arrays (count of them, sizes elems) are all finite: the bf16 products
 * need it (see the top) */
static int sm_bf16_finite(const float *const *x, const int64_t *elems, int count)
{
    int finite = 1;
    for (int i = 0; i < count; i++) {
        const int64_t chunk = 1 << 16, chunks = (elems[i] + chunk - 1) / chunk;
#pragma omp parallel for reduction(&& : finite) num_threads(pa_threads_for((double)elems[i], chunks))
        for (int64_t c = 0; c < chunks; c++)
            finite = finite && PA_FN(sm_all_finite)(x[i] + c * chunk,
                                                    elems[i] - c * chunk < chunk ? elems[i] - c * chunk : chunk);
    }
    return finite;
}

/* sm_softmax_columns' new maxima for a transposed accumulator OT [Dv x ldo] (query c in
 * column c) and scores xs ST (xs > 0): m, l and the columns of OT of the queries whose max
 * grew rescaled (OT in one pass), msafe = m with -inf as 0. The exponentials are left to
 * sm_bf16_exp_pairs. */
static void sm_bf16_raise_max(const real *ST, int64_t lds, int64_t bk, int64_t n, real xs,
                              real *m, real *l, real *OT, int64_t ldo, int64_t Dv, real *factor,
                              real *msafe)
{
    for (int64_t c = 0; c < n; c++) factor[c] = -(real)INFINITY;
    PA_FN(col_max_into)(factor, ST, lds, bk, n);
    int grew = 0;
    for (int64_t c = 0; c < n; c++) {
        real f = 1;
        factor[c] *= xs;
        if (factor[c] > m[c]) {
            f = (real)exp((double)m[c] - (double)factor[c]);
            l[c] *= f;
            m[c] = factor[c];
            grew = 1;
        }
        factor[c] = f;
        msafe[c] = m[c] == -(real)INFINITY ? 0 : m[c];
    }
    for (int64_t x = 0; x < Dv && grew; x++)
        for (int64_t c = 0; c < n; c++) OT[x * ldo + c] *= factor[c];
}

/* The probabilities of a score tile straight into the B operand of O^T += V^T P^T: P^T [bk x
 * n] = exp(xs ST - m) (m: sm_bf16_raise_max's msafe) as pa_bf16_pairs_b lays it out (pad / 2
 * pairs of key rows, columns up to n rounded to PA_BF16_PAD, zeros past bk and n), and l[c]
 * += column c's sum. One pass over ST; the bf16 rounding is to nearest, ties to even, as the
 * packings' (P lies in [0, 1], or is NaN, which stays NaN). */
static void sm_bf16_exp_pairs(const real *ST, int64_t lds, int64_t bk, int64_t pad, int64_t n,
                              real xs, const real *m, real *l, uint32_t *PT)
{
    const int64_t bps = pad / 2 * 16;
    for (int64_t c0 = 0; c0 < pa_bf16_round(n, PA_BF16_PAD); c0 += VL) {
        uint32_t *dst = PT + c0 / 16 * bps;
        if (c0 >= n) {
            memset(dst, 0, sizeof(uint32_t) * bps);
            continue;
        }
        const int w = n - c0 < VL ? (int)(n - c0) : VL;
        const vreal mv = w == VL ? PA_FN(vload)(m + c0) : PA_FN(vload_part)(m + c0, w, 0);
        vreal sum = PA_FN(vset)(0);
        for (int64_t p = 0; p < pad / 2; p++) {
            vuint half[2];
            for (int odd = 0; odd < 2; odd++) {
                const int64_t row = 2 * p + odd;
                vreal e = PA_FN(vset)(0);
                if (row < bk) {
                    const real *x = ST + row * lds + c0;
                    e = PA_FN(vexp_nonpos)((w == VL ? PA_FN(vload)(x) : PA_FN(vload_part)(x, w, -(real)INFINITY)) * xs - mv);
                }
                sum += e;
                vuint bits;
                memcpy(&bits, &e, sizeof bits);
                vuint rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
                half[odd] = (vuint)PA_FN(vselect)(e == e, (vreal)rounded, (vreal)((bits >> 16) | 0x40));
            }
            vuint pair = half[0] | (half[1] << 16);
            memcpy(dst + p * 16, &pair, sizeof pair);
        }
        real s[VL];
        PA_FN(vstore)(s, sum);
        for (int c = 0; c < w; c++) l[c0 + c] += s[c];
    }
}

/* The forward's operands: Q as B columns, K as A rows, V^T as A rows (pairs of keys) */
typedef struct {
    sm_bf16_pack q, k, vt;
} sm_bf16_fwd;

/* sm_forward_block's key block [j0, j1) (visibility vis) with bf16 products, into the
 * transposed accumulator O^T [Dv x lds] (s->O; s->pt: P^T) */
static void sm_forward_keys_bf16(const pa_softmax_desc *d, const PA_FN(sm_gate) * gt,
                                 const sm_bf16_fwd *pk, int64_t n, int64_t h, int64_t i0,
                                 int64_t bq, int64_t j0, int64_t j1, int vis,
                                 PA_FN(sm_scratch) * s)
{
    const int64_t Dv = d->Dv, lds = s->lds, kh = h / (d->H / d->Hk), k0 = d->cu_k[n];
    const int64_t tk = d->cu_k[n + 1] - k0, off = tk - (d->cu_q[n + 1] - d->cu_q[n]);
    const int64_t bk = j1 - j0, pad = pa_bf16_round(bk, PA_BF16_PAD);
    int64_t bps_q, lda_k, lda_v;
    const uint32_t *Q = sm_bf16_at(&pk->q, n, h, i0, &bps_q);
    const uint32_t *K = sm_bf16_at(&pk->k, n, kh, j0, &lda_k);
    const uint32_t *VT = sm_bf16_at(&pk->vt, n, kh, j0, &lda_v);
    real *ST = s->S;
    /* the scores unscaled, which AMX stores straight from its tiles; the scale rides in the
     * exponentials, or is applied first where a transform needs the true scores */
    pa_bf16_gemm(bk, bq, (d->Dk + 1) / 2, 1, K, lda_k, Q, bps_q, 0, ST, lds);
    real xs = (real)d->scale;
    if (vis != SM_VISIBLE || d->softcap > 0 || d->alibi || gt->G || !(xs > 0)) {
        for (int64_t x = 0; x < bk; x++) PA_FN(row_scale)(ST + x * lds, bq, xs);
        PA_FN(sm_transform_tile)(d, gt, h, ST, 1, lds, bq, bk, i0 + off, j0, tk, k0, vis, NULL);
        xs = 1;
    }
    sm_bf16_raise_max(ST, lds, bk, bq, xs, s->m, s->l, s->O, lds, Dv, s->dP, s->dP + lds);
    sm_bf16_exp_pairs(ST, lds, bk, pad, bq, xs, s->dP + lds, s->l, s->pt);
    pa_bf16_gemm(Dv, bq, (bk + 1) / 2, 1, VT, lda_v, s->pt, pad / 2 * 16, 1, s->O, lds);
}

/* The backward's operands: Q and dO as A rows (S, dP), K and V as B columns (S, dP), K as
 * pairs of keys (dQ), dO and Q as pairs of queries (dV, dK). Query blocks start anywhere
 * even, so the query packings have PA_BF16_PAD more zero rows for AMX's last K step. */
typedef struct {
    sm_bf16_pack q, dout, kt, vt, k, dout_pairs, q_pairs;
} sm_bf16_bwd;

/* sm_backward_tile's products in bf16 (s->pt: the packed P^T, dS or dS^T), for the keys
 * [ja, jb) of the block at j0 that its queries may see (ja a multiple of NR, which is
 * PA_BF16_PAD here), visibility vis */
static void sm_backward_tile_bf16(const pa_softmax_desc *d, const sm_bf16_bwd *pk,
                                  const PA_FN(sm_gate) * gt, const real *lse, const real *Drow,
                                  real *dq, int with_dq, real *dK, real *dV, int64_t n,
                                  int64_t h, int64_t i0, int64_t bq, int64_t j0, int64_t ja,
                                  int64_t jb, int vis, PA_FN(sm_scratch) * s)
{
    const int64_t H = d->H, Dk = d->Dk, Dv = d->Dv, kh = h / (H / d->Hk), lds = s->lds;
    const int64_t q0 = d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n];
    const int64_t ip0 = i0 + tk - (d->cu_q[n + 1] - q0);
    const float scale = (float)d->scale;
    real *S = s->S, *dP = s->dP;
    int64_t ld_q, ld_kt, ld_do, ld_vt, ld;
    const int partial = vis == SM_PARTIAL;
    const int64_t w = jb - ja, qpad = pa_bf16_round(bq, PA_BF16_PAD);
    const uint32_t *Q = sm_bf16_at(&pk->q, n, h, i0, &ld_q);
    const uint32_t *KT = sm_bf16_at(&pk->kt, n, kh, ja, &ld_kt);
    pa_bf16_gemm(bq, w, (Dk + 1) / 2, scale, Q, ld_q, KT, ld_kt, 0, S, lds);
    if (vis != SM_VISIBLE || d->softcap > 0 || d->alibi || gt->G)
        PA_FN(sm_transform_tile)(d, gt, h, S, lds, 1, bq, w, ip0, ja, tk, d->cu_k[n], vis, s->dcap);
    PA_FN(sm_bwd_probs)(d, lse, S, lds, n, h, i0, bq, ja, jb, partial);
    if (dV) {
        const uint32_t *dOp = sm_bf16_at(&pk->dout_pairs, n, h, i0, &ld);
        pa_bf16_pairs_a(bq, qpad, w, S, lds, s->pt);
        pa_bf16_gemm(w, Dv, (bq + 1) / 2, 1, s->pt, qpad / 2, dOp, ld, 1, dV + (ja - j0) * Dv, Dv);
    }
    const uint32_t *dO = sm_bf16_at(&pk->dout, n, h, i0, &ld_do);
    const uint32_t *VT = sm_bf16_at(&pk->vt, n, kh, ja, &ld_vt);
    pa_bf16_gemm(bq, w, (Dv + 1) / 2, 1, dO, ld_do, VT, ld_vt, 0, dP, lds);
    PA_FN(sm_bwd_dscores)(d, gt, Drow, S, dP, s, with_dq, dK != NULL, n, h, i0, bq, ja, jb, partial);
    if (with_dq) {
        const uint32_t *K = sm_bf16_at(&pk->k, n, kh, ja, &ld);
        pa_bf16_rows_a(bq, qpad, w, dP, lds, s->pt);
        pa_bf16_gemm(bq, Dk, (w + 1) / 2, scale, s->pt, pa_bf16_dp(w) / 2, K, ld, 1,
                     dq + ((q0 + i0) * H + h) * Dk, H * Dk);
    }
    if (dK) {
        const uint32_t *Qp = sm_bf16_at(&pk->q_pairs, n, h, i0, &ld);
        pa_bf16_pairs_a(bq, qpad, w, dP, lds, s->pt);
        pa_bf16_gemm(w, Dk, (bq + 1) / 2, scale, s->pt, qpad / 2, Qp, ld, 1, dK + (ja - j0) * Dk, Dk);
    }
}
