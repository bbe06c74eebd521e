/* The pieces of softmax attention that work a query row at a time, which the sparse
 * attention kernels (ops/sparse_attn.c) share with ops/softmax_attn.c: the keys a query
 * sees, the score transform, the online softmax's step and the finished row, and the
 * decode's key rows, scores, P V product and scratch. Template body (see core/dtype.h); needs
 * core/vmath.h and core/gemm.c before it. */

#define SM_DECODE_KB 64 /* keys per block of the decode path */

/* Keys visible to the query at bottom-right-aligned position ip: the window [lo, hi]
 * (empty when hi < lo) and the sinks [0, shi). Written so that no sum overflows for any
 * window or sinks value up to INT64_MAX: a bound beyond the keys is compared, never added. */
static inline void PA_FN(sm_bounds)(const pa_softmax_desc *d, int64_t ip, int64_t tk,
                                    int64_t *lo, int64_t *hi, int64_t *shi)
{
    int64_t chi = d->causal ? (ip < tk - 1 ? ip : tk - 1) : tk - 1;
    int64_t wl = d->window_left, wr = d->window_right;
    *lo = wl < 0 || wl >= ip ? 0 : ip - wl;
    *hi = wr < 0 || wr >= chi - ip ? chi : ip + wr;
    *shi = d->sinks < chi + 1 ? d->sinks : chi + 1;
}

/* The keys of [j0, j1) visible to the query at ip, relative to j0: the sinks [r[0][0],
 * r[0][1]), then the window [r[1][0], r[1][1]), in order and disjoint, either maybe empty. */
static inline void PA_FN(sm_row_ranges)(const pa_softmax_desc *d, int64_t ip, int64_t tk,
                                        int64_t j0, int64_t j1, int64_t r[2][2])
{
    int64_t lo, hi, shi;
    PA_FN(sm_bounds)(d, ip, tk, &lo, &hi, &shi);
    int64_t sinks_end = shi < j0 ? j0 : shi < j1 ? shi : j1;
    int64_t start = lo > sinks_end ? lo : sinks_end;
    start = start < j1 ? start : j1;
    int64_t end = hi + 1 < start ? start : hi + 1 < j1 ? hi + 1 : j1;
    r[0][0] = 0;
    r[0][1] = sinks_end - j0;
    r[1][0] = start - j0;
    r[1][1] = end - j0;
}

/* 1 when the n values at x are all finite: x - x is 0 for finite x, NaN for inf and NaN. */
static inline int PA_FN(sm_all_finite)(const real *x, int64_t n)
{
    vreal acc = PA_FN(vset)(0);
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vreal v = PA_FN(vload)(x + i);
        acc += v - v;
    }
    real sum = PA_FN(hsum)(acc);
    for (; i < n; i++) sum += x[i] - x[i];
    return sum == 0;
}

/* softcap and ALiBi applied to one scaled score x; *dcap gets d(capped)/dx when asked. */
static inline real PA_FN(sm_score)(real x, double cap, real slope, int64_t dist, real *dcap)
{
    if (cap > 0) {
        double t = tanh((double)x / cap);
        x = (real)(cap * t);
        if (dcap) *dcap = (real)(1 - t * t);
    } else if (dcap) {
        *dcap = 1;
    }
    return x - slope * (real)(dist < 0 ? -dist : dist);
}

static inline real PA_FN(sm_slope)(const pa_softmax_desc *d, int64_t h)
{
    return d->alibi ? ((const real *)d->alibi)[h] : 0;
}

/* The online softmax's step for one query: a new max mx rescales its sum l and accumulator
 * acc[Dv] (only when the max grows, so the common case costs a compare). */
static inline void PA_FN(sm_raise_max)(real *m, real *l, real *acc, int64_t Dv, real mx)
{
    if (mx > *m) {
        real f = (real)exp((double)*m - (double)mx);
        *l *= f;
        PA_FN(row_scale)(acc, Dv, f);
        *m = mx;
    }
}

/* One step of the online softmax for n queries over a transposed score tile ST [bk x lds]
 * (key x, query c at ST[x * lds + c]), vectorised across the queries: their maxima m and sums
 * l (n each) updated, query c's accumulator row (O + orow[c] * Dv, or O + c * Dv without
 * orow) rescaled where its max grew, ST replaced by exp(ST - m). mnew, msafe: n reals of
 * scratch. */
