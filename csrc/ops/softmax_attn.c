/* Softmax attention: parallel, flash and recurrent forms, forward and backward.
 * Template body (see core/dtype.h); needs core/vmath.h, core/gemm.c and ops/softmax_rows.h
 * before it.
 *
 * Flash (FA-2 on the CPU): work items are (sequence, head, query block), scheduled
 * dynamically, a head's blocks one after another (so its K and V stay in cache between
 * them), the latest (longest causal) first. Q, K and V are packed once per call as
 * GEMM operands. Per item and key block: the scores are computed transposed, S^T = scale K
 * Q^T (keys down, queries across), so the online softmax runs down columns with whole
 * vectors of queries (no horizontal max or sum) and S^T is already the A operand of O += P V
 * (no repacking of P); scores are transformed (softcap, ALiBi, mask) only where a block
 * needs it, the accumulator is rescaled only where a query's max grows, and key blocks are
 * trimmed to the keys some query of the block sees (skipped when none). Per-thread scratch.
 * The parallel form is the same tile engine with one tile covering all keys and queries of
 * a sequence: it materialises the Tq x Tk scores, and the online softmax reduces to the
 * plain one. The recurrent form is separate code: one query, keys streamed one at a time.
 *
 * Decode (softmax_decode: flash with at most one query per sequence, and every KV-cache
 * call): no tiles. Work items are (query, part of its visible keys) over every head, keys
 * wherever they lie (rows of a contiguous cache or blocks of a paged one); each cached row
 * of all KV heads is read once, in order, with software prefetch, the heads of a KV head
 * sharing its loads (as GEMM tiles with the heads across the lanes where a group fills a
 * vector: MQA is bound by its FLOP, not its reads); the parts are merged by their
 * log-sum-exps (flash decoding).
 *
 * Backward (flash and parallel): units (sequence, KV head) each own the dK and dV rows of
 * their KV head and the dQ rows of the query heads of their group, so no two threads write
 * one row. Per tile: P is recomputed from the forward's LSE, dV += P^T dO, dP = dO V^T,
 * dS = P (dP - D) (times the softcap derivative), dQ += scale dS K, dK += scale dS^T Q;
 * D = rowsum(dO * O) - dlse folds in the cotangent of the LSE. With fewer units than threads
 * the work splits into key-block items (dK, dV) and query-block items (dQ, recomputing P and
 * dP). Every dQ tile is added in the same order in both schemes, so the result is the same
 * bits for any thread count.
 *
 * Non-finite values follow the float64 formula over each query's visible keys: a NaN or +inf
 * score (or visible scores all -inf) makes the row NaN, and a key the query cannot see never
 * reaches it. Masks are therefore applied by selection (never by adding -inf or multiplying
 * by 0), and the GEMMs of partially masked tiles keep 0 * NaN out (sm_add_nonfinite_rows).
 *
 * The Forgetting Transformer's gate (d->gate, flash and parallel forms) is one more score
 * option: the tiles' transform pass adds G_i - G_j (sm_gate_bias); the backward's tiles leave
 * the diagonal of dS out and sum the rest of its rows and columns, from which sm_gate_finish
 * makes the diagonal's terms and dg (sm_gate: the gate's layout, precision and gradient).
 */

/* bf16 products (softmax_bf16.h) live in the float AVX-512 instantiation, which the amx and
 * avx512_bf16 paths run */
#undef SM_BF16
#define SM_BF16 (!PA_DOUBLE && PA_VBYTES == 64)

#define SM_BQ 96     /* forward query block: a multiple of every NR and MR */
#define SM_BWD_BQ 48 /* backward query block: a multiple of every MR */
#define SM_BK 192    /* key block: a multiple of every NR and MR */
#define SM_DECODE_MAXQ 1 /* flash forward takes the decode path up to this many queries */

/* x[c * stride] = value for the c in [0, n) outside the ranges r (as sm_row_ranges gives). */
static inline void PA_FN(sm_fill_hidden)(real *x, int64_t stride, int64_t n,
                                         const int64_t r[2][2], real value)
{
    int64_t c = 0;
    for (int s = 0; s < 2; s++) {
        for (; c < r[s][0]; c++) x[c * stride] = value;
        c = c > r[s][1] ? c : r[s][1];
    }
    for (; c < n; c++) x[c * stride] = value;
}

#define SM_HIDDEN 0
#define SM_PARTIAL 1
#define SM_VISIBLE 2

/* Queries ip0..ip1 against the key block [j0, j1). The window bounds grow with ip, so the
 * first and last query bound the block. Trims the block to the keys some query may see,
 * [*ja, *jb) (start kept a multiple of `align`, where the packed operands' panels begin),
 * and classifies it: SM_HIDDEN is exact, SM_PARTIAL may be pessimistic. */
static inline int PA_FN(sm_block_keys)(const pa_softmax_desc *d, int64_t ip0, int64_t ip1,
                                       int64_t j0, int64_t j1, int64_t tk, int64_t align,
                                       int64_t *ja, int64_t *jb)
{
    int64_t lo0, hi0, shi0, lo1, hi1, shi1;
    PA_FN(sm_bounds)(d, ip0, tk, &lo0, &hi0, &shi0);
    PA_FN(sm_bounds)(d, ip1, tk, &lo1, &hi1, &shi1);
    int64_t reach = hi1 + 1 > shi1 ? hi1 + 1 : shi1;
    int64_t start = j0 < shi1 || lo0 < j0 ? j0 : lo0;
    *ja = start / align * align;
    *jb = j1 < reach ? j1 : reach;
    if (*jb <= *ja || !(lo0 < *jb || *ja < shi1)) return SM_HIDDEN;
    if ((lo1 <= *ja && hi0 >= *jb - 1) || *jb <= shi0) return SM_VISIBLE;
    return SM_PARTIAL;
}

/* FoX's forget gate: the score of the query at position i and key j (of one sequence and
 * query head) gains G_i - G_j, G_x = g_0 + ... + g_x the running sum of the log gate. The
 * queries are the keys' own positions (cu_q = cu_k), the mask causal with at most a left
 * window, so every query sees its own key. G runs to -1e4 and beyond on long sequences, where
 * a float G_i - G_j would keep only the leading digits of the difference; so each G is summed
 * in double (gate_sum2, each step clamped by gate_step, so that a -inf gate is a full reset
 * rather than -inf - -inf) and kept as real hi + lo parts, and the bias is (hi_i - hi_j) +
 * (lo_i - lo_j): the first difference is exact for the nearby keys that carry the weight
 * (Sterbenz), the second small, so the bias is good to about its own rounding however large G
 * grows. A NaN gate makes G NaN from its step on, so every later query of its head is NaN (its
 * window may not even reach back that far).
 *
 * Backward (no lse cotangent): a gate that forgets fast makes P nearly one-hot on the
 * diagonal, o_i ~ v_i, and there dS_ii = P_ii (dP_ii - D_i) is the difference of two O(1)
 * numbers, do_i.v_i - do_i.o_i, whose rounding would swamp the small gradients of q, k and g.
 * But each row of dS sums to 0 (sum_j P_ij dP_ij = do_i.o_i = D_i), so dS_ii = -(the row's
 * other entries), each of them accurate. So the tiles leave the diagonal out (sm_backward_tile
 * zeroes it before the products with K and Q) and sum each row's other entries, and
 * sm_gate_finish adds the diagonal's terms to dq and dk from those sums. Then g_t: the pairs
 * whose bias holds it are those with j < t <= i, and their dS sum is
 *   dg_t = sum_{x < t} (colsum_x - rowsum_x),
 * colsum_x the dS of key x over the later queries and rowsum_x that of query x over the
 * earlier keys (the pairs with both ends before t cancel), summed in double; both sums leave
 * the diagonal out, which enters no difference G_i - G_j. The column sums are taken in the
 * key-block passes and the row sums in the query-block passes (each owns its keys or its
 * queries: no two threads add into one entry, and the order is the same for any thread
 * count). A sequence's first step gets 0, and so does a clamped step (gate_step). */
typedef struct {
    real *G;      /* [2][H][rows_k]: the hi parts, then the lo parts (NULL without a gate) */
    double *dcol; /* backward: [H][rows_k] each key's column sum of dS (the diagonal left out) */
    double *drow; /* backward: [H][rows_k] each query's row sum of dS (the diagonal left out) */
    int64_t rows; /* rows_k */
} PA_FN(sm_gate);

/* Frees gt's buffers; a second call (after sm_gate_alloc failed and freed them) does nothing */
static void PA_FN(sm_gate_free)(PA_FN(sm_gate) * gt)
{
    free(gt->G);
    free(gt->dcol);
    gt->G = NULL;
    gt->dcol = gt->drow = NULL;
}

/* gt for d (nothing to do without a gate); 0 if out of memory */
static int PA_FN(sm_gate_alloc)(PA_FN(sm_gate) * gt, const pa_softmax_desc *d, int backward)
{
    memset(gt, 0, sizeof *gt);
    if (!d->gate) return 1;
    gt->rows = d->cu_k[d->nseq];
    const size_t n = (size_t)(d->H * gt->rows);
    gt->G = pa_alloc(sizeof(real) * (2 * n + 1));
    gt->dcol = backward ? pa_alloc(sizeof(double) * (2 * n + 1)) : NULL;
    if (!gt->G || (backward && !gt->dcol)) {
        PA_FN(sm_gate_free)(gt);
        return 0;
    }
    gt->drow = backward ? gt->dcol + n : NULL;
    return 1;
}

/* The hi parts of head h from key row r0 on (the lo parts H * rows further) */
static inline const real *PA_FN(sm_gate_at)(const PA_FN(sm_gate) * gt, int64_t h, int64_t r0)
{
    return gt->G + h * gt->rows + r0;
}

/* G of every (sequence, head), and the backward's sums zeroed: one (sequence, head) per
 * iteration of a work-shared loop, called by every thread of the kernel's parallel region;
 * ends with its barrier. */
static void PA_FN(sm_gate_fill)(const PA_FN(sm_gate) * gt, const pa_softmax_desc *d)
{
    if (!gt->G) return;
    const int64_t H = d->H, lo = H * gt->rows;
    const real *g = d->gate;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < d->nseq * H; u++) {
        const int64_t n = u / H, h = u % H;
        real *Gh = gt->G + h * gt->rows;
        double hs = 0, ls = 0;
        for (int64_t r = d->cu_k[n]; r < d->cu_k[n + 1]; r++) {
            PA_FN(gate_sum2)(&hs, &ls, PA_FN(gate_step)(g[r * H + h]));
            const real hi = (real)hs;
            Gh[r] = hi;
            Gh[lo + r] = (real)((hs - hi) + ls);
            if (gt->dcol) gt->dcol[h * gt->rows + r] = gt->drow[h * gt->rows + r] = 0;
        }
    }
}

/* S[x * ld + c] += the gate's bias over a tile of `rows` x `cols`: Gr and Gc the hi parts of
 * the rows' and the columns' positions (sm_gate_at; lo parts lo further), the rows the queries
 * (the backward's S) or the keys (the forward's S^T). Either way query i and key j get
 * (hi_i - hi_j) + (lo_i - lo_j), so the backward recomputes the forward's bits. */
static void PA_FN(sm_gate_bias)(real *S, int64_t ld, int64_t rows, int64_t cols, const real *Gr,
                                const real *Gc, int64_t lo, int rows_are_queries)
{
    for (int64_t x = 0; x < rows; x++) {
        real *s = S + x * ld;
        const real rh = Gr[x], rl = Gr[lo + x];
        const vreal vh = PA_FN(vset)(rh), vl = PA_FN(vset)(rl);
        int64_t c = 0;
        if (rows_are_queries) {
            for (; c + VL <= cols; c += VL)
                PA_FN(vstore)(s + c, PA_FN(vload)(s + c) + ((vh - PA_FN(vload)(Gc + c)) +
                                                            (vl - PA_FN(vload)(Gc + lo + c))));
            for (; c < cols; c++) s[c] += (rh - Gc[c]) + (rl - Gc[lo + c]);
        } else {
            for (; c + VL <= cols; c += VL)
                PA_FN(vstore)(s + c, PA_FN(vload)(s + c) + ((PA_FN(vload)(Gc + c) - vh) +
                                                            (PA_FN(vload)(Gc + lo + c) - vl)));
            for (; c < cols; c++) s[c] += (Gc[c] - rh) + (Gc[lo + c] - rl);
        }
    }
}

