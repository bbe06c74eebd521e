/* The diagonal-plus-low-rank (DPLR) delta rule (fla's generalized delta rule; RWKV-7), forward
 * and backward. Template body (see core/dtype.h); needs core/vmath.h, ops/decay.h and the
 * linear engine's description (kernels.h) before it.
 *
 * Per (sequence, head) unit, with S_0 = h0 (zeros when absent), q~ = scale q and a log decay
 * gk_t per key channel:
 *   S_t = (diag(e^gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T q~_t,
 * i.e. with w_t = S_{t-1}^T a_t:  S_t = diag(e^gk_t) S_{t-1} + b_t w_t^T + k_t v_t^T.
 *
 * Forms: recurrent, one pass over S per step (the pass that writes S_t also forms S_t^T a_{t+1}
 * for the next step); chunk, per chunk of rows with G_i the inclusive cumulative gate from the
 * chunk's start (G_{-1} = 0) and S_0 the state entering it, u_i = S_{i-1}^T a_i solves
 *   (I - A_ab) U = A_a0 S_0 + A_ak V,   A_ab[i,j] = sum_c a_ic e^(G_{i-1,c} - G_jc) b_jc (j < i),
 * A_ak likewise with k_j, A_a0 rows a_i e^G_{i-1}; then
 *   o_t = (q~_t e^G_t)^T S_0 + sum_{j<=t} A_qb[t,j] u_j + A_qk[t,j] v_j   (exponent G_t - G_j),
 *   S_C = e^G_C S_0 + sum_j (b_j e^(G_C - G_j)) u_j^T + (k_j e^(G_C - G_j)) v_j^T.
 * Every exponent is a difference taken per pair, never above 0, so no strong decay overflows.
 * The chunk form's backward is the recurrent one (the same function's gradients).
 *
 * Backward: states kept every DP_PIECE steps; each piece's states recomputed forward, then
 * stepped back one row at a time with dS, the gradient reaching S_t:
 *   dS += q~ do^T,  dq = scale S_t do,  dk = dS v,  dv = dS^T k,  db = dS w,  dw = dS^T b,
 *   da = S_{t-1} dw,  dgk = e^gk (S_{t-1} * dS) summed over V,
 *   dS_{t-1} = diag(e^gk) dS + a dw^T.
 * Only e^gk <= 1 is ever formed, so strong decays cannot overflow.
 *
 * Work is split over (sequence, head) units, each on one thread.
 */

#define DP_PIECE 64 /* backward: steps between kept states */

typedef struct {
    int64_t T;      /* rows of the sequence */
    int64_t sk, sv; /* row strides: q/k/a/b/gk, v/o */
    const real *q, *k, *v, *a, *b, *gk, *dout;
    real *o, *dq, *dk, *dv, *da, *db, *dgk;
} PA_FN(dp_unit);

typedef struct {
    const pa_linear_desc *d;
    const real *q, *k, *v, *a, *b, *gk, *h0, *dout, *dht;
    real *o, *ht, *dq, *dk, *dv, *da, *db, *dgk, *dh0;
} PA_FN(dp_call);

static void PA_FN(dp_unit_of)(const PA_FN(dp_call) *c, int64_t unit, PA_FN(dp_unit) *u)
{
    const pa_linear_desc *d = c->d;
    const pa_linear_unit_at at = pa_linear_unit(d, unit);
    const int64_t ok = at.k, ov = at.v;
    u->T = at.T;
    u->sk = d->H * d->K;
    u->sv = d->H * d->V;
    u->q = c->q + ok;
    u->k = c->k + ok;
    u->v = c->v + ov;
    u->a = c->a + ok;
    u->b = c->b + ok;
    u->gk = c->gk + ok;
    u->dout = c->dout ? c->dout + ov : NULL;
    u->o = c->o ? c->o + ov : NULL;
    u->dq = c->dq ? c->dq + ok : NULL;
    u->dk = c->dk ? c->dk + ok : NULL;
    u->dv = c->dv ? c->dv + ov : NULL;
    u->da = c->da ? c->da + ok : NULL;
    u->db = c->db ? c->db + ok : NULL;
    u->dgk = c->dgk ? c->dgk + ok : NULL;
}

