/* Sparse softmax attention: the kernels of the sparse ops beyond the flash and decode forms.
 * Template body (see core/dtype.h); needs core/vmath.h, core/gemm.c and ops/softmax_rows.h
 * (the row-wise pieces it shares with softmax_attn.c) before it. Three parts:
 *
 * 1. softmax_decode_backward, the backward of the decode form over keys that lie anywhere,
 *    listed per query. NSA's compressed and selected branches and DeepSeek sparse attention
 *    run their forward through softmax_decode: one query row, every head of it, against the
 *    key rows its selection lists (a block table of whole key blocks, or of single rows).
 *    Work items are query rows; per item and key block P is recomputed from the forward's
 *    LSE, dP = dO V^T, dS = P (dP - D) with D = rowsum(dO * O) - dlse, dQ = scale dS K, dK +=
 *    scale dS^T Q, dV += P^T dO. The query row owns its dQ; the keys of one row are listed
 *    by many rows, so each thread adds its dK and dV into a buffer of its own (the first
 *    thread into dk, dv), summed in thread order at the end. Items are dealt round robin,
 *    so the result is the same bits for a given thread count.
 * 2. dsa_select, DeepSeek sparse attention's choice of keys, and dsa_index_loss, its
 *    indexer's distillation loss over the chosen keys with the loss's gradient (below).
 * 3. moba_select, moba_forward / moba_backward: MoBA's choice of blocks and its attention to
 *    them (below).
 */

/* dst_row[kh] += sum_g w[(kh G + g) * SM_DECODE_KB + c] src[kh G + g] for every KV head kh:
 * the outer-product update dK (or dV) of one key row from the heads of its groups, each
 * vector of the row loaded and stored once for all of them. */
static inline void PA_FN(sd_key_update)(real *dst, const real *src, const real *w, int64_t c,
                                        int64_t H, int64_t Hk, int64_t D)
{
    const int64_t G = H / Hk;
    for (int64_t kh = 0; kh < Hk; kh++) {
        real *row = dst + kh * D;
        const real *x = src + kh * G * D, *wk = w + kh * G * SM_DECODE_KB + c;
        int64_t e = 0;
        for (; e + VL <= D; e += VL) {
            vreal a = PA_FN(vload)(row + e);
            for (int64_t g = 0; g < G; g++)
                a += PA_FN(vset)(wk[g * SM_DECODE_KB]) * PA_FN(vload)(x + g * D + e);
            PA_FN(vstore)(row + e, a);
        }
        for (; e < D; e++) {
            real a = row[e];
            for (int64_t g = 0; g < G; g++) a += wk[g * SM_DECODE_KB] * x[g * D + e];
            row[e] = a;
        }
    }
}

/* Scratch of one backward thread: the decode scratch (scores -> P), dS [H, SM_DECODE_KB], D
 * [H]. */
typedef struct {
    PA_FN(sm_decode_scratch) w;
    real *dS, *Drow;
    void *block;
} PA_FN(sd_scratch);

static int PA_FN(sd_scratch_alloc)(PA_FN(sd_scratch) * s, const pa_softmax_desc *d)
{
    const size_t H = (size_t)d->H;
    void **parts[] = {(void **)&s->dS, (void **)&s->Drow};
    const size_t bytes[] = {sizeof(real) * H * SM_DECODE_KB, sizeof(real) * H};
    s->block = NULL;
    if (!PA_FN(sm_decode_scratch_alloc)(&s->w, d)) return 0;
    if (!(s->block = pa_alloc_parts(parts, bytes, 2))) {
        free(s->w.block);
        return 0;
    }
    return 1;
}

/* The backward of query i of sequence n (every head): its dq row, and dK, dV of the keys it
 * sees added into dk, dv (rows as k, v). */
static void PA_FN(sd_backward_row)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                   const real *q, const real *k, const real *v, const real *o,
                                   const real *lse, const real *dout, const real *dlse,
                                   int64_t n, int64_t i, real *dq, real *dk, real *dv,
                                   PA_FN(sd_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, G = H / Hk, KB = SM_DECODE_KB;
    const int64_t q0 = d->cu_q[n], tk = rows->end[n] - rows->start[n];
    const int64_t ip = i + tk - (d->cu_q[n + 1] - q0), row = q0 + i;
    const real *qi = q + row * H * Dk, *doi = dout + row * H * Dv, *li = lse + row * H;
    const real scale = (real)d->scale;
    real *dqi = dq + row * H * Dk, *P = s->w.S, *dS = s->dS;
    /* dP = dO V^T is the decode's score pass over V with dO as the query */
    pa_softmax_desc dv_desc = *d;
    dv_desc.Dk = Dv;
    dv_desc.scale = 1;
    for (int64_t h = 0; h < H; h++)
        s->Drow[h] = PA_FN(dot)(doi + h * Dv, o + (row * H + h) * Dv, Dv) -
                     (dlse ? dlse[row * H + h] : 0);
    memset(dqi, 0, sizeof(real) * H * Dk);
    int64_t ranges[2][2];
    PA_FN(sm_row_ranges)(d, ip, tk, 0, tk, ranges);
    for (int rg = 0; rg < 2; rg++)
        for (int64_t jb = ranges[rg][0]; jb < ranges[rg][1]; jb += KB) {
            const int64_t nb = ranges[rg][1] - jb < KB ? ranges[rg][1] - jb : KB;
            const int64_t count =
                PA_FN(sm_block_rows)(d, rows, k, v, n, jb, nb, ranges[rg][1], s->w.kp, s->w.vp);
            PA_FN(sm_row_scores)(d, qi, s->w.kp, s->w.vp, count, ip, jb, nb, P);
            PA_FN(sm_row_scores)(&dv_desc, doi, s->w.vp, NULL, nb, ip, jb, nb, dS);
            for (int64_t h = 0; h < H; h++) {
                real *p = P + h * KB, *ds = dS + h * KB;
                PA_FN(row_exp_sum)(p, nb, li[h]);
                for (int64_t c = 0; c < nb; c++) ds[c] = scale * p[c] * (ds[c] - s->Drow[h]);
            }
            for (int64_t kh = 0; kh < Hk; kh++) {
                int64_t g = 0;
                for (; g + 4 <= G; g += 4)
                    PA_FN(sm_pv)(dqi + (kh * G + g) * Dk, Dk, dS + (kh * G + g) * KB, s->w.kp,
                                 kh * Dk, nb, 4);
                for (; g < G; g++)
                    PA_FN(sm_pv)(dqi + (kh * G + g) * Dk, Dk, dS + (kh * G + g) * KB, s->w.kp,
                                 kh * Dk, nb, 1);
            }
            for (int64_t c = 0; c < nb; c++) {
                const int64_t krow = (s->w.kp[c] - k) / (Hk * Dk);
                PA_FN(sd_key_update)(dk + krow * Hk * Dk, qi, dS, c, H, Hk, Dk);
                PA_FN(sd_key_update)(dv + krow * Hk * Dv, doi, P, c, H, Hk, Dv);
            }
        }
}

/* dst[0, n) = sum of the `parts` buffers at src (`stride` apart), in order. */
static void PA_FN(sd_sum_parts)(real *dst, const real *src, int64_t stride, int parts,
                                int64_t n)
{
#pragma omp for schedule(static)
    for (int64_t e = 0; e < n; e++) {
        real x = dst[e];
        for (int p = 0; p < parts; p++) x += src[p * stride + e];
        dst[e] = x;
    }
}

