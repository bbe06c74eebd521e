/* Log-linear attention (log-linear Mamba-2), forward and backward. Template body (see
 * core/dtype.h); needs core/vmath.h, core/gemm.c, ops/decay.h and ops/linear_engine.h (a
 * block's rows staged contiguous) before it.
 *
 * Per (sequence, head) unit, with positions p = start + t (start: where the sequence resumes,
 * 0 without an initial state) and G the cumulative log gate of the call:
 *   o_t = sum_{s<=t} ls[t, lev(p_t, p_s)] exp(G_t - G_s) (scale q_t . k_s) v_s
 * with lev(p, p') = bit_length(p XOR p'), 0 for the token itself: the levels of a Fenwick tree
 * over positions. Seen from the next position p, the past splits into one set per level; each
 * level keeps the K x V state sum exp(G - G_s) k_s v_s^T of its set. Moving from p to p + 1
 * merges levels 1 .. z+1 and the token p into level z+1, z the count of trailing ones of p
 * (every token at level <= z+1 from p is at level z+1 from p + 1); higher levels stay.
 * Levels 0 .. L are kept (level L is only written, by a last step whose final state is not
 * wanted: the wrapper asks for L levels exactly when the final state is wanted).
 *
 * Forms. Recurrent, per token: decay the occupied levels by exp(g_t) (only factors <= 1 are
 * ever formed, so strong gates cannot overflow), read them with q_t, then merge.
 * Chunk (C = 2^c rows): blocks of rows inside one aligned chunk of positions [jC, (j+1)C)
 * (the first block of a resumed sequence and the last may be shorter). Inside a block two
 * tokens are at a level <= c, so that part is the masked quadratic product
 *   o_i += sum_{j<=i} ls[i, lev(p_i, p_j)] exp(a_i - a_j) (q~_i . k_j) v_j
 * with a the block's own cumulative gate. A level l entering the block at P0 is at level
 * max(l, lev(p_i, P0)) from row i (l itself for l > c), so each occupied level is one product
 * (w_l * Q~) S_l with w_l[i] = ls[i, that level] exp(a_i). Leaving at P1, a level l goes to
 * max(l, lev(P1, P0)) and row j to lev(P1, p_j) (non-increasing in j: a few runs of rows, one
 * product K^T diag(exp(A - a)) V each, A the block's total gate). Work O(T (C + L) K V).
 * Parallel: the chunk algorithm with blocks of a power of two >= T (the masked T x T product).
 *
 * Recurrent backward: states kept every `piece` steps (about sqrt(T)); each piece's states recomputed,
 * then stepped back with dS, the gradients reaching each level:
 *   merge:  every level 1 .. z+1 entering it gets dS_{z+1};  dk = dS_{z+1} v, dv = dS_{z+1}^T k
 *   read:   dS_l += ls_l q~ do^T,  dq~ += ls_l S_l do,  dls_l = q~ . S_l do  (l >= 1)
 *   decay:  dg = sum_l <dS_l, S_l>,  dS_l *= exp(g)
 *
 * The chunk backward keeps the occupied levels entering every block and steps the blocks back:
 *   leave:  dS_l(in) = e^A dS_{max(l, m)},  dA += <dS_{max(l, m)}, e^A S_l>; row j at level m_j:
 *           dk_j = e^(A-a_j) dS_m_j v_j, dv_j = e^(A-a_j) dS_m_j^T k_j, u_j = k_j . dk_j moves
 *           from a_j to A
 *   read:   Z = dO S_l^T, dq~ += w_l Z, dls += e^a (q~ . Z), da += w_l (q~ . Z),
 *           dS_l(in) += (w_l Q~)^T dO
 *   block:  dP = dO V^T, dM = dP * W (W the masked weights), dq~ += dM K, dk += dM^T Q~,
 *           dv += (W * Q~K^T)^T dO, da_i += E_ij, da_j -= E_ij with E = W * Q~K^T * dP
 *   and dg is the reverse cumulative sum of da.
 *
 * Work is split over (sequence, head) units, each on one thread. Where a unit's rows lie a
 * multiple of 1 KiB apart, the chunk form works on a copy of each block's rows, contiguous
 * (ll_stage), and copies its output rows back: the block's own product reads every earlier
 * row of the block for each row.
 */

typedef struct {
    int64_t T, start;
    int64_t sk, sv, sg, sl; /* row strides: q/k, v/o, g, level_scales */
    const real *q, *k, *v, *g, *ls, *dout;
    real *o, *dq, *dk, *dv, *dg, *dls;
} PA_FN(ll_unit);

typedef struct {
    const pa_loglin_desc *d;
    const real *q, *k, *v, *g, *ls, *h0, *dout, *dht;
    real *o, *ht, *dq, *dk, *dv, *dg, *dls, *dh0;
    int staged; /* blocks staged contiguous (rows_staged) */
} PA_FN(ll_call);