static void PA_FN(sm_softmax_columns)(real *ST, int64_t lds, int64_t bk, int64_t n, real *m,
                                      real *l, real *O, const int64_t *orow, int64_t Dv,
                                      real *mnew, real *msafe)
{
    memcpy(mnew, m, sizeof(real) * n);
    PA_FN(col_max_into)(mnew, ST, lds, bk, n);
    for (int64_t c = 0; c < n; c++) { /* msafe: m with -inf as 0 */
        PA_FN(sm_raise_max)(m + c, l + c, O + (orow ? orow[c] : c) * Dv, Dv, mnew[c]);
        msafe[c] = m[c] == -(real)INFINITY ? 0 : m[c];
    }
    PA_FN(col_exp_sub_acc)(ST, lds, bk, msafe, l, n);
}

/* o = acc / l and lse = m + log l; 0 and -inf for a query that sees no key. Otherwise l is
 * NaN (a NaN or +inf score: exp(NaN - m), exp(inf - inf)) or 0 (every score -inf), and the
 * softmax is NaN, as the oracle's exp(s - max s) makes it: never a silent 0. */
static inline void PA_FN(sm_write_row)(real *orow, real *lse, const real *acc, int64_t Dv,
                                       real m, real l, int sees_keys)
{
    if (l > 0) {
        real inv = 1 / l;
        for (int64_t c = 0; c < Dv; c++) orow[c] = acc[c] * inv;
        *lse = m + (real)log((double)l);
    } else {
        real fill = sees_keys ? (real)NAN : 0;
        for (int64_t c = 0; c < Dv; c++) orow[c] = fill;
        *lse = sees_keys ? (real)NAN : -(real)INFINITY;
    }
}

/* Rows of k and v are in order in memory only within a block of a paged cache, and a row of
 * every KV head is often a whole 4 KB page, at which hardware prefetchers stop: the decode
 * asks for the K row SM_DECODE_AHEAD keys ahead and for the V rows of a key block while it
 * scores them, into L2 (measured, 64k keys, Hk=8, D=128, 2 threads: 38.7 ms without, 28.4
 * ms with; into L1 the prefetches stall on the few L1 miss buffers). */
#define SM_DECODE_AHEAD 8

/* The row of k and v holding key j of sequence n. */
static inline int64_t PA_FN(sm_key_row)(const pa_key_rows *r, int64_t n, int64_t j)
{
    if (!r->block_table) return r->start[n] + j;
    return (int64_t)r->block_table[n * r->table_stride + j / r->block_size] * r->block_size +
           j % r->block_size;
}

/* The K and V rows (all KV heads) of keys j0 .. j0+nb-1 of sequence n, into kp and vp, and
 * up to SM_DECODE_AHEAD more below jlimit (to prefetch; the count is returned). */
static inline int64_t PA_FN(sm_block_rows)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                           const real *k, const real *v, int64_t n, int64_t j0,
                                           int64_t nb, int64_t jlimit, const real **kp,
                                           const real **vp)
{
    int64_t count = jlimit - j0 < nb + SM_DECODE_AHEAD ? jlimit - j0 : nb + SM_DECODE_AHEAD;
    for (int64_t c = 0; c < count; c++) {
        const int64_t row = PA_FN(sm_key_row)(rows, n, j0 + c);
        kp[c] = k + row * d->Hk * d->Dk;
        vp[c] = v + row * d->Hk * d->Dv;
    }
    return count;
}

#if PA_VBYTES == 64 && !PA_DOUBLE
#define SM_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
/* The lane sums of v[0..15], as the lanes of one vector (lane i the sum of v[i]): four
 * stages, each adding the halves of every segment of two vectors into one, 45 operations
 * where 16 separate horizontal sums take 128. */