static int PA_FN(softmax_decode_backward)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                          int64_t key_rows, const void *qv, const void *kv,
                                          const void *vv, const void *ov, const void *lsev,
                                          const void *doutv, const void *dlsev, void *dqv,
                                          void *dkv, void *dvv)
{
    const real *q = qv, *k = kv, *v = vv, *o = ov, *lse = lsev, *dout = doutv, *dlse = dlsev;
    real *dq = dqv, *dk = dkv, *dv = dvv;
    const int64_t nseq = d->nseq, nq = d->cu_q[nseq];
    const int64_t nk = key_rows * d->Hk * d->Dk, nv = key_rows * d->Hk * d->Dv;
    memset(dk, 0, sizeof(real) * (size_t)nk);
    memset(dv, 0, sizeof(real) * (size_t)nv);
    if (nq == 0) return PA_OK;
    double work = 0;
    for (int64_t n = 0; n < nseq; n++)
        work += (double)(d->cu_q[n + 1] - d->cu_q[n]) * (double)(rows->end[n] - rows->start[n]);
    const int threads = pa_threads_for(work * (double)d->H * 2.5 * (double)(d->Dk + d->Dv), nq);
    /* threads 1 .. threads-1 add into buffers of their own: [threads - 1][dk | dv] */
    real *extra = NULL;
    if (threads > 1 && !(extra = pa_alloc(sizeof(real) * (size_t)((threads - 1) * (nk + nv)))))
        return PA_ENOMEM;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int tid = pa_thread_id();
        real *mk = tid ? extra + (tid - 1) * (nk + nv) : dk, *mv = tid ? mk + nk : dv;
        if (tid) memset(mk, 0, sizeof(real) * (size_t)(nk + nv));
        PA_FN(sd_scratch) s;
        int ok = pa_scratch_ok(PA_FN(sd_scratch_alloc)(&s, d), &failed);
        int64_t n = 0;
#pragma omp for schedule(static, 1)
        for (int64_t r = 0; r < nq; r++) {
            while (r >= d->cu_q[n + 1]) n++;
            if (ok)
                PA_FN(sd_backward_row)(d, rows, q, k, v, o, lse, dout, dlse, n, r - d->cu_q[n],
                                       dq, mk, mv, &s);
        }
        if (ok) {
            free(s.block);
            free(s.w.block);
        }
        if (threads > 1) {
            PA_FN(sd_sum_parts)(dk, extra, nk + nv, threads - 1, nk);
            PA_FN(sd_sum_parts)(dv, extra + nk, nk + nv, threads - 1, nv);
        }
    }
    free(extra);
    return failed ? PA_ENOMEM : PA_OK;
}

/* DeepSeek sparse attention's selection: the lightning indexer's scores I[t, s] = sum_j
 * w[t, j] relu(q[t, j] . k[s]) and each query's top_k visible keys by them, without the
 * [Tq, Tk] scores: work items are tiles of SD_SELECT_ROWS queries of one sequence, whose
 * scores are formed SD_SELECT_KEYS keys at a time by one GEMM over the tile's (query, index
 * head) rows, then reduced over the heads into the tile's rows of scores; a quickselect finds
 * each row's k-th largest score, and one pass in key order takes the keys above it and the
 * equal ones first in order (ties to the lower key), so the keys come out ascending. */

#define SD_SELECT_ROWS 64
#define SD_SELECT_KEYS 512

/* The k-th largest of x[0, n) (1 <= k <= n, no NaN); x and tmp (n reals) are overwritten.
 * Quickselect with median-of-three pivots, each pass a branch-free three-way partition into
 * the other buffer (scores are random to the branch predictor): the values above the pivot
 * from its front, those below from its back. */
static real PA_FN(sd_kth_largest)(real *x, int64_t n, int64_t k, real *tmp)
{
    while (n > 1) {
        const real a = x[0], b = x[n / 2], c = x[n - 1];
        const real pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t above = 0, below = 0;
        for (int64_t i = 0; i < n; i++) { /* the two slots written never hold a kept value */
            const real v = x[i];
            tmp[above] = v;
            tmp[n - 1 - below] = v;
            above += v > pivot;
            below += v < pivot;
        }
        real *const other = x;
        if (k <= above) {
            x = tmp;
            n = above;
        } else if (k <= n - below) {
            return pivot;
        } else {
            k -= n - below;
            x = tmp + n - below;
            n = below;
        }
        tmp = other;
    }
    return x[0];
}

/* Per-thread scratch of the selection: the GEMM's output C [rows * Hi, keys], the tile's
 * scores S [rows, maxk], a query's candidates (values, a copy and a buffer the quickselect
 * overwrites, key indices; maxk each), a sample, and the GEMM's workspace. */
typedef struct {
    real *C, *S, *val, *work_val, *tmp, *sample, *work;
    int64_t *idx;
    void *block;
} PA_FN(sd_select_scratch);

#define SD_SAMPLE 512

/* The top_k of the scores S[0, vis) (ties to the lower key; NaN never taken) as rows k0 + c,
 * ascending, into out (-1 after the last); *nan = 1 when a score is NaN. Returns how many.
 * The k-th largest score comes from a sample first: a value t a little below the sample's
 * matching rank, so that (with high probability) at least top_k scores are >= t; one pass
 * keeps those as candidates in key order, a quickselect over them gives the k-th largest,
 * and the candidates above it (then the ties, in order) are the keys. A sample that misses
 * falls back to every score as a candidate. */
static int64_t PA_FN(sd_top_keys)(const real *S, int64_t vis, int64_t top_k, int64_t k0,
                                  int32_t *out, uint8_t *nan, PA_FN(sd_select_scratch) * s)
{
    int64_t taken = 0, m = 0;
    uint8_t bad = 0;
    real t = -(real)INFINITY;
    if (vis > top_k) {
        const int64_t ns = vis < SD_SAMPLE ? vis : SD_SAMPLE;
        const double expect = (double)top_k * (double)ns / (double)vis;
        const int64_t rank = (int64_t)(expect + 3 * sqrt(expect) + 4);
        if (rank < ns) {
            for (int64_t j = 0; j < ns; j++) {
                const real x = S[j * vis / ns];
                s->sample[j] = x != x ? -(real)INFINITY : x;
            }
            t = PA_FN(sd_kth_largest)(s->sample, ns, rank + 1, s->tmp);
        }
    }
    for (int64_t c = 0; c < vis; c++) {
        const real x = S[c];
        bad |= x != x;
        s->idx[m] = c;
        s->val[m] = x;
        m += x >= t;
    }
    *nan = bad;
    if (vis <= top_k) {
        for (int64_t c = 0; c < vis; c++) out[taken++] = (int32_t)(k0 + c);
    } else {
        if (m < top_k) { /* the sample missed (or NaN scores): every score a candidate */
            for (int64_t c = 0; c < vis; c++) {
                s->idx[c] = c;
                s->val[c] = S[c];
            }
            m = vis;
        }
        for (int64_t j = 0; j < m; j++) s->work_val[j] = s->val[j] != s->val[j] ? -(real)INFINITY : s->val[j];
        const real kth = PA_FN(sd_kth_largest)(s->work_val, m, top_k, s->tmp);
        int64_t above = 0;
        for (int64_t j = 0; j < m; j++) above += s->val[j] > kth;
        int64_t ties = top_k - above;
        /* branch-free: the next slot is written always and advances when the key is taken */
        for (int64_t j = 0; j < m && taken < top_k; j++) {
            const int tie = s->val[j] == kth && ties > 0;
            ties -= tie;
            out[taken] = (int32_t)(k0 + s->idx[j]);
            taken += (s->val[j] > kth) | tie;
        }
    }
    for (int64_t c = taken; c < top_k; c++) out[c] = -1;
    return taken;
}