/* Per-thread scratch */
typedef struct {
    int64_t K, V;
    real *e;       /* K: a step's decays e^gk */
    real *w, *dw;  /* V each: S_{t-1}^T a, its gradient */
    real *S, *dS;  /* K x V each */
    real *states;  /* backward: the state entering each piece, then one piece's states */
    int64_t C;     /* chunk form: rows per chunk (0: recurrent) */
    double *G, *Gl; /* K x C: the chunk's cumulative gate per channel, hi and lo parts */
    real *Aab, *Aak, *Aqb, *Aqk; /* C x C each: the chunk's four matrices */
    real *U;       /* C x V: u_i = S_{i-1}^T a_i */
    void *block;
} PA_FN(dp_scratch);

static int PA_FN(dp_scratch_alloc)(PA_FN(dp_scratch) *s, int64_t K, int64_t V, int64_t nstates,
                                   int64_t C)
{
    const size_t r = sizeof(real), dd = sizeof(double);
    size_t bytes[] = {K * r,     V * r,     V * r,     K * V * r, K * V * r, nstates * K * V * r,
                      K * C * dd, K * C * dd, C * C * r, C * C * r, C * C * r, C * C * r,
                      C * V * r};
    void **const parts[] = {(void **)&s->e,   (void **)&s->w,   (void **)&s->dw,
                            (void **)&s->S,   (void **)&s->dS,  (void **)&s->states,
                            (void **)&s->G,   (void **)&s->Gl,  (void **)&s->Aab,
                            (void **)&s->Aak, (void **)&s->Aqb, (void **)&s->Aqk,
                            (void **)&s->U};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    s->K = K;
    s->V = V;
    s->C = C;
    return s->block != NULL;
}

/* dst = src (K V reals), or zeros when src is NULL */
static void PA_FN(dp_copy_state)(const real *src, real *dst, int64_t KV)
{
    if (src)
        memcpy(dst, src, sizeof(real) * KV);
    else
        memset(dst, 0, sizeof(real) * KV);
}

/* e = e^gk_t over the K channels, each step clamped as the gate engines clamp it */
static void PA_FN(dp_decays)(const PA_FN(dp_unit) *u, int64_t t, real *restrict e, int64_t K)
{
    const real *restrict g = u->gk + t * u->sk;
    for (int64_t r = 0; r < K; r++) e[r] = (real)exp(PA_FN(gate_step)(g[r]));
}

/* w = S^T x over K rows of S */
static void PA_FN(dp_state_t_vec)(const real *restrict S, const real *restrict x, real *restrict w,
                                  int64_t K, int64_t V)
{
    for (int64_t j = 0; j < V; j++) w[j] = 0;
    for (int64_t r = 0; r < K; r++) PA_FN(axpy)(w, S + r * V, V, x[r]);
}

/* Steps t0 .. t0+n-1 on S in place (S holds the entering state); o rows written when u->o;
 * with trail, the state after each step goes to trail + i K V. */
static void PA_FN(dp_recurrent)(const PA_FN(dp_unit) *u, int64_t t0, int64_t n, double scale,
                                real *restrict S, real *trail, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V;
    real *restrict w = sc->w, *restrict e = sc->e;
    const real sq = (real)scale;
    if (n > 0) PA_FN(dp_state_t_vec)(S, u->a + t0 * u->sk, w, K, V);
    for (int64_t t = t0; t < t0 + n; t++) {
        const real *restrict kt = u->k + t * u->sk, *restrict qt = u->q + t * u->sk;
        const real *restrict bt = u->b + t * u->sk, *restrict vt = u->v + t * u->sv;
        /* the next step's a (this one's on the last step: its product goes unused) */
        const real *restrict an = u->a + (t + 1 < t0 + n ? t + 1 : t) * u->sk;
        real *ot = u->o ? u->o + t * u->sv : NULL;
        PA_FN(dp_decays)(u, t, e, K);
        for (int64_t j = 0; j < V; j += VL) {
            const int64_t left = V - j;
            const vreal vw = PA_FN(row_ld)(w + j, left), vv = PA_FN(row_ld)(vt + j, left);
            vreal o0 = PA_FN(vset)(0), o1 = o0, w0 = o0, w1 = o0;
            for (int64_t r = 0; r < K; r++) {
                const vreal x = e[r] * PA_FN(row_ld)(S + r * V + j, left) + bt[r] * vw + kt[r] * vv;
                PA_FN(row_st)(S + r * V + j, x, left);
                if (r % 2) {
                    o1 += (sq * qt[r]) * x;
                    w1 += an[r] * x;
                } else {
                    o0 += (sq * qt[r]) * x;
                    w0 += an[r] * x;
                }
            }
            if (ot) PA_FN(row_st)(ot + j, o0 + o1, left);
            PA_FN(row_st)(w + j, w0 + w1, left);
        }
        if (trail) memcpy(trail + (t - t0) * K * V, S, sizeof(real) * K * V);
    }
}

