/* The delta-rule engine (DeltaNet, Gated DeltaNet, Kimi Delta Attention), forward and
 * backward. Template body (see core/dtype.h); needs core/vmath.h, core/gemm.c, ops/rows.h,
 * ops/decay.h and ops/linear_engine.h (the gate sides it shares with the linear engine:
 * cumulative gates, the gated Gram and triangular products, row factors) before it.
 *
 * Per (sequence, value head) unit, with S_0 = h0 (zeros when absent), q~ = scale q and a log
 * gate g per step, absent (0), a scalar, or a K-vector (one decay per key channel, KDA):
 *   S_t = (I - beta_t k_t k_t^T) diag(e^g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q~_t,
 * i.e. with the decayed state D_t = diag(e^g_t) S_{t-1} and the step's new value
 * u_t = beta_t (v_t - D_t^T k_t):  S_t = D_t + k_t u_t^T. (A scalar gate commutes with
 * I - beta k k^T: Gated DeltaNet's e^g_t (I - beta_t k_t k_t^T) S_{t-1}.) q and k may have
 * fewer heads than v (groups): value head h reads head h / (H / Hqk), and the backward sums a
 * group's heads into dq and dk (la_group_heads).
 *
 * Forms. recurrent: that step, one pass over S per step (the pass that writes S_t also forms
 * D_{t+1}^T k_{t+1} = S_t^T (e^g_{t+1} k_{t+1}) for the next step). chunk (the WY / UT form):
 * blocks of l rows, G the inclusive cumulative gate inside the block (per channel; every
 * exponent below is <= 0), f_i = e^G_i and f'_i = e^(G_last - G_i) the rows' factors to the
 * block's start and end, E_ij = e^(G_i - G_j) (j <= i) inside the sums over channels:
 *   A' = strictly-lower(sum_c k_ic k_jc E_ijc)   (the key side's gated Gram, la_gram),
 *   A  = diag(beta) A',
 *   Z = [W | U] = (I + A)^-1 [diag(beta) (K f) | diag(beta) V]   (forward substitution by
 *       DR_SUB-row diagonal blocks, GEMMs below them; the inverse is never formed),
 *   V' = U - W S  (the rows' u_t, from the state S entering the block),
 *   O  = (Q~ f) S + P V',   P = lower(sum_c q~_ic k_jc E_ijc) (diagonal included),
 *   S' = diag(e^G_last) S + (K f')^T V'.
 * The gate side (la_side) gives every product for each kind: without a gate E = 1; a scalar
 * gate's E is a mask; a vector gate's Grams and triangular products take the linear engine's
 * factored or sub-block forms, so every factor stays bounded however strong the gate.
 * parallel: the chunk algorithm with one block per sequence.
 *
 * Backward. chunk and parallel: a forward pass keeps the state entering each block (one K x V
 * state per block of the unit in progress); blocks in reverse then recompute A, Z, V' and,
 * with dS' the gradient reaching S':
 *   dV' = P^T dO + (K f') dS',   dW = -dV' S^T,
 *   dR = [dX | dY] = (I + A)^-T [dW | dV'],   dA = -strictly-lower(dR Z^T),
 *   dS = diag(e^G_last) dS' + (Q~ f)^T dO - W^T dV',
 * and q, k, v, beta take the products' derivatives: dP = dO V'^T and dA' = diag(beta) dA
 * reach q and k through the gated triangular products (la_apply) from both ends. The gate's
 * gradient dG_i is the derivative of every factor with respect to G_i, per channel (summed
 * over channels for a scalar gate): a factor x e^(+G_i) adds x dx, one x e^(-G_i) subtracts
 * it. So over the off-diagonal pairs of P, q~_i times the gradient q_i gets from row i's
 * pairs, minus k_i times the one k_i gets from column i's; over those of A' the same with k
 * at both ends; beta_i (k_i f_i) dX_i; q~_i f_i (S dO_i); -(k_i f'_i)(V'_i dS'^T); and, for
 * the last row, those f' terms summed plus e^G_last rowsum(S * dS'). dg is dG summed in
 * reverse inside the block. Only bounded factors appear, and a row's pair with itself in P
 * (E = 1, the same term at both ends) is added to dq and dk after the gate's terms are
 * taken: strong gates neither overflow nor leave the rounding of large cancelling terms.
 * recurrent: states kept every DR_PIECE steps; each piece's states recomputed, then stepped
 * back one row at a time.
 *
 * Work is split over (sequence, head) units, each on one thread. Where a unit's rows lie a
 * multiple of 1 KiB apart, the chunk and parallel forms work on a copy of each block's rows,
 * contiguous (dr_stage), and copy its output rows back.
 */

#define DR_SUB 16   /* rows of a diagonal block of the triangular solves */
#define DR_PIECE 64 /* recurrent backward: steps between kept states */

typedef struct {
    int64_t T;              /* rows of the sequence */
    int gate;               /* PA_GATE_* */
    int64_t sq, sk, sv, sg, sb; /* row strides: q/k, dq/dk, v/o, g/dg, beta */
    const real *q, *k, *v, *g, *beta, *dout;
    real *o, *dq, *dk, *dv, *dg, *dbeta;
} PA_FN(dr_unit);

typedef struct {
    const pa_linear_desc *d;
    const real *q, *k, *v, *g, *beta, *h0, *dout, *dht;
    real *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dh0;
    real *states;         /* chunk form: the kept states (forward: written; backward: read) */
    const int64_t *first; /* their layout (la_slots) when given */
    int stream;           /* kept states and staged outputs put with non-temporal stores */
    int staged;           /* blocks staged contiguous (rows_staged) */
} PA_FN(dr_call);

static void PA_FN(dr_unit_of)(const PA_FN(dr_call) *c, int64_t unit, PA_FN(dr_unit) *u)
{
    const pa_linear_desc *d = c->d;
    const pa_linear_unit_at at = pa_linear_unit(d, unit);
    const int vec = d->gk == PA_GATE_VECTOR;
    u->T = at.T;
    u->gate = d->gk;
    u->sq = d->Hqk * d->K;
    u->sk = d->H * d->K;
    u->sv = d->H * d->V;
    u->sg = vec ? d->H * d->K : d->H;
    u->sb = d->H;
    /* q and k have Hqk heads: value head h reads head h / (H / Hqk) */
    const int64_t oq = at.r0 * u->sq + at.h / (d->H / d->Hqk) * d->K;
    const int64_t ok = at.k, ov = at.v, og = vec ? at.k : at.row, ob = at.row;
    u->q = c->q + oq;
    u->k = c->k + oq;
    u->v = c->v + ov;
    u->g = c->g ? c->g + og : NULL;
    u->beta = c->beta + ob;
    u->dout = c->dout ? c->dout + ov : NULL;
    u->o = c->o ? c->o + ov : NULL;
    u->dq = c->dq ? c->dq + ok : NULL;
    u->dk = c->dk ? c->dk + ok : NULL;
    u->dv = c->dv ? c->dv + ov : NULL;
    u->dg = c->dg ? c->dg + og : NULL;
    u->dbeta = c->dbeta ? c->dbeta + ob : NULL;
}