static void PA_FN(ll_unit_of)(const PA_FN(ll_call) *c, int64_t unit, PA_FN(ll_unit) *u)
{
    const pa_loglin_desc *d = c->d;
    const int64_t H = d->H, n = unit / H, h = unit % H, r0 = d->cu[n];
    const int64_t row = r0 * H + h, ok = row * d->K, ov = row * d->V, ol = row * d->L;
    u->T = d->cu[n + 1] - r0;
    u->start = d->start ? d->start[n] : 0;
    u->sk = H * d->K;
    u->sv = H * d->V;
    u->sg = H;
    u->sl = H * d->L;
    u->q = c->q + ok;
    u->k = c->k + ok;
    u->v = c->v + ov;
    u->g = c->g + row;
    u->ls = c->ls + ol;
    u->dout = c->dout ? c->dout + ov : NULL;
    u->o = c->o ? c->o + ov : NULL;
    u->dq = c->dq ? c->dq + ok : NULL;
    u->dk = c->dk ? c->dk + ok : NULL;
    u->dv = c->dv ? c->dv + ov : NULL;
    u->dg = c->dg ? c->dg + row : NULL;
    u->dls = c->dls ? c->dls + ol : NULL;
}

/* Levels 0 .. L of K x V each, and which of them are occupied (bit l: level l nonzero) */
typedef struct {
    real *S;
    uint64_t occ;
} PA_FN(ll_levels);

typedef struct {
    int64_t K, V, L, piece, C;
    real *S, *dS;     /* (L + 1) K V each */
    real *qs, *w;     /* K each: scale q, S do */
    real *kept;       /* backward: the levels entering each piece */
    real *trail;      /* backward: one piece's levels after each step's decay */
    uint64_t *occ;    /* backward: occupancy of kept (first) and trail entries */
    /* chunk form (C rows a block) */
    real *Qs, *Kd, *dQs, *dKb; /* C K each: scale q, the rows' writes, gradients */
    real *Y, *dVb;             /* C max(K, V), C V */
    real *wl, *dSp, *work;     /* C; (L + 1) K V; the GEMM's packing */
    double *a, *da;            /* C each: the block's cumulative gate, its gradient */
    real *stage;               /* C rows of a block's inputs and outputs (ll_stage) */
    void *block;
} PA_FN(ll_scratch);

/* pieces: levels kept (backward); piece: steps of a recurrent piece (backward); C: rows of a
 * chunk-form block (0: recurrent form); staged: room to stage a block (ll_stage) */
static int PA_FN(ll_scratch_alloc)(PA_FN(ll_scratch) *s, const pa_loglin_desc *d, int64_t pieces,
                                   int64_t piece, int64_t C, int staged)
{
    const size_t r = sizeof(real), LKV = (size_t)((d->L + 1) * d->K * d->V);
    const int64_t K = d->K, V = d->V, KV_ = K > V ? K : V, D = C > KV_ ? C : KV_;
    const size_t ck = (size_t)(C * K) * r;
    size_t bytes[] = {LKV * r, LKV * r, d->K * r, d->K * r, pieces * LKV * r, piece * LKV * r,
                      (pieces + piece + 1) * sizeof(uint64_t),
                      ck, ck, ck, ck, (size_t)(C * KV_) * r, (size_t)(C * V) * r,
                      C * r, C ? LKV * r : 0, C ? (size_t)PA_FN(gemm_work_elems)(D, D, D) * r : 0,
                      C * sizeof(double), C * sizeof(double),
                      staged ? (size_t)(C * (4 * K + 3 * V + 2 * d->L + 2)) * r : 0};
    void **const parts[] = {(void **)&s->S,    (void **)&s->dS,    (void **)&s->qs,
                            (void **)&s->w,    (void **)&s->kept,  (void **)&s->trail,
                            (void **)&s->occ,  (void **)&s->Qs,    (void **)&s->Kd,
                            (void **)&s->dQs,  (void **)&s->dKb,   (void **)&s->Y,
                            (void **)&s->dVb,  (void **)&s->wl,    (void **)&s->dSp,
                            (void **)&s->work, (void **)&s->a,     (void **)&s->da,
                            (void **)&s->stage};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    s->K = d->K;
    s->V = d->V;
    s->L = d->L;
    s->piece = piece;
    s->C = C;
    return s->block != NULL;
}

/* The levels entering a unit: h0's levels 1 .. L-1 (level 0 of h0 carries the position, read
 * by the wrapper), all occupied; zeros without h0 */
static uint64_t PA_FN(ll_enter)(const real *h0, real *S, int64_t L, int64_t KV)
{
    memset(S, 0, sizeof(real) * (size_t)((L + 1) * KV));
    if (!h0) return 0;
    memcpy(S + KV, h0 + KV, sizeof(real) * (size_t)((L - 1) * KV));
    return L > 1 ? ((((uint64_t)1) << L) - 2) : 0;
}

/* count of trailing ones of p: the step from p to p + 1 merges levels 1 .. that + 1 */
static inline int PA_FN(ll_trailing_ones)(int64_t p)
{
    return __builtin_ctzll(~(uint64_t)p);
}

/* One step t on the levels: decay, read into o (when u->o), merge. With after_decay, the
 * levels after the decay go there. */