/* After every tile: the diagonal pairs' terms of dq and dk (dS_ii = -rowsum_i, times scale),
 * then dg_t = sum_{x < t} (colsum_x - rowsum_x) along each sequence (see sm_gate). One
 * (sequence, KV head) per iteration of a work-shared loop: it owns its dk rows and the dq
 * rows of its heads. */
static void PA_FN(sm_gate_finish)(const PA_FN(sm_gate) * gt, const pa_softmax_desc *d,
                                  const real *q, const real *k, real *dq, real *dk, real *dg)
{
    if (!gt->G) return;
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, group = H / Hk;
    const real scale = (real)d->scale, *g = d->gate;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < d->nseq * Hk; u++) {
        const int64_t n = u / Hk, kh = u % Hk, r0 = d->cu_k[n], r1 = d->cu_k[n + 1];
        for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
            const double *dc = gt->dcol + h * gt->rows, *dr = gt->drow + h * gt->rows;
            double acc = 0;
            for (int64_t r = r0; r < r1; r++) {
                const real ds = (real)-dr[r] * scale;
                PA_FN(axpy)(dq + (r * H + h) * Dk, k + (r * Hk + kh) * Dk, Dk, ds);
                PA_FN(axpy)(dk + (r * Hk + kh) * Dk, q + (r * H + h) * Dk, Dk, ds);
                dg[r * H + h] = __builtin_isless(g[r * H + h], -PA_GATE_RESET) ? 0 : (real)acc;
                acc += dc[r] - dr[r];
            }
        }
    }
}

/* In-place score transform of a tile of bq queries (at ip0..) by bk keys (at j0..) of head h,
 * the score of query r and key c at S[r * rs + c * cs] (S^T, keys down, has rs = 1; S, queries
 * down, cs = 1), k0 the sequence's first key row: softcap and ALiBi at the visible scores
 * (with softcap, dcap, if not NULL and in the same layout, receives the derivative of the cap
 * there), then the gate's bias (gt), then masked scores become -inf, by selection (a NaN
 * score of a key the query cannot see is replaced, not carried). */
static void PA_FN(sm_transform_tile)(const pa_softmax_desc *d, const PA_FN(sm_gate) * gt,
                                     int64_t h, real *S, int64_t rs, int64_t cs, int64_t bq,
                                     int64_t bk, int64_t ip0, int64_t j0, int64_t tk, int64_t k0,
                                     int visibility, real *dcap)
{
    real slope = PA_FN(sm_slope)(d, h);
    for (int64_t r = 0; r < bq && (d->softcap > 0 || d->alibi); r++) {
        int64_t ip = ip0 + r, rg[2][2] = {{0, 0}, {0, bk}};
        if (visibility != SM_VISIBLE) PA_FN(sm_row_ranges)(d, ip, tk, j0, j0 + bk, rg);
        for (int s = 0; s < 2; s++)
            for (int64_t c = rg[s][0]; c < rg[s][1]; c++)
                S[r * rs + c * cs] = PA_FN(sm_score)(S[r * rs + c * cs], d->softcap, slope,
                                                     ip - j0 - c,
                                                     dcap ? dcap + r * rs + c * cs : NULL);
    }
    if (gt->G) {
        const real *Gq = PA_FN(sm_gate_at)(gt, h, k0 + ip0), *Gk = PA_FN(sm_gate_at)(gt, h, k0 + j0);
        const int64_t lo = d->H * gt->rows;
        if (rs == 1)
            PA_FN(sm_gate_bias)(S, cs, bk, bq, Gk, Gq, lo, 0);
        else
            PA_FN(sm_gate_bias)(S, rs, bq, bk, Gq, Gk, lo, 1);
    }
    for (int64_t r = 0; r < bq && visibility != SM_VISIBLE; r++) {
        int64_t rg[2][2];
        PA_FN(sm_row_ranges)(d, ip0 + r, tk, j0, j0 + bk, rg);
        PA_FN(sm_fill_hidden)(S + r * rs, cs, bk, rg, -(real)INFINITY);
    }
}

/* Operands packed once per call for the GEMM, so no tile repacks (or transposes) them.
 * The rows packed are the queries of each (sequence, query head) or the keys of each
 * (sequence, KV head), x [rows, heads, D], laid out as
 *   SM_A_ROWS     an A operand X [t x D], panels of MR rows (blocks start at multiples of MR);
 *   SM_B_COLUMNS  a B operand X^T [D x t], panels of NR rows (blocks at multiples of NR);
 *   SM_B_ROWS     a B operand X [t x D], panels of NR features (blocks anywhere). */
#define SM_A_ROWS 0
#define SM_B_COLUMNS 1
#define SM_B_ROWS 2

typedef struct {
    const real *x; /* what is packed: [rows, heads, D] */
    real *data;
    int64_t *offset; /* [nseq * heads + 1] */
    /* [2 * nseq * heads], or NULL when not asked for: per (sequence, head), rows [first, end)
     * hold every row with a non-finite value (first = end when none); see sm_bad_rows */
    int64_t *nonfinite;
    int64_t D;
    int queries, layout;
} PA_FN(sm_packed);

static void PA_FN(sm_packed_free)(PA_FN(sm_packed) * pk)
{
    free(pk->data);
    free(pk->offset);
    free(pk->nonfinite);
    pk->data = NULL;
    pk->offset = NULL;
    pk->nonfinite = NULL;
}

static inline int64_t PA_FN(sm_pack_heads)(const PA_FN(sm_packed) * pk, const pa_softmax_desc *d)
{
    return pk->queries ? d->H : d->Hk;
}

static inline const int64_t *PA_FN(sm_pack_cu)(const PA_FN(sm_packed) * pk, const pa_softmax_desc *d)
{
    return pk->queries ? d->cu_q : d->cu_k;
}

/* Lays out and allocates a packing of x (filled later by sm_pack_fill, which also finds its
 * non-finite rows when find_nonfinite); 0 if out of memory. */
static int PA_FN(sm_pack_alloc)(PA_FN(sm_packed) * pk, const pa_softmax_desc *d, const real *x,
                                int64_t D, int queries, int layout, int find_nonfinite)
{
    pk->x = x;
    pk->D = D;
    pk->queries = queries;
    pk->layout = layout;
    const int64_t nseq = d->nseq, heads = PA_FN(sm_pack_heads)(pk, d);
    const int64_t *cu = PA_FN(sm_pack_cu)(pk, d);
    pk->offset = malloc(sizeof(int64_t) * (nseq * heads + 1));
    pk->nonfinite = find_nonfinite ? malloc(sizeof(int64_t) * (2 * nseq * heads + 1)) : NULL;
    if (!pk->offset || (find_nonfinite && !pk->nonfinite)) {
        PA_FN(sm_packed_free)(pk);
        return 0;
    }
    int64_t total = 0;
    for (int64_t u = 0; u < nseq * heads; u++) {
        int64_t t = cu[u / heads + 1] - cu[u / heads];
        pk->offset[u] = total;
        total += layout == SM_B_COLUMNS ? PA_FN(packed_b_elems)(D, t)
                 : layout == SM_B_ROWS  ? PA_FN(packed_b_elems)(t, D)
                                        : PA_FN(packed_a_elems)(t, D);
    }
    pk->offset[nseq * heads] = total;
    pk->data = pa_alloc(sizeof(real) * (total + 1));
    if (!pk->data) {
        PA_FN(sm_packed_free)(pk);
        return 0;
    }
    return 1;
}

/* Fills packings (count of them) with one (sequence, head) per iteration of a work-shared
 * loop: called by every thread of the kernel's parallel region; ends with its barrier. */
static void PA_FN(sm_pack_fill)(PA_FN(sm_packed) * const *pks, int count, const pa_softmax_desc *d)
{
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += d->nseq * PA_FN(sm_pack_heads)(pks[i], d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < total; t++) {
        int i = 0;
        int64_t u = t;
        while (u >= d->nseq * PA_FN(sm_pack_heads)(pks[i], d)) u -= d->nseq * PA_FN(sm_pack_heads)(pks[i++], d);
        const PA_FN(sm_packed) *pk = pks[i];
        const int64_t heads = PA_FN(sm_pack_heads)(pk, d);
        const int64_t *cu = PA_FN(sm_pack_cu)(pk, d);
        int64_t n = u / heads, hd = u % heads, r0 = cu[n], len = cu[n + 1] - r0, D = pk->D;
        const real *X = pk->x + (r0 * heads + hd) * D;
        real *dst = pk->data + pk->offset[u];
        if (pk->layout == SM_B_COLUMNS)
            PA_FN(pack_b)(D, len, X, 1, heads * D, dst);
        else if (pk->layout == SM_B_ROWS)
            PA_FN(pack_b)(len, D, X, heads * D, 1, dst);
        else
            PA_FN(pack_a)(len, D, X, heads * D, 1, dst);
        if (pk->nonfinite) {
            /* one pass over the packing just written (in cache); rows only if it fails */
            int64_t first = 0, end = 0;
            if (!PA_FN(sm_all_finite)(dst, pk->offset[u + 1] - pk->offset[u])) {
                while (PA_FN(sm_all_finite)(X + first * heads * D, D)) first++;
                end = len;
                while (PA_FN(sm_all_finite)(X + (end - 1) * heads * D, D)) end--;
            }
            pk->nonfinite[2 * u] = first;
            pk->nonfinite[2 * u + 1] = end;
        }
    }
}

/* The rows [a, b) of (sequence n, head hd) that may hold non-finite values, as [*lo, *hi)
 * relative to a; 0 when there are none. */
static inline int PA_FN(sm_bad_rows)(const PA_FN(sm_packed) * pk, const pa_softmax_desc *d,
                                     int64_t n, int64_t hd, int64_t a, int64_t b, int64_t *lo,
                                     int64_t *hi)
{
    const int64_t *r = pk->nonfinite + 2 * (n * PA_FN(sm_pack_heads)(pk, d) + hd);
    *lo = (r[0] > a ? r[0] : a) - a;
    *hi = (r[1] < b ? r[1] : b) - a;
    return *lo < *hi;
}

/* Row p (of the sequence) of (sequence n, head hd) of what pk packs, unpacked. */
static inline const real *PA_FN(sm_raw_row)(const PA_FN(sm_packed) * pk, const pa_softmax_desc *d,
                                            int64_t n, int64_t hd, int64_t p)
{
    const int64_t heads = PA_FN(sm_pack_heads)(pk, d);
    return pk->x + ((PA_FN(sm_pack_cu)(pk, d)[n] + p) * heads + hd) * pk->D;
}

/* The packed operand of rows j0.. (keys or queries) of (sequence n, head hd); *stride gets
 * the panel stride: bps of a B operand, ars of an A operand (see gemm_packed_ab). */
static inline const real *PA_FN(sm_packed_at)(const PA_FN(sm_packed) * pk,
                                              const pa_softmax_desc *d, int64_t n, int64_t hd,
                                              int64_t j0, int64_t *stride)
{
    const int64_t *cu = PA_FN(sm_pack_cu)(pk, d);
    const real *base = pk->data + pk->offset[n * PA_FN(sm_pack_heads)(pk, d) + hd];
    if (pk->layout == SM_B_COLUMNS) {
        *stride = pk->D * NR;
        return base + j0 / NR * pk->D * NR;
    }
    if (pk->layout == SM_B_ROWS) {
        *stride = (cu[n + 1] - cu[n]) * NR;
        return base + j0 * NR;
    }
    *stride = MR * pk->D;
    return base + j0 * pk->D;
}