/* Per-thread scratch for blocks of up to L rows (L = 0: the recurrent form's). */
typedef struct {
    int64_t L, K, V;
    PA_FN(la_side) ks;     /* the block's key side: its gate as the products take it */
    double *Gs;            /* 2 L: a scalar gate's cumulative sums, hi then lo parts */
    real *Gk, *Ek;         /* 2 L K, (2 L + 1) K: a vector gate's (hi, lo), its factors */
    double *acc;           /* 2 K: the vector gate's running sums */
    double *dG;            /* L K: the gate's gradient per row (and channel, for a vector) */
    real *bet, *dp;        /* L each: beta_i, the diagonal of dP */
    real *Dm, *M, *A, *P, *E; /* L x L each: a scalar gate's mask, A', A, P, dP or dA */
    real *Z, *R;           /* L x (K + V) each: [W | U], then [dW | dV'] and [dX | dY] */
    real *Vn;              /* L x V: V' */
    real *Tk, *Tq, *Tr;    /* L x K each */
    real *dec, *kd, *f;    /* 2 K, K, K: a recurrent step's decays (this step's, the next's),
                            * the next key times its decays; a block's total decay */
    real *w, *uv, *du;     /* V each: a recurrent step's D^T k, u, du */
    real *S, *dS;          /* K x V each */
    real *states;          /* backward: the kept states */
    real *stage;           /* a block's input and output rows, contiguous (dr_stage) */
    real *Bp;              /* one operand packed once for the products below */
    int64_t *rows;         /* L: the non-finite rows of a triangular product's operand */
    real *work;            /* GEMM packing of the other operand */
    PA_FN(la_bufs) bufs;   /* the gated products' (Tm, U: L x K, M: L x L; Bp, rows, work above) */
    void *block;
} PA_FN(dr_scratch);

/* Bytes of the two GEMM buffers of a delta-family chunk scratch (this engine's and dplr's),
 * blocks of L rows by K + V columns: one packed operand (*packed) and a GEMM's packing
 * workspace (*work) for products up to max(L, K + V) square; none for L = 0 (no chunks). */
static void PA_FN(dr_gemm_bytes)(int64_t L, int64_t K, int64_t V, size_t *packed, size_t *work)
{
    const int64_t big = L > K + V ? L : K + V;
    *packed = L ? (size_t)PA_FN(packed_b_elems)(big, big) * sizeof(real) : 0;
    *work = L ? (size_t)PA_FN(gemm_work_elems)(big, big, big) * sizeof(real) : 0;
}

/* The end of a delta-family scratch allocation: the gated products' buffers (la_bufs) share
 * the scratch's packed operand, row list and workspace. */
static void PA_FN(dr_scratch_link)(PA_FN(la_bufs) *bufs, real *Bp, int64_t *rows, real *work)
{
    bufs->Bp = Bp;
    bufs->rows = rows;
    bufs->work = work;
}

/* staged: room to stage a block (dr_stage) */
static int PA_FN(dr_scratch_alloc)(PA_FN(dr_scratch) *s, int64_t L, int64_t K, int64_t V,
                                   int64_t nstates, int staged)
{
    const int64_t W = K + V;
    const size_t r = sizeof(real), dbl = sizeof(double), LL = L * L * r, LK = L * K * r;
    size_t packed, work;
    PA_FN(dr_gemm_bytes)(L, K, V, &packed, &work);
    size_t bytes[] = {2 * L * dbl, 2 * LK, (2 * L + 1) * K * r, 2 * K * dbl, L * K * dbl,
                      L * r, L * r, LL, LL, LL, LL, LL, L * W * r, L * W * r, L * V * r,
                      LK, LK, LK, 2 * K * r, K * r, K * r, V * r, V * r, V * r,
                      K * V * r, K * V * r, nstates * K * V * r,
                      staged ? L * (6 * K + 3 * V + 2) * r : 0,
                      packed, L * sizeof(int64_t), work, LK, LK, LL};
    void **const parts[] = {(void **)&s->Gs, (void **)&s->Gk, (void **)&s->Ek, (void **)&s->acc,
                            (void **)&s->dG, (void **)&s->bet, (void **)&s->dp, (void **)&s->Dm,
                            (void **)&s->M, (void **)&s->A, (void **)&s->P, (void **)&s->E,
                            (void **)&s->Z, (void **)&s->R, (void **)&s->Vn, (void **)&s->Tk,
                            (void **)&s->Tq, (void **)&s->Tr, (void **)&s->dec, (void **)&s->kd,
                            (void **)&s->f, (void **)&s->w, (void **)&s->uv, (void **)&s->du,
                            (void **)&s->S, (void **)&s->dS, (void **)&s->states,
                            (void **)&s->stage, (void **)&s->Bp,
                            (void **)&s->rows, (void **)&s->work, (void **)&s->bufs.Tm,
                            (void **)&s->bufs.U, (void **)&s->bufs.M};
    if (!(s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]))))
        return 0;
    s->L = L;
    s->K = K;
    s->V = V;
    PA_FN(dr_scratch_link)(&s->bufs, s->Bp, s->rows, s->work);
    return 1;
}

/* dst = src (K V reals), or zeros when src is NULL */
static void PA_FN(dr_copy_state)(const real *src, real *dst, int64_t KV)
{
    if (src)
        memcpy(dst, src, sizeof(real) * KV);
    else
        memset(dst, 0, sizeof(real) * KV);
}

/* a[0..K) = the decays e^g of step t per channel: a vector gate's own, a scalar gate's
 * repeated, ones without a gate; clamped (gate_step) as the block's cumulative sums are */
static void PA_FN(dr_step_decays)(const PA_FN(dr_unit) *u, int64_t t, int64_t K, real *a)
{
    const real *g = u->g ? u->g + t * u->sg : NULL;
    if (u->gate == PA_GATE_VECTOR) {
        for (int64_t c = 0; c < K; c++) a[c] = (real)PA_FN(gate_step)(g[c]);
        PA_FN(exp_array)(a, a, K);
        return;
    }
    const real e = g ? (real)exp(PA_FN(gate_step)(g[0])) : 1;
    for (int64_t c = 0; c < K; c++) a[c] = e;
}

/* ---- the recurrent form ---- */

/* Steps t0 .. t0+n-1 from the entering state S0 (NULL: zeros; may be S) into S; o rows
 * written when u->o; with trail, the state after each step goes to trail + i K V. The state
 * is swept by columns of one vector: the new rows are written while the output and the next
 * step's D^T k accumulate in registers, so S is read once and written once per step. */