static void PA_FN(ll_step)(const PA_FN(ll_unit) *u, int64_t t, double scale, PA_FN(ll_levels) *lv,
                           PA_FN(ll_scratch) *sc, real *after_decay, uint64_t *occ_after_decay)
{
    const int64_t K = sc->K, V = sc->V, L = sc->L, KV = K * V;
    real *restrict S = lv->S;
    const real e = (real)exp(PA_FN(gate_step)(u->g[t * u->sg]));
    const real *restrict kt = u->k + t * u->sk, *restrict vt = u->v + t * u->sv;
    /* an empty level is a zero state, which a NaN decay makes NaN (0 e^NaN): every level then */
    if (e != e) lv->occ |= (((uint64_t)1) << (L + 1)) - 2;
    for (int64_t l = 1; l <= L; l++)
        if (lv->occ >> l & 1)
            for (int64_t x = 0; x < KV; x++) S[l * KV + x] *= e;
    if (after_decay) {
        memcpy(after_decay, S, sizeof(real) * (size_t)((L + 1) * KV));
        *occ_after_decay = lv->occ;
    }
    if (u->o) {
        const real *restrict qt = u->q + t * u->sk, *restrict lt = u->ls + t * u->sl;
        real *restrict ot = u->o + t * u->sv, *restrict qs = sc->qs;
        for (int64_t r = 0; r < K; r++) qs[r] = (real)scale * qt[r];
        const real self = lt[0] * PA_FN(dot)(qs, kt, K);
        for (int64_t j = 0; j < V; j++) ot[j] = self * vt[j];
        for (int64_t l = 1; l < L; l++)
            if (lv->occ >> l & 1)
                for (int64_t r = 0; r < K; r++) PA_FN(axpy)(ot, S + l * KV + r * V, V, lt[l] * qs[r]);
    }
    const int top = PA_FN(ll_trailing_ones)(u->start + t) + 1;
    real *restrict dst = S + top * KV;
    for (int l = 1; l < top; l++)
        if (lv->occ >> l & 1) {
            for (int64_t x = 0; x < KV; x++) dst[x] += S[l * KV + x];
            memset(S + l * KV, 0, sizeof(real) * (size_t)KV);
        }
    for (int64_t r = 0; r < K; r++) PA_FN(axpy)(dst + r * V, vt, V, kt[r]);
    lv->occ = (lv->occ & ~((((uint64_t)1) << (top + 1)) - 1)) | ((uint64_t)1 << top);
}

/* Step t in reverse from its levels after the decay (Sa, occupancy occ) and dS, the gradient
 * reaching the levels after the step (on return, the levels entering it). */