/* e^(G_i - G_j) of channel c's cumulative gate (j < 0: e^G_i; i < 0: 1, the chunk's start) */
static inline double PA_FN(dp_chunk_decay)(const PA_FN(dp_scratch) *sc, int64_t c, int64_t i,
                                           int64_t j)
{
    const double *G = sc->G + c * sc->C, *Gl = sc->Gl + c * sc->C;
    return i < 0 ? 1 : exp(PA_FN(gate_diff)(G, Gl, i, j));
}

/* Rows t0 .. t0+n-1 (n <= sc->C) as one chunk on S in place (S holds the entering state); o
 * rows written when u->o. */
static void PA_FN(dp_chunk)(const PA_FN(dp_unit) *u, int64_t t0, int64_t n, double scale,
                            real *restrict S, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, C = sc->C, sk = u->sk, sv = u->sv;
    const real *q = u->q + t0 * sk, *k = u->k + t0 * sk, *a = u->a + t0 * sk, *b = u->b + t0 * sk;
    const real *v = u->v + t0 * sv;
    real *restrict U = sc->U;
    for (int64_t c = 0; c < K; c++)
        PA_FN(gate_cumsum)(u->gk + t0 * sk + c, sk, n, 0, sc->G + c * C, sc->Gl + c * C);
    /* the four matrices: rows read S_{i-1} (A_ab, A_ak, strictly lower) or S_t (A_qb, A_qk) */
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j <= i; j++) {
            double ab = 0, ak = 0, qb = 0, qk = 0;
            for (int64_t c = 0; c < K; c++) {
                const double et = PA_FN(dp_chunk_decay)(sc, c, i, j);
                const double ex = j < i ? PA_FN(dp_chunk_decay)(sc, c, i - 1, j) : 0;
                const double bj = b[j * sk + c], kj = k[j * sk + c];
                qb += q[i * sk + c] * et * bj;
                qk += q[i * sk + c] * et * kj;
                ab += a[i * sk + c] * ex * bj;
                ak += a[i * sk + c] * ex * kj;
            }
            sc->Aqb[i * C + j] = (real)(scale * qb);
            sc->Aqk[i * C + j] = (real)(scale * qk);
            sc->Aab[i * C + j] = (real)ab;
            sc->Aak[i * C + j] = (real)ak;
        }
    /* U by forward substitution; o_t from S_0, U and V */
    for (int64_t i = 0; i < n; i++) {
        real *restrict ui = U + i * V, *restrict ot = u->o ? u->o + (t0 + i) * sv : NULL;
        for (int64_t x = 0; x < V; x++) ui[x] = 0;
        for (int64_t c = 0; c < K; c++)
            PA_FN(axpy)(ui, S + c * V, V, (real)(a[i * sk + c] * PA_FN(dp_chunk_decay)(sc, c, i - 1, -1)));
        for (int64_t j = 0; j < i; j++) {
            PA_FN(axpy)(ui, v + j * sv, V, sc->Aak[i * C + j]);
            PA_FN(axpy)(ui, U + j * V, V, sc->Aab[i * C + j]);
        }
        if (!ot) continue;
        for (int64_t x = 0; x < V; x++) ot[x] = 0;
        for (int64_t c = 0; c < K; c++)
            PA_FN(axpy)(ot, S + c * V, V,
                        (real)(scale * q[i * sk + c] * PA_FN(dp_chunk_decay)(sc, c, i, -1)));
        for (int64_t j = 0; j <= i; j++) {
            PA_FN(axpy)(ot, v + j * sv, V, sc->Aqk[i * C + j]);
            PA_FN(axpy)(ot, U + j * V, V, sc->Aqb[i * C + j]);
        }
    }
    /* the state leaving the chunk, row by row (row c reads only row c of S_0) */
    for (int64_t c = 0; c < K; c++) {
        real *restrict row = S + c * V;
        const real e = (real)PA_FN(dp_chunk_decay)(sc, c, n - 1, -1);
        for (int64_t x = 0; x < V; x++) row[x] *= e;
        for (int64_t j = 0; j < n; j++) {
            const double ej = PA_FN(dp_chunk_decay)(sc, c, n - 1, j);
            PA_FN(axpy)(row, U + j * V, V, (real)(b[j * sk + c] * ej));
            PA_FN(axpy)(row, v + j * sv, V, (real)(k[j * sk + c] * ej));
        }
    }
}