static void PA_FN(dr_recurrent)(const PA_FN(dr_unit) *u, int64_t t0, int64_t n, double scale,
                                const real *S0, real *S, real *trail, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V;
    real *restrict w = sc->w, *restrict uv = sc->uv, *restrict kd = sc->kd;
    real *a = sc->dec, *an = sc->dec + K; /* this step's decays, the next one's */
    if (n == 0) {
        if (S0 != S) PA_FN(dr_copy_state)(S0, S, K * V);
        return;
    }
    PA_FN(dr_step_decays)(u, t0, K, a);
    for (int64_t r = 0; r < K; r++) kd[r] = a[r] * u->k[t0 * u->sq + r];
    for (int64_t j = 0; j < V; j += VL) { /* w = D^T k = S0^T (e^g k) */
        vreal a0 = PA_FN(vset)(0), a1 = a0;
        for (int64_t r = 0; S0 && r + 1 < K; r += 2) {
            a0 += kd[r] * PA_FN(row_ld)(S0 + r * V + j, V - j);
            a1 += kd[r + 1] * PA_FN(row_ld)(S0 + (r + 1) * V + j, V - j);
        }
        if (S0 && K % 2) a0 += kd[K - 1] * PA_FN(row_ld)(S0 + (K - 1) * V + j, V - j);
        PA_FN(row_st)(w + j, a0 + a1, V - j);
    }
    for (int64_t t = t0; t < t0 + n; t++) {
        const real b = u->beta[t * u->sb], sq = (real)scale;
        const real *restrict kt = u->k + t * u->sq, *restrict qt = u->q + t * u->sq;
        const real *restrict vt = u->v + t * u->sv;
        const real *src = t == t0 ? S0 : S;
        real *ot = u->o ? u->o + t * u->sv : NULL;
        for (int64_t j = 0; j < V; j++) uv[j] = b * (vt[j] - w[j]);
        if (t + 1 < t0 + n) { /* the next step's decayed key, for its D^T k */
            PA_FN(dr_step_decays)(u, t + 1, K, an);
            for (int64_t r = 0; r < K; r++) kd[r] = an[r] * kt[u->sq + r];
        }
        for (int64_t j = 0; j < V; j += VL) {
            const int64_t left = V - j;
            const vreal vu = PA_FN(row_ld)(uv + j, left);
            vreal o0 = PA_FN(vset)(0), o1 = o0, w0 = o0, w1 = o0;
            for (int64_t r = 0; r < K; r++) {
                /* a zero entering state still takes its decay: 0 e^NaN is NaN */
                const vreal x = a[r] * (src ? PA_FN(row_ld)(src + r * V + j, left) : PA_FN(vset)(0)) +
                                kt[r] * vu;
                PA_FN(row_st)(S + r * V + j, x, left);
                if (r % 2) {
                    o1 += (sq * qt[r]) * x;
                    w1 += kd[r] * x;
                } else {
                    o0 += (sq * qt[r]) * x;
                    w0 += kd[r] * x;
                }
            }
            if (ot) PA_FN(row_st)(ot + j, o0 + o1, left);
            PA_FN(row_st)(w + j, w0 + w1, left);
        }
        real *swap = a;
        a = an;
        an = swap;
        if (trail) memcpy(trail + (t - t0) * K * V, S, sizeof(real) * K * V);
    }
}

/* Steps t0+n-1 down to t0 in reverse, from their states (trail: the state entering t0, then
 * the state after each step) and dS, the gradient reaching the last one (on return, the one
 * reaching the state entering t0). */
static void PA_FN(dr_recurrent_reverse)(const PA_FN(dr_unit) *u, int64_t t0, int64_t n,
                                        double scale, const real *trail, real *restrict dS,
                                        PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, KV = K * V;
    real *restrict w = sc->w, *restrict uv = sc->uv, *restrict du = sc->du;
    real *restrict a = sc->dec;
    const real sc_ = (real)scale;
    const int vec = u->gate == PA_GATE_VECTOR;
    for (int64_t t = t0 + n - 1; t >= t0; t--) {
        const real *restrict Sp = trail + (t - t0) * KV, *restrict Sc = Sp + KV;
        const real b = u->beta[t * u->sb];
        const real *restrict kt = u->k + t * u->sq, *restrict qt = u->q + t * u->sq;
        const real *restrict vt = u->v + t * u->sv, *restrict dot_ = u->dout + t * u->sv;
        real *restrict dqt = u->dq + t * u->sk, *restrict dkt = u->dk + t * u->sk;
        real *restrict dvt = u->dv + t * u->sv;
        PA_FN(dr_step_decays)(u, t, K, a);
        for (int64_t j = 0; j < V; j++) w[j] = du[j] = 0;
        for (int64_t r = 0; r < K; r++) { /* dS += q~ do^T; du = dS^T k; D^T k = S_{t-1}^T (a k) */
            real *restrict row = dS + r * V;
            const real qr = sc_ * qt[r], kr = kt[r], kar = a[r] * kt[r];
            dqt[r] = sc_ * PA_FN(dot)(Sc + r * V, dot_, V);
            for (int64_t j = 0; j < V; j++) {
                row[j] += qr * dot_[j];
                du[j] += kr * row[j];
                w[j] += kar * Sp[r * V + j];
            }
        }
        double db = 0;
        for (int64_t j = 0; j < V; j++) {
            const real res = vt[j] - w[j]; /* v - D^T k */
            uv[j] = b * res;
            db += (double)du[j] * res;
            dvt[j] = b * du[j];
        }
        u->dbeta[t * u->sb] = (real)db;
        /* dD = dS - beta k du^T; dS_{t-1} = diag(a) dD; dg = a * rowsum(S_{t-1} * dD) per
         * channel (summed for a scalar gate): a product, so strong gates keep their digits */
        double dg = 0;
        real *dgt = u->dg ? u->dg + t * u->sg : NULL;
        const real *gt = u->g ? u->g + t * u->sg : NULL;
        for (int64_t r = 0; r < K; r++) {
            real *restrict row = dS + r * V;
            const real *restrict sp = Sp + r * V;
            const real kr = b * kt[r];
            dkt[r] = PA_FN(dot)(row, uv, V) - b * a[r] * PA_FN(dot)(sp, du, V);
            for (int64_t j = 0; j < V; j++) row[j] -= kr * du[j];
            if (dgt && vec)
                dgt[r] = gt[r] < -PA_GATE_RESET ? 0 : a[r] * PA_FN(dot)(sp, row, V);
            else if (dgt)
                dg += (double)PA_FN(dot)(sp, row, V);
            for (int64_t j = 0; j < V; j++) row[j] *= a[r];
        }
        if (dgt && !vec) dgt[0] = gt[0] < -PA_GATE_RESET ? 0 : (real)(a[0] * dg);
    }
}

/* The recurrent steps of n rows backward go by pieces of DR_PIECE rows: their room holds the
 * state entering each piece (the first given), then a piece's steps (DR_PIECE + 1 states). */