static void PA_FN(ll_step_reverse)(const PA_FN(ll_unit) *u, int64_t t, double scale,
                                   const real *restrict Sa, uint64_t occ, real *restrict dS,
                                   PA_FN(ll_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, L = sc->L, KV = K * V;
    const real gt = u->g[t * u->sg], e = (real)exp(PA_FN(gate_step)(gt));
    const real *restrict kt = u->k + t * u->sk, *restrict vt = u->v + t * u->sv;
    const real *restrict qt = u->q + t * u->sk, *restrict lt = u->ls + t * u->sl;
    const real *restrict dot_ = u->dout + t * u->sv;
    real *restrict dqt = u->dq + t * u->sk, *restrict dkt = u->dk + t * u->sk;
    real *restrict dvt = u->dv + t * u->sv, *restrict dlt = u->dls + t * u->sl;
    real *restrict qs = sc->qs, *restrict w = sc->w;
    /* merge: the token's write and every merged level had dS_top */
    const int top = PA_FN(ll_trailing_ones)(u->start + t) + 1;
    const real *restrict dtop = dS + top * KV;
    for (int64_t r = 0; r < K; r++) dkt[r] = PA_FN(dot)(dtop + r * V, vt, V);
    for (int64_t j = 0; j < V; j++) dvt[j] = 0;
    for (int64_t r = 0; r < K; r++) PA_FN(axpy)(dvt, dtop + r * V, V, kt[r]);
    for (int l = 1; l < top; l++) memcpy(dS + l * KV, dtop, sizeof(real) * (size_t)KV);
    /* read */
    for (int64_t r = 0; r < K; r++) {
        qs[r] = (real)scale * qt[r];
        dqt[r] = 0;
    }
    const real qk = PA_FN(dot)(qs, kt, K), dov = PA_FN(dot)(dot_, vt, V);
    dlt[0] = qk * dov;
    for (int64_t r = 0; r < K; r++) {
        dqt[r] += lt[0] * dov * kt[r];
        dkt[r] += lt[0] * dov * qs[r];
    }
    PA_FN(axpy)(dvt, dot_, V, lt[0] * qk);
    for (int64_t l = 1; l < L; l++) {
        dlt[l] = 0;
        if (!(occ >> l & 1)) continue;
        const real *restrict Sl = Sa + l * KV;
        real *restrict dSl = dS + l * KV;
        for (int64_t r = 0; r < K; r++) w[r] = PA_FN(dot)(Sl + r * V, dot_, V);
        dlt[l] = PA_FN(dot)(qs, w, K);
        for (int64_t r = 0; r < K; r++) {
            dqt[r] += lt[l] * w[r];
            PA_FN(axpy)(dSl + r * V, dot_, V, lt[l] * qs[r]);
        }
    }
    for (int64_t r = 0; r < K; r++) dqt[r] *= (real)scale;
    /* decay; a clamped step's gradient is 0, as exp's is below the clamp */
    real dg = 0;
    for (int64_t l = 1; l <= L; l++) {
        real *restrict dSl = dS + l * KV;
        if (occ >> l & 1) dg += PA_FN(dot)(dSl, Sa + l * KV, KV);
        for (int64_t x = 0; x < KV; x++) dSl[x] *= e;
    }
    u->dg[t * u->sg] = gt < -PA_GATE_RESET ? 0 : dg;
}

/* The final state: levels 1 .. L-1, level 0 holding the next position at [0, 0] */
static void PA_FN(ll_leave)(const PA_FN(ll_levels) *lv, int64_t next, real *ht, int64_t L,
                            int64_t KV)
{
    memcpy(ht, lv->S, sizeof(real) * (size_t)(L * KV));
    memset(ht, 0, sizeof(real) * (size_t)KV);
    ht[0] = (real)next;
}

static void PA_FN(ll_unit_backward)(const PA_FN(ll_call) *c, int64_t unit, PA_FN(ll_scratch) *sc)
{
    const pa_loglin_desc *d = c->d;
    const int64_t L = d->L, KV = d->K * d->V, LKV = L * KV, SKV = (L + 1) * KV;
    const int64_t P = sc->piece;
    PA_FN(ll_unit) u;
    PA_FN(ll_unit_of)(c, unit, &u);
    const int64_t np = (u.T + P - 1) / P;
    uint64_t *kocc = sc->occ, *tocc = sc->occ + np;
    PA_FN(ll_levels) lv = {.S = sc->S};
    lv.occ = PA_FN(ll_enter)(c->h0 ? c->h0 + unit * LKV : NULL, lv.S, L, KV);
    for (int64_t p = 0; p < np; p++) {
        memcpy(sc->kept + p * SKV, lv.S, sizeof(real) * (size_t)SKV);
        kocc[p] = lv.occ;
        for (int64_t t = p * P; t < u.T && t < (p + 1) * P; t++)
            PA_FN(ll_step)(&u, t, d->scale, &lv, sc, NULL, NULL);
    }
    memset(sc->dS, 0, sizeof(real) * (size_t)SKV);
    if (c->dht) {
        memcpy(sc->dS, c->dht + unit * LKV, sizeof(real) * (size_t)LKV);
        memset(sc->dS, 0, sizeof(real) * (size_t)KV);
    }
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t t0 = p * P, n = u.T - t0 < P ? u.T - t0 : P;
        memcpy(lv.S, sc->kept + p * SKV, sizeof(real) * (size_t)SKV);
        lv.occ = kocc[p];
        for (int64_t i = 0; i < n; i++)
            PA_FN(ll_step)(&u, t0 + i, d->scale, &lv, sc, sc->trail + i * SKV, tocc + i);
        for (int64_t i = n - 1; i >= 0; i--)
            PA_FN(ll_step_reverse)(&u, t0 + i, d->scale, sc->trail + i * SKV, tocc[i], sc->dS, sc);
    }
    if (c->dh0) {
        memcpy(c->dh0 + unit * LKV, sc->dS, sizeof(real) * (size_t)LKV);
        memset(c->dh0 + unit * LKV, 0, sizeof(real) * (size_t)KV);
    }
}

/* ---- chunk form ---- */