/* The scores of query rows i0.. (head h) against keys j0.., transformed (with gt's gate).
 * transposed = 0: S = scale Q K^T [bq x bk] from Q (SM_A_ROWS) and K (SM_B_COLUMNS);
 * transposed = 1: S = scale K Q^T [bk x bq] from K (SM_A_ROWS) and Q (SM_B_COLUMNS). */
static void PA_FN(sm_scores)(const pa_softmax_desc *d, const PA_FN(sm_gate) * gt, int64_t n,
                             int64_t h, const PA_FN(sm_packed) * Qp, const PA_FN(sm_packed) * Kp,
                             int transposed, real *S, int64_t lds, int64_t i0, int64_t bq,
                             int64_t j0, int64_t bk, int64_t off, int64_t tk, int visibility,
                             real *dcap)
{
    int64_t qs, ks;
    const real *Qb = PA_FN(sm_packed_at)(Qp, d, n, h, i0, &qs);
    const real *Kb = PA_FN(sm_packed_at)(Kp, d, n, h / (d->H / d->Hk), j0, &ks);
    if (transposed)
        PA_FN(gemm_packed_ab)(bk, bq, d->Dk, (real)d->scale, Kb, ks, MR, Qb, qs, 0, S, lds);
    else
        PA_FN(gemm_packed_ab)(bq, bk, d->Dk, (real)d->scale, Qb, qs, MR, Kb, ks, 0, S, lds);
    if (visibility != SM_VISIBLE || d->softcap > 0 || d->alibi || gt->G)
        PA_FN(sm_transform_tile)(d, gt, h, S, transposed ? 1 : lds, transposed ? lds : 1, bq, bk,
                                 i0 + off, j0, tk, d->cu_k[n], visibility, dcap);
}

typedef struct {
    real *S, *O, *m, *l, *dP, *dcap, *dK, *dV, *work;
    real *colsum;   /* a backward tile's column sums of dS (with a gate) */
    real *finite_b; /* a tile's B operand without its non-finite rows (sm_pack_finite_rows) */
    uint32_t *pt;   /* bf16 products: P^T as a B-form operand (sm_forward_keys_bf16) */
    real *orow;     /* bf16 products: a row of O */
    int64_t lds;    /* leading dimension of S */
} PA_FN(sm_scratch);

static void PA_FN(sm_scratch_free)(PA_FN(sm_scratch) * s)
{
    free(s->S);
    free(s->O);
    free(s->m);
    free(s->l);
    free(s->dP);
    free(s->dcap);
    free(s->dK);
    free(s->dV);
    free(s->work);
    free(s->finite_b);
    free(s->colsum);
    free(s->pt);
    free(s->orow);
}

/* Per-thread buffers for tiles of bq queries x bk keys: forward S^T [bk x lds] (lds = bq
 * rounded up to MR), O (with bf16 products O^T [Dv x lds], P^T and a row of O), m, l; backward
 * (with bf16 products the packing of P or dS) S and dP [bq x lds] (lds = bk rounded up to MR), dK,
 * dV (and dcap with softcap, colsum with a gate); both a B operand of the tile's keys or
 * queries. S (and the
 * backward's dP) are zeroed: the GEMMs that read them in place read whole panels. Returns 0
 * when an allocation failed (all freed then). */
static int PA_FN(sm_scratch_alloc)(PA_FN(sm_scratch) * s, const pa_softmax_desc *d, int64_t bq,
                                   int64_t bk, int backward, int bf16)
{
    memset(s, 0, sizeof *s);
    s->lds = ((backward ? bk : bq) + MR - 1) / MR * MR;
    const size_t tile = sizeof(real) * (size_t)((backward ? bq : bk) * s->lds);
    s->S = pa_alloc(tile);
    int ok = s->S != NULL;
    if (s->S) memset(s->S, 0, tile);
    if (!backward) {
        s->O = pa_alloc(sizeof(real) * s->lds * d->Dv);
        if (bf16) {
            s->pt = pa_alloc(sizeof(uint32_t) * (bk + PA_BF16_PAD) / 2 * (s->lds + PA_BF16_PAD));
            s->orow = pa_alloc(sizeof(real) * d->Dv);
            ok = ok && s->pt && s->orow;
        }
        s->m = pa_alloc(sizeof(real) * bq);
        s->l = pa_alloc(sizeof(real) * bq);
        s->dP = pa_alloc(sizeof(real) * 2 * s->lds); /* the new and the finite column maxima */
        s->finite_b = pa_alloc(sizeof(real) * PA_FN(packed_b_elems)(bk, d->Dv));
        ok = ok && s->O && s->m && s->l && s->dP && s->finite_b;
    } else {
        /* workspace of the GEMMs that pack an operand: dV, dQ and dK (bk x D x bq shapes) */
        int64_t D = d->Dk > d->Dv ? d->Dk : d->Dv;
        int64_t w1 = PA_FN(gemm_work_elems)(bk, D, bq), w2 = PA_FN(gemm_work_elems)(bq, D, bk);
        s->work = pa_alloc(sizeof(real) * (w1 > w2 ? w1 : w2));
        s->dP = pa_alloc(tile);
        if (s->dP) memset(s->dP, 0, tile);
        if (bf16) {
            s->pt = pa_alloc(sizeof(uint32_t) * (bk + PA_BF16_PAD) * (bq + PA_BF16_PAD));
            ok = ok && s->pt;
        }
        s->dK = pa_alloc(sizeof(real) * bk * d->Dk);
        s->dV = pa_alloc(sizeof(real) * bk * d->Dv);
        int64_t b1 = PA_FN(packed_b_elems)(bk, d->Dk), b2 = PA_FN(packed_b_elems)(bq, D);
        s->finite_b = pa_alloc(sizeof(real) * (b1 > b2 ? b1 : b2));
        ok = ok && s->work && s->dP && s->dK && s->dV && s->finite_b;
        if (d->softcap > 0) {
            s->dcap = pa_alloc(tile);
            ok = ok && s->dcap;
        }
        if (d->gate) {
            s->colsum = pa_alloc(sizeof(real) * bk);
            ok = ok && s->colsum;
        }
    }
    if (!ok) PA_FN(sm_scratch_free)(s);
    return ok;
}

/* 1 when the query at ip sees some key of its sequence of tk keys. */
static inline int PA_FN(sm_sees_keys)(const pa_softmax_desc *d, int64_t ip, int64_t tk)
{
    int64_t rg[2][2];
    PA_FN(sm_row_ranges)(d, ip, tk, 0, tk, rg);
    return rg[0][1] > 0 || rg[1][1] > rg[1][0];
}

/* A partially masked tile multiplies exact zeros (the pairs a query cannot see) into its B
 * operand, and 0 * inf = 0 * NaN = NaN would carry a key's (a query's) non-finite value to
 * the queries (keys) that cannot see it: a NaN in the future of a causal row, or the garbage
 * past the end of a KV cache. Tested per tile in O(1) against the rows sm_pack_fill found
 * when it packed the operand, so finite inputs pay one pass over each operand per call.
 * Such a tile's GEMM takes the B operand with those rows set to 0 (every output that does
 * not see them gets the same bits as with a finite input), and sm_add_nonfinite_rows adds
 * the rows' products with the visible pairs by hand. */

/* Packs rows [0, n) of B (ldb apart, D features) as a B operand (bps = n * NR) into dst,
 * the rows of [lo, hi) that are not finite set to 0. */
static void PA_FN(sm_pack_finite_rows)(int64_t n, int64_t D, const real *B, int64_t ldb,
                                       int64_t lo, int64_t hi, real *dst)
{
    PA_FN(pack_b)(n, D, B, ldb, 1, dst);
    for (int64_t p = lo; p < hi; p++)
        if (!PA_FN(sm_all_finite)(B + p * ldb, D))
            for (int64_t jr = 0; jr < D; jr += NR)
                memset(dst + jr * n + p * NR, 0, sizeof(real) * NR);
}

/* C += alpha A(r, c) B(row) over the visible pairs (query r, key c) of the tile of bq queries
 * at ip0.. by w keys at j0.. (A(r, c) = A[r * ars + c * acs]), for the rows of B in [lo, hi)
 * that are not finite. B's rows are the tile's queries (query_rows; C's rows its keys) or
 * its keys (C's rows its queries). */
static void PA_FN(sm_add_nonfinite_rows)(const pa_softmax_desc *d, int64_t ip0, int64_t bq,
                                         int64_t j0, int64_t w, int64_t tk, const real *A,
                                         int64_t ars, int64_t acs, const real *B, int64_t ldb,
                                         int64_t D, int64_t lo, int64_t hi, int query_rows,
                                         real alpha, real *C, int64_t ldc)
{
    for (int64_t p = lo; p < hi; p++) {
        const real *b = B + p * ldb;
        if (PA_FN(sm_all_finite)(b, D)) continue;
        int64_t rg[2][2];
        if (query_rows) {
            PA_FN(sm_row_ranges)(d, ip0 + p, tk, j0, j0 + w, rg);
            for (int s = 0; s < 2; s++)
                for (int64_t c = rg[s][0]; c < rg[s][1]; c++)
                    PA_FN(axpy)(C + c * ldc, b, D, alpha * A[p * ars + c * acs]);
            continue;
        }
        for (int64_t r = 0; r < bq; r++) {
            PA_FN(sm_row_ranges)(d, ip0 + r, tk, j0, j0 + w, rg);
            if ((p >= rg[0][0] && p < rg[0][1]) || (p >= rg[1][0] && p < rg[1][1]))
                PA_FN(axpy)(C + r * ldc, b, D, alpha * A[r * ars + p * acs]);
        }
    }
}

/* A backward tile's probabilities: S [bq x w] (queries i0.. of head h of sequence n, keys
 * ja..jb-1, lds apart) becomes P = exp(S - lse); 0 for a query that sees no key, and at the
 * hidden pairs of a NaN row of a partial tile (exp(-inf - NaN) is NaN there too). */
static void PA_FN(sm_bwd_probs)(const pa_softmax_desc *d, const real *lse, real *S, int64_t lds,
                                int64_t n, int64_t h, int64_t i0, int64_t bq, int64_t ja,
                                int64_t jb, int partial)
{
    const int64_t H = d->H, q0 = d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n], w = jb - ja;
    const int64_t ip0 = i0 + tk - (d->cu_q[n + 1] - q0);
    for (int64_t r = 0; r < bq; r++) {
        real L = lse[(q0 + i0 + r) * H + h];
        if (L == -(real)INFINITY) {
            memset(S + r * lds, 0, sizeof(real) * w);
            continue;
        }
        PA_FN(row_exp_sum)(S + r * lds, w, L);
        if (partial && L - L != 0) {
            int64_t rg[2][2];
            PA_FN(sm_row_ranges)(d, ip0 + r, tk, ja, jb, rg);
            PA_FN(sm_fill_hidden)(S + r * lds, 1, w, rg, 0);
        }
    }
}

/* A backward tile's dS = P (dP - D) (times the softcap derivative s->dcap) in place of dP, 0
 * at the pairs hidden in a partial tile; with a gate the diagonal pair leaves the tile
 * (sm_gate_finish) and the rest is summed: its rows' sums with_dq, its columns' with_dk. */