static int64_t PA_FN(dr_pieces)(int64_t n)
{
    return (n + DR_PIECE - 1) / DR_PIECE;
}

/* That room for n rows of K x V states entering with S, allocated (NULL where it cannot be
 * had); the delta and DPLR chunk backwards' blocks that *_rows_unclean flags */
static real *PA_FN(dr_reverse_room)(const real *S, int64_t n, int64_t KV)
{
    real *room = pa_alloc(sizeof(real) * (size_t)((PA_FN(dr_pieces)(n) + DR_PIECE + 1) * KV));
    if (room) memcpy(room, S, sizeof(real) * KV);
    return room;
}

/* Rows r0 .. r0+n-1 of unit u in reverse by the recurrent form's steps, in the room
 * (dr_pieces) whose first state enters them. dS as in dr_recurrent_reverse. */
static void PA_FN(dr_rows_reverse)(const PA_FN(dr_unit) *u, int64_t r0, int64_t n, double scale,
                                   real *bounds, real *dS, PA_FN(dr_scratch) *sc)
{
    const int64_t KV = sc->K * sc->V, np = PA_FN(dr_pieces)(n);
    real *trail = bounds + np * KV;
    for (int64_t p = 0; p + 1 < np; p++)
        PA_FN(dr_recurrent)(u, r0 + p * DR_PIECE, DR_PIECE, scale, bounds + p * KV,
                            bounds + (p + 1) * KV, NULL, sc);
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t t0 = r0 + p * DR_PIECE, m = n - p * DR_PIECE < DR_PIECE ? n - p * DR_PIECE : DR_PIECE;
        memcpy(trail, bounds + p * KV, sizeof(real) * KV);
        PA_FN(dr_recurrent)(u, t0, m, scale, trail, sc->S, trail + KV, sc);
        PA_FN(dr_recurrent_reverse)(u, t0, m, scale, trail, dS, sc);
    }
}

/* Whether rows r0 .. r0+n-1 of a unit hold a NaN gate or a value that is not finite. The
 * chunk form's backward would then spread NaN over gradients of its block that the
 * recurrence keeps finite (the prefix sums of a NaN gate are NaN for every later pair of
 * rows, a NaN value reaches every row's gate gradient through the block's Grams); such a
 * block takes the recurrent steps instead. A gate of -inf (a reset) is finite arithmetic
 * there and counts as clean. */
static int PA_FN(dr_rows_unclean)(const PA_FN(dr_unit) *u, int64_t r0, int64_t n, int64_t K,
                                  int64_t V)
{
    const int64_t G = u->gate == PA_GATE_VECTOR ? K : 1;
    return PA_FN(la_rows_bad)(1, &u->g, &u->sg, &G, r0, n, 1) ||
           PA_FN(la_rows_bad)(1, &u->v, &u->sv, &V, r0, n, 0);
}

/* ---- the chunk form's building blocks ---- */

/* Rows r0 .. r1-1 of the l x N matrix B (rows of ldb) into Bp, packed as pack_b packs all l
 * rows (panels of NR columns l NR apart, row r at r NR inside): a packing filled a few rows at
 * a time, or read from row r on (Bp + r NR). */
static void PA_FN(dr_pack_rows)(int64_t r0, int64_t r1, int64_t l, int64_t N, const real *B,
                                int64_t ldb, real *Bp)
{
    for (int64_t j = 0; j < N; j += NR)
        PA_FN(pack_b)(r1 - r0, N - j < NR ? N - j : NR, B + r0 * ldb + j, ldb, 1,
                      Bp + j * l + r0 * NR);
}

/* Solves (I + A) X = X in place for the unit lower triangular I + A (A l x l strictly lower,
 * leading dimension l; X l x W): DR_SUB-row blocks, a GEMM for everything left of a block's
 * diagonal, substitution inside it; the solved rows are packed once, as they are finished,
 * for the GEMMs of the blocks below (Bp). */
static void PA_FN(dr_solve_lower)(const real *A, int64_t l, real *X, int64_t W, real *Bp,
                                  real *work)
{
    const int products = pa_bf16_products_begin(0); /* a substitution's error would compound */
    for (int64_t b0 = 0; b0 < l; b0 += DR_SUB) {
        const int64_t b1 = b0 + DR_SUB < l ? b0 + DR_SUB : l;
        PA_FN(gemm_packed_b)(b1 - b0, W, b0, -1, A + b0 * l, l, 1, Bp, l * NR, 1, X + b0 * W, W,
                             work);
        for (int64_t i = b0 + 1; i < b1; i++)
            for (int64_t j = b0; j < i; j++) PA_FN(axpy)(X + i * W, X + j * W, W, -A[i * l + j]);
        PA_FN(dr_pack_rows)(b0, b1, l, W, X, W, Bp);
    }
    pa_bf16_products_end(products);
}

/* Solves (I + A)^T X = X in place: the same blocks from the last, transposed. */
static void PA_FN(dr_solve_upper)(const real *A, int64_t l, real *X, int64_t W, real *Bp,
                                  real *work)
{
    const int products = pa_bf16_products_begin(0); /* as dr_solve_lower */
    for (int64_t b0 = (l - 1) / DR_SUB * DR_SUB; b0 >= 0; b0 -= DR_SUB) {
        const int64_t b1 = b0 + DR_SUB < l ? b0 + DR_SUB : l;
        PA_FN(gemm_packed_b)(b1 - b0, W, l - b1, -1, A + b1 * l + b0, 1, l, Bp + b1 * NR, l * NR,
                             1, X + b0 * W, W, work);
        for (int64_t i = b1 - 2; i >= b0; i--)
            for (int64_t j = i + 1; j < b1; j++) PA_FN(axpy)(X + i * W, X + j * W, W, -A[j * l + i]);
        PA_FN(dr_pack_rows)(b0, b1, l, W, X, W, Bp);
    }
    pa_bf16_products_end(products);
}

/* The block's key side over rows c0 .. c0+l-1 (sc->ks): a scalar gate's cumulative sums and
 * mask, or a vector gate's cumulative sums and, when they span little enough, its factors. */
static void PA_FN(dr_side)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K;
    PA_FN(la_side) *s = &sc->ks;
    *s = (PA_FN(la_side)){.kind = u->gate, .D = K, .G = sc->Gk, .lo = sc->L * K};
    if (u->gate == PA_GATE_SCALAR) {
        PA_FN(la_scalar_side)(s, u->g + c0 * u->sg, u->sg, l, 0, sc->Gs, sc->L, sc->Dm);
    } else if (u->gate == PA_GATE_VECTOR) {
        PA_FN(la_cumsum_hilo)(u->g + c0 * u->sg, u->sg, l, K, 0, sc->Gk, s->lo, sc->acc);
        PA_FN(la_factor)(s, l, sc->Ek);
    }
}