static int PA_FN(dsa_select)(const pa_dsa_select_desc *d, const void *qv, const void *kv,
                             const void *wv, int32_t *rows, int64_t *count, uint8_t *nan)
{
    const real *iq = qv, *ik = kv, *iw = wv;
    const int64_t Hi = d->Hi, Di = d->Di, top_k = d->top_k, R = SD_SELECT_ROWS;
    int64_t maxk = 0, items = 0;
    double work = 0;
    int64_t *first = malloc(sizeof(int64_t) * (d->nseq + 1));
    if (!first) return PA_ENOMEM;
    first[0] = 0;
    for (int64_t n = 0; n < d->nseq; n++) {
        const int64_t tq = d->cu_q[n + 1] - d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n];
        maxk = tk > maxk ? tk : maxk;
        first[n + 1] = first[n] + (tq + R - 1) / R;
        work += (double)tq * (double)tk * (double)(Hi * Di);
    }
    items = first[d->nseq];
    const int threads = pa_threads_for(work, items);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        PA_FN(sd_select_scratch) s;
        const int64_t kb = SD_SELECT_KEYS < maxk ? SD_SELECT_KEYS : (maxk > 0 ? maxk : 1);
        void **parts[] = {(void **)&s.C,      (void **)&s.S,    (void **)&s.val,  (void **)&s.work_val,
                          (void **)&s.tmp,    (void **)&s.sample, (void **)&s.work, (void **)&s.idx};
        const size_t row = sizeof(real) * (size_t)(maxk + 1);
        const size_t bytes[] = {sizeof(real) * (size_t)(R * Hi * kb), row * R, row, row,
                                row > sizeof(real) * SD_SAMPLE ? row : sizeof(real) * SD_SAMPLE,
                                sizeof(real) * SD_SAMPLE,
                                sizeof(real) * (size_t)PA_FN(gemm_work_elems)(R * Hi, kb, Di),
                                sizeof(int64_t) * (size_t)(maxk + 1)};
        s.block = pa_alloc_parts(parts, bytes, 8);
        const int ok = pa_scratch_ok(s.block != NULL, &failed);
        int64_t n = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            while (t >= first[n + 1]) n++;
            if (!ok) continue;
            const int64_t q0 = d->cu_q[n], tq = d->cu_q[n + 1] - q0, k0 = d->cu_k[n];
            const int64_t tk = d->cu_k[n + 1] - k0, i0 = (t - first[n]) * R;
            const int64_t nr = tq - i0 < R ? tq - i0 : R, lag = tk - tq;
            /* keys visible to the tile's last query (bottom-right causal) */
            const int64_t kvis = d->causal ? i0 + nr + lag : tk;
            for (int64_t j0 = 0; j0 < kvis; j0 += kb) {
                const int64_t nb = kvis - j0 < kb ? kvis - j0 : kb;
                PA_FN(gemm)(nr * Hi, nb, Di, 1, iq + (q0 + i0) * Hi * Di, Di, 1, ik + (k0 + j0) * Di,
                            1, Di, 0, s.C, nb, s.work);
                for (int64_t r = 0; r < nr; r++) {
                    real *out = s.S + r * maxk + j0;
                    const real *w = iw + (q0 + i0 + r) * Hi;
                    for (int64_t c = 0; c < nb; c++) out[c] = 0;
                    for (int64_t j = 0; j < Hi; j++) {
                        const real *x = s.C + (r * Hi + j) * nb, wj = w[j];
                        /* relu as x < 0 ? 0 : x, so a NaN stays NaN */
                        for (int64_t c = 0; c < nb; c++) out[c] += wj * (x[c] < 0 ? 0 : x[c]);
                    }
                }
            }
            for (int64_t r = 0; r < nr; r++) {
                const int64_t row = q0 + i0 + r, vis = d->causal ? i0 + r + lag + 1 : tk;
                count[row] = PA_FN(sd_top_keys)(s.S + r * maxk, vis, top_k, k0, rows + row * top_k,
                                                nan + row, &s);
            }
        }
        free(s.block);
    }
    free(first);
    return failed ? PA_ENOMEM : PA_OK;
}

/* dsa_index_loss: per query row t over its c chosen key rows r_i (dsa_select's), the target
 * P_i = (1/H) sum_h softmax_i(scale q_th . k_{r_i}) of the main attention, the indexer's
 * scores I_i = sum_j w_tj relu(a_ji), a_ji = iq_tj . ik_{r_i}, p = softmax(I), the loss
 * KL(P || p) = sum_i P_i (log P_i - log p_i) (terms with P_i = 0 are 0) and, with dI_i =
 * grad_scale (p_i - P_i), the gradients dw_tj = sum_i dI_i relu(a_ji), diq_tj = sum_i
 * da_ji ik_{r_i} with da_ji = w_tj dI_i [a_ji > 0], dik_s = sum over the (t, i) that chose
 * s of sum_j da_ji iq_tj. A query row owns its loss, diq and diw (items: query rows); da is
 * kept [rows_q, Hi, top_k] so that the second pass, over key rows, gathers dik from the
 * rows that chose each key in query order: the same bits at any thread count, no per-thread
 * copies of dik. Work is O(rows_q top_k (H Dk + Hi Di)), never [Tq, Tk]. */
static void PA_FN(dl_row)(const pa_dsa_loss_desc *d, const real *q, const real *k,
                          const real *iq, const real *ik, const real *iw, const int32_t *keys,
                          int64_t c, real *loss, real *diq, real *diw, real *da, real *P,
                          real *I, real *A)
{
    const int64_t H = d->H, G = d->H / d->Hk, Hk = d->Hk, D = d->D, Hi = d->Hi, Di = d->Di;
    const real scale = (real)d->scale, gs = (real)d->grad_scale;
    for (int64_t i = 0; i < c; i++) P[i] = 0;
    for (int64_t h = 0; h < H; h++) {
        for (int64_t i = 0; i < c; i++)
            I[i] = scale * PA_FN(dot)(q + h * D, k + ((int64_t)keys[i] * Hk + h / G) * D, D);
        PA_FN(softmax_inplace)(I, c);
        PA_FN(axpy)(P, I, c, (real)1 / (real)H);
    }
    for (int64_t i = 0; i < c; i++) I[i] = 0;
    for (int64_t j = 0; j < Hi; j++) {
        real *a = A + j * c;
        for (int64_t i = 0; i < c; i++) {
            a[i] = PA_FN(dot)(iq + j * Di, ik + (int64_t)keys[i] * Di, Di);
            I[i] += iw[j] * (a[i] < 0 ? 0 : a[i]); /* relu as x < 0 ? 0 : x: NaN stays NaN */
        }
    }
    const real m = PA_FN(row_max)(I, c);
    real z = 0;
    for (int64_t i = 0; i < c; i++) z += (real)exp((double)(I[i] - m));
    const real lse = m + (real)log((double)z);
    real kl = 0;
    for (int64_t i = 0; i < c; i++) {
        const real logp = I[i] - lse, p = (real)exp((double)logp);
        /* !(P <= 0): a NaN target counts, so that NaN in gives NaN out */
        if (!(P[i] <= 0)) kl += P[i] * ((real)log((double)P[i]) - logp);
        I[i] = gs * (p - P[i]); /* dI */
    }
    *loss = kl;
    for (int64_t j = 0; j < Hi; j++) {
        const real *a = A + j * c;
        real *daj = da + j * d->top_k, dw = 0;
        for (int64_t i = 0; i < c; i++) {
            dw += I[i] * (a[i] < 0 ? 0 : a[i]);
            daj[i] = a[i] > 0 ? iw[j] * I[i] : 0;
        }
        diw[j] = dw;
        real *dq = diq + j * Di;
        for (int64_t x = 0; x < Di; x++) dq[x] = 0;
        for (int64_t i = 0; i < c; i++) PA_FN(axpy)(dq, ik + (int64_t)keys[i] * Di, Di, daj[i]);
    }
}

static int PA_FN(dsa_index_loss)(const pa_dsa_loss_desc *d, const void *qv, const void *kv,
                                 const void *iqv, const void *ikv, const void *iwv,
                                 const int32_t *rows, const int64_t *count, void *lossv,
                                 void *diqv, void *dikv, void *diwv)
{
    const real *q = qv, *k = kv, *iq = iqv, *ik = ikv, *iw = iwv;
    real *loss = lossv, *diq = diqv, *dik = dikv, *diw = diwv;
    const int64_t Rq = d->Rq, Rk = d->Rk, Hi = d->Hi, Di = d->Di, top_k = d->top_k;
    /* da [Rq, Hi, top_k]; the (row, slot) pairs that chose each key row, in query order:
     * by_key[first[s] .. first[s+1]-1] */
    real *da = malloc(sizeof(real) * (size_t)(Rq * Hi * top_k + 1));
    int64_t *first = calloc((size_t)(Rk + 2), sizeof(int64_t));
    int64_t *by_key = malloc(sizeof(int64_t) * (size_t)(Rq * top_k + 1));
    if (!da || !first || !by_key) {
        free(da);
        free(first);
        free(by_key);
        return PA_ENOMEM;
    }
    for (int64_t t = 0; t < Rq; t++)
        for (int64_t i = 0; i < count[t]; i++) first[rows[t * top_k + i] + 2]++;
    for (int64_t s = 0; s < Rk; s++) first[s + 2] += first[s + 1];
    for (int64_t t = 0; t < Rq; t++)
        for (int64_t i = 0; i < count[t]; i++) by_key[first[rows[t * top_k + i] + 1]++] = t * top_k + i;
    const double work = (double)Rq * (double)top_k * (double)(d->H * d->D + 2 * Hi * Di);
    const int threads = pa_threads_for(work, Rq > Rk ? Rq : Rk);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        real *P = malloc(sizeof(real) * (size_t)(top_k * (2 + Hi) + 1));
        const int ok = pa_scratch_ok(P != NULL, &failed);
#pragma omp for schedule(dynamic, 16)
        for (int64_t t = 0; t < Rq; t++) {
            if (!ok) continue;
            PA_FN(dl_row)(d, q + t * d->H * d->D, k, iq + t * Hi * Di, ik, iw + t * Hi,
                          rows + t * top_k, count[t], loss + t, diq + t * Hi * Di, diw + t * Hi,
                          da + t * Hi * top_k, P, P + top_k, P + 2 * top_k);
        }
#pragma omp for schedule(dynamic, 16)
        for (int64_t s = 0; s < Rk; s++) {
            real *dk = dik + s * Di;
            for (int64_t e = 0; e < Di; e++) dk[e] = 0;
            if (!ok) continue;
            for (int64_t n = first[s]; n < first[s + 1]; n++) {
                const int64_t t = by_key[n] / top_k, i = by_key[n] % top_k;
                for (int64_t j = 0; j < Hi; j++)
                    PA_FN(axpy)(dk, iq + (t * Hi + j) * Di, Di, da[(t * Hi + j) * top_k + i]);
            }
        }
        free(P);
    }
    free(da);
    free(first);
    free(by_key);
    return failed ? PA_ENOMEM : PA_OK;
}