static void PA_FN(sm_bwd_dscores)(const pa_softmax_desc *d, const PA_FN(sm_gate) * gt,
                                  const real *Drow, const real *S, real *dP,
                                  const PA_FN(sm_scratch) * s, int with_dq, int with_dk,
                                  int64_t n, int64_t h, int64_t i0, int64_t bq, int64_t ja,
                                  int64_t jb, int partial)
{
    const int64_t H = d->H, q0 = d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n], w = jb - ja;
    const int64_t ip0 = i0 + tk - (d->cu_q[n + 1] - q0), lds = s->lds;
    for (int64_t r = 0; r < bq; r++) {
        real Dr = Drow[(q0 + i0 + r) * H + h];
        const real *pr = S + r * lds;
        real *dpr = dP + r * lds;
        if (s->dcap) {
            const real *dcr = s->dcap + r * lds;
            for (int64_t c = 0; c < w; c++) dpr[c] = pr[c] * (dpr[c] - Dr) * dcr[c];
        } else {
            for (int64_t c = 0; c < w; c++) dpr[c] = pr[c] * (dpr[c] - Dr);
        }
        if (partial) { /* dcap is unset at the hidden pairs, and dP, D may be anything there */
            int64_t rg[2][2];
            PA_FN(sm_row_ranges)(d, ip0 + r, tk, ja, jb, rg);
            PA_FN(sm_fill_hidden)(dpr, 1, w, rg, 0);
        }
        if (gt->G) {
            if (ip0 + r >= ja && ip0 + r < jb) dpr[ip0 + r - ja] = 0;
            if (with_dq) gt->drow[h * gt->rows + d->cu_k[n] + ip0 + r] += PA_FN(row_sum)(dpr, w);
        }
    }
    if (with_dk && gt->G) { /* the tile's column sums in the working dtype, then into double */
        real *cs = s->colsum;
        double *dcol = gt->dcol + h * gt->rows + d->cu_k[n] + ja;
        memset(cs, 0, sizeof(real) * w);
        for (int64_t r = 0; r < bq; r++) PA_FN(axpy)(cs, dP + r * lds, w, 1);
        for (int64_t c = 0; c < w; c++) dcol[c] += cs[c];
    }
}

#if SM_BF16
#include "softmax_bf16.h"
#endif

/* One (sequence n, head h, query rows i0 .. i0+bq-1) of the forward, key blocks of bkmax,
 * with float products from Q (SM_B_COLUMNS), K (SM_A_ROWS) and V (SM_B_ROWS), or where bf16
 * (an sm_bf16_fwd) is given with its products (sm_forward_keys_bf16: O kept transposed). */
static void PA_FN(sm_forward_block)(const pa_softmax_desc *d, const PA_FN(sm_gate) * gt,
                                    const PA_FN(sm_packed) * Qp, const PA_FN(sm_packed) * Kp,
                                    const PA_FN(sm_packed) * Vp, const void *bf16, real *o,
                                    real *lse, int64_t n, int64_t h, int64_t i0, int64_t bq,
                                    int64_t bkmax, PA_FN(sm_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dv = d->Dv, lds = s->lds;
    const int64_t q0 = d->cu_q[n], k0 = d->cu_k[n];
    const int64_t tk = d->cu_k[n + 1] - k0, off = tk - (d->cu_q[n + 1] - q0);
    const int64_t kh = h / (H / Hk);
#if SM_BF16
    const int64_t align = bf16 ? PA_BF16_PAD : MR; /* where the packed keys' blocks start */
#else
    const int64_t align = MR;
#endif
    real *O = s->O, *m = s->m, *l = s->l, *ST = s->S;
    for (int64_t r = 0; r < bq; r++) {
        m[r] = -(real)INFINITY;
        l[r] = 0;
    }
    memset(O, 0, sizeof(real) * (bf16 ? Dv * lds : bq * Dv));
    for (int64_t jblk = 0; jblk < tk; jblk += bkmax) {
        int64_t j0, j1;
        int vis = PA_FN(sm_block_keys)(d, i0 + off, i0 + bq - 1 + off, jblk,
                                       tk - jblk < bkmax ? tk : jblk + bkmax, tk, align, &j0, &j1);
        if (vis == SM_HIDDEN) continue;
#if SM_BF16
        if (bf16) {
            sm_forward_keys_bf16(d, gt, bf16, n, h, i0, bq, j0, j1, vis, s);
            continue;
        }
#endif
        const int64_t bk = j1 - j0;
        PA_FN(sm_scores)(d, gt, n, h, Qp, Kp, 1, ST, lds, i0, bq, j0, bk, off, tk, vis, NULL);
        PA_FN(sm_softmax_columns)(ST, lds, bk, bq, m, l, O, NULL, Dv, s->dP, s->dP + lds);
        int64_t bps, lo, hi;
        const real *Vb = PA_FN(sm_packed_at)(Vp, d, n, kh, j0, &bps);
        if (vis == SM_PARTIAL && PA_FN(sm_bad_rows)(Vp, d, n, kh, j0, j1, &lo, &hi)) {
            const real *V = PA_FN(sm_raw_row)(Vp, d, n, kh, j0);
            PA_FN(sm_pack_finite_rows)(bk, Dv, V, Hk * Dv, lo, hi, s->finite_b);
            PA_FN(gemm_packed_ab)(bq, Dv, bk, 1, ST, MR, lds, s->finite_b, bk * NR, 1, O, Dv);
            PA_FN(sm_add_nonfinite_rows)(d, i0 + off, bq, j0, bk, tk, ST, 1, lds, V, Hk * Dv, Dv,
                                         lo, hi, 0, 1, O, Dv);
        } else {
            PA_FN(gemm_packed_ab)(bq, Dv, bk, 1, ST, MR, lds, Vb, bps, 1, O, Dv);
        }
    }
    for (int64_t r = 0; r < bq; r++) {
        const int64_t row = (q0 + i0 + r) * H + h;
        const real *acc = O + r * Dv;
        if (bf16) { /* a column of O^T */
            for (int64_t x = 0; x < Dv; x++) s->orow[x] = O[x * lds + r];
            acc = s->orow;
        }
        PA_FN(sm_write_row)(o + row * Dv, lse + row, acc, Dv, m[r], l[r],
                            PA_FN(sm_sees_keys)(d, i0 + r + off, tk));
    }
}

/* One query (row i of sequence n, head h), keys streamed one at a time. acc: Dv scratch. */
static void PA_FN(sm_forward_row)(const pa_softmax_desc *d, const real *q, const real *k,
                                  const real *v, real *o, real *lse, int64_t n, int64_t h,
                                  int64_t i, real *acc)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv;
    const int64_t q0 = d->cu_q[n], k0 = d->cu_k[n];
    const int64_t tk = d->cu_k[n + 1] - k0, ip = i + tk - (d->cu_q[n + 1] - q0);
    const int64_t kh = h / (H / Hk);
    const real *qi = q + ((q0 + i) * H + h) * Dk;
    real slope = PA_FN(sm_slope)(d, h), m = -(real)INFINITY, l = 0;
    int64_t ranges[2][2];
    PA_FN(sm_row_ranges)(d, ip, tk, 0, tk, ranges);
    memset(acc, 0, sizeof(real) * Dv);
    for (int rg = 0; rg < 2; rg++)
    for (int64_t j = ranges[rg][0]; j < ranges[rg][1]; j++) {
        const real *kj = k + ((k0 + j) * Hk + kh) * Dk, *vj = v + ((k0 + j) * Hk + kh) * Dv;
        real x = PA_FN(sm_score)((real)d->scale * PA_FN(dot)(qi, kj, Dk), d->softcap, slope,
                                 ip - j, NULL);
        PA_FN(sm_raise_max)(&m, &l, acc, Dv, x);
        /* m = -inf only while every score so far is -inf: exp(-inf - -inf) would be NaN */
        real p = (real)exp((double)x - (m == -(real)INFINITY ? 0 : (double)m));
        l += p;
        PA_FN(axpy)(acc, vj, Dv, p);
    }
    const int64_t row = (q0 + i) * H + h;
    PA_FN(sm_write_row)(o + row * Dv, lse + row, acc, Dv, m, l, PA_FN(sm_sees_keys)(d, ip, tk));
}

/* Cuts the visible ranges r (as sm_row_ranges gives them) to part s of S: the visible keys
 * s * count / S .. (s + 1) * count / S - 1 of the two ranges taken in order. */
static inline void PA_FN(sm_split_ranges)(int64_t r[2][2], int64_t s, int64_t S)
{
    const int64_t n0 = r[0][1] - r[0][0], count = n0 + r[1][1] - r[1][0];
    const int64_t a = s * count / S, b = (s + 1) * count / S;
    const int64_t base0 = r[0][0], base1 = r[1][0];
    r[0][0] = base0 + (a < n0 ? a : n0);
    r[0][1] = base0 + (b < n0 ? b : n0);
    r[1][0] = base1 + (a > n0 ? a - n0 : 0);
    r[1][1] = base1 + (b > n0 ? b - n0 : 0);
}

/* The wide layout of the decode, for groups of at least VL query heads per KV head (MQA):
 * there the 2 G FLOP per cached value, not memory, bound the decode, so the products run
 * as register-blocked GEMM tiles with the group's heads across the vector lanes: scores
 * transposed, ST [keys x heads] = K QT with QT [Dk x heads] (the queries transposed once
 * per part), and O [heads x Dv] += P V with P read from ST. Each K element is broadcast
 * once per panel of up to 4 vectors of heads and each V vector loaded once per tile of MR
 * heads, with no horizontal sums (the dot-product layout sums every vector of its 4 heads
 * per key load across the lanes, and reloads the queries for every key). */

#define SM_WIDE_ACC (MR * NV) /* accumulator vectors of a wide tile (12 AVX2, 24 AVX-512) */

/* ST[x * ldt + j] = scale * sum_e kr[x][off + e] QT[e * ldq + j] for the keys x < mr and the
 * NVS * VL columns j: R keys by NVS vectors of heads in registers, R >= mr a constant where
 * inlined (rows past mr repeat the last key and are not stored). */
static inline __attribute__((always_inline)) void PA_FN(sm_wide_scores_tile)(
    const real *QT, int64_t ldq, const real *const *kr, int64_t off, int64_t Dk, real scale,
    real *ST, int64_t ldt, int64_t mr, const int R, const int NVS)
{
    vreal acc[SM_WIDE_ACC][4];
    const real *kx[SM_WIDE_ACC];
#pragma GCC unroll 24
    for (int x = 0; x < R; x++) {
        kx[x] = kr[x < mr ? x : mr - 1] + off;
#pragma GCC unroll 4
        for (int j = 0; j < NVS; j++) acc[x][j] = PA_FN(vset)(0);
    }
    for (int64_t e = 0; e < Dk; e++) {
        vreal b[4];
#pragma GCC unroll 4
        for (int j = 0; j < NVS; j++) b[j] = PA_FN(vload)(QT + e * ldq + j * VL);
#pragma GCC unroll 24
        for (int x = 0; x < R; x++) {
            const vreal a = PA_FN(vset)(kx[x][e]);
#pragma GCC unroll 4
            for (int j = 0; j < NVS; j++) acc[x][j] += a * b[j];
        }
    }
    for (int x = 0; x < mr; x++)
        for (int j = 0; j < NVS; j++) PA_FN(vstore)(ST + x * ldt + j * VL, acc[x][j] * scale);
}

/* The nb keys of sm_wide_scores against the NVS vectors of heads at column j0, in
 * tiles of R = SM_WIDE_ACC / NVS keys (a ragged last one in a third or two thirds of R). */
static inline __attribute__((always_inline)) void PA_FN(sm_wide_scores_panel)(
    const real *QT, int64_t Gp, const real *const *kr, int64_t off, int64_t Dk, real scale,
    int64_t nb, real *ST, int64_t j0, const real *const *vp, int64_t count, int64_t kspan,
    int64_t vspan, const int NVS)
{
    const int R = SM_WIDE_ACC / NVS;
    for (int64_t x = 0; x < nb; x += R) {
        const int64_t mr = nb - x < R ? nb - x : R;
        for (int64_t c = x; vp && c < x + mr; c++) {
            if (c + SM_DECODE_AHEAD < count) PA_FN(prefetch_span)(kr[c + SM_DECODE_AHEAD], kspan, 0);
            PA_FN(prefetch_span)(vp[c], vspan, 0);
        }
        const real *q = QT + j0;
        real *st = ST + x * Gp + j0;
        if (mr > 2 * R / 3)
            PA_FN(sm_wide_scores_tile)(q, Gp, kr + x, off, Dk, scale, st, Gp, mr, R, NVS);
        else if (mr > R / 3)
            PA_FN(sm_wide_scores_tile)(q, Gp, kr + x, off, Dk, scale, st, Gp, mr, 2 * R / 3, NVS);
        else
            PA_FN(sm_wide_scores_tile)(q, Gp, kr + x, off, Dk, scale, st, Gp, mr, R / 3, NVS);
    }
}