/* Y_i = alpha X_i f_i for the block's l rows (K each; X rows of ldx, Y rows of K), f_i the
 * row's factor from the block's start (to_end = 0) or to its end (to_end = 1) */
static void PA_FN(dr_gate_rows)(const PA_FN(dr_scratch) *sc, int64_t l, int to_end, real alpha,
                                const real *X, int64_t ldx, real *Y)
{
    for (int64_t i = 0; i < l; i++)
        PA_FN(la_side_row)(&sc->ks, l, to_end, i, Y + i * sc->K, X + i * ldx, alpha, 0);
}

/* dG_i += alpha x * y over the K channels: each channel's own with a vector gate, their sum
 * with a scalar one */
static void PA_FN(dr_gate_terms)(PA_FN(dr_scratch) *sc, int64_t i, const real *x, const real *y,
                                 double alpha)
{
    const int64_t K = sc->K;
    if (sc->ks.kind == PA_GATE_VECTOR) {
        double *dG = sc->dG + i * K;
        for (int64_t c = 0; c < K; c++) dG[c] += alpha * ((double)x[c] * y[c]);
    } else {
        sc->dG[i] += alpha * PA_FN(dot)(x, y, K);
    }
}

/* The block of rows c0 .. c0+l-1: its key side, beta, the gated Gram A' (in M), A and
 * Z = [W | U]. */
static void PA_FN(dr_block)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, sq = u->sq, sv = u->sv;
    const real *k = u->k + c0 * sq, *v = u->v + c0 * sv;
    PA_FN(dr_side)(u, c0, l, sc);
    PA_FN(la_gram)(&sc->ks, l, 1, k, sq, k, sq, 1, sc->M, &sc->bufs);
    for (int64_t i = 0; i < l; i++) {
        const real b = u->beta[(c0 + i) * u->sb];
        real *a = sc->A + i * l, *z = sc->Z + i * W;
        const real *m = sc->M + i * l;
        sc->bet[i] = b;
        for (int64_t j = 0; j < i; j++) a[j] = b * m[j];
        for (int64_t j = i; j < l; j++) a[j] = 0;
        PA_FN(la_side_row)(&sc->ks, l, 0, i, z, k + i * sq, b, 0);
        for (int64_t c = 0; c < V; c++) z[K + c] = b * v[i * sv + c];
    }
    PA_FN(dr_solve_lower)(sc->A, l, sc->Z, W, sc->Bp, sc->work);
}

/* la_zero_start for rows c0 .. c0+l-1 of unit u: its inputs (do in a backward) and dS */
static int PA_FN(dr_zero_start)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, const real *dS,
                                const PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, G = u->gate == PA_GATE_VECTOR ? K : 1;
    const real *const x[] = {u->q, u->k, u->v, u->g, u->beta, u->dout};
    const int64_t ld[] = {u->sq, u->sq, u->sv, u->sg, u->sb, u->sv}, w[] = {K, K, V, G, 1, V};
    return PA_FN(la_zero_start)(6, x, ld, w, c0, l, dS, K, V);
}

/* V' = U - W S (S NULL: a zero state, V' = U) */
static void PA_FN(dr_values)(int64_t l, const real *S, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V;
    for (int64_t i = 0; i < l; i++) memcpy(sc->Vn + i * V, sc->Z + i * W + K, sizeof(real) * V);
    if (S) PA_FN(gemm)(l, V, K, -1, sc->Z, W, 1, S, V, 1, 1, sc->Vn, V, sc->work);
}

/* P = the gated Gram of scale Q with K (lower, diagonal included; 0 above) */
static void PA_FN(dr_scores)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                             PA_FN(dr_scratch) *sc)
{
    const real *q = u->q + c0 * u->sq, *k = u->k + c0 * u->sq;
    PA_FN(la_gram)(&sc->ks, l, (real)scale, q, u->sq, k, u->sq, 0, sc->P, &sc->bufs);
}

/* The block's o rows from its entering state S (NULL: zeros; dr_block and dr_values done) */
static void PA_FN(dr_output)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                             const real *S, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, sv = u->sv;
    real *o = u->o + c0 * sv;
    if (S) {
        PA_FN(dr_gate_rows)(sc, l, 0, (real)scale, u->q + c0 * u->sq, u->sq, sc->Tk);
        PA_FN(gemm)(l, V, K, 1, sc->Tk, K, 1, S, V, 1, 0, o, sv, sc->work);
    }
    PA_FN(dr_scores)(u, c0, l, scale, sc);
    PA_FN(la_tri_product)(l, V, 1, sc->P, 0, S ? 1 : 0, o, sv, sc->Vn, V, &sc->bufs);
}

/* rows c of S (K x V) times f[c], the block's total decay per channel (in sc->f) */
static void PA_FN(dr_decay_state)(PA_FN(dr_scratch) *sc, int64_t l, real *S)
{
    const int64_t K = sc->K, V = sc->V;
    PA_FN(la_total_decay)(&sc->ks, l, sc->f);
    for (int64_t c = 0; sc->ks.kind != PA_GATE_NONE && c < K; c++)
        PA_FN(row_scale)(S + c * V, V, sc->f[c]);
}

/* S <- diag(e^G_last) S + (K f')^T V' */
static void PA_FN(dr_state)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, real *S,
                            PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V;
    PA_FN(dr_decay_state)(sc, l, S);
    PA_FN(dr_gate_rows)(sc, l, 1, 1, u->k + c0 * u->sq, u->sq, sc->Tk);
    PA_FN(gemm)(K, V, l, 1, sc->Tk, 1, K, sc->Vn, V, 1, 1, S, V, sc->work);
}

/* Z_i += alpha sum_{j<i} Wm_ij E_ij X_j into Tq and Z_j += alpha sum_{i>j} Wm_ij E_ij Y_i
 * into Tr (both zeroed first; Wm strictly lower, l x l): a Gram's gradient reaching the rows
 * of its two ends, kept apart for the gate's terms */
static void PA_FN(dr_gram_grads)(PA_FN(dr_scratch) *sc, int64_t l, real alpha, const real *Wm,
                                 const real *X, const real *Y, int64_t ld)
{
    const int64_t K = sc->K;
    memset(sc->Tq, 0, sizeof(real) * l * K);
    memset(sc->Tr, 0, sizeof(real) * l * K);
    PA_FN(la_apply)(&sc->ks, l, alpha, Wm, 0, X, ld, sc->Tq, K, &sc->bufs);
    PA_FN(la_apply)(&sc->ks, l, alpha, Wm, 1, Y, ld, sc->Tr, K, &sc->bufs);
}

/* The block's gradients: dq, dk, dv, dbeta, dg of its rows from its entering state S and dS,
 * the gradient reaching its end state (on return, the one reaching S). fresh: S is a unit's
 * zero start (no h0), whose products are left out where dr_zero_start allows. */