/* MoBA (moba_forward, moba_backward): every (query row, head) attends to a list of whole
 * key blocks of its sequence (the blocks it chose: causal, past ones; non-causal, its own
 * among them), and, when causal, to its own block up to its position. K and V are packed
 * once per call, per (KV head, block), in each layout the GEMMs read. Forward: items
 * (sequence, head, SB_ITEM_ROWS query rows); an item's queries are bucketed by chosen
 * block, and per block the bucket's rows are gathered into one GEMM against the block's
 * keys; the causal own block takes the item's rows that lie in it (consecutive
 * rows of q, no gather) against the keys up to the last of them, the keys after a row's
 * position masked by selection; one online softmax per query across all its blocks. The
 * scores are formed transposed (keys by queries, K the packed A operand), as the flash
 * kernel does, so that P is read in place as the A operand of P V.
 * Backward: items (KV head, block), each over the (query, head) pairs that chose the block
 * (a list built at the start) and the query rows whose own block it is: the item owns the
 * block's dK and dV rows (P and dS, queries by keys, read in place as the A operands of
 * P^T dO and dS^T Q), and adds dS K into the pairs' dQ rows: with a KV head per thread or
 * more, a thread takes whole KV heads and writes dq itself; otherwise into a buffer of its
 * thread's (the first thread's is dq), the buffers summed in thread order at the end. A masked pair
 * is an exact 0 in the GEMMs of the own block, and 0 * NaN would carry a non-finite value to
 * pairs that cannot see it: the packing notes which blocks have a non-finite K or V row,
 * and an own block whose operands are not all finite goes pair by pair over its visible
 * keys (sb_own_pairs_slow). */

#define SB_ROWS 128       /* query rows of a GEMM: S [SB_ROWS x block] stays in L2 */
#define SB_ITEM_ROWS 2048 /* query rows of a forward item: a block meets a few hundred of them */

/* The packed operands of every (KV head, block): the forward's K as an A operand [bk x D]
 * (transposed scores K Q^T) and V as a B operand [bk x D] (P V); the backward's K^T and V^T
 * as B operands [D x bk] (scores, dP) and K as a B operand [bk x D] (dQ). */
typedef struct {
    real *ka, *kt, *vt, *kr, *vr;
    int64_t *off_ka, *off_kt, *off_vt, *off_kr, *off_vr; /* [Hk * nblocks + 1] */
    unsigned char *k_finite, *v_finite;         /* [Hk * nblocks]: 1 when every row is finite
                                                   (causal; else 1) */
    void *block;
} PA_FN(sb_packs);

static int64_t PA_FN(sb_block_len)(const pa_moba_desc *d, int64_t gb)
{
    const int64_t n = d->block_seq[gb], j = gb - d->first_block[n];
    const int64_t start = d->cu_k[n] + j * d->block_size, end = d->cu_k[n + 1];
    return end - start < d->block_size ? end - start : d->block_size;
}

static int64_t PA_FN(sb_block_row)(const pa_moba_desc *d, int64_t gb)
{
    const int64_t n = d->block_seq[gb];
    return d->cu_k[n] + (gb - d->first_block[n]) * d->block_size;
}

/* Keys before sequence n's first query: query i sits at key position i + lag. */
static inline int64_t PA_FN(sb_lag)(const pa_moba_desc *d, int64_t n)
{
    return (d->cu_k[n + 1] - d->cu_k[n]) - (d->cu_q[n + 1] - d->cu_q[n]);
}

/* The unit (KV head, global block) of head h's choice j (a block of sequence n). */
static inline int64_t PA_FN(sb_unit)(const pa_moba_desc *d, int64_t n, int64_t h, int64_t j)
{
    return h / (d->H / d->Hk) * d->first_block[d->nseq] + d->first_block[n] + j;
}

/* Lays out and fills the packings a pass needs: the forward ka and vr, the backward kt, vt
 * and kr; 0 when out of memory. */
static int PA_FN(sb_pack)(PA_FN(sb_packs) * p, const pa_moba_desc *d, const real *k,
                          const real *v, int backward)
{
    const int64_t nb = d->first_block[d->nseq], units = d->Hk * nb, Dk = d->Dk, Dv = d->Dv;
    memset(p, 0, sizeof *p);
    int64_t *offs = malloc(sizeof(int64_t) * 5 * (units + 1) + 2 * (size_t)units + 1);
    if (!offs) return 0;
    p->k_finite = (unsigned char *)(offs + 5 * (units + 1));
    p->v_finite = p->k_finite + units;
    int64_t **off[] = {&p->off_ka, &p->off_kt, &p->off_vt, &p->off_kr, &p->off_vr};
    for (int x = 0; x < 5; x++) *off[x] = offs + x * (units + 1);
    int64_t tot[5] = {0, 0, 0, 0, 0};
    for (int64_t u = 0; u <= units; u++) {
        for (int x = 0; x < 5; x++) (*off[x])[u] = tot[x];
        const int64_t bk = u < units ? PA_FN(sb_block_len)(d, u % nb) : 0;
        tot[0] += backward ? 0 : PA_FN(packed_a_elems)(bk, Dk);
        tot[1] += backward ? PA_FN(packed_b_elems)(Dk, bk) : 0;
        tot[2] += backward ? PA_FN(packed_b_elems)(Dv, bk) : 0;
        tot[3] += backward ? PA_FN(packed_b_elems)(bk, Dk) : 0;
        tot[4] += backward ? 0 : PA_FN(packed_b_elems)(bk, Dv);
    }
    void **parts[] = {(void **)&p->ka, (void **)&p->kt, (void **)&p->vt, (void **)&p->kr, (void **)&p->vr};
    size_t bytes[5];
    for (int x = 0; x < 5; x++) bytes[x] = sizeof(real) * (size_t)(tot[x] + 1);
    if (!(p->block = pa_alloc_parts(parts, bytes, 5))) {
        free(offs);
        return 0;
    }
    const int64_t ldk = d->Hk * Dk, ldv = d->Hk * Dv;
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t u = 0; u < units; u++) {
        const int64_t kh = u / nb, gb = u % nb, bk = PA_FN(sb_block_len)(d, gb);
        const real *K = k + PA_FN(sb_block_row)(d, gb) * ldk + kh * Dk;
        const real *V = v + PA_FN(sb_block_row)(d, gb) * ldv + kh * Dv;
        int kf = 1, vf = 1; /* read by the causal own block only */
        for (int64_t x = 0; d->causal && x < bk; x++) {
            kf &= PA_FN(sm_all_finite)(K + x * ldk, Dk);
            vf &= PA_FN(sm_all_finite)(V + x * ldv, Dv);
        }
        p->k_finite[u] = (unsigned char)kf;
        p->v_finite[u] = (unsigned char)vf;
        if (backward) {
            PA_FN(pack_b)(Dk, bk, K, 1, ldk, p->kt + p->off_kt[u]);
            PA_FN(pack_b)(Dv, bk, V, 1, ldv, p->vt + p->off_vt[u]);
            PA_FN(pack_b)(bk, Dk, K, ldk, 1, p->kr + p->off_kr[u]);
        } else {
            PA_FN(pack_a)(bk, Dk, K, ldk, 1, p->ka + p->off_ka[u]);
            PA_FN(pack_b)(bk, Dv, V, ldv, 1, p->vr + p->off_vr[u]);
        }
    }
    return 1;
}