/* The scores of the nb keys kr[0..nb) (off: the KV head's offset in a row) against the Gp
 * columns of QT (ldq = Gp), into ST [nb x Gp]: panels of 4, 2 or 1 vectors of heads (the
 * widest that fit), so that few keys (3 in a 4-vector tile of AVX2) share the registers and
 * their row pointers stay in registers too. With vp, the first panel prefetches as
 * sm_row_scores does: the K rows (kspan reals) SM_DECODE_AHEAD keys on, below count, and
 * the block's V rows (vspan reals). */
static void PA_FN(sm_wide_scores)(const real *QT, int64_t Gp, const real *const *kr, int64_t off,
                                  int64_t Dk, real scale, int64_t nb, real *ST,
                                  const real *const *vp, int64_t count, int64_t kspan, int64_t vspan)
{
    for (int64_t j0 = 0; j0 < Gp;) {
        const int64_t left = (Gp - j0) / VL;
        const real *const *pf = j0 == 0 ? vp : NULL;
        if (left >= 4) {
            PA_FN(sm_wide_scores_panel)(QT, Gp, kr, off, Dk, scale, nb, ST, j0, pf, count, kspan, vspan, 4);
            j0 += 4 * VL;
        } else if (left >= 2) {
            PA_FN(sm_wide_scores_panel)(QT, Gp, kr, off, Dk, scale, nb, ST, j0, pf, count, kspan, vspan, 2);
            j0 += 2 * VL;
        } else {
            PA_FN(sm_wide_scores_panel)(QT, Gp, kr, off, Dk, scale, nb, ST, j0, pf, count, kspan, vspan, 1);
            j0 += VL;
        }
    }
}

/* O[r * Dv + j] += sum_x P[x * ldp + r] Vp[x * NVS * VL + j] for the heads r < mr and the
 * NVS * VL columns j of a packed panel Vp of V (O offset to the tile's first column, P to
 * its first head): R heads by NVS vectors in registers over all nb keys; R >= mr a
 * constant where inlined. The heads past mr read P beyond the group (ST's slack at its
 * end) and are not stored. */
static inline __attribute__((always_inline)) void PA_FN(sm_wide_pv_tile)(
    real *O, int64_t Dv, const real *P, int64_t ldp, const real *Vp, int64_t nb, int64_t mr,
    const int R, const int NVS)
{
    vreal acc[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NVS; j++)
            acc[r][j] = r < mr ? PA_FN(vload)(O + r * Dv + j * VL) : PA_FN(vset)(0);
    for (int64_t x = 0; x < nb; x++, P += ldp, Vp += NVS * VL) {
        vreal b[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NVS; j++) b[j] = PA_FN(vload)(Vp + j * VL);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const vreal a = PA_FN(vset)(P[r]);
#pragma GCC unroll 4
            for (int j = 0; j < NVS; j++) acc[r][j] += a * b[j];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NVS; j++) PA_FN(vstore)(O + r * Dv + j * VL, acc[r][j]);
}

/* O [G x Dv] += P V for the G heads of one KV head, P the transposed probabilities [nb x
 * ldp] and V's rows vp[x] + off. V's whole vectors are first packed into panels of NV
 * vectors (one at the end), each [nb x width] contiguous at Vp + e * nb: read in place,
 * rows of V a multiple of 512 bytes apart fall in few sets of the L1 cache, so a panel
 * would not stay there across the head tiles (a profile showed the tiles' FMAs waiting on
 * V's loads), and each row's pointer would be one more load per key. Per panel, tiles of MR
 * heads, 2 MR / 3 where that leaves no tile of a third (32 = 4 x 6 + 2 x 4); the columns
 * past the last whole vector are scalar. Vp: nb x Dv reals. */
static __attribute__((noinline)) void PA_FN(sm_wide_pv)(real *O, int64_t Dv, const real *P, int64_t ldp,
                              const real *const *vp, int64_t off, int64_t nb, int64_t G, real *Vp)
{
    const int64_t Dw = Dv / VL * VL, Dn = Dw / (NV * VL) * (NV * VL);
    for (int64_t x = 0; x < nb; x++) {
        const real *src = vp[x] + off;
        int64_t e = 0;
        for (; e < Dn; e += NV * VL)
            for (int j = 0; j < NV; j++)
                PA_FN(vstore)(Vp + e * nb + x * NV * VL + j * VL, PA_FN(vload)(src + e + j * VL));
        for (; e < Dw; e += VL) PA_FN(vstore)(Vp + e * nb + x * VL, PA_FN(vload)(src + e));
    }
    for (int64_t e = 0; e < Dw;) {
        const int wide = e < Dn;
        const real *Vpe = Vp + e * nb;
        for (int64_t h = 0; h < G;) {
            const int64_t left = G - h;
            const int64_t mr = left > MR && left < MR + 2 * MR / 3 ? 2 * MR / 3 : left < MR ? left : MR;
            real *Ot = O + h * Dv + e;
            const real *Pt = P + h;
            if (!wide)
                PA_FN(sm_wide_pv_tile)(Ot, Dv, Pt, ldp, Vpe, nb, mr, MR, 1);
            else if (mr > 2 * MR / 3)
                PA_FN(sm_wide_pv_tile)(Ot, Dv, Pt, ldp, Vpe, nb, mr, MR, NV);
            else if (mr > MR / 3)
                PA_FN(sm_wide_pv_tile)(Ot, Dv, Pt, ldp, Vpe, nb, mr, 2 * MR / 3, NV);
            else
                PA_FN(sm_wide_pv_tile)(Ot, Dv, Pt, ldp, Vpe, nb, mr, MR / 3, NV);
            h += mr;
        }
        e += wide ? NV * VL : VL;
    }
    for (int64_t e = Dw; e < Dv; e++)
        for (int64_t h = 0; h < G; h++) {
            real x = O[h * Dv + e];
            for (int64_t c = 0; c < nb; c++) x += P[c * ldp + h] * vp[c][off + e];
            O[h * Dv + e] = x;
        }
}

/* One key block of the decode in the wide layout: the nb keys w->kp[0..nb) (rows up to
 * count prefetched, as sm_row_scores does) against every head of the part's query (w->QT),
 * their online softmax down the columns of ST, and acc += P V. */
static __attribute__((noinline)) void PA_FN(sm_wide_block)(const pa_softmax_desc *d,
                                                           PA_FN(sm_decode_scratch) * w,
                                                           int64_t ip, int64_t jb, int64_t nb,
                                                           int64_t count)
{
    const int64_t Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, G = d->H / Hk, KB = SM_DECODE_KB;
    const int64_t Gp = PA_FN(sm_group_lanes)(d);
    for (int64_t kh = 0; kh < Hk; kh++) {
        real *ST = w->ST + kh * KB * Gp;
        PA_FN(sm_wide_scores)(w->QT + kh * Dk * Gp, Gp, w->kp, kh * Dk, Dk, (real)d->scale, nb, ST,
                              kh == 0 ? w->vp : NULL, count, Hk * Dk, Hk * Dv);
        if (d->softcap > 0 || d->alibi)
            for (int64_t c = 0; c < nb; c++)
                for (int64_t g = 0; g < G; g++)
                    ST[c * Gp + g] = PA_FN(sm_score)(ST[c * Gp + g], d->softcap,
                                                     PA_FN(sm_slope)(d, kh * G + g), ip - jb - c, NULL);
        PA_FN(sm_softmax_columns)(ST, Gp, nb, G, w->m + kh * G, w->l + kh * G, w->acc + kh * G * Dv,
                                  NULL, Dv, w->mnew, w->msafe);
        PA_FN(sm_wide_pv)(w->acc + kh * G * Dv, Dv, ST, Gp, w->vp, kh * Dv, nb, G, w->Vp);
    }
}

/* Flash decode, part s of S of the keys visible to query i of sequence n, every head at
 * once. Groups of a vector of query heads or more take the wide layout (sm_wide_block);
 * for smaller ones a query row would fill one row of a GEMM tile, so no GEMM: keys in blocks of
 * SM_DECODE_KB, each K and V row (all KV heads) read once, in order, for every head; an
 * online softmax per head with the vectorised max and exp+sum passes; P V with the heads of
 * a KV head sharing each load of V. Writes the part's o and lse at po, plse (rows as o's):
 * 0 and -inf where the part has no key or its scores are all -inf (the merge decides what
 * that makes of the row). */
static void PA_FN(sm_decode_part)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                  const real *q, const real *k, const real *v, int64_t n,
                                  int64_t i, int64_t s, int64_t S, real *po, real *plse,
                                  PA_FN(sm_decode_scratch) * w)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, G = H / Hk, KB = SM_DECODE_KB;
    const int64_t q0 = d->cu_q[n], tk = rows->end[n] - rows->start[n];
    const int64_t ip = i + tk - (d->cu_q[n + 1] - q0);
    const real *qi = q + (q0 + i) * H * Dk;
    real *Sc = w->S, *acc = w->acc, *m = w->m, *l = w->l;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -(real)INFINITY;
        l[h] = 0;
    }
    memset(acc, 0, sizeof(real) * H * Dv);
    const int wide = PA_FN(sm_wide)(d);
    const int64_t Gp = PA_FN(sm_group_lanes)(d);
    if (wide)
        for (int64_t kh = 0; kh < Hk; kh++)
            for (int64_t e = 0; e < Dk; e++)
                for (int64_t g = 0; g < Gp; g++)
                    w->QT[(kh * Dk + e) * Gp + g] = g < G ? qi[(kh * G + g) * Dk + e] : 0;
    int64_t ranges[2][2];
    PA_FN(sm_row_ranges)(d, ip, tk, 0, tk, ranges);
    PA_FN(sm_split_ranges)(ranges, s, S);
    for (int rg = 0; rg < 2; rg++)
        for (int64_t jb = ranges[rg][0]; jb < ranges[rg][1]; jb += KB) {
            const int64_t nb = ranges[rg][1] - jb < KB ? ranges[rg][1] - jb : KB;
            const int64_t count =
                PA_FN(sm_block_rows)(d, rows, k, v, n, jb, nb, ranges[rg][1], w->kp, w->vp);
            if (wide) {
                PA_FN(sm_wide_block)(d, w, ip, jb, nb, count);
                continue;
            }
            PA_FN(sm_row_scores)(d, qi, w->kp, w->vp, count, ip, jb, nb, Sc);
            for (int64_t h = 0; h < H; h++) {
                PA_FN(sm_raise_max)(m + h, l + h, acc + h * Dv, Dv, PA_FN(row_max)(Sc + h * KB, nb));
                /* m = -inf only while every score so far is -inf (see sm_forward_row) */
                l[h] += PA_FN(row_exp_sum)(Sc + h * KB, nb, m[h] == -(real)INFINITY ? 0 : m[h]);
            }
            for (int64_t kh = 0; kh < Hk; kh++) {
                int64_t g = 0;
                for (; g + 4 <= G; g += 4)
                    PA_FN(sm_pv)(acc + (kh * G + g) * Dv, Dv, Sc + (kh * G + g) * KB, w->vp,
                                 kh * Dv, nb, 4);
                for (; g < G; g++)
                    PA_FN(sm_pv)(acc + (kh * G + g) * Dv, Dv, Sc + (kh * G + g) * KB, w->vp,
                                 kh * Dv, nb, 1);
            }
        }
    for (int64_t h = 0; h < H; h++) {
        const int64_t row = (q0 + i) * H + h;
        if (l[h] == 0) {
            memset(po + row * Dv, 0, sizeof(real) * Dv);
            plse[row] = -(real)INFINITY;
        } else {
            PA_FN(sm_write_row)(po + row * Dv, plse + row, acc + h * Dv, Dv, m[h], l[h], 1);
        }
    }
}

