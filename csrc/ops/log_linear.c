/* Log-linear attention (log-linear Mamba-2), forward and backward. Template body (see
 * core/dtype.h); needs core/vmath.h and ops/decay.h before it.
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
 * Form: recurrent, per token: decay the occupied levels by exp(g_t) (only factors <= 1 are ever
 * formed, so strong gates cannot overflow), read them with q_t, then merge.
 *
 * Backward: states kept every `piece` steps (about sqrt(T)); each piece's states recomputed,
 * then stepped back with dS, the gradients reaching each level:
 *   merge:  every level 1 .. z+1 entering it gets dS_{z+1};  dk = dS_{z+1} v, dv = dS_{z+1}^T k
 *   read:   dS_l += ls_l q~ do^T,  dq~ += ls_l S_l do,  dls_l = q~ . S_l do  (l >= 1)
 *   decay:  dg = sum_l <dS_l, S_l>,  dS_l *= exp(g)
 *
 * Work is split over (sequence, head) units, each on one thread.
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
    int64_t K, V, L, piece;
    real *S, *dS;     /* (L + 1) K V each */
    real *qs, *w;     /* K each: scale q, S do */
    real *kept;       /* backward: the levels entering each piece */
    real *trail;      /* backward: one piece's levels after each step's decay */
    uint64_t *occ;    /* backward: occupancy of kept (first) and trail entries */
    void *block;
} PA_FN(ll_scratch);

static int PA_FN(ll_scratch_alloc)(PA_FN(ll_scratch) *s, const pa_loglin_desc *d, int64_t pieces,
                                   int64_t piece)
{
    const size_t r = sizeof(real), LKV = (size_t)((d->L + 1) * d->K * d->V);
    size_t bytes[] = {LKV * r, LKV * r, d->K * r, d->K * r, pieces * LKV * r, piece * LKV * r,
                      (pieces + piece + 1) * sizeof(uint64_t)};
    void **const parts[] = {(void **)&s->S,    (void **)&s->dS,    (void **)&s->qs,
                            (void **)&s->w,    (void **)&s->kept,  (void **)&s->trail,
                            (void **)&s->occ};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    s->K = d->K;
    s->V = d->V;
    s->L = d->L;
    s->piece = piece;
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

static void PA_FN(ll_unit_forward)(const PA_FN(ll_call) *c, int64_t unit, PA_FN(ll_scratch) *sc)
{
    const pa_loglin_desc *d = c->d;
    const int64_t L = d->L, KV = d->K * d->V, LKV = L * KV;
    PA_FN(ll_unit) u;
    PA_FN(ll_unit_of)(c, unit, &u);
    PA_FN(ll_levels) lv = {.S = sc->S};
    lv.occ = PA_FN(ll_enter)(c->h0 ? c->h0 + unit * LKV : NULL, lv.S, L, KV);
    for (int64_t t = 0; t < u.T; t++) PA_FN(ll_step)(&u, t, d->scale, &lv, sc, NULL, NULL);
    if (c->ht) PA_FN(ll_leave)(&lv, u.start + u.T, c->ht + unit * LKV, L, KV);
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

static int PA_FN(ll_run)(const PA_FN(ll_call) *c, int backward)
{
    const pa_loglin_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    int64_t maxlen = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        if (d->cu[n + 1] - d->cu[n] > maxlen) maxlen = d->cu[n + 1] - d->cu[n];
    int64_t piece = 1;
    while (piece * piece < maxlen) piece++;
    const int64_t pieces = backward ? (maxlen + piece - 1) / piece : 0;
    if (!backward) piece = 0;
    const double rows = (double)d->cu[d->nseq] * (double)d->H;
    const double work = rows * (double)(d->K * d->V) * (double)(d->L + 1) * 4;
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        PA_FN(ll_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(ll_scratch_alloc)(&sc, d, pieces, piece), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(ll_unit_backward)(c, un, &sc);
            else
                PA_FN(ll_unit_forward)(c, un, &sc);
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
                              .o = o, .ht = ht};
    return PA_FN(ll_run)(&c, 0);
}

static int PA_FN(loglin_backward)(const pa_loglin_desc *d, const void *q, const void *k,
                                  const void *v, const void *g, const void *ls, const void *h0,
                                  const void *dout, const void *dht, void *dq, void *dk, void *dv,
                                  void *dg, void *dls, void *dh0)
{
    const PA_FN(ll_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .ls = ls, .h0 = h0,
                              .dout = dout, .dht = dht, .dq = dq, .dk = dk, .dv = dv, .dg = dg,
                              .dls = dls, .dh0 = dh0};
    return PA_FN(ll_run)(&c, 1);
}