static void PA_FN(sb_packs_free)(PA_FN(sb_packs) * p)
{
    free(p->block);
    free(p->off_ka);
}

/* Leading dimensions of the score tiles, each rounded up to MR: the GEMM that takes a tile
 * as its A operand in place reads whole panels. Forward: S^T [block x SB_LDS] (keys by
 * queries); backward: S and dP [SB_ROWS x sb_ldb] (queries by keys). */
#define SB_LDS ((SB_ROWS + MR - 1) / MR * MR)
static inline int64_t PA_FN(sb_ldb)(const pa_moba_desc *d) { return (d->block_size + MR - 1) / MR * MR; }

/* Per-thread scratch: gathered rows Q [SB_ROWS x Dk], dO [SB_ROWS x Dv] and their packings
 * as B operands (Q^T or Q, dO), the score tiles S and dP, an output T [SB_ROWS x
 * max(Dk, Dv)], a forward item's accumulators O, m, l [SB_ITEM_ROWS] and a GEMM's share of
 * them (cm: m, l, new max, finite max [SB_ROWS each]), the bucketing (count per block,
 * order), and the GEMMs' workspace. */
typedef struct {
    real *Q, *dO, *Qb, *dOb, *S, *dP, *T, *O, *m, *l, *cm, *dKb, *dVb, *work;
    int64_t *cnt, *order, *pos;
    void *block;
} PA_FN(sb_scratch);

static int PA_FN(sb_scratch_alloc)(PA_FN(sb_scratch) * s, const pa_moba_desc *d, int64_t maxnb)
{
    const int64_t R = SB_ROWS, RI = SB_ITEM_ROWS, bs = d->block_size, D = d->Dk > d->Dv ? d->Dk : d->Dv;
    /* a row lists each block once (moba_desc checks): maxnb pairs at most, whatever slots */
    const int64_t cap = maxnb > 0 ? maxnb : 1, slots = d->slots < 1 ? 1 : (d->slots < cap ? d->slots : cap);
    const int64_t ldb = PA_FN(sb_ldb)(d);
    const int64_t tile = R * ldb > bs * SB_LDS ? R * ldb : bs * SB_LDS;
    int64_t w = PA_FN(gemm_work_elems)(R, bs, D), w2 = PA_FN(gemm_work_elems)(R, D, bs);
    w = w > w2 ? w : w2;
    const int64_t qb = PA_FN(packed_b_elems)(R, D) > PA_FN(packed_b_elems)(D, R)
                           ? PA_FN(packed_b_elems)(R, D) : PA_FN(packed_b_elems)(D, R);
    void **parts[] = {(void **)&s->Q,   (void **)&s->dO,  (void **)&s->Qb,   (void **)&s->dOb,
                      (void **)&s->S,   (void **)&s->dP,  (void **)&s->T,    (void **)&s->O,
                      (void **)&s->m,   (void **)&s->l,   (void **)&s->cm,   (void **)&s->dKb,
                      (void **)&s->dVb, (void **)&s->work, (void **)&s->cnt, (void **)&s->order,
                      (void **)&s->pos};
    const size_t bytes[] = {sizeof(real) * R * d->Dk,  sizeof(real) * R * d->Dv,
                            sizeof(real) * qb,         sizeof(real) * qb,
                            sizeof(real) * tile,       sizeof(real) * tile,
                            sizeof(real) * R * D,      sizeof(real) * RI * D,
                            sizeof(real) * RI,         sizeof(real) * RI,
                            sizeof(real) * 4 * R,      sizeof(real) * bs * d->Dk,
                            sizeof(real) * bs * d->Dv, sizeof(real) * w,
                            sizeof(int64_t) * (maxnb + 1), sizeof(int64_t) * RI * slots,
                            sizeof(int64_t) * RI * slots};
    s->block = pa_alloc_parts(parts, bytes, 17);
    if (!s->block) return 0;
    /* the panels' columns past a GEMM's rows are read (never stored): keep them defined */
    memset(s->S, 0, sizeof(real) * tile);
    memset(s->dP, 0, sizeof(real) * tile);
    return 1;
}

/* The item's (row, slot) pairs bucketed by chosen block: s->cnt[j] .. s->cnt[j+1] of
 * s->order hold the local rows (r) that chose block j of the sequence, ascending. */
static void PA_FN(sb_bucket)(const pa_moba_desc *d, const int32_t *choice, int64_t row0,
                             int64_t nr, int64_t h, int64_t nbs, PA_FN(sb_scratch) * s)
{
    const int64_t S = d->slots, H = d->H;
    memset(s->cnt, 0, sizeof(int64_t) * (nbs + 1));
    for (int64_t r = 0; r < nr; r++)
        for (int64_t t = 0; t < S; t++) {
            const int32_t j = choice[((row0 + r) * H + h) * S + t];
            if (j >= 0) s->cnt[j + 1]++;
        }
    for (int64_t j = 0; j < nbs; j++) s->cnt[j + 1] += s->cnt[j];
    memcpy(s->pos, s->cnt, sizeof(int64_t) * nbs);
    for (int64_t r = 0; r < nr; r++)
        for (int64_t t = 0; t < S; t++) {
            const int32_t j = choice[((row0 + r) * H + h) * S + t];
            if (j >= 0) s->order[s->pos[j]++] = r;
        }
}

/* 1 when (query, head) `row` (of q's rows times heads) chose some block. */
static inline int PA_FN(sb_chose)(const pa_moba_desc *d, const int32_t *choice, int64_t row)
{
    for (int64_t t = 0; t < d->slots; t++)
        if (choice[row * d->slots + t] >= 0) return 1;
    return 0;
}

/* The flash kernel's online softmax (sm_softmax_columns) for the mj gathered item rows
 * rows[c] over one block's transposed scores s->S: their m and l gathered, updated and put
 * back. */
static void PA_FN(sb_softmax_gathered)(PA_FN(sb_scratch) * s, int64_t bk, int64_t mj,
                                       const int64_t *rows, int64_t Dv)
{
    real *m = s->cm, *l = m + SB_ROWS;
    for (int64_t c = 0; c < mj; c++) {
        m[c] = s->m[rows[c]];
        l[c] = s->l[rows[c]];
    }
    PA_FN(sm_softmax_columns)(s->S, SB_LDS, bk, mj, m, l, s->O, rows, Dv, l + SB_ROWS,
                              l + 2 * SB_ROWS);
    for (int64_t c = 0; c < mj; c++) {
        s->m[rows[c]] = m[c];
        s->l[rows[c]] = l[c];
    }
}

/* The query rows [ra, rb) of item rows 0 .. nr-1 (position base + r in the sequence's keys)
 * that lie in block j, and the keys of j that row ra sees; 0 when none lie in it. */
static inline int64_t PA_FN(sb_own_rows)(int64_t base, int64_t nr, int64_t j, int64_t bs,
                                         int64_t *ra, int64_t *rb)
{
    *ra = j * bs - base > 0 ? j * bs - base : 0;
    *rb = (j + 1) * bs - base < nr ? (j + 1) * bs - base : nr;
    return *rb > *ra ? base + *ra - j * bs + 1 : 0;
}

/* S^T = scale K Q^T [bk x mj] of unit u's first bk keys and the mj queries packed in s->Qb,
 * into s->S. */
static inline void PA_FN(sb_scores_t)(const pa_moba_desc *d, const PA_FN(sb_packs) * p, int64_t u,
                                      int64_t bk, int64_t mj, PA_FN(sb_scratch) * s)
{
    PA_FN(gemm_packed_ab)(bk, mj, d->Dk, (real)d->scale, p->ka + p->off_ka[u], MR * d->Dk, MR,
                          s->Qb, d->Dk * NR, 0, s->S, SB_LDS);
}

/* The own block j (unit u) of the item's rows [ra, rb): S^T = scale K Q^T over the keys the
 * last of them sees, the later keys of each row masked, the online softmax, O += P V. */