static inline vreal PA_FN(sm_hsum16)(const vreal *v)
{
    vreal w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = SM_SHUF(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SM_SHUF(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        x[i] = SM_SHUF(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SM_SHUF(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        y[i] = SM_SHUF(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SM_SHUF(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SM_SHUF(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SM_SHUF(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SM_SHUF

/* Scores of four heads (rows q0, Dk apart) against four keys (rows kr[0..3]), Dk a multiple
 * of VL, into S[r * SM_DECODE_KB + c] (r the head, c the key), times scale. */
static inline void PA_FN(sm_scores_4x4)(const real *q0, const real *const *kr, int64_t Dk,
                                        real scale, real *S)
{
    vreal acc[16];
    for (int i = 0; i < 16; i++) acc[i] = PA_FN(vset)(0);
    for (int64_t e = 0; e < Dk; e += VL) {
        const vreal k0 = PA_FN(vload)(kr[0] + e), k1 = PA_FN(vload)(kr[1] + e),
                    k2 = PA_FN(vload)(kr[2] + e), k3 = PA_FN(vload)(kr[3] + e);
        for (int r = 0; r < 4; r++) {
            const vreal qv = PA_FN(vload)(q0 + r * Dk + e);
            acc[4 * r] += qv * k0;
            acc[4 * r + 1] += qv * k1;
            acc[4 * r + 2] += qv * k2;
            acc[4 * r + 3] += qv * k3;
        }
    }
    real z[16];
    PA_FN(vstore)(z, PA_FN(sm_hsum16)(acc) * scale);
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) S[r * SM_DECODE_KB + c] = z[4 * r + c];
}
#endif

/* Scores of every head of the query at ip (rows qi, Dk apart) against the nb keys j0.. whose
 * K rows are kp, into S[h * SM_DECODE_KB + c]. Key by key (with AVX-512 and float, four keys
 * by four heads at a time where it can), so each K row (all KV heads) is read from memory
 * once and in order; the rows kp[nb ..] (count in all) and V's rows vp[.. nb] are prefetched
 * on the way. */
static void PA_FN(sm_row_scores)(const pa_softmax_desc *d, const real *qi, const real *const *kp,
                                 const real *const *vp, int64_t count, int64_t ip, int64_t j0,
                                 int64_t nb, real *S)
{
    const int64_t H = d->H, Hk = d->Hk, Dk = d->Dk, G = H / Hk, KB = SM_DECODE_KB;
    const real scale = (real)d->scale;
    int64_t c = 0;
#if PA_VBYTES == 64 && !PA_DOUBLE
    /* only for short rows (all KV heads of a key within 1 KB): four rows of several KB read
     * side by side lose the hardware prefetcher (measured, 64k keys, Hk=8, D=128, 2 threads:
     * 23.3 ms key by key, 31.5 ms four at a time) */
    if (G % 4 == 0 && Dk % VL == 0 && Hk * Dk <= 256)
        for (; c + 4 <= nb; c += 4) {
            for (int64_t i = c; i < c + 4; i++) {
                if (i + SM_DECODE_AHEAD < count) PA_FN(prefetch_span)(kp[i + SM_DECODE_AHEAD], Hk * Dk, 0);
                if (vp) PA_FN(prefetch_span)(vp[i], Hk * d->Dv, 0);
            }
            for (int64_t kh = 0; kh < Hk; kh++) {
                const real *kr[4] = {kp[c] + kh * Dk, kp[c + 1] + kh * Dk, kp[c + 2] + kh * Dk,
                                     kp[c + 3] + kh * Dk};
                for (int64_t g = 0; g < G; g += 4)
                    PA_FN(sm_scores_4x4)(qi + (kh * G + g) * Dk, kr, Dk, scale, S + (kh * G + g) * KB + c);
            }
        }
#endif
    for (; c < nb; c++) {
        if (c + SM_DECODE_AHEAD < count) PA_FN(prefetch_span)(kp[c + SM_DECODE_AHEAD], Hk * Dk, 0);
        if (vp) PA_FN(prefetch_span)(vp[c], Hk * d->Dv, 0);
        for (int64_t kh = 0; kh < Hk; kh++) {
            const real *kr = kp[c] + kh * Dk;
            int64_t g = 0;
            for (; g + 4 <= G; g += 4) { /* four heads share each load of the key */
                const real *q0 = qi + (kh * G + g) * Dk;
                vreal a0 = PA_FN(vset)(0), a1 = a0, a2 = a0, a3 = a0;
                int64_t e = 0;
                for (; e + VL <= Dk; e += VL) {
                    const vreal kv = PA_FN(vload)(kr + e);
                    a0 += PA_FN(vload)(q0 + e) * kv;
                    a1 += PA_FN(vload)(q0 + Dk + e) * kv;
                    a2 += PA_FN(vload)(q0 + 2 * Dk + e) * kv;
                    a3 += PA_FN(vload)(q0 + 3 * Dk + e) * kv;
                }
                real x[4] = {PA_FN(hsum)(a0), PA_FN(hsum)(a1), PA_FN(hsum)(a2), PA_FN(hsum)(a3)};
                for (; e < Dk; e++)
                    for (int r = 0; r < 4; r++) x[r] += q0[r * Dk + e] * kr[e];
                for (int r = 0; r < 4; r++) S[(kh * G + g + r) * KB + c] = scale * x[r];
            }
            for (; g < G; g++)
                S[(kh * G + g) * KB + c] = scale * PA_FN(dot)(qi + (kh * G + g) * Dk, kr, Dk);
        }
    }
    if (d->softcap > 0 || d->alibi)
        for (int64_t h = 0; h < H; h++)
            for (int64_t c = 0; c < nb; c++)
                S[h * KB + c] = PA_FN(sm_score)(S[h * KB + c], d->softcap, PA_FN(sm_slope)(d, h),
                                                ip - j0 - c, NULL);
}

/* acc[r * Dv ..][0, Dv) += sum_c P[r * SM_DECODE_KB + c] (vp[c] + off)[0, Dv) for the R <= 4
 * heads r of one KV head: the P V product of the decode, the heads sharing every load of V
 * and their accumulators held in registers across the keys. R is a constant where inlined. */
static inline __attribute__((always_inline)) void PA_FN(sm_pv)(real *acc, int64_t Dv,
                                                               const real *P,
                                                               const real *const *vp,
                                                               int64_t off, int64_t nb, int R)
{
    const int64_t KB = SM_DECODE_KB;
    int64_t e = 0;
    for (; e + 2 * VL <= Dv; e += 2 * VL) {
        vreal a0[4], a1[4];
        for (int r = 0; r < R; r++) {
            a0[r] = PA_FN(vload)(acc + r * Dv + e);
            a1[r] = PA_FN(vload)(acc + r * Dv + e + VL);
        }
        for (int64_t c = 0; c < nb; c++) {
            const vreal v0 = PA_FN(vload)(vp[c] + off + e), v1 = PA_FN(vload)(vp[c] + off + e + VL);
            for (int r = 0; r < R; r++) {
                const vreal p = PA_FN(vset)(P[r * KB + c]);
                a0[r] += p * v0;
                a1[r] += p * v1;
            }
        }
        for (int r = 0; r < R; r++) {
            PA_FN(vstore)(acc + r * Dv + e, a0[r]);
            PA_FN(vstore)(acc + r * Dv + e + VL, a1[r]);
        }
    }
    for (; e < Dv; e++)
        for (int r = 0; r < R; r++) {
            real x = acc[r * Dv + e];
            for (int64_t c = 0; c < nb; c++) x += P[r * KB + c] * vp[c][off + e];
            acc[r * Dv + e] = x;
        }
}

/* Whether the decode takes its wide layout (softmax_attn.c, sm_wide_block): a group of
 * query heads per KV head fills a vector. */
static inline int PA_FN(sm_wide)(const pa_softmax_desc *d) { return d->H / d->Hk >= VL; }

/* Query heads per KV head padded to whole vectors: the columns of the wide layout. */
static inline int64_t PA_FN(sm_group_lanes)(const pa_softmax_desc *d)
{
    return (d->H / d->Hk + VL - 1) / VL * VL;
}

#define SM_WIDE_SLACK 16 /* reals after ST: the wide P V tile reads up to a tile of heads past a group */

/* Scratch of one decode thread: scores [H, SM_DECODE_KB], accumulators [H, Dv], running max
 * and sum [H], and the K and V row pointers of a key block; for the wide layout the queries
 * transposed QT [Hk, Dk, Gp], the scores transposed ST [Hk, SM_DECODE_KB, Gp] (and slack),
 * V's block packed Vp [SM_DECODE_KB, Dv] and two vectors of Gp for the column softmax (Gp:
 * sm_group_lanes; all empty for the dot-product layout). */
typedef struct {
    real *S, *acc, *m, *l, *QT, *ST, *Vp, *mnew, *msafe;
    const real **kp, **vp;
    void *block;
} PA_FN(sm_decode_scratch);

static int PA_FN(sm_decode_scratch_alloc)(PA_FN(sm_decode_scratch) * s, const pa_softmax_desc *d)
{
    const size_t H = (size_t)d->H, KB = SM_DECODE_KB, Hk = (size_t)d->Hk;
    const int wide = PA_FN(sm_wide)(d);
    const size_t Gp = wide ? (size_t)PA_FN(sm_group_lanes)(d) : 0;
    void **parts[] = {(void **)&s->S,  (void **)&s->acc, (void **)&s->m,    (void **)&s->l,
                      (void **)&s->kp, (void **)&s->vp,  (void **)&s->QT,   (void **)&s->ST,
                      (void **)&s->Vp, (void **)&s->mnew, (void **)&s->msafe};
    const size_t bytes[] = {sizeof(real) * H * KB, sizeof(real) * H * (size_t)d->Dv,
                            sizeof(real) * H, sizeof(real) * H,
                            sizeof(real *) * (KB + SM_DECODE_AHEAD),
                            sizeof(real *) * (KB + SM_DECODE_AHEAD),
                            sizeof(real) * Hk * (size_t)d->Dk * Gp,
                            sizeof(real) * (Hk * KB * Gp + (wide ? SM_WIDE_SLACK : 0)),
                            sizeof(real) * (wide ? KB * (size_t)d->Dv : 0),
                            sizeof(real) * Gp, sizeof(real) * Gp};
    s->block = pa_alloc_parts(parts, bytes, 11);
    return s->block != NULL;
}