static inline int PA_FN(ll_bits)(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* Rows of the block starting at row t0: up to the end of its aligned chunk of C positions */
static inline int64_t PA_FN(ll_block_rows)(const PA_FN(ll_unit) *u, int64_t t0, int64_t C)
{
    const int64_t room = C - ((u->start + t0) & (C - 1));
    return u->T - t0 < room ? u->T - t0 : room;
}

/* The block's cumulative gate a (in double: differences of long sums) and, with_q, its scaled
 * queries Qs (the levels' pass alone reads no query) */
static void PA_FN(ll_block_prep)(const PA_FN(ll_unit) *u, int64_t t0, int64_t n, double scale,
                                 int with_q, PA_FN(ll_scratch) *sc)
{
    const int64_t K = sc->K;
    double acc = 0;
    for (int64_t i = 0; i < n; i++) {
        acc += PA_FN(gate_step)(u->g[(t0 + i) * u->sg]);
        sc->a[i] = acc;
        if (!with_q) continue;
        const real *qt = u->q + (t0 + i) * u->sk;
        for (int64_t r = 0; r < K; r++) sc->Qs[i * K + r] = (real)scale * qt[r];
    }
}

/* The level from row i of a block at P0 of an entering level l */
static inline int PA_FN(ll_seen)(int l, int64_t P0, int64_t i)
{
    const int b = PA_FN(ll_bits)((uint64_t)((P0 + i) ^ P0));
    return l > b ? l : b;
}

/* Kd[j] = exp(A - a[j]) k_{t0+j}: the block's keys decayed to its end */
static void PA_FN(ll_decayed_keys)(const PA_FN(ll_unit) *u, int64_t t0, int64_t n, double A,
                                   const double *a, int64_t K, real *Kd)
{
    for (int64_t j = 0; j < n; j++) {
        const real e = (real)exp(A - a[j]), *kt = u->k + (t0 + j) * u->sk;
        for (int64_t r = 0; r < K; r++) Kd[j * K + r] = e * kt[r];
    }
}

/* The end of the run of rows j0.. (of n, positions P0..P1) that enter one level at the block's
 * end, that level into *lev */
static inline int64_t PA_FN(ll_level_run)(int64_t P0, int64_t P1, int64_t j0, int64_t n, int *lev)
{
    *lev = PA_FN(ll_bits)((uint64_t)(P1 ^ (P0 + j0)));
    int64_t j1 = j0 + 1;
    while (j1 < n && PA_FN(ll_bits)((uint64_t)(P1 ^ (P0 + j1))) == *lev) j1++;
    return j1;
}

/* Rows t0 .. t0+n-1 as one block: outputs (when write_o), then the levels leave it */
static void PA_FN(ll_block_forward)(const PA_FN(ll_unit) *u, int64_t t0, int64_t n, double scale,
                                    PA_FN(ll_levels) *lv, PA_FN(ll_scratch) *sc, int write_o)
{
    const int64_t K = sc->K, V = sc->V, L = sc->L, KV = K * V;
    const int64_t P0 = u->start + t0, P1 = P0 + n;
    real *S = lv->S, *Qs = sc->Qs, *Kd = sc->Kd, *work = sc->work;
    const double *a = sc->a;
    PA_FN(ll_block_prep)(u, t0, n, scale, write_o, sc);
    if (write_o) {
        /* the block's own rows: the masked product, row by row so that a non-finite row
         * reaches no earlier one */
        for (int64_t i = 0; i < n; i++) {
            const real *lt = u->ls + (t0 + i) * u->sl;
            real *ot = u->o + (t0 + i) * u->sv;
            for (int64_t j = 0; j < V; j++) ot[j] = 0;
            for (int64_t j = 0; j <= i; j++) {
                const real w = lt[PA_FN(ll_bits)((uint64_t)((P0 + i) ^ (P0 + j)))] *
                               (real)exp(a[i] - a[j]);
                PA_FN(axpy)(ot, u->v + (t0 + j) * u->sv, V,
                            w * PA_FN(dot)(Qs + i * K, u->k + (t0 + j) * u->sk, K));
            }
        }
        /* the levels entering it */
        for (int l = 1; l < L; l++) {
            if (!(lv->occ >> l & 1)) continue;
            PA_FN(gemm)(n, V, K, 1, Qs, K, 1, S + l * KV, V, 1, 0, sc->Y, V, work);
            for (int64_t i = 0; i < n; i++) {
                const int seen = PA_FN(ll_seen)(l, P0, i);
                const real w = u->ls[(t0 + i) * u->sl + seen] * (real)exp(a[i]);
                PA_FN(axpy)(u->o + (t0 + i) * u->sv, sc->Y + i * V, V, w);
            }
        }
    }
    /* leave: level l to max(l, m), row j to lev(P1, p_j) */
    const double A = a[n - 1];
    const real eA = (real)exp(A);
    const int m = PA_FN(ll_bits)((uint64_t)(P1 ^ P0));
    const uint64_t below = (((uint64_t)1) << m) - 1;
    for (int l = 1; l <= L; l++)
        if (lv->occ >> l & 1)
            for (int64_t x = 0; x < KV; x++) S[l * KV + x] *= eA;
    for (int l = 1; l < m; l++)
        if (lv->occ >> l & 1) {
            real *dst = S + m * KV, *Sl = S + l * KV;
            for (int64_t x = 0; x < KV; x++) dst[x] += Sl[x];
            memset(Sl, 0, sizeof(real) * (size_t)KV);
        }
    if (lv->occ & below) lv->occ = (lv->occ & ~below) | ((uint64_t)1 << m);
    PA_FN(ll_decayed_keys)(u, t0, n, A, a, K, Kd);
    for (int64_t j0 = 0, j1; j0 < n; j0 = j1) {
        int lev;
        j1 = PA_FN(ll_level_run)(P0, P1, j0, n, &lev);
        PA_FN(gemm)(K, V, j1 - j0, 1, Kd + j0 * K, 1, K, u->v + (t0 + j0) * u->sv, u->sv, 1, 1,
                    S + lev * KV, V, work);
        lv->occ |= (uint64_t)1 << lev;
    }
}

/* The block's backward from its entering levels S (occupancy occ) and dS, the gradient
 * reaching the levels leaving it (on return, the one reaching those entering it) */
static void PA_FN(ll_block_backward)(const PA_FN(ll_unit) *u, int64_t t0, int64_t n, double scale,
                                     const real *S, uint64_t occ, real *dS, PA_FN(ll_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, L = sc->L, KV = K * V;
    const int64_t P0 = u->start + t0, P1 = P0 + n;
    real *Qs = sc->Qs, *Kd = sc->Kd, *Y = sc->Y, *dSp = sc->dSp, *work = sc->work;
    real *dQs = sc->dQs, *dKb = sc->dKb, *dVb = sc->dVb;
    double *a = sc->a, *da = sc->da;
    PA_FN(ll_block_prep)(u, t0, n, scale, 1, sc);
    memset(dQs, 0, sizeof(real) * (size_t)(n * K));
    memset(dKb, 0, sizeof(real) * (size_t)(n * K));
    memset(dVb, 0, sizeof(real) * (size_t)(n * V));
    for (int64_t i = 0; i < n; i++) {
        da[i] = 0;
        for (int64_t l = 0; l < L; l++) u->dls[(t0 + i) * u->sl + l] = 0;
    }
    const double A = a[n - 1];
    const real eA = (real)exp(A);
    const int m = PA_FN(ll_bits)((uint64_t)(P1 ^ P0));
    double dA = 0;
    /* leave */
    memset(dSp, 0, sizeof(real) * (size_t)KV);
    for (int l = 1; l <= L; l++) {
        const real *dto = dS + (l > m ? l : m) * KV;
        real *dl = dSp + l * KV;
        for (int64_t x = 0; x < KV; x++) dl[x] = eA * dto[x];
        if (occ >> l & 1) dA += (double)PA_FN(dot)(dl, S + l * KV, KV);
    }
    PA_FN(ll_decayed_keys)(u, t0, n, A, a, K, Kd);
    for (int64_t j0 = 0, j1; j0 < n; j0 = j1) {
        int lev;
        j1 = PA_FN(ll_level_run)(P0, P1, j0, n, &lev);
        const real *D = dS + lev * KV;
        PA_FN(gemm)(j1 - j0, K, V, 1, u->v + (t0 + j0) * u->sv, u->sv, 1, D, 1, V, 0, Y, K, work);
        for (int64_t j = j0; j < j1; j++) {
            const real e = (real)exp(A - a[j]), *yj = Y + (j - j0) * K;
            PA_FN(axpy)(dKb + j * K, yj, K, e);
            const double uj = (double)e * PA_FN(dot)(u->k + (t0 + j) * u->sk, yj, K);
            da[j] -= uj;
            dA += uj;
        }
        PA_FN(gemm)(j1 - j0, V, K, 1, Kd + j0 * K, K, 1, D, V, 1, 1, dVb + j0 * V, V, work);
    }
    /* reads of the entering levels */
    const real *dout = u->dout + t0 * u->sv;
    for (int l = 1; l < L; l++) {
        if (!(occ >> l & 1)) continue;
        PA_FN(gemm)(n, K, V, 1, dout, u->sv, 1, S + l * KV, 1, V, 0, Y, K, work);
        for (int64_t i = 0; i < n; i++) {
            const int seen = PA_FN(ll_seen)(l, P0, i);
            const real ea = (real)exp(a[i]), w = u->ls[(t0 + i) * u->sl + seen] * ea;
            const real r = PA_FN(dot)(Qs + i * K, Y + i * K, K);
            u->dls[(t0 + i) * u->sl + seen] += ea * r;
            da[i] += (double)(w * r);
            PA_FN(axpy)(dQs + i * K, Y + i * K, K, w);
            for (int64_t x = 0; x < K; x++) Kd[i * K + x] = w * Qs[i * K + x];
        }
        PA_FN(gemm)(K, V, n, 1, Kd, 1, K, dout, u->sv, 1, 1, dSp + l * KV, V, work);
    }
    /* the block's own rows */
    for (int64_t i = 0; i < n; i++) {
        const real *lt = u->ls + (t0 + i) * u->sl, *doi = u->dout + (t0 + i) * u->sv;
        real *dlt = u->dls + (t0 + i) * u->sl;
        for (int64_t j = 0; j <= i; j++) {
            const int lev = PA_FN(ll_bits)((uint64_t)((P0 + i) ^ (P0 + j)));
            const real *kj = u->k + (t0 + j) * u->sk, *vj = u->v + (t0 + j) * u->sv;
            const real e = (real)exp(a[i] - a[j]), w = lt[lev] * e;
            const real qk = PA_FN(dot)(Qs + i * K, kj, K), dp = PA_FN(dot)(doi, vj, V);
            dlt[lev] += e * qk * dp;
            const double E = (double)(w * qk * dp);
            da[i] += E;
            da[j] -= E;
            PA_FN(axpy)(dQs + i * K, kj, K, w * dp);
            PA_FN(axpy)(dKb + j * K, Qs + i * K, K, w * dp);
            PA_FN(axpy)(dVb + j * V, doi, V, w * qk);
        }
    }
    da[n - 1] += dA;
    double acc = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        acc += da[i];
        const real gt = u->g[(t0 + i) * u->sg];
        u->dg[(t0 + i) * u->sg] = gt < -PA_GATE_RESET ? 0 : (real)acc;
        real *dqt = u->dq + (t0 + i) * u->sk, *dkt = u->dk + (t0 + i) * u->sk;
        for (int64_t r = 0; r < K; r++) {
            dqt[r] = (real)scale * dQs[i * K + r];
            dkt[r] = dKb[i * K + r];
        }
        memcpy(u->dv + (t0 + i) * u->sv, dVb + i * V, sizeof(real) * (size_t)V);
    }
    memcpy(dS, dSp, sizeof(real) * (size_t)((L + 1) * KV));
}

/* The unit whose rows *r0 .. *r0+n-1 are unit u's rows t0 .. t0+n-1, for a block's
 * functions: u itself (*r0 = t0), or where the call stages its blocks, *b, those rows copied
 * contiguous into sc->stage (rows_copy; *r0 = 0, its positions from start + t0): k, v and g,
 * and q, the level scales and dout unless state_only; the outputs written there go back to u
 * by ll_unstage. */
static const PA_FN(ll_unit) *PA_FN(ll_stage)(const PA_FN(ll_call) *c, const PA_FN(ll_unit) *u,
                                             int64_t t0, int64_t n, int state_only,
                                             PA_FN(ll_scratch) *sc, PA_FN(ll_unit) *b,
                                             int64_t *r0)
{
    *r0 = c->staged ? 0 : t0;
    if (!c->staged) return u;
    const int64_t K = sc->K, V = sc->V, L = sc->L;
    real *p = sc->stage;
    *b = (PA_FN(ll_unit)){.T = n, .start = u->start + t0, .sk = K, .sv = V, .sg = 1, .sl = L};
    const real *const in[] = {u->k, u->v, u->g, u->q, u->ls, u->dout};
    const int64_t ld[] = {u->sk, u->sv, u->sg, u->sk, u->sl, u->sv}, w[] = {K, V, 1, K, L, V};
    const real **const to[] = {&b->k, &b->v, &b->g, &b->q, &b->ls, &b->dout};
    PA_FN(stage_rows_in)(state_only ? 3 : 6, in, ld, w, t0, n, to, &p);
    if (state_only) return b;
    real *const out[] = {u->o, u->dq, u->dk, u->dv, u->dg, u->dls};
    const int64_t wo[] = {V, K, K, V, 1, L};
    real **const into[] = {&b->o, &b->dq, &b->dk, &b->dv, &b->dg, &b->dls};
    PA_FN(stage_rows_out)(6, out, wo, n, into, &p);
    return b;
}

/* The outputs of block b (as ll_stage gave it for rows t0 .. t0+n-1) into u's rows where it
 * is a staged copy */
static void PA_FN(ll_unstage)(const PA_FN(ll_unit) *b, int64_t t0, int64_t n,
                              const PA_FN(ll_unit) *u)
{
    if (b == u) return;
    real *const from[] = {b->o, b->dq, b->dk, b->dv, b->dg, b->dls};
    real *const to[] = {u->o, u->dq, u->dk, u->dv, u->dg, u->dls};
    const int64_t width[] = {b->sv, b->sk, b->sk, b->sv, 1, b->sl};
    const int64_t ld[] = {u->sv, u->sk, u->sk, u->sv, u->sg, u->sl};
    PA_FN(unstage_rows)(6, from, width, to, ld, t0, n, 0);
}

/* One unit's forward: token by token (the recurrent form, sc->C = 0) or block by block */
static void PA_FN(ll_unit_forward)(const PA_FN(ll_call) *c, int64_t unit, PA_FN(ll_scratch) *sc)
{
    const pa_loglin_desc *d = c->d;
    const int64_t L = d->L, KV = d->K * d->V, LKV = L * KV;
    PA_FN(ll_unit) u;
    PA_FN(ll_unit_of)(c, unit, &u);
    PA_FN(ll_levels) lv = {.S = sc->S};
    lv.occ = PA_FN(ll_enter)(c->h0 ? c->h0 + unit * LKV : NULL, lv.S, L, KV);
    if (!sc->C)
        for (int64_t t = 0; t < u.T; t++) PA_FN(ll_step)(&u, t, d->scale, &lv, sc, NULL, NULL);
    for (int64_t t0 = 0, n, r; sc->C && t0 < u.T; t0 += n) {
        n = PA_FN(ll_block_rows)(&u, t0, sc->C);
        PA_FN(ll_unit) staged;
        const PA_FN(ll_unit) *b = PA_FN(ll_stage)(c, &u, t0, n, 0, sc, &staged, &r);
        PA_FN(ll_block_forward)(b, r, n, d->scale, &lv, sc, 1);
        PA_FN(ll_unstage)(b, t0, n, &u);
    }
    if (c->ht) PA_FN(ll_leave)(&lv, u.start + u.T, c->ht + unit * LKV, L, KV);
}

static void PA_FN(ll_unit_backward_chunk)(const PA_FN(ll_call) *c, int64_t unit, PA_FN(ll_scratch) *sc)
{
    const pa_loglin_desc *d = c->d;
    const int64_t L = d->L, KV = d->K * d->V, LKV = L * KV, SKV = (L + 1) * KV;
    PA_FN(ll_unit) u;
    PA_FN(ll_unit_of)(c, unit, &u);
    PA_FN(ll_levels) lv = {.S = sc->S};
    lv.occ = PA_FN(ll_enter)(c->h0 ? c->h0 + unit * LKV : NULL, lv.S, L, KV);
    /* the occupied levels entering each block, packed one after another (about half of
     * log2(T / C) of them: far less memory than every level) */
    int64_t nb = 0, kept = 0;
    for (int64_t t0 = 0, n; t0 < u.T; t0 += n, nb++) {
        n = PA_FN(ll_block_rows)(&u, t0, sc->C);
        sc->occ[nb] = lv.occ;
        for (int l = 1; l <= L; l++)
            if (lv.occ >> l & 1)
                memcpy(sc->kept + KV * kept++, lv.S + l * KV, sizeof(real) * (size_t)KV);
        PA_FN(ll_unit) staged;
        int64_t r;
        const PA_FN(ll_unit) *b = PA_FN(ll_stage)(c, &u, t0, n, 1, sc, &staged, &r);
        PA_FN(ll_block_forward)(b, r, n, d->scale, &lv, sc, 0);
    }
    memset(sc->dS, 0, sizeof(real) * (size_t)SKV);
    if (c->dht) {
        memcpy(sc->dS, c->dht + unit * LKV, sizeof(real) * (size_t)LKV);
        memset(sc->dS, 0, sizeof(real) * (size_t)KV);
    }
    const int64_t first = u.T ? PA_FN(ll_block_rows)(&u, 0, sc->C) : 0;
    for (int64_t b = nb - 1; b >= 0; b--) {
        const int64_t t0 = b ? first + (b - 1) * sc->C : 0;
        const int64_t n = PA_FN(ll_block_rows)(&u, t0, sc->C);
        for (int l = L; l >= 1; l--)
            if (sc->occ[b] >> l & 1)
                memcpy(sc->S + l * KV, sc->kept + KV * --kept, sizeof(real) * (size_t)KV);
        PA_FN(ll_unit) staged;
        int64_t r;
        const PA_FN(ll_unit) *bu = PA_FN(ll_stage)(c, &u, t0, n, 0, sc, &staged, &r);
        PA_FN(ll_block_backward)(bu, r, n, d->scale, sc->S, sc->occ[b], sc->dS, sc);
        PA_FN(ll_unstage)(bu, t0, n, &u);
    }
    if (c->dh0) {
        memcpy(c->dh0 + unit * LKV, sc->dS, sizeof(real) * (size_t)LKV);
        memset(c->dh0 + unit * LKV, 0, sizeof(real) * (size_t)KV);
    }
}

static int PA_FN(ll_run)(const PA_FN(ll_call) *c, int backward)
{
    const pa_loglin_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    int64_t maxlen = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        if (d->cu[n + 1] - d->cu[n] > maxlen) maxlen = d->cu[n + 1] - d->cu[n];
    int64_t piece = 0, pieces = 0, C = 0;
    if (d->form == PA_FORM_RECURRENT) {
        if (backward) {
            for (piece = 1; piece * piece < maxlen; piece++) {}
            pieces = (maxlen + piece - 1) / piece;
        }
    } else {
        /* the parallel form: blocks of a power of two >= T (one block a sequence, two when a
         * resumed one crosses a multiple of it) */
        C = d->chunk;
        if (d->form == PA_FORM_PARALLEL)
            for (C = 1; C < maxlen; C *= 2) {}
        if (backward) pieces = maxlen / C + 2;
    }
    const double rows = (double)d->cu[d->nseq] * (double)d->H;
    const double work = rows * (double)(d->K * d->V) * (double)(d->L + 1) * 4;
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        PA_FN(ll_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(ll_scratch_alloc)(&sc, d, pieces, piece, C, c->staged),
                                    &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (!backward)
                PA_FN(ll_unit_forward)(c, un, &sc);
            else if (C)
                PA_FN(ll_unit_backward_chunk)(c, un, &sc);
            else
                PA_FN(ll_unit_backward)(c, un, &sc);
        }
        if (ok) free(sc.block);
        pa_subnormals_end(csr);
    }
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(loglin_forward)(const pa_loglin_desc *d, const void *q, const void *k,
                                 const void *v, const void *g, const void *ls, const void *h0,
                                 void *o, void *ht)
{
    const PA_FN(ll_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .ls = ls, .h0 = h0,
                              .o = o, .ht = ht,
                              .staged = PA_FN(rows_staged)(d->H * d->K, d->H * d->V)};
    return PA_FN(ll_run)(&c, 0);
}

static int PA_FN(loglin_backward)(const pa_loglin_desc *d, const void *q, const void *k,
                                  const void *v, const void *g, const void *ls, const void *h0,
                                  const void *dout, const void *dht, void *dq, void *dk, void *dv,
                                  void *dg, void *dls, void *dh0)
{
    const PA_FN(ll_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .ls = ls, .h0 = h0,
                              .dout = dout, .dht = dht, .dq = dq, .dk = dk, .dv = dv, .dg = dg,
                              .dls = dls, .dh0 = dh0,
                              .staged = PA_FN(rows_staged)(d->H * d->K, d->H * d->V)};
    return PA_FN(ll_run)(&c, 1);
}