static void PA_FN(dr_block_grads)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                                  const real *S, int fresh, real *dS, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, sq = u->sq, sk = u->sk, sv = u->sv;
    const real *q = u->q + c0 * sq, *k = u->k + c0 * sq, *v = u->v + c0 * sv;
    const real *dO = u->dout + c0 * sv;
    real *dq = u->dq + c0 * sk, *dk = u->dk + c0 * sk, *dv = u->dv + c0 * sv;
    real *work = sc->work, *dVn = sc->R + K, *Tk = sc->Tk, *Tq = sc->Tq, *Tr = sc->Tr;
    const real sc_ = (real)scale;
    const int gated = u->gate != PA_GATE_NONE, vec = u->gate == PA_GATE_VECTOR;
    const int64_t nc = vec ? K : 1; /* the gate's channels */
    double *dG = sc->dG;
    /* the Grams of ungated rows: dP (width V) and dA (width K + V) */
    const PA_FN(la_side) plain_v = {.kind = PA_GATE_NONE, .D = V}, plain_w = {.kind = PA_GATE_NONE, .D = W};
    PA_FN(dr_block)(u, c0, l, sc);
    if (fresh && PA_FN(dr_zero_start)(u, c0, l, dS, sc)) S = NULL;
    PA_FN(dr_values)(l, S, sc);
    PA_FN(dr_scores)(u, c0, l, scale, sc);
    if (gated) memset(dG, 0, sizeof(double) * l * nc);

    /* dV' = P^T dO + (K f') dS' */
    PA_FN(la_tri_product)(l, V, 1, sc->P, 1, 0, dVn, W, dO, sv, &sc->bufs);
    PA_FN(dr_gate_rows)(sc, l, 1, 1, k, sq, Tk);
    PA_FN(gemm)(l, V, K, 1, Tk, K, 1, dS, V, 1, 1, dVn, W, work);

    /* the end state's terms: dk = f' (V' dS'^T); the gate's through f' (both ends) and
     * through e^G_last */
    PA_FN(gemm)(l, K, V, 1, sc->Vn, V, 1, dS, 1, V, 0, Tq, K, work);
    for (int64_t i = 0; i < l; i++) {
        const real *tq = Tq + i * K, *kf = Tk + i * K;
        PA_FN(la_side_row)(&sc->ks, l, 1, i, dk + i * sk, tq, 1, 0);
        if (gated && i < l - 1) { /* the last row's f' is e^0: its two terms cancel */
            PA_FN(dr_gate_terms)(sc, l - 1, kf, tq, 1);
            PA_FN(dr_gate_terms)(sc, i, kf, tq, -1);
        }
    }
    if (gated) {
        PA_FN(la_total_decay)(&sc->ks, l, sc->f);
        for (int64_t c = 0; S && c < K; c++)
            dG[(l - 1) * nc + (vec ? c : 0)] += sc->f[c] * PA_FN(dot)(S + c * V, dS + c * V, V);
    }

    /* dq = scale f (dO S^T), and the gate's term through f */
    if (S) {
        PA_FN(gemm)(l, K, V, sc_, dO, sv, 1, S, 1, V, 0, dq, sk, work);
        for (int64_t i = 0; gated && i < l; i++) {
            PA_FN(la_side_row)(&sc->ks, l, 0, i, dq + i * sk, dq + i * sk, 1, 0);
            PA_FN(dr_gate_terms)(sc, i, q + i * sq, dq + i * sk, 1);
        }
    } else {
        for (int64_t i = 0; i < l; i++) memset(dq + i * sk, 0, sizeof(real) * K);
    }

    /* dP = dO V'^T: its pairs below the diagonal through the gated products (the gate's terms
     * from their two ends), then its diagonal, whose gate factor is 1 */
    PA_FN(la_gram_rows)(&plain_v, l, 1, dO, sv, sc->Vn, V, 0, sc->E, &sc->bufs);
    for (int64_t i = 0; i < l; i++) {
        sc->dp[i] = sc->E[i * l + i];
        sc->E[i * l + i] = 0;
    }
    PA_FN(dr_gram_grads)(sc, l, sc_, sc->E, k, q, sq);
    for (int64_t i = 0; i < l; i++) {
        const real *qi = q + i * sq, *ki = k + i * sq;
        if (gated) {
            PA_FN(dr_gate_terms)(sc, i, qi, Tq + i * K, 1);
            PA_FN(dr_gate_terms)(sc, i, ki, Tr + i * K, -1);
        }
        PA_FN(axpy)(dq + i * sk, Tq + i * K, K, 1);
        PA_FN(axpy)(dq + i * sk, ki, K, sc_ * sc->dp[i]);
        PA_FN(axpy)(dk + i * sk, Tr + i * K, K, 1);
        PA_FN(axpy)(dk + i * sk, qi, K, sc_ * sc->dp[i]);
    }

    /* dW = -dV' S^T, then dS = diag(e^G_last) dS' + (Q~ f)^T dO - W^T dV' */
    if (S)
        PA_FN(gemm)(l, K, V, -1, dVn, W, 1, S, 1, V, 0, sc->R, W, work);
    else
        for (int64_t i = 0; i < l; i++) memset(sc->R + i * W, 0, sizeof(real) * K);
    PA_FN(dr_decay_state)(sc, l, dS);
    PA_FN(dr_gate_rows)(sc, l, 0, sc_, q, sq, Tk);
    PA_FN(gemm)(K, V, l, 1, Tk, 1, K, dO, sv, 1, 1, dS, V, work);
    PA_FN(gemm)(K, V, l, -1, sc->Z, 1, W, dVn, W, 1, 1, dS, V, work);

    /* [dX | dY] = (I + A)^-T [dW | dV'];  dA = -strictly-lower([dX | dY] Z^T) */
    PA_FN(dr_solve_upper)(sc->A, l, sc->R, W, sc->Bp, work);
    PA_FN(la_gram_rows)(&plain_w, l, -1, sc->R, W, sc->Z, W, 1, sc->E, &sc->bufs);
    /* A = diag(beta) A': beta's term, and dA' = diag(beta) dA (in E); Z's right-hand side
     * beta_i [k_i f_i | v_i]: beta's, k's, v's and the gate's terms */
    PA_FN(dr_gate_rows)(sc, l, 0, 1, k, sq, Tk);
    for (int64_t i = 0; i < l; i++) {
        real *da = sc->E + i * l;
        const real *m = sc->M + i * l, b = sc->bet[i];
        double db = 0;
        for (int64_t j = 0; j < i; j++) {
            db += (double)da[j] * m[j];
            da[j] *= b;
        }
        const real *dx = sc->R + i * W, *dy = dx + K, *kf = Tk + i * K;
        db += (double)PA_FN(dot)(dx, kf, K) + PA_FN(dot)(dy, v + i * sv, V);
        u->dbeta[(c0 + i) * u->sb] = (real)db;
        if (gated) PA_FN(dr_gate_terms)(sc, i, kf, dx, b);
        PA_FN(la_side_row)(&sc->ks, l, 0, i, dk + i * sk, dx, b, 1);
        for (int64_t j = 0; j < V; j++) dv[i * sv + j] = b * dy[j];
    }
    /* A'_ij = sum_c k_ic k_jc E_ijc: k's terms from both ends, and the gate's */
    PA_FN(dr_gram_grads)(sc, l, 1, sc->E, k, k, sq);
    for (int64_t i = 0; i < l; i++) {
        const real *ki = k + i * sq;
        if (gated) {
            PA_FN(dr_gate_terms)(sc, i, ki, Tq + i * K, 1);
            PA_FN(dr_gate_terms)(sc, i, ki, Tr + i * K, -1);
        }
        PA_FN(axpy)(dk + i * sk, Tq + i * K, K, 1);
        PA_FN(axpy)(dk + i * sk, Tr + i * K, K, 1);
    }

    if (gated)
        PA_FN(gate_grads_from_cumulative)(dG, l, nc, u->g + c0 * u->sg, u->dg + c0 * u->sg, u->sg);
}