/* Steps t0+n-1 down to t0 in reverse, from their states (trail: the state entering t0, then
 * the state after each step) and dS, the gradient reaching the last one (on return, the one
 * reaching the state entering t0). */
static void PA_FN(dp_recurrent_reverse)(const PA_FN(dp_unit) *u, int64_t t0, int64_t n,
                                        double scale, const real *trail, real *restrict dS,
                                        PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, KV = K * V;
    real *restrict w = sc->w, *restrict dw = sc->dw, *restrict e = sc->e;
    const real sq = (real)scale;
    for (int64_t t = t0 + n - 1; t >= t0; t--) {
        const real *restrict Sp = trail + (t - t0) * KV, *restrict Sc = Sp + KV;
        const real *restrict kt = u->k + t * u->sk, *restrict qt = u->q + t * u->sk;
        const real *restrict at = u->a + t * u->sk, *restrict bt = u->b + t * u->sk;
        const real *restrict gt = u->gk + t * u->sk, *restrict vt = u->v + t * u->sv;
        const real *restrict dot_ = u->dout + t * u->sv;
        real *restrict dqt = u->dq + t * u->sk, *restrict dkt = u->dk + t * u->sk;
        real *restrict dat = u->da + t * u->sk, *restrict dbt = u->db + t * u->sk;
        real *restrict dgt = u->dgk + t * u->sk, *restrict dvt = u->dv + t * u->sv;
        PA_FN(dp_decays)(u, t, e, K);
        PA_FN(dp_state_t_vec)(Sp, at, w, K, V);
        for (int64_t j = 0; j < V; j++) dw[j] = dvt[j] = 0;
        for (int64_t r = 0; r < K; r++) { /* dS += q~ do^T, then the write terms' gradients */
            real *restrict row = dS + r * V;
            dqt[r] = sq * PA_FN(dot)(Sc + r * V, dot_, V);
            PA_FN(axpy)(row, dot_, V, sq * qt[r]);
            dkt[r] = PA_FN(dot)(row, vt, V);
            dbt[r] = PA_FN(dot)(row, w, V);
            PA_FN(axpy)(dw, row, V, bt[r]);
            PA_FN(axpy)(dvt, row, V, kt[r]);
        }
        for (int64_t r = 0; r < K; r++) { /* through the transition to S_{t-1} */
            real *restrict row = dS + r * V;
            const real *restrict sp = Sp + r * V;
            dat[r] = PA_FN(dot)(sp, dw, V);
            /* a clamped step's gradient is 0, as exp's is below the clamp */
            dgt[r] = gt[r] < -PA_GATE_RESET ? 0 : e[r] * PA_FN(dot)(sp, row, V);
            for (int64_t j = 0; j < V; j++) row[j] = e[r] * row[j] + at[r] * dw[j];
        }
    }
}