/* o and lse of row `row` (of o's rows times heads) from the S parts at po, plse (R rows
 * apart): lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s. A NaN part, or a query
 * that sees keys whose scores are all -inf, gives NaN, as the one-pass softmax does. */
static void PA_FN(sm_decode_merge)(const real *po, const real *plse, int64_t S, int64_t R,
                                   int64_t Dv, int64_t row, int sees_keys, real *o, real *lse)
{
    real m = -(real)INFINITY;
    int nan = 0;
    for (int64_t s = 0; s < S; s++) {
        real x = plse[s * R + row];
        nan |= x != x;
        m = x > m ? x : m;
    }
    real *orow = o + row * Dv;
    if (nan || m == -(real)INFINITY) {
        PA_FN(sm_write_row)(orow, lse + row, NULL, Dv, m, nan ? (real)NAN : 0, nan || sees_keys);
        return;
    }
    double total = 0;
    for (int64_t s = 0; s < S; s++) total += exp((double)plse[s * R + row] - (double)m);
    memset(orow, 0, sizeof(real) * Dv);
    for (int64_t s = 0; s < S; s++)
        PA_FN(axpy)(orow, po + (s * R + row) * Dv, Dv,
                    (real)(exp((double)plse[s * R + row] - (double)m) / total));
    lse[row] = m + (real)log(total);
}

/* colsum[n, h, j] += exp(s_ij - lse_i) over the queries i of sequence n that see key j, for
 * every head and the keys j0 .. j1-1. */
static void PA_FN(sm_decode_colsum)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                    const real *q, const real *k, const real *v, const real *lse,
                                    int64_t n, int64_t j0, int64_t j1, real *colsum, int64_t clen,
                                    PA_FN(sm_decode_scratch) * w)
{
    const int64_t H = d->H, Dk = d->Dk, KB = SM_DECODE_KB;
    const int64_t q0 = d->cu_q[n], tq = d->cu_q[n + 1] - q0, tk = rows->end[n] - rows->start[n];
    for (int64_t i = 0; i < tq; i++) {
        const int64_t ip = i + tk - tq;
        int64_t ranges[2][2];
        PA_FN(sm_row_ranges)(d, ip, tk, j0, j1, ranges);
        for (int rg = 0; rg < 2; rg++)
            for (int64_t jb = j0 + ranges[rg][0]; jb < j0 + ranges[rg][1]; jb += KB) {
                const int64_t nb = j0 + ranges[rg][1] - jb < KB ? j0 + ranges[rg][1] - jb : KB;
                const int64_t count = PA_FN(sm_block_rows)(d, rows, k, v, n, jb, nb,
                                                           j0 + ranges[rg][1], w->kp, w->vp);
                PA_FN(sm_row_scores)(d, q + (q0 + i) * H * Dk, w->kp, NULL, count, ip, jb, nb, w->S);
                for (int64_t h = 0; h < H; h++) {
                    real *cs = colsum + (n * H + h) * clen + jb, *p = w->S + h * KB;
                    PA_FN(row_exp_sum)(p, nb, lse[(q0 + i) * H + h]);
                    for (int64_t c = 0; c < nb; c++) cs[c] += p[c];
                }
            }
    }
}

#define SM_SPLIT_MIN_KEYS 512   /* flash decoding splits no part below this many keys */
#define SM_COLSUM_KEYS 1024     /* keys per work item of the column sums */

/* Parts per query when the caller leaves it to us: enough work items (query, part) for two
 * per thread, each part at least SM_SPLIT_MIN_KEYS keys. (Eight per thread, to balance a
 * thread slowed by other work, made GQA over 4096 keys about 25% slower on 2 threads,
 * measured, H=32, Hk=8, D=128.) */
static int64_t PA_FN(sm_decode_splits)(int64_t units, int64_t maxk)
{
    const int64_t threads = pa_get_num_threads(), want = 2 * threads;
    if (units >= want) return 1;
    int64_t S = (want + units - 1) / units, cap = maxk / SM_SPLIT_MIN_KEYS;
    S = S < cap ? S : cap;
    return S < 1 ? 1 : S > 64 ? 64 : S;
}

static int PA_FN(softmax_decode)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                 int64_t num_splits, const void *qv, const void *kv,
                                 const void *vv, void *ov, void *lsev, void *colsumv, int64_t clen)
{
    const real *q = qv, *k = kv, *v = vv;
    real *o = ov, *lse = lsev, *colsum = colsumv;
    const int64_t nseq = d->nseq, H = d->H, Dv = d->Dv;
    const int64_t nq = d->cu_q[nseq], R = nq * H;
    if (nq == 0) return PA_OK;
    int64_t maxk = 0, citems = 0;
    double work = 0;
    int64_t *cfirst = malloc(sizeof(int64_t) * (nseq + 1));
    if (!cfirst) return PA_ENOMEM;
    cfirst[0] = 0;
    for (int64_t n = 0; n < nseq; n++) {
        const int64_t tk = rows->end[n] - rows->start[n];
        maxk = tk > maxk ? tk : maxk;
        work += (double)(d->cu_q[n + 1] - d->cu_q[n]) * (double)tk;
        cfirst[n + 1] = cfirst[n] + (colsum ? (tk + SM_COLSUM_KEYS - 1) / SM_COLSUM_KEYS : 0);
    }
    citems = cfirst[nseq];
    const int64_t S = num_splits > 0 ? num_splits : PA_FN(sm_decode_splits)(nq, maxk);
    const int64_t items = nq * S;
    real *po = pa_alloc(sizeof(real) * (size_t)(S * R * (Dv + 1)));
    if (!po) {
        free(cfirst);
        return PA_ENOMEM;
    }
    real *plse = po + S * R * Dv;
    int failed = 0;
    const int threads = pa_threads_for(work * (double)H * (double)(d->Dk + Dv),
                                       items > citems ? items : citems);
#pragma omp parallel num_threads(threads)
    {
        PA_FN(sm_decode_scratch) w;
        int ok = pa_scratch_ok(PA_FN(sm_decode_scratch_alloc)(&w, d), &failed);
        int64_t n = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            const int64_t s = t % S, row = t / S;
            while (row >= d->cu_q[n + 1]) n++;
            if (ok)
                PA_FN(sm_decode_part)(d, rows, q, k, v, n, row - d->cu_q[n], s, S, po + s * R * Dv,
                                      plse + s * R, &w);
        }
        n = 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const int64_t row = r / H;
            while (row >= d->cu_q[n + 1]) n++;
            const int64_t tk = rows->end[n] - rows->start[n];
            const int64_t ip = row - d->cu_q[n] + tk - (d->cu_q[n + 1] - d->cu_q[n]);
            PA_FN(sm_decode_merge)(po, plse, S, R, Dv, r, PA_FN(sm_sees_keys)(d, ip, tk), o, lse);
        }
        n = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < citems; t++) {
            while (t >= cfirst[n + 1]) n++;
            const int64_t tk = rows->end[n] - rows->start[n], j0 = (t - cfirst[n]) * SM_COLSUM_KEYS;
            if (ok)
                PA_FN(sm_decode_colsum)(d, rows, q, k, v, lse, n, j0,
                                        j0 + SM_COLSUM_KEYS < tk ? j0 + SM_COLSUM_KEYS : tk,
                                        colsum, clen, &w);
        }
        if (ok) free(w.block);
    }
    free(po);
    free(cfirst);
    return failed ? PA_ENOMEM : PA_OK;
}

static int64_t PA_FN(sm_max_len)(const int64_t *cu, int64_t nseq)
{
    int64_t mx = 0;
    for (int64_t n = 0; n < nseq; n++) mx = cu[n + 1] - cu[n] > mx ? cu[n + 1] - cu[n] : mx;
    return mx;
}

/* Work items (sequence, head, block of `block` rows of cu): sequence n owns items
 * first[n] .. first[n+1]-1, `heads` per block; returns their number. */
static int64_t PA_FN(sm_items)(const int64_t *cu, int64_t nseq, int64_t block, int64_t heads,
                               int64_t *first)
{
    first[0] = 0;
    for (int64_t n = 0; n < nseq; n++)
        first[n + 1] = first[n] + (cu[n + 1] - cu[n] + block - 1) / block * heads;
    return first[nseq];
}

/* Item t -> sequence *n (moved from its previous value: a thread's items only increase),
 * head *hd and block index *b; reverse numbers the blocks from the end (the longest causal
 * ones first). Consecutive items are blocks of one head: the threads then sweep one head's
 * keys (or queries) together, a few MiB that the caches hold, where taking the heads in
 * turn swept every head's (64 MiB at B=2, H=8, T=8192, D=64: T=8192 forward on 1 thread
 * 2411 -> 1931 ms on a 2-CPU Intel Xeon, T=2048 128.4 -> 123.9 ms). */
static inline void PA_FN(sm_item)(const int64_t *first, int64_t t, int64_t heads, int reverse,
                                  int64_t *n, int64_t *hd, int64_t *b)
{
    while (t >= first[*n + 1]) ++*n;
    int64_t local = t - first[*n], nblk = (first[*n + 1] - first[*n]) / heads;
    *hd = local / nblk;
    *b = reverse ? nblk - 1 - local % nblk : local % nblk;
}

/* Threads for a call: no more than work items, and about a million multiply-adds each at
 * least, so small calls do not pay for waking (or waiting on) threads. */
static int PA_FN(sm_threads)(const pa_softmax_desc *d, int64_t items)
{
    double work = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        work += (double)(d->cu_q[n + 1] - d->cu_q[n]) * (double)(d->cu_k[n + 1] - d->cu_k[n]);
    work *= (double)d->H * (double)(d->Dk + d->Dv);
    return pa_threads_for(work, items);
}