static void PA_FN(sb_forward_own)(const pa_moba_desc *d, const PA_FN(sb_packs) * p,
                                  const real *q, const real *v, int64_t h, int64_t row0,
                                  int64_t ra, int64_t rb, int64_t vis0, int64_t u, int64_t gb,
                                  PA_FN(sb_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, kh = h / (H / Hk);
    const int64_t mj = rb - ra, bk = vis0 + mj - 1, bkfull = PA_FN(sb_block_len)(d, gb);
    PA_FN(pack_b)(Dk, mj, q + ((row0 + ra) * H + h) * Dk, 1, H * Dk, s->Qb);
    PA_FN(sb_scores_t)(d, p, u, bk, mj, s);
    for (int64_t x = vis0; x < bk; x++) /* key x is hidden from rows c <= x - vis0 */
        for (int64_t c = 0; c <= x - vis0 && c < mj; c++) s->S[x * SB_LDS + c] = -(real)INFINITY;
    PA_FN(sm_softmax_columns)(s->S, SB_LDS, bk, mj, s->m + ra, s->l + ra, s->O + ra * Dv, NULL, Dv,
                              s->cm, s->cm + SB_ROWS);
    if (p->v_finite[u]) {
        PA_FN(gemm_packed_ab)(mj, Dv, bk, 1, s->S, MR, SB_LDS, p->vr + p->off_vr[u], bkfull * NR,
                              1, s->O + ra * Dv, Dv);
        return;
    }
    const real *V = v + PA_FN(sb_block_row)(d, gb) * Hk * Dv + kh * Dv;
    for (int64_t c = 0; c < mj; c++) /* visible keys only: no 0 * NaN from the masked ones */
        for (int64_t x = 0; x < vis0 + c; x++)
            PA_FN(axpy)(s->O + (ra + c) * Dv, V + x * Hk * Dv, Dv, s->S[x * SB_LDS + c]);
}

/* Forward of one item: sequence n, head h, query rows row0 .. row0+nr-1. */
static void PA_FN(sb_forward_item)(const pa_moba_desc *d, const PA_FN(sb_packs) * p,
                                   const real *q, const real *v, const int32_t *choice, int64_t n,
                                   int64_t h, int64_t row0, int64_t nr, real *o, real *lse,
                                   PA_FN(sb_scratch) * s)
{
    const int64_t H = d->H, Dk = d->Dk, Dv = d->Dv, kh = h / (H / d->Hk);
    const int64_t fb = d->first_block[n], nbs = d->first_block[n + 1] - fb, nb = d->first_block[d->nseq];
    for (int64_t r = 0; r < nr; r++) {
        s->m[r] = -(real)INFINITY;
        s->l[r] = 0;
    }
    memset(s->O, 0, sizeof(real) * nr * Dv);
    PA_FN(sb_bucket)(d, choice, row0, nr, h, nbs, s);
    for (int64_t j = 0; j < nbs; j++)
    for (int64_t a = s->cnt[j]; a < s->cnt[j + 1]; a += SB_ROWS) {
        const int64_t mj = s->cnt[j + 1] - a < SB_ROWS ? s->cnt[j + 1] - a : SB_ROWS;
        const int64_t u = kh * nb + fb + j, bk = PA_FN(sb_block_len)(d, fb + j);
        for (int64_t c = 0; c < mj; c++)
            memcpy(s->Q + c * Dk, q + ((row0 + s->order[a + c]) * H + h) * Dk, sizeof(real) * Dk);
        PA_FN(pack_b)(Dk, mj, s->Q, 1, Dk, s->Qb);
        PA_FN(sb_scores_t)(d, p, u, bk, mj, s);
        PA_FN(sb_softmax_gathered)(s, bk, mj, s->order + a, Dv);
        PA_FN(gemm_packed_ab)(mj, Dv, bk, 1, s->S, MR, SB_LDS, p->vr + p->off_vr[u], bk * NR, 0,
                              s->T, Dv);
        for (int64_t c = 0; c < mj; c++)
            PA_FN(axpy)(s->O + s->order[a + c] * Dv, s->T + c * Dv, Dv, 1);
    }
    if (d->causal) {
        const int64_t bs = d->block_size;
        const int64_t base = row0 - d->cu_q[n] + PA_FN(sb_lag)(d, n);
        for (int64_t j = base / bs; j <= (base + nr - 1) / bs; j++) {
            int64_t ra, rb;
            const int64_t vis0 = PA_FN(sb_own_rows)(base, nr, j, bs, &ra, &rb);
            if (!vis0) continue;
            for (int64_t a = ra; a < rb; a += SB_ROWS)
                PA_FN(sb_forward_own)(d, p, q, v, h, row0, a, rb - a < SB_ROWS ? rb : a + SB_ROWS,
                                      vis0 + a - ra, kh * nb + fb + j, fb + j, s);
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        const int64_t row = (row0 + r) * H + h;
        PA_FN(sm_write_row)(o + row * Dv, lse + row, s->O + r * Dv, Dv, s->m[r], s->l[r],
                            d->causal || PA_FN(sb_chose)(d, choice, row));
    }
}

/* Items (sequence, head, SB_ITEM_ROWS query rows): *count, and first[n] the first of
 * sequence n. */
static int64_t *PA_FN(sb_items)(const pa_moba_desc *d, int64_t *count)
{
    int64_t *first = malloc(sizeof(int64_t) * (d->nseq + 1));
    if (!first) return NULL;
    first[0] = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        first[n + 1] = first[n] + (d->cu_q[n + 1] - d->cu_q[n] + SB_ITEM_ROWS - 1) / SB_ITEM_ROWS * d->H;
    *count = first[d->nseq];
    return first;
}

static int64_t PA_FN(sb_max_blocks)(const pa_moba_desc *d)
{
    int64_t mx = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        mx = d->first_block[n + 1] - d->first_block[n] > mx ? d->first_block[n + 1] - d->first_block[n] : mx;
    return mx;
}

/* 1 when x comes before y in ascending order with NaN last (a stable sort then keeps the
 * lower index first among equals). */
static inline int PA_FN(sb_before)(real x, real y)
{
    if (x != x) return 0;
    return y != y || x < y;
}

/* MoBA's choice: for every (query row, head), the d->slots blocks of its sequence first in a
 * stable ascending sort of -q.mean(k_block) (causal: the blocks at and after the query's own
 * count as +inf, and are dropped once chosen, so a query before its slots' worth of past
 * blocks takes all it has; non-causal: the query's own block comes first whatever its score,
 * then the others in that order), -1 after them. */
static int PA_FN(moba_select)(const pa_moba_desc *d, const void *qv, const void *kmv, int32_t *choice)
{
    const real *q = qv, *km = kmv;
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, G = H / Hk, S = d->slots, bs = d->block_size;
    const int64_t rows = d->cu_q[d->nseq], maxnb = PA_FN(sb_max_blocks)(d), width = S > 0 ? S : 1;
    const double work = (double)rows * (double)H * (double)maxnb * (double)(Dk + S);
    int failed = 0;
#pragma omp parallel num_threads(pa_threads_for(work, rows))
    {
        real *x = malloc(sizeof(real) * (size_t)(maxnb + 1));
        unsigned char *taken = malloc((size_t)maxnb + 1);
        const int ok = pa_scratch_ok(x && taken, &failed);
        int64_t n = 0;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (!ok) continue;
            while (row >= d->cu_q[n + 1]) n++; /* rows ascend within a thread's share */
            const int64_t fb = d->first_block[n], nbs = d->first_block[n + 1] - fb;
            const int64_t own = (row - d->cu_q[n] + PA_FN(sb_lag)(d, n)) / bs;
            const int64_t limit = d->causal ? own : nbs;
            for (int64_t h = 0; h < H; h++) {
                const real *qh = q + (row * H + h) * Dk;
                int32_t *out = choice + (row * H + h) * width;
                for (int64_t j = 0; j < nbs; j++) {
                    x[j] = j < limit ? -PA_FN(dot)(qh, km + ((fb + j) * Hk + h / G) * Dk, Dk) : (real)INFINITY;
                    taken[j] = 0;
                }
                for (int64_t s = 0; s < width; s++) out[s] = -1;
                int64_t got = 0;
                if (!d->causal && S > 0) { /* MoBA's rule: the own block always, for locality */
                    taken[own] = 1;
                    out[got++] = (int32_t)own;
                }
                for (int64_t s = got; s < S && s < nbs; s++) {
                    int64_t best = -1;
                    for (int64_t j = 0; j < nbs; j++)
                        if (!taken[j] && (best < 0 || PA_FN(sb_before)(x[j], x[best]))) best = j;
                    taken[best] = 1;
                    if (best < limit) out[got++] = (int32_t)best;
                }
            }
        }
        free(x);
        free(taken);
    }
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(moba_forward)(const pa_moba_desc *d, const void *qv, const void *kv,
                               const void *vv, const int32_t *choice, void *ov, void *lsev)
{
    const real *q = qv;
    real *o = ov, *lse = lsev;
    PA_FN(sb_packs) p;
    int64_t items;
    int64_t *first = PA_FN(sb_items)(d, &items);
    if (!first) return PA_ENOMEM;
    if (!PA_FN(sb_pack)(&p, d, kv, vv, 0)) {
        free(first);
        return PA_ENOMEM;
    }
    const int64_t maxnb = PA_FN(sb_max_blocks)(d);
    double work = (double)d->cu_q[d->nseq] * (double)d->H * ((double)d->slots + 0.5 * d->causal) *
                  (double)d->block_size * (double)(d->Dk + d->Dv);
    int failed = 0;
#pragma omp parallel num_threads(pa_threads_for(work, items))
    {
        PA_FN(sb_scratch) s;
        const int ok = pa_scratch_ok(PA_FN(sb_scratch_alloc)(&s, d, maxnb), &failed);
        int64_t n = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            while (t >= first[n + 1]) n++;
            const int64_t local = t - first[n], h = local % d->H, c = local / d->H;
            const int64_t row0 = d->cu_q[n] + c * SB_ITEM_ROWS, end = d->cu_q[n + 1];
            if (ok)
                PA_FN(sb_forward_item)(d, &p, q, vv, choice, n, h, row0,
                                       end - row0 < SB_ITEM_ROWS ? end - row0 : SB_ITEM_ROWS, o, lse, &s);
        }
        if (ok) free(s.block);
    }
    PA_FN(sb_packs_free)(&p);
    free(first);
    return failed ? PA_ENOMEM : PA_OK;
}

/* P = exp(S - lse) and dS = scale P (dP - D) for the mj rows (their lse and D at lse_of[c],
 * D_of[c]), S and dP [mj x bk], ldb apart; S becomes P, dP becomes dS. Row c sees the first
 * vis0 + c keys (all with vis0 >= bk); the others get an exact 0 in both. */
static void PA_FN(sb_grad_scores)(real *S, real *dP, int64_t mj, int64_t bk, int64_t ldb,
                                  const real *lse_of, const real *D_of, real scale, int64_t vis0)
{
    const vreal vs = PA_FN(vset)(scale);
    for (int64_t c = 0; c < mj; c++) {
        real *p = S + c * ldb, *dp = dP + c * ldb;
        const int64_t vis = vis0 + c < bk ? vis0 + c : bk;
        const vreal vl = PA_FN(vset)(lse_of[c]), vd = PA_FN(vset)(D_of[c]);
        int64_t x = 0;
        for (; x + VL <= vis; x += VL) { /* one pass: P and dS of VL keys */
            const vreal pv = PA_FN(vexp_nonpos)(PA_FN(vload)(p + x) - vl);
            PA_FN(vstore)(p + x, pv);
            PA_FN(vstore)(dp + x, vs * pv * (PA_FN(vload)(dp + x) - vd));
        }
        if (x < vis) {
            const int r = (int)(vis - x);
            const vreal pv = PA_FN(vexp_nonpos)(PA_FN(vload_part)(p + x, r, 0) - vl);
            PA_FN(vstore_part)(p + x, pv, r);
            PA_FN(vstore_part)(dp + x, vs * pv * (PA_FN(vload_part)(dp + x, r, 0) - vd), r);
        }
        for (x = vis; x < bk; x++) p[x] = dp[x] = 0;
    }
}

/* mj queries' share of unit u's backward against its first bk keys (bkfull in all): Q and
 * dO rows lq and ldo apart, their lse and D in s->m and s->l, row c seeing the first vis0 + c
 * keys. P and dS recomputed, dV += P^T dO and dK += dS^T Q into s->dVb and s->dKb (P and dS
 * read in place as the A operand), dS K into dq (rows lq apart; added when beta is 1). */
static void PA_FN(sb_backward_tile)(const pa_moba_desc *d, const PA_FN(sb_packs) * p, int64_t u,
                                    const real *Q, int64_t lq, const real *dO, int64_t ldo,
                                    int64_t mj, int64_t bk, int64_t bkfull, int64_t vis0,
                                    real *dq, real beta, PA_FN(sb_scratch) * s)
{
    const int64_t Dk = d->Dk, Dv = d->Dv, ldb = PA_FN(sb_ldb)(d);
    PA_FN(gemm_packed_b)(mj, bk, Dk, (real)d->scale, Q, lq, 1, p->kt + p->off_kt[u], Dk * NR, 0,
                         s->S, ldb, s->work);
    PA_FN(gemm_packed_b)(mj, bk, Dv, 1, dO, ldo, 1, p->vt + p->off_vt[u], Dv * NR, 0, s->dP, ldb,
                         s->work);
    PA_FN(sb_grad_scores)(s->S, s->dP, mj, bk, ldb, s->m, s->l, (real)d->scale, vis0);
    PA_FN(pack_b)(mj, Dv, dO, ldo, 1, s->dOb);
    PA_FN(gemm_packed_ab)(bk, Dv, mj, 1, s->S, MR, ldb, s->dOb, mj * NR, 1, s->dVb, Dv);
    PA_FN(pack_b)(mj, Dk, Q, lq, 1, s->Qb);
    PA_FN(gemm_packed_ab)(bk, Dk, mj, 1, s->dP, MR, ldb, s->Qb, mj * NR, 1, s->dKb, Dk);
    PA_FN(gemm_packed_b)(mj, Dk, bk, 1, s->dP, ldb, 1, p->kr + p->off_kr[u], bkfull * NR, beta, dq,
                         lq, s->work);
}

/* The own block's part of unit u's backward, pair by pair over the visible keys: for an own
 * block with a non-finite K row or a non-finite row of Q or dO among its queries. */
static void PA_FN(sb_own_pairs_slow)(const pa_moba_desc *d, const real *Q, const real *dO,
                                     const real *K, const real *V, int64_t mj, int64_t vis0,
                                     real *dqr, PA_FN(sb_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv;
    const real scale = (real)d->scale;
    for (int64_t c = 0; c < mj; c++) {
        const real *qc = Q + c * H * Dk, *doc = dO + c * H * Dv;
        for (int64_t x = 0; x < vis0 + c; x++) {
            const real *kx = K + x * Hk * Dk, *vx = V + x * Hk * Dv;
            const real pr = (real)exp((double)(scale * PA_FN(dot)(qc, kx, Dk)) - (double)s->m[c]);
            const real ds = scale * pr * (PA_FN(dot)(doc, vx, Dv) - s->l[c]);
            PA_FN(axpy)(s->dVb + x * Dv, doc, Dv, pr);
            PA_FN(axpy)(s->dKb + x * Dk, qc, Dk, ds);
            PA_FN(axpy)(dqr + c * H * Dk, kx, Dk, ds);
        }
    }
}

/* The own block's part of unit u's backward: the query rows row .. row+mj-1 of head h, row c
 * seeing the block's first vis0 + c keys; dK and dV into the unit's dKb, dVb, dS K into dq. */
static void PA_FN(sb_own_backward)(const pa_moba_desc *d, const PA_FN(sb_packs) * p,
                                   const real *q, const real *k, const real *v, const real *dout,
                                   const real *lse, const real *Dr, int64_t u, int64_t h,
                                   int64_t row, int64_t mj, int64_t vis0, real *dq,
                                   PA_FN(sb_scratch) * s)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, Dv = d->Dv, nb = d->first_block[d->nseq];
    const int64_t kh = u / nb, gb = u % nb, bkfull = PA_FN(sb_block_len)(d, gb), bk = vis0 + mj - 1;
    const real *Q = q + (row * H + h) * Dk, *dO = dout + (row * H + h) * Dv;
    real *dqr = dq + (row * H + h) * Dk;
    int finite = p->k_finite[u];
    for (int64_t c = 0; c < mj; c++) {
        s->m[c] = lse[(row + c) * H + h];
        s->l[c] = Dr[(row + c) * H + h];
        finite = finite && PA_FN(sm_all_finite)(Q + c * H * Dk, Dk) &&
                 PA_FN(sm_all_finite)(dO + c * H * Dv, Dv);
    }
    if (!finite) {
        const int64_t r0 = PA_FN(sb_block_row)(d, gb);
        PA_FN(sb_own_pairs_slow)(d, Q, dO, k + (r0 * Hk + kh) * Dk, v + (r0 * Hk + kh) * Dv, mj,
                                 vis0, dqr, s);
        return;
    }
    PA_FN(sb_backward_tile)(d, p, u, Q, H * Dk, dO, H * Dv, mj, bk, bkfull, vis0, dqr, 1, s);
}

/* The backward of block unit u (KV head, block) over the (query, head) pairs that chose it,
 * pairs[0, m), SB_ROWS at a time, and (causal) the query rows whose own block it is: P and
 * dS recomputed, dV += P^T dO, dK += dS^T Q (the unit's own rows of dk, dv, written), and dS
 * K added into the pairs' rows of dq. */
static void PA_FN(sb_backward_unit)(const pa_moba_desc *d, const PA_FN(sb_packs) * p,
                                    const real *q, const real *k, const real *v, const real *dout,
                                    const real *lse, const real *Dr, const int64_t *pairs,
                                    int64_t m, int64_t u, real *dq, real *dk, real *dv,
                                    PA_FN(sb_scratch) * s)
{
    const int64_t Dk = d->Dk, Dv = d->Dv, Hk = d->Hk, nb = d->first_block[d->nseq];
    const int64_t kh = u / nb, gb = u % nb, bk = PA_FN(sb_block_len)(d, gb);
    memset(s->dKb, 0, sizeof(real) * bk * Dk);
    memset(s->dVb, 0, sizeof(real) * bk * Dv);
    for (int64_t c0 = 0; c0 < m; c0 += SB_ROWS) {
        const int64_t mj = m - c0 < SB_ROWS ? m - c0 : SB_ROWS;
        for (int64_t c = 0; c < mj; c++) {
            const int64_t row = pairs[c0 + c];
            memcpy(s->Q + c * Dk, q + row * Dk, sizeof(real) * Dk);
            memcpy(s->dO + c * Dv, dout + row * Dv, sizeof(real) * Dv);
            s->m[c] = lse[row];
            s->l[c] = Dr[row];
        }
        PA_FN(sb_backward_tile)(d, p, u, s->Q, Dk, s->dO, Dv, mj, bk, bk, bk, s->T, 0, s);
        for (int64_t c = 0; c < mj; c++) PA_FN(axpy)(dq + pairs[c0 + c] * Dk, s->T + c * Dk, Dk, 1);
    }
    if (d->causal) {
        const int64_t n = d->block_seq[gb], bs = d->block_size, G = d->H / Hk;
        const int64_t j0 = (gb - d->first_block[n]) * bs;
        const int64_t lag = PA_FN(sb_lag)(d, n);
        /* the block's query rows: local rows i0 .. i1-1, at positions i + lag */
        const int64_t i0 = j0 - lag > 0 ? j0 - lag : 0, i1 = j0 + bk - lag;
        for (int64_t g = 0; g < G; g++)
            for (int64_t a = i0; a < i1; a += SB_ROWS)
                PA_FN(sb_own_backward)(d, p, q, k, v, dout, lse, Dr, u, kh * G + g, d->cu_q[n] + a,
                                       i1 - a < SB_ROWS ? i1 - a : SB_ROWS, a + lag - j0 + 1, dq, s);
    }
    const int64_t r0 = PA_FN(sb_block_row)(d, gb);
    for (int64_t x = 0; x < bk; x++) {
        memcpy(dk + ((r0 + x) * Hk + kh) * Dk, s->dKb + x * Dk, sizeof(real) * Dk);
        memcpy(dv + ((r0 + x) * Hk + kh) * Dv, s->dVb + x * Dv, sizeof(real) * Dv);
    }
}

static int PA_FN(moba_backward)(const pa_moba_desc *d, const void *qv, const void *kv,
                                const void *vv, const void *ov, const void *lsev,
                                const void *doutv, const void *dlsev, const int32_t *choice,
                                void *dqv, void *dkv, void *dvv)
{
    const real *q = qv, *o = ov, *lse = lsev, *dout = doutv, *dlse = dlsev;
    real *dq = dqv, *dk = dkv, *dv = dvv;
    const int64_t H = d->H, Hk = d->Hk, S = d->slots, rows = d->cu_q[d->nseq];
    const int64_t nb = d->first_block[d->nseq], units = Hk * nb;
    /* every unit runs, and writes its block's dK and dV rows (zeros where no query chose it) */
    real *Dr = pa_alloc(sizeof(real) * (size_t)(rows * H + 1));
    int64_t *ucnt = malloc(sizeof(int64_t) * (units + 1)), *pairs = NULL, *fill = NULL;
    int64_t npairs = 0;
    for (int64_t x = 0; x < rows * H * S; x++) npairs += choice[x] >= 0;
    pairs = malloc(sizeof(int64_t) * (npairs + 1));
    fill = malloc(sizeof(int64_t) * (units + 1));
    PA_FN(sb_packs) p;
    int packed = Dr && ucnt && pairs && fill && PA_FN(sb_pack)(&p, d, kv, vv, 1);
    if (!packed) {
        free(Dr);
        free(ucnt);
        free(pairs);
        free(fill);
        return PA_ENOMEM;
    }
    /* the pairs of each unit, (query, head) rows ascending */
    memset(ucnt, 0, sizeof(int64_t) * (units + 1));
    for (int64_t n = 0, row = 0; row < rows; row++) {
        while (row >= d->cu_q[n + 1]) n++;
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < S; t++) {
                const int32_t j = choice[(row * H + h) * S + t];
                if (j >= 0) ucnt[PA_FN(sb_unit)(d, n, h, j) + 1]++;
            }
    }
    for (int64_t u = 0; u < units; u++) ucnt[u + 1] += ucnt[u];
    memcpy(fill, ucnt, sizeof(int64_t) * units);
    for (int64_t n = 0, row = 0; row < rows; row++) {
        while (row >= d->cu_q[n + 1]) n++;
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < S; t++) {
                const int32_t j = choice[(row * H + h) * S + t];
                if (j >= 0) pairs[fill[PA_FN(sb_unit)(d, n, h, j)]++] = row * H + h;
            }
    }
    const int64_t maxnb = PA_FN(sb_max_blocks)(d), nq = rows * H * d->Dk;
    double work = ((double)npairs + 0.5 * d->causal * (double)(rows * H)) * (double)d->block_size *
                  (double)(d->Dk + d->Dv) * 2.5;
    const int threads = pa_threads_for(work, units);
    /* With a KV head per thread or more, a thread takes whole KV heads, whose query heads'
     * dQ rows no other thread touches. Otherwise threads 1 .. threads-1 add their dQ into
     * buffers of their own, summed in thread order. */
    const int by_head = Hk >= threads;
    real *extra = threads > 1 && !by_head ? pa_alloc(sizeof(real) * (size_t)((threads - 1) * nq)) : NULL;
    int failed = threads > 1 && !by_head && !extra;
    memset(dq, 0, sizeof(real) * (size_t)nq);