static void PA_FN(dp_unit_forward)(const PA_FN(dp_call) *c, int64_t unit, PA_FN(dp_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V;
    PA_FN(dp_unit) u;
    PA_FN(dp_unit_of)(c, unit, &u);
    PA_FN(dp_copy_state)(c->h0 ? c->h0 + unit * KV : NULL, sc->S, KV);
    if (sc->C)
        for (int64_t t0 = 0; t0 < u.T; t0 += sc->C)
            PA_FN(dp_chunk)(&u, t0, u.T - t0 < sc->C ? u.T - t0 : sc->C, d->scale, sc->S, sc);
    else
        PA_FN(dp_recurrent)(&u, 0, u.T, d->scale, sc->S, NULL, sc);
    if (c->ht) memcpy(c->ht + unit * KV, sc->S, sizeof(real) * KV);
}

/* The backward of one unit: the states entering its pieces, then one reverse pass carrying
 * dS. */
static void PA_FN(dp_unit_backward)(const PA_FN(dp_call) *c, int64_t unit, PA_FN(dp_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V;
    PA_FN(dp_unit) u;
    PA_FN(dp_unit_of)(c, unit, &u);
    const int64_t np = (u.T + DP_PIECE - 1) / DP_PIECE;
    real *states = sc->states, *dS = sc->dS;
    PA_FN(dp_copy_state)(c->h0 ? c->h0 + unit * KV : NULL, states, KV);
    for (int64_t p = 0; p < np; p++) {
        const int64_t r0 = p * DP_PIECE, n = u.T - r0 < DP_PIECE ? u.T - r0 : DP_PIECE;
        real *S = states + (p + 1) * KV;
        memcpy(S, S - KV, sizeof(real) * KV);
        PA_FN(dp_recurrent)(&u, r0, n, d->scale, S, NULL, sc);
    }
    PA_FN(dp_copy_state)(c->dht ? c->dht + unit * KV : NULL, dS, KV);
    real *trail = states + (np + 1) * KV; /* a piece's states */
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t r0 = p * DP_PIECE, n = u.T - r0 < DP_PIECE ? u.T - r0 : DP_PIECE;
        memcpy(trail, states + p * KV, sizeof(real) * KV);
        memcpy(sc->S, trail, sizeof(real) * KV);
        PA_FN(dp_recurrent)(&u, r0, n, d->scale, sc->S, trail + KV, sc);
        PA_FN(dp_recurrent_reverse)(&u, r0, n, d->scale, trail, dS, sc);
    }
    if (c->dh0) memcpy(c->dh0 + unit * KV, dS, sizeof(real) * KV);
}

static int PA_FN(dp_run)(const PA_FN(dp_call) *c, int backward)
{
    const pa_linear_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    const int64_t maxlen = pa_linear_max_len(d);
    /* backward: the state entering each piece and the last, then one piece's states */
    const int64_t nstates = backward ? (maxlen + DP_PIECE - 1) / DP_PIECE + 1 + DP_PIECE + 1 : 0;
    const double rows = (double)d->cu[d->nseq] * (double)d->H, KV = (double)(d->K * d->V);
    /* multiply-adds; a step streams its state through memory, so it weighs more */
    const double work = rows * KV * 10;
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    const int64_t C = !backward && d->form == PA_FORM_CHUNK ? d->chunk : 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        PA_FN(dp_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(dp_scratch_alloc)(&sc, d->K, d->V, nstates, C), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(dp_unit_backward)(c, un, &sc);
            else
                PA_FN(dp_unit_forward)(c, un, &sc);
        }
        if (ok) free(sc.block);
        pa_subnormals_end(csr);
    }
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(dplr_forward)(const pa_linear_desc *d, const void *q, const void *k,
                               const void *v, const void *a, const void *b, const void *gk,
                               const void *h0, void *o, void *ht)
{
    const PA_FN(dp_call) c = {.d = d, .q = q, .k = k, .v = v, .a = a, .b = b, .gk = gk,
                              .h0 = h0, .o = o, .ht = ht};
    return PA_FN(dp_run)(&c, 0);
}

static int PA_FN(dplr_backward)(const pa_linear_desc *d, const void *q, const void *k,
                                const void *v, const void *a, const void *b, const void *gk,
                                const void *h0, const void *dout, const void *dht, void *dq,
                                void *dk, void *dv, void *da, void *db, void *dgk, void *dh0)
{
    const PA_FN(dp_call) c = {.d = d, .q = q, .k = k, .v = v, .a = a, .b = b, .gk = gk,
                              .h0 = h0, .dout = dout, .dht = dht, .dq = dq, .dk = dk, .dv = dv,
                              .da = da, .db = db, .dgk = dgk, .dh0 = dh0};
    return PA_FN(dp_run)(&c, 1);
}