static int PA_FN(softmax_forward)(const pa_softmax_desc *d, const void *qv, const void *kv,
                                  const void *vv, void *ov, void *lsev)
{
    const real *q = qv, *k = kv, *v = vv;
    real *o = ov, *lse = lsev;
    const int64_t nseq = d->nseq, H = d->H;
    const int64_t maxq = PA_FN(sm_max_len)(d->cu_q, nseq), maxk = PA_FN(sm_max_len)(d->cu_k, nseq);
    const int form = d->form;
    if (form == PA_FORM_FLASH && maxq <= SM_DECODE_MAXQ && !d->gate) {
        const pa_key_rows rows = {d->cu_k, d->cu_k + 1, NULL, 0, 1};
        return PA_FN(softmax_decode)(d, &rows, 0, qv, kv, vv, ov, lsev, NULL, 0);
    }
    const int tiled = form != PA_FORM_RECURRENT;
    /* query-block and key-block sizes; the parallel form takes whole sequences */
    const int64_t bq_form = form == PA_FORM_PARALLEL ? maxq : form == PA_FORM_FLASH ? SM_BQ : 1;
    const int64_t bqmax = bq_form < maxq ? bq_form : maxq;
    const int64_t bkmax = form == PA_FORM_PARALLEL || maxk < SM_BK ? (maxk > 0 ? maxk : 1) : SM_BK;
    if (maxq == 0) return PA_OK;
#if SM_BF16
    const float *arrays[] = {v};
    const int64_t elems[] = {d->cu_k[nseq] * d->Hk * d->Dv};
    const int bf16 = tiled && d->bf16 && pa_bf16_kind() != PA_BF16_NONE &&
                     sm_bf16_finite(arrays, elems, 1);
    sm_bf16_fwd bp = {{0}, {0}, {0}};
    sm_bf16_pack *const bpacks[] = {&bp.q, &bp.k, &bp.vt};
    const void *bf16_packs = bf16 ? &bp : NULL;
#else
    const int bf16 = 0;
    const void *bf16_packs = NULL;
#endif
    PA_FN(sm_packed) Qp = {0}, Kp = {0}, Vp = {0};
    PA_FN(sm_packed) *const packs[] = {&Qp, &Kp, &Vp};
    const int npacks = tiled && !bf16 ? 3 : 0;
    PA_FN(sm_gate) gt;
    int64_t *first = malloc(sizeof(int64_t) * (nseq + 1));
    /* failed: an allocation here, or a thread's scratch below (every buffer freed at the end) */
    int failed = !PA_FN(sm_gate_alloc)(&gt, d, 0) || !first ||
#if SM_BF16
                 (bf16 && !(sm_bf16_pack_alloc(&bp.q, d, q, d->Dk, 1, SM_BF16_ROWS_B, 0) &&
                            sm_bf16_pack_alloc(&bp.k, d, k, d->Dk, 0, SM_BF16_ROWS_A, 0) &&
                            sm_bf16_pack_alloc(&bp.vt, d, v, d->Dv, 0, SM_BF16_PAIRS_A, 0))) ||
#endif
                 (npacks && !(PA_FN(sm_pack_alloc)(&Qp, d, q, d->Dk, 1, SM_B_COLUMNS, 0) &&
                              PA_FN(sm_pack_alloc)(&Kp, d, k, d->Dk, 0, SM_A_ROWS, 0) &&
                              PA_FN(sm_pack_alloc)(&Vp, d, v, d->Dv, 0, SM_B_ROWS, 1)));
    if (!failed) {
        const int64_t items = PA_FN(sm_items)(d->cu_q, nseq, bqmax, H, first);
#pragma omp parallel num_threads(PA_FN(sm_threads)(d, items))
        {
            PA_FN(sm_pack_fill)(packs, npacks, d);
#if SM_BF16
            sm_bf16_pack_fill(bpacks, bf16 ? 3 : 0, d);
#endif
            PA_FN(sm_gate_fill)(&gt, d);
            PA_FN(sm_scratch) s;
            real *acc = NULL; /* the recurrent form's scratch */
            int ok = pa_scratch_ok(tiled ? PA_FN(sm_scratch_alloc)(&s, d, bqmax, bkmax, 0, bf16)
                                         : (acc = pa_alloc(sizeof(real) * d->Dv)) != NULL,
                                   &failed);
            int64_t n = 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items; t++) {
                if (!ok) continue;
                int64_t h, b;
                PA_FN(sm_item)(first, t, H, 1, &n, &h, &b);
                int64_t tq = d->cu_q[n + 1] - d->cu_q[n], i0 = b * bqmax;
                int64_t bq = tq - i0 < bqmax ? tq - i0 : bqmax;
                if (form == PA_FORM_RECURRENT)
                    PA_FN(sm_forward_row)(d, q, k, v, o, lse, n, h, i0, acc);
                else
                    PA_FN(sm_forward_block)(d, &gt, &Qp, &Kp, &Vp, bf16_packs, o, lse, n, h, i0, bq,
                                            bkmax, &s);
            }
            if (!tiled)
                free(acc);
            else if (ok)
                PA_FN(sm_scratch_free)(&s);
        }
    }
    free(first);
    PA_FN(sm_gate_free)(&gt);
    PA_FN(sm_packed_free)(&Qp);
    PA_FN(sm_packed_free)(&Kp);
    PA_FN(sm_packed_free)(&Vp);
#if SM_BF16
    for (int i = 0; i < 3; i++) sm_bf16_pack_free(bpacks[i]);
#endif
    return failed ? PA_ENOMEM : PA_OK;
}

/* The operands of the backward tiles packed once: Q and K^T (scores), dO and V^T (dP),
 * K (dQ), dO and Q as B operands (dV = P^T dO, dK = dS^T Q, with P and dS read in place). */
typedef struct {
    PA_FN(sm_packed) Q, KT, dO, VT, K, dOr, Qr;
#if SM_BF16
    const sm_bf16_bwd *bf16; /* the operands of bf16 products (then the others are unused) */
#endif
} PA_FN(sm_bwd_packs);

static void PA_FN(sm_bwd_packs_free)(PA_FN(sm_bwd_packs) * pk)
{
    PA_FN(sm_packed_free)(&pk->Q);
    PA_FN(sm_packed_free)(&pk->KT);
    PA_FN(sm_packed_free)(&pk->dO);
    PA_FN(sm_packed_free)(&pk->VT);
    PA_FN(sm_packed_free)(&pk->K);
    PA_FN(sm_packed_free)(&pk->dOr);
    PA_FN(sm_packed_free)(&pk->Qr);
}

/* One backward tile: queries i0..i0+bq-1 of head h against the key block [j0, j0+bk) of
 * sequence n. With dK/dV (not NULL: the block's accumulators, row 0 = key j0) adds the tile's
 * dK and dV, and with a gate its column sums of dS; with_dq adds its dQ into dq, and with a
 * gate its row sums of dS (sm_gate: a gated tile leaves out its diagonal pairs). In a partially masked tile P and dS are 0 at the
 * pairs a query cannot see by selection (a NaN LSE, dP or D would reach them otherwise), and
 * the products with non-finite rows of dO, K or Q go as sm_add_nonfinite_rows explains. */
static void PA_FN(sm_backward_tile)(const pa_softmax_desc *d, const PA_FN(sm_bwd_packs) * pk,
                                    const PA_FN(sm_gate) * gt, const real *lse, const real *Drow,
                                    real *dq, int with_dq, real *dK, real *dV, int64_t n,
                                    int64_t h, int64_t i0, int64_t bq, int64_t j0, int64_t bk,
                                    PA_FN(sm_scratch) * s)
{
    const int64_t H = d->H, Dk = d->Dk, Dv = d->Dv, kh = h / (H / d->Hk), lds = s->lds;
    const int64_t q0 = d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n];
    const int64_t off = tk - (d->cu_q[n + 1] - q0), ip0 = i0 + off;
    const real scale = (real)d->scale;
    real *S = s->S, *dP = s->dP;
    int64_t ja, jb, vt_bps, k_bps, do_ars, lo, hi;
    int vis = PA_FN(sm_block_keys)(d, ip0, ip0 + bq - 1, j0, j0 + bk, tk, NR, &ja, &jb);
    if (vis == SM_HIDDEN) return;
    const int partial = vis == SM_PARTIAL;
    const int64_t w = jb - ja; /* the keys ja..jb-1 this query block may see */
#if SM_BF16
    if (pk->bf16) {
        sm_backward_tile_bf16(d, pk->bf16, gt, lse, Drow, dq, with_dq, dK, dV, n, h, i0, bq, j0,
                              ja, jb, vis, s);
        return;
    }
#endif
    const real *VT = PA_FN(sm_packed_at)(&pk->VT, d, n, kh, ja, &vt_bps);
    const real *dOp = PA_FN(sm_packed_at)(&pk->dO, d, n, h, i0, &do_ars);
    const real *Q = PA_FN(sm_raw_row)(&pk->Q, d, n, h, i0);
    const real *dO = PA_FN(sm_raw_row)(&pk->dO, d, n, h, i0);
    PA_FN(sm_scores)(d, gt, n, h, &pk->Q, &pk->KT, 0, S, lds, i0, bq, ja, w, off, tk, vis, s->dcap);
    PA_FN(sm_bwd_probs)(d, lse, S, lds, n, h, i0, bq, ja, jb, partial);
    if (dV && partial && PA_FN(sm_bad_rows)(&pk->dO, d, n, h, i0, i0 + bq, &lo, &hi)) {
        PA_FN(sm_pack_finite_rows)(bq, Dv, dO, H * Dv, lo, hi, s->finite_b);
        PA_FN(gemm_packed_b)(w, Dv, bq, 1, S, 1, lds, s->finite_b, bq * NR, 1, dV + (ja - j0) * Dv,
                             Dv, s->work);
        PA_FN(sm_add_nonfinite_rows)(d, ip0, bq, ja, w, tk, S, lds, 1, dO, H * Dv, Dv, lo, hi, 1,
                                     1, dV + (ja - j0) * Dv, Dv);
    } else if (dV) {
        int64_t bps;
        const real *dOr = PA_FN(sm_packed_at)(&pk->dOr, d, n, h, i0, &bps);
        PA_FN(gemm_packed_ab)(w, Dv, bq, 1, S, MR, lds, dOr, bps, 1, dV + (ja - j0) * Dv, Dv);
    }
    PA_FN(gemm_packed_ab)(bq, w, Dv, 1, dOp, do_ars, MR, VT, vt_bps, 0, dP, lds);
    PA_FN(sm_bwd_dscores)(d, gt, Drow, S, dP, s, with_dq, dK != NULL, n, h, i0, bq, ja, jb, partial);
    if (with_dq) {
        real *dQ = dq + ((q0 + i0) * H + h) * Dk;
        const real *Kp = PA_FN(sm_packed_at)(&pk->K, d, n, kh, ja, &k_bps);
        if (partial && PA_FN(sm_bad_rows)(&pk->K, d, n, kh, ja, jb, &lo, &hi)) {
            const real *K = PA_FN(sm_raw_row)(&pk->K, d, n, kh, ja);
            PA_FN(sm_pack_finite_rows)(w, Dk, K, d->Hk * Dk, lo, hi, s->finite_b);
            PA_FN(gemm_packed_b)(bq, Dk, w, scale, dP, lds, 1, s->finite_b, w * NR, 1, dQ, H * Dk,
                                 s->work);
            PA_FN(sm_add_nonfinite_rows)(d, ip0, bq, ja, w, tk, dP, lds, 1, K, d->Hk * Dk, Dk, lo,
                                         hi, 0, scale, dQ, H * Dk);
        } else {
            PA_FN(gemm_packed_b)(bq, Dk, w, scale, dP, lds, 1, Kp, k_bps, 1, dQ, H * Dk, s->work);
        }
    }
    if (dK && partial && PA_FN(sm_bad_rows)(&pk->Q, d, n, h, i0, i0 + bq, &lo, &hi)) {
        PA_FN(sm_pack_finite_rows)(bq, Dk, Q, H * Dk, lo, hi, s->finite_b);
        PA_FN(gemm_packed_b)(w, Dk, bq, scale, dP, 1, lds, s->finite_b, bq * NR, 1,
                             dK + (ja - j0) * Dk, Dk, s->work);
        PA_FN(sm_add_nonfinite_rows)(d, ip0, bq, ja, w, tk, dP, lds, 1, Q, H * Dk, Dk, lo, hi, 1,
                                     scale, dK + (ja - j0) * Dk, Dk);
    } else if (dK) {
        int64_t bps;
        const real *Qr = PA_FN(sm_packed_at)(&pk->Qr, d, n, h, i0, &bps);
        PA_FN(gemm_packed_ab)(w, Dk, bq, scale, dP, MR, lds, Qr, bps, 1, dK + (ja - j0) * Dk, Dk);
    }
}

/* dK and dV of the key block [j0, j0+bk) of (sequence n, KV head kh), over every query of its
 * heads (with a gate, its keys' column sums of dS too); with_dq also adds the block's share of
 * dQ. */