#pragma omp parallel num_threads(threads) if (!failed)
    if (!failed) {
        const int tid = pa_thread_id();
        real *mine = tid && extra ? extra + (tid - 1) * nq : dq;
        if (mine != dq) memset(mine, 0, sizeof(real) * (size_t)nq);
        PA_FN(sb_scratch) s;
        const int ok = pa_scratch_ok(PA_FN(sb_scratch_alloc)(&s, d, maxnb), &failed);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows * H; r++)
            Dr[r] = PA_FN(dot)(dout + r * d->Dv, o + r * d->Dv, d->Dv) - (dlse ? dlse[r] : 0);
        /* work w: by KV head (its blocks in order: the same bits for any thread count), or one
         * unit; dealt round robin, so a thread's dQ buffer gets the same units on every run */
        const int64_t per = by_head && nb > 0 ? nb : 1;
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < units / per; w++)
            for (int64_t u = w * per; ok && u < (w + 1) * per; u++)
                PA_FN(sb_backward_unit)(d, &p, q, kv, vv, dout, lse, Dr, pairs + ucnt[u],
                                        ucnt[u + 1] - ucnt[u], u, mine, dk, dv, &s);
        if (ok) free(s.block);
        if (extra) PA_FN(sd_sum_parts)(dq, extra, nq, threads - 1, nq);
    }
    free(extra);
    PA_FN(sb_packs_free)(&p);
    free(Dr);
    free(ucnt);
    free(pairs);
    free(fill);
    return failed ? PA_ENOMEM : PA_OK;
}