/* ---- drivers ---- */

/* The unit whose rows *r0 .. *r0+l-1 are unit u's rows c0 .. c0+l-1, for a block's
 * functions: u itself (*r0 = c0), or where the call stages its blocks, *b, those rows copied
 * contiguous into sc->stage (rows_copy; *r0 = 0): k, v, beta and the gate, and q and dout
 * unless state_only; the outputs written there go back to u by dr_unstage. */
static const PA_FN(dr_unit) *PA_FN(dr_stage)(const PA_FN(dr_call) *c, const PA_FN(dr_unit) *u,
                                             int64_t c0, int64_t l, int state_only,
                                             PA_FN(dr_scratch) *sc, PA_FN(dr_unit) *b,
                                             int64_t *r0)
{
    *r0 = c->staged ? 0 : c0;
    if (!c->staged) return u;
    const int64_t K = sc->K, V = sc->V, G = u->gate == PA_GATE_VECTOR ? K : 1;
    real *p = sc->stage;
    *b = (PA_FN(dr_unit)){.T = l, .gate = u->gate, .sq = K, .sk = K, .sv = V, .sg = G, .sb = 1};
    const real *const in[] = {u->k, u->v, u->beta, u->g, u->q, u->dout};
    const int64_t ld[] = {u->sq, u->sv, u->sb, u->sg, u->sq, u->sv}, w[] = {K, V, 1, G, K, V};
    const real **const to[] = {&b->k, &b->v, &b->beta, &b->g, &b->q, &b->dout};
    PA_FN(stage_rows_in)(state_only ? 4 : 6, in, ld, w, c0, l, to, &p);
    if (state_only) return b;
    real *const out[] = {u->o, u->dq, u->dk, u->dv, u->dg, u->dbeta};
    const int64_t wo[] = {V, K, K, V, G, 1};
    real **const into[] = {&b->o, &b->dq, &b->dk, &b->dv, &b->dg, &b->dbeta};
    PA_FN(stage_rows_out)(6, out, wo, l, into, &p);
    return b;
}

/* The outputs of block b (as dr_stage gave it for rows c0 .. c0+l-1) into u's rows where it
 * is a staged copy (rows_put) */
static void PA_FN(dr_unstage)(const PA_FN(dr_call) *c, const PA_FN(dr_unit) *b, int64_t c0,
                              int64_t l, const PA_FN(dr_unit) *u)
{
    if (b == u) return;
    const int64_t K = c->d->K, V = c->d->V;
    real *const from[] = {b->o, b->dq, b->dk, b->dv, b->dg, b->dbeta};
    real *const to[] = {u->o, u->dq, u->dk, u->dv, u->dg, u->dbeta};
    const int64_t w[] = {V, K, K, V, b->sg, 1}, ld[] = {u->sv, u->sk, u->sk, u->sv, u->sg, u->sb};
    PA_FN(unstage_rows)(6, from, w, to, ld, c0, l, c->stream);
}

/* The unit's rows r0 .. r0+n-1 into L2 (prefetch_block_rows). state_only: the rows a block's
 * state reads (k, v, the gate), not q and do. */
static inline __attribute__((always_inline)) void PA_FN(dr_prefetch_rows)(const PA_FN(dr_unit) *u,
                                                                         int64_t K, int64_t V,
                                                                         int64_t r0, int64_t n,
                                                                         int state_only)
{
    if (!state_only) PA_FN(prefetch_block_rows)(u->q, u->sq, K, r0, n, u->T);
    PA_FN(prefetch_block_rows)(u->k, u->sq, K, r0, n, u->T);
    PA_FN(prefetch_block_rows)(u->v, u->sv, V, r0, n, u->T);
    if (u->gate == PA_GATE_VECTOR) PA_FN(prefetch_block_rows)(u->g, u->sg, K, r0, n, u->T);
    if (u->dout && !state_only) PA_FN(prefetch_block_rows)(u->dout, u->sv, V, r0, n, u->T);
}