static void PA_FN(sm_backward_keys)(const pa_softmax_desc *d, const PA_FN(sm_bwd_packs) * pk,
                                    const PA_FN(sm_gate) * gt, const real *lse, const real *Drow,
                                    real *dq, int with_dq, real *dk, real *dv, int64_t n,
                                    int64_t kh, int64_t j0, int64_t bk, int64_t bqmax,
                                    PA_FN(sm_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, group = H / Hk;
    const int64_t tq = d->cu_q[n + 1] - d->cu_q[n], k0 = d->cu_k[n];
    memset(s->dK, 0, sizeof(real) * bk * Dk);
    memset(s->dV, 0, sizeof(real) * bk * Dv);
    for (int64_t h = kh * group; h < (kh + 1) * group; h++)
        for (int64_t i0 = 0; i0 < tq; i0 += bqmax)
            PA_FN(sm_backward_tile)(d, pk, gt, lse, Drow, dq, with_dq, s->dK, s->dV, n, h, i0,
                                    tq - i0 < bqmax ? tq - i0 : bqmax, j0, bk, s);
    for (int64_t c = 0; c < bk; c++) {
        memcpy(dk + ((k0 + j0 + c) * Hk + kh) * Dk, s->dK + c * Dk, sizeof(real) * Dk);
        memcpy(dv + ((k0 + j0 + c) * Hk + kh) * Dv, s->dV + c * Dv, sizeof(real) * Dv);
    }
}

/* Backward of one unit (sequence n, KV head kh), one query and one key at a time. dk and dv
 * rows of the unit are accumulated in place (zeroed by the caller). */
static void PA_FN(sm_backward_unit_recurrent)(const pa_softmax_desc *d, const real *q,
                                              const real *k, const real *v, const real *lse,
                                              const real *dout, const real *Drow, real *dq,
                                              real *dk, real *dv, int64_t n, int64_t kh)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, group = H / Hk;
    const int64_t q0 = d->cu_q[n], k0 = d->cu_k[n];
    const int64_t tq = d->cu_q[n + 1] - q0, tk = d->cu_k[n + 1] - k0, off = tk - tq;
    const real scale = (real)d->scale;
    for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
        real slope = PA_FN(sm_slope)(d, h);
        for (int64_t i = 0; i < tq; i++) {
            const int64_t row = (q0 + i) * H + h, ip = i + off;
            const real *qi = q + row * Dk, *doi = dout + row * Dv;
            real *dqi = dq + row * Dk;
            real L = lse[row], Dr = Drow[row];
            if (L == -(real)INFINITY) continue;
            int64_t ranges[2][2];
            PA_FN(sm_row_ranges)(d, ip, tk, 0, tk, ranges);
            for (int rg = 0; rg < 2; rg++)
            for (int64_t j = ranges[rg][0]; j < ranges[rg][1]; j++) {
                const int64_t krow = (k0 + j) * Hk + kh;
                real dcap;
                real x = PA_FN(sm_score)(scale * PA_FN(dot)(qi, k + krow * Dk, Dk), d->softcap,
                                         slope, ip - j, &dcap);
                real p = (real)exp((double)x - (double)L);
                PA_FN(axpy)(dv + krow * Dv, doi, Dv, p);
                real ds = p * (PA_FN(dot)(doi, v + krow * Dv, Dv) - Dr) * dcap * scale;
                PA_FN(axpy)(dqi, k + krow * Dk, Dk, ds);
                PA_FN(axpy)(dk + krow * Dk, qi, Dk, ds);
            }
        }
    }
}

static int PA_FN(softmax_backward)(const pa_softmax_desc *d, const void *qv, const void *kv,
                                   const void *vv, const void *ov, const void *lsev,
                                   const void *doutv, const void *dlsev, void *dqv, void *dkv,
                                   void *dvv, void *dgv)
{
    const real *q = qv, *k = kv, *v = vv, *o = ov, *lse = lsev, *dout = doutv, *dlse = dlsev;
    real *dq = dqv, *dk = dkv, *dv = dvv, *dg = dgv;
    const int64_t nseq = d->nseq, H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv;
    const int64_t rows_q = d->cu_q[nseq], rows_k = d->cu_k[nseq];
    const int64_t maxq = PA_FN(sm_max_len)(d->cu_q, nseq), maxk = PA_FN(sm_max_len)(d->cu_k, nseq);
    const int form = d->form, tiled = form != PA_FORM_RECURRENT && maxq > 0 && maxk > 0;
    const int64_t bqmax = form == PA_FORM_PARALLEL ? maxq : SM_BWD_BQ < maxq ? SM_BWD_BQ : maxq;
    const int64_t bkmax = form == PA_FORM_PARALLEL ? maxk : SM_BK < maxk ? SM_BK : maxk;
    PA_FN(sm_bwd_packs) pk;
    memset(&pk, 0, sizeof pk);
    PA_FN(sm_packed) *const packs[] = {&pk.Q, &pk.KT, &pk.dO, &pk.VT, &pk.K, &pk.dOr, &pk.Qr};
#if SM_BF16
    const float *arrays[] = {q, k, v, dout};
    const int64_t elems[] = {rows_q * H * Dk, rows_k * Hk * Dk, rows_k * Hk * Dv, rows_q * H * Dv};
    const int bf16 = tiled && d->bf16 && pa_bf16_kind() != PA_BF16_NONE &&
                     sm_bf16_finite(arrays, elems, 4);
    sm_bf16_bwd bb;
    memset(&bb, 0, sizeof bb);
    sm_bf16_pack *const bpacks[] = {&bb.q, &bb.dout, &bb.kt, &bb.vt, &bb.k, &bb.dout_pairs, &bb.q_pairs};
    if (bf16) pk.bf16 = &bb;
#else
    const int bf16 = 0;
#endif
    const int npacks = tiled && !bf16 ? 7 : 0;
    /* Work: one unit per (sequence, KV head) owns its dK, dV and its heads' dQ rows and does
     * 5 GEMMs a tile. With fewer units than threads can use, split instead: items (sequence,
     * KV head, key block) make dK and dV (4 GEMMs a tile), items (sequence, head, query block)
     * make dQ (3 GEMMs a tile). Both add every dQ tile in the same order, so the results are
     * the same bits either way. */
    int64_t *first_k = malloc(sizeof(int64_t) * (nseq + 1)), *first_q = malloc(sizeof(int64_t) * (nseq + 1));
    real *Drow = pa_alloc(sizeof(real) * (rows_q * H + 1));
    PA_FN(sm_gate) gt;
    /* failed: an allocation here, or a thread's scratch below (every buffer freed at the end) */
    int failed = !PA_FN(sm_gate_alloc)(&gt, d, 1) || !Drow || !first_k || !first_q ||
#if SM_BF16
                 (bf16 && !(sm_bf16_pack_alloc(&bb.q, d, q, Dk, 1, SM_BF16_ROWS_A, PA_BF16_PAD) &&
                            sm_bf16_pack_alloc(&bb.dout, d, dout, Dv, 1, SM_BF16_ROWS_A, PA_BF16_PAD) &&
                            sm_bf16_pack_alloc(&bb.kt, d, k, Dk, 0, SM_BF16_ROWS_B, 0) &&
                            sm_bf16_pack_alloc(&bb.vt, d, v, Dv, 0, SM_BF16_ROWS_B, 0) &&
                            sm_bf16_pack_alloc(&bb.k, d, k, Dk, 0, SM_BF16_PAIRS_B, 0) &&
                            sm_bf16_pack_alloc(&bb.dout_pairs, d, dout, Dv, 1, SM_BF16_PAIRS_B,
                                               PA_BF16_PAD) &&
                            sm_bf16_pack_alloc(&bb.q_pairs, d, q, Dk, 1, SM_BF16_PAIRS_B,
                                               PA_BF16_PAD))) ||
#endif
                 (npacks && !(PA_FN(sm_pack_alloc)(&pk.Q, d, q, Dk, 1, SM_A_ROWS, 1) &&
                              PA_FN(sm_pack_alloc)(&pk.KT, d, k, Dk, 0, SM_B_COLUMNS, 0) &&
                              PA_FN(sm_pack_alloc)(&pk.dO, d, dout, Dv, 1, SM_A_ROWS, 1) &&
                              PA_FN(sm_pack_alloc)(&pk.VT, d, v, Dv, 0, SM_B_COLUMNS, 0) &&
                              PA_FN(sm_pack_alloc)(&pk.K, d, k, Dk, 0, SM_B_ROWS, 1) &&
                              PA_FN(sm_pack_alloc)(&pk.dOr, d, dout, Dv, 1, SM_B_ROWS, 0) &&
                              PA_FN(sm_pack_alloc)(&pk.Qr, d, q, Dk, 1, SM_B_ROWS, 0)));
    if (!failed) {
        /* the blocks are empty (0) when a side has no rows at all: then no tile is made */
        const int64_t items_k = tiled ? PA_FN(sm_items)(d->cu_k, nseq, bkmax, Hk, first_k) : 0;
        const int64_t items_q = tiled ? PA_FN(sm_items)(d->cu_q, nseq, bqmax, H, first_q) : 0;
        const int nthreads = PA_FN(sm_threads)(d, tiled ? (items_k > items_q ? items_k : items_q)
                                                        : nseq * Hk);
        const int split = tiled && nseq * Hk < 2 * nthreads;
        if (!tiled) { /* accumulated in place (recurrent), or no tile touches them */
            memset(dk, 0, sizeof(real) * rows_k * Hk * Dk);
            memset(dv, 0, sizeof(real) * rows_k * Hk * Dv);
        }
#pragma omp parallel num_threads(nthreads)
        {
            PA_FN(sm_pack_fill)(packs, npacks, d);
#if SM_BF16
            sm_bf16_pack_fill(bpacks, bf16 ? 7 : 0, d);
#endif
            PA_FN(sm_gate_fill)(&gt, d);
            /* D = rowsum(dO * O) - dlse; dq is accumulated */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows_q * H; r++) {
                Drow[r] = PA_FN(dot)(dout + r * Dv, o + r * Dv, Dv) - (dlse ? dlse[r] : 0);
                memset(dq + r * Dk, 0, sizeof(real) * Dk);
            }
            PA_FN(sm_scratch) s;
            int ok = pa_scratch_ok(!tiled || PA_FN(sm_scratch_alloc)(&s, d, bqmax, bkmax, 1, bf16), &failed);
            if (form == PA_FORM_RECURRENT) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < nseq * Hk; u++)
                    PA_FN(sm_backward_unit_recurrent)(d, q, k, v, lse, dout, Drow, dq, dk, dv, u / Hk,
                                                      u % Hk);
            } else if (tiled && !split) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < nseq * Hk; u++) {
                    int64_t n = u / Hk, tk = d->cu_k[n + 1] - d->cu_k[n];
                    for (int64_t j0 = 0; ok && j0 < tk; j0 += bkmax)
                        PA_FN(sm_backward_keys)(d, &pk, &gt, lse, Drow, dq, 1, dk, dv, n, u % Hk, j0,
                                                tk - j0 < bkmax ? tk - j0 : bkmax, bqmax, &s);
                }
            } else if (tiled) {
                int64_t n = 0;
#pragma omp for schedule(dynamic, 1) nowait
                for (int64_t t = 0; t < items_k; t++) {
                    int64_t kh, b;
                    PA_FN(sm_item)(first_k, t, Hk, 0, &n, &kh, &b);
                    int64_t tk = d->cu_k[n + 1] - d->cu_k[n], j0 = b * bkmax;
                    if (ok)
                        PA_FN(sm_backward_keys)(d, &pk, &gt, lse, Drow, dq, 0, dk, dv, n, kh, j0,
                                                tk - j0 < bkmax ? tk - j0 : bkmax, bqmax, &s);
                }
                n = 0;
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < items_q; t++) {
                    int64_t h, b;
                    PA_FN(sm_item)(first_q, t, H, 1, &n, &h, &b);
                    int64_t tq = d->cu_q[n + 1] - d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n];
                    int64_t i0 = b * bqmax, bq = tq - i0 < bqmax ? tq - i0 : bqmax;
                    for (int64_t j0 = 0; ok && j0 < tk; j0 += bkmax)
                        PA_FN(sm_backward_tile)(d, &pk, &gt, lse, Drow, dq, 1, NULL, NULL, n, h, i0, bq,
                                                j0, tk - j0 < bkmax ? tk - j0 : bkmax, &s);
                }
            }
            PA_FN(sm_gate_finish)(&gt, d, q, k, dq, dk, dg);
            if (ok && tiled) PA_FN(sm_scratch_free)(&s);
        }
    }
    free(Drow);
    free(first_k);
    free(first_q);
    PA_FN(sm_gate_free)(&gt);
    PA_FN(sm_bwd_packs_free)(&pk);
#if SM_BF16
    for (int i = 0; i < 7; i++) sm_bf16_pack_free(bpacks[i]);
#endif
    return failed ? PA_ENOMEM : PA_OK;
}