static void PA_FN(dr_unit_forward)(const PA_FN(dr_call) *c, int64_t unit, int64_t L,
                                   PA_FN(dr_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V;
    PA_FN(dr_unit) u;
    PA_FN(dr_unit_of)(c, unit, &u);
    const real *h0 = c->h0 ? c->h0 + unit * KV : NULL;
    if (d->form == PA_FORM_RECURRENT) { /* h0 read and the final state written once */
        PA_FN(dr_recurrent)(&u, 0, u.T, d->scale, h0, c->ht ? c->ht + unit * KV : sc->S, NULL, sc);
        return;
    }
    real *S = c->ht ? c->ht + unit * KV : sc->S;
    real *slot = c->states ? c->states + c->first[unit] * KV : NULL;
    if (S != h0) PA_FN(dr_copy_state)(h0, S, KV);
    for (int64_t c0 = 0; c0 < u.T; c0 += L) {
        const int64_t l = u.T - c0 < L ? u.T - c0 : L;
        PA_FN(dr_unit) staged;
        int64_t r;
        const PA_FN(dr_unit) *b = PA_FN(dr_stage)(c, &u, c0, l, 0, sc, &staged, &r);
        PA_FN(dr_prefetch_rows)(&u, d->K, d->V, c0 + L, L / 2, 0);
        PA_FN(dr_block)(b, r, l, sc);
        /* a unit without h0 enters its first block with zeros: their products left out */
        const real *Sin = c0 == 0 && !h0 && PA_FN(dr_zero_start)(b, r, l, NULL, sc) ? NULL : S;
        PA_FN(dr_values)(l, Sin, sc);
        PA_FN(dr_output)(b, r, l, d->scale, Sin, sc);
        PA_FN(dr_prefetch_rows)(&u, d->K, d->V, c0 + L + L / 2, L - L / 2, 0);
        PA_FN(la_keep_state)(&slot, S, KV, c->stream);
        PA_FN(dr_state)(b, r, l, S, sc);
        PA_FN(dr_unstage)(c, b, c0, l, &u);
    }
    PA_FN(la_keep_state)(&slot, S, KV, c->stream);
}

/* The backward of one unit: the states entering its blocks (or pieces), then one reverse
 * pass carrying dS. */
static void PA_FN(dr_unit_backward)(const PA_FN(dr_call) *c, int64_t unit, int64_t L,
                                    PA_FN(dr_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V;
    const int rec = d->form == PA_FORM_RECURRENT;
    const int64_t P = rec ? DR_PIECE : L;
    PA_FN(dr_unit) u;
    PA_FN(dr_unit_of)(c, unit, &u);
    const int64_t np = (u.T + P - 1) / P;
    real *states = c->states ? c->states + c->first[unit] * KV : sc->states, *dS = sc->dS;
    if (!c->states) PA_FN(dr_copy_state)(c->h0 ? c->h0 + unit * KV : NULL, states, KV);
    for (int64_t p = 0; !c->states && !rec && p < np; p++) { /* the states entering blocks */
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        real *S = states + (p + 1) * KV;
        PA_FN(dr_unit) staged;
        int64_t r;
        memcpy(S, S - KV, sizeof(real) * KV);
        const PA_FN(dr_unit) *b = PA_FN(dr_stage)(c, &u, r0, n, 1, sc, &staged, &r);
        PA_FN(dr_prefetch_rows)(&u, d->K, d->V, r0 + P, P, 1);
        PA_FN(dr_block)(b, r, n, sc);
        PA_FN(dr_values)(n, p == 0 && !c->h0 && PA_FN(dr_zero_start)(b, r, n, NULL, sc) ? NULL : S - KV,
                         sc);
        PA_FN(dr_state)(b, r, n, S, sc);
    }
    PA_FN(dr_copy_state)(c->dht ? c->dht + unit * KV : NULL, dS, KV);
    if (rec) { /* the states entering its pieces (the scratch's room), each piece in reverse */
        PA_FN(dr_rows_reverse)(&u, 0, u.T, d->scale, states, dS, sc);
    } else {
        for (int64_t p = np - 1; p >= 0; p--) {
            const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
            PA_FN(dr_unit) staged;
            int64_t r;
            const PA_FN(dr_unit) *b = PA_FN(dr_stage)(c, &u, r0, n, 0, sc, &staged, &r);
            if (r0) PA_FN(dr_prefetch_rows)(&u, d->K, d->V, r0 - P, P, 0);
            /* an unclean block by the recurrent steps, unless their room cannot be had */
            real *room = PA_FN(dr_rows_unclean)(b, r, n, d->K, d->V)
                             ? PA_FN(dr_reverse_room)(states + p * KV, n, KV) : NULL;
            if (room)
                PA_FN(dr_rows_reverse)(b, r, n, d->scale, room, dS, sc);
            else
                PA_FN(dr_block_grads)(b, r, n, d->scale, states + p * KV, p == 0 && !c->h0, dS, sc);
            free(room);
            PA_FN(dr_unstage)(c, b, r0, n, &u);
        }
    }
    if (c->dh0) memcpy(c->dh0 + unit * KV, dS, sizeof(real) * KV);
}

/* The states a delta-family backward keeps in its scratch, P rows apart: without kept ones
 * (kept 0), the state entering each block or piece and the last; recurrent: also a piece's
 * states. None for a forward. */
static int64_t PA_FN(dr_backward_states)(const pa_linear_desc *d, int backward, int kept,
                                         int64_t P)
{
    if (!backward) return 0;
    return (kept ? 0 : (pa_linear_max_len(d) + P - 1) / P + 1) +
           (d->form == PA_FORM_RECURRENT ? DR_PIECE + 1 : 0);
}

static int PA_FN(dr_run)(PA_FN(dr_call) *c, int backward)
{
    const pa_linear_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    const int rec = d->form == PA_FORM_RECURRENT;
    const int64_t L = rec ? 0 : pa_linear_block_rows(d);
    if (c->states && !(c->first = PA_FN(la_slots)(d, L))) return PA_ENOMEM;
    c->stream = PA_FN(la_streams)(d);
    c->staged = PA_FN(rows_staged)(d->Hqk * d->K, d->H * d->V);
    const int64_t nstates =
        PA_FN(dr_backward_states)(d, backward, c->states != NULL, rec ? DR_PIECE : L);
    const double rows = (double)d->cu[d->nseq] * (double)d->H, KV = (double)(d->K * d->V);
    /* multiply-adds; a recurrent step streams its state through memory, so it weighs more */
    const double work = rec ? rows * KV * 8 : rows * (KV * 3 + (double)L * (2 * d->K + d->V));
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        const int products = pa_bf16_products_begin(d->bf16 && d->form == PA_FORM_CHUNK);
        PA_FN(dr_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(dr_scratch_alloc)(&sc, L, d->K, d->V, nstates, c->staged),
                                    &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(dr_unit_backward)(c, un, L, &sc);
            else
                PA_FN(dr_unit_forward)(c, un, L, &sc);
        }
        if (ok) free(sc.block);
        pa_bf16_products_end(products);
        pa_subnormals_end(csr);
    }
    free((void *)c->first);
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(delta_forward)(const pa_linear_desc *d, const void *q, const void *k,
                                const void *v, const void *g, const void *beta, const void *h0,
                                void *o, void *ht, void *states)
{
    PA_FN(dr_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .beta = beta, .h0 = h0,
                        .o = o, .ht = ht, .states = d->form == PA_FORM_CHUNK ? states : NULL};
    return PA_FN(dr_run)(&c, 0);
}

static int PA_FN(delta_backward)(const pa_linear_desc *d, const void *q, const void *k,
                                 const void *v, const void *g, const void *beta, const void *h0,
                                 const void *dout, const void *dht, const void *states, void *dq,
                                 void *dk, void *dv, void *dg, void *dbeta, void *dh0)
{
    int nomem;
    real *heads = PA_FN(la_group_heads)(d, &nomem);
    if (nomem) return PA_ENOMEM;
    PA_FN(dr_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .beta = beta, .h0 = h0,
                        .dout = dout, .dht = dht, .dq = heads ? heads : dq,
                        .dk = heads ? heads + d->cu[d->nseq] * d->H * d->K : dk, .dv = dv,
                        .dg = dg, .dbeta = dbeta, .dh0 = dh0,
                        .states = d->form == PA_FORM_CHUNK ? (real *)states : NULL};
    int rc = PA_FN(dr_run)(&c, 1);
    if (heads && rc == PA_OK) PA_FN(la_sum_groups)(d, heads, dq, dk);
    free(heads);
    return rc;
}
