/* The diagonal-plus-low-rank (DPLR) delta rule (fla's generalized delta rule; RWKV-7), forward
 * and backward. Template body (see core/dtype.h); needs core/vmath.h, core/gemm.c, ops/rows.h,
 * ops/decay.h, ops/linear_engine.h (a block's gate side and the gated Grams and triangular
 * products over it) and ops/delta_rule.c (its blocked triangular solves) before it.
 *
 * Per (sequence, head) unit, with S_0 = h0 (zeros when absent), q~ = scale q and a log decay
 * gk_t per key channel:
 *   S_t = (diag(e^gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T q~_t,
 * i.e. with u_t = S_{t-1}^T a_t:  S_t = diag(e^gk_t) S_{t-1} + b_t u_t^T + k_t v_t^T.
 *
 * Forms. recurrent: one pass over S per step (the pass that writes S_t also forms S_t^T a_{t+1}
 * for the next step). chunk (the WY form): blocks of l rows with S the state entering one, G
 * the inclusive cumulative gate inside the block (per channel), f_i = e^G_i, f'_i =
 * e^(G_last - G_i), E_ij = e^(G_i - G_j) (j <= i) inside the sums over channels. Row i reads
 * S_{i-1}, whose decay from row j is E_{i-1,j}: the a side's Grams pair a_{m+1} with G_m, the
 * rows Xa_m = a_{m+1} (Xa_{l-1} = 0) shifted down a row after the product:
 *   A_ab = shift(lower(Gram(Xa, b))),  A_ak = shift(lower(Gram(Xa, k)))   (strictly lower),
 *   Z = [W | U] = (I - A_ab)^-1 [a_i f_{i-1} | A_ak V]   (f_{-1} = 1; the blocked solves),
 *   u = U + W S,
 *   O = (Q~ f) S + Pk V + Pb u,   Pk = lower(Gram(Q~, K)), Pb = lower(Gram(Q~, B)),
 *   S' = diag(e^G_last) S + (K f')^T V + (B f')^T u.
 * The Grams and triangular products are the linear engine's, which keep every factor bounded
 * however strong the gate (factored, or by sub-blocks, or pair by pair).
 *
 * Backward. chunk: a forward pass over the blocks keeps the state entering each; blocks in
 * reverse then recompute Z, u and the Grams and, with dS' the gradient reaching S':
 *   du = Pb^T dO + (B f') dS',  dv = Pk^T dO + (K f') dS',  dW = du S^T,
 *   dS = diag(e^G_last) dS' + (Q~ f)^T dO + W^T du,
 *   dR = (I - A_ab)^-T [dW | du],  d(-A_ab) = -strictly-lower(dR Z^T),
 *   dA_ak = strictly-lower(dR_U V^T),  dv += A_ak^T dR_U,
 * and the Grams' gradients (dPk = dO V^T, dPb = dO u^T, the shifted ones shifted back up)
 * reach their two ends through the gated triangular products. The gate's gradient dG_i, per
 * channel, is the derivative of every factor with respect to G_i: a factor x e^(+G_i) adds
 * x dx, one x e^(-G_i) subtracts it (the Grams' pairs from their two ends, q~ f, a f_{i-1},
 * the f' of k and b, and e^G_last on S); dgk is dG summed in reverse inside the block. A Gram's
 * diagonal pairs (E = 1) are added after the gate's terms, which they would only cancel.
 * recurrent: states kept every DR_PIECE steps (delta_rule.c's); each piece's states
 * recomputed forward, then stepped back one row at a time with dS, the gradient reaching S_t:
 *   dS += q~ do^T,  dq = scale S_t do,  dk = dS v,  dv = dS^T k,  db = dS u,  du = dS^T b,
 *   da = S_{t-1} du,  dgk = e^gk (S_{t-1} * dS) summed over V,
 *   dS_{t-1} = diag(e^gk) dS + a du^T.
 * Only e^gk <= 1 is ever formed, so strong decays cannot overflow.
 *
 * Work is split over (sequence, head) units, each on one thread. Where a unit's rows lie a
 * multiple of 1 KiB apart, the chunk form works on a copy of each block's rows, contiguous
 * (dp_stage), and copies its output rows back.
 */

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
    real *states;         /* chunk form: the kept states (forward: written; backward: read) */
    const int64_t *first; /* their layout (la_slots) when given */
    int stream;           /* kept states and staged outputs put with non-temporal stores */
    int staged;           /* blocks staged contiguous (rows_staged) */
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

/* Per-thread scratch; the chunk form's parts for blocks of up to L rows (L = 0: recurrent) */
typedef struct {
    int64_t L, K, V;
    real *e;       /* K: a step's decays e^gk */
    real *w, *dw;  /* V each: u = S_{t-1}^T a, its gradient */
    real *S, *dS;  /* K x V each */
    real *states;  /* backward: the state entering each block (or piece), then a piece's states */
    PA_FN(la_side) ks;  /* the block's gate as the products take it */
    real *Gk, *Ek;      /* 2 L K, (2 L + 1) K: its cumulative gate (hi, lo), its factors */
    double *acc;        /* 2 K: the cumulative gate's running sums */
    double *dG;         /* L K: the gate's gradient per row and channel */
    real *dp;           /* L: a Gram gradient's diagonal */
    real *Xa;           /* L x K: the shifted a rows, Xa_m = a_{m+1} (the last one 0) */
    real *A, *Mk, *Pb, *Pk, *E; /* L x L each: -A_ab, A_ak (shifted), the two output Grams,
                                 * a Gram's gradient */
    real *Z, *R;        /* L x (K + V) each: [W | U], then [dW | dU] and its solve */
    real *Un;           /* L x V: the rows' u */
    real *Tk, *Tq, *Tr; /* L x K each */
    real *f;            /* K: the block's total decay */
    real *stage;        /* a block's input and output rows, contiguous (dp_stage) */
    real *Bp;           /* one operand packed once */
    int64_t *rows;      /* L: the non-finite rows of a triangular product's operand */
    real *work;         /* GEMM packing */
    PA_FN(la_bufs) bufs;
    void *block;
} PA_FN(dp_scratch);

/* staged: room to stage a block (dp_stage) */
static int PA_FN(dp_scratch_alloc)(PA_FN(dp_scratch) *s, int64_t L, int64_t K, int64_t V,
                                   int64_t nstates, int staged)
{
    const int64_t W = K + V;
    const size_t r = sizeof(real), dbl = sizeof(double), LL = L * L * r, LK = L * K * r;
    size_t packed, work;
    PA_FN(dr_gemm_bytes)(L, K, V, &packed, &work);
    size_t bytes[] = {K * r, V * r, V * r, K * V * r, K * V * r, nstates * K * V * r,
                      2 * LK, (2 * L + 1) * K * r, 2 * K * dbl, L * K * dbl, L * r, LK,
                      LL, LL, LL, LL, LL, L * W * r, L * W * r, L * V * r, LK, LK, LK, K * r,
                      staged ? L * (10 * K + 3 * V) * r : 0, packed, L * sizeof(int64_t), work, LK, LK, LL};
    void **const parts[] = {(void **)&s->e,   (void **)&s->w,     (void **)&s->dw,
                            (void **)&s->S,   (void **)&s->dS,    (void **)&s->states,
                            (void **)&s->Gk,  (void **)&s->Ek,    (void **)&s->acc,
                            (void **)&s->dG,  (void **)&s->dp,    (void **)&s->Xa,
                            (void **)&s->A,   (void **)&s->Mk,    (void **)&s->Pb,
                            (void **)&s->Pk,  (void **)&s->E,     (void **)&s->Z,
                            (void **)&s->R,   (void **)&s->Un,    (void **)&s->Tk,
                            (void **)&s->Tq,  (void **)&s->Tr,    (void **)&s->f,
                            (void **)&s->stage, (void **)&s->Bp,  (void **)&s->rows,  (void **)&s->work,
                            (void **)&s->bufs.Tm, (void **)&s->bufs.U, (void **)&s->bufs.M};
    if (!(s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]))))
        return 0;
    s->L = L;
    s->K = K;
    s->V = V;
    PA_FN(dr_scratch_link)(&s->bufs, s->Bp, s->rows, s->work);
    return 1;
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

/* Rows r0 .. r0+n-1 of unit u in reverse by the recurrent steps, in the room (dr_pieces)
 * whose first state enters them. dS as in dp_recurrent_reverse. */
static void PA_FN(dp_rows_reverse)(const PA_FN(dp_unit) *u, int64_t r0, int64_t n, double scale,
                                   real *bounds, real *dS, PA_FN(dp_scratch) *sc)
{
    const int64_t KV = sc->K * sc->V, np = PA_FN(dr_pieces)(n);
    real *trail = bounds + np * KV;
    for (int64_t p = 0; p + 1 < np; p++) {
        memcpy(bounds + (p + 1) * KV, bounds + p * KV, sizeof(real) * KV);
        PA_FN(dp_recurrent)(u, r0 + p * DR_PIECE, DR_PIECE, scale, bounds + (p + 1) * KV, NULL, sc);
    }
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t t0 = r0 + p * DR_PIECE, m = n - p * DR_PIECE < DR_PIECE ? n - p * DR_PIECE : DR_PIECE;
        memcpy(trail, bounds + p * KV, sizeof(real) * KV);
        memcpy(sc->S, trail, sizeof(real) * KV);
        PA_FN(dp_recurrent)(u, t0, m, scale, sc->S, trail + KV, sc);
        PA_FN(dp_recurrent_reverse)(u, t0, m, scale, trail, dS, sc);
    }
}

/* Whether rows r0 .. r0+n-1 of a unit hold a NaN gate or a k, v, a or b that is not finite:
 * the chunk backward's Grams would spread it over gradients of the block that the
 * recurrence keeps finite, so such a block takes the recurrent steps. A gate of -inf (a
 * reset) counts as clean. */
static int PA_FN(dp_rows_unclean)(const PA_FN(dp_unit) *u, int64_t r0, int64_t n, int64_t K,
                                  int64_t V)
{
    const real *const x[] = {u->k, u->a, u->b, u->v};
    const int64_t ld[] = {u->sk, u->sk, u->sk, u->sv}, w[] = {K, K, K, V};
    return PA_FN(la_rows_bad)(1, &u->gk, &u->sk, &K, r0, n, 1) ||
           PA_FN(la_rows_bad)(4, x, ld, w, r0, n, 0);
}

/* ---- the chunk form ---- */

/* dst (l x l) = sign W shifted down a row, strictly lower: dst_ij = sign W_{i-1,j} (j < i);
 * the shifted Grams' rows m = i - 1 pair a_{m+1} with G_m */
static void PA_FN(dp_shift_down)(const real *W, int64_t l, real sign, real *dst)
{
    for (int64_t i = l - 1; i >= 0; i--)
        for (int64_t j = 0; j < l; j++) dst[i * l + j] = j < i ? sign * W[(i - 1) * l + j] : 0;
}

/* W (l x l) = sign dst shifted up a row, lower with its diagonal: W_mj = sign dst_{m+1,j}
 * (j <= m), in place (W may be dst) */
static void PA_FN(dp_shift_up)(real *W, int64_t l, real sign)
{
    for (int64_t m = 0; m < l; m++)
        for (int64_t j = 0; j < l; j++) W[m * l + j] = m + 1 < l && j <= m ? sign * W[(m + 1) * l + j] : 0;
}

/* dG_i += alpha x * y over the K channels */
static void PA_FN(dp_gate_terms)(PA_FN(dp_scratch) *sc, int64_t i, const real *x, const real *y,
                                 double alpha)
{
    double *dG = sc->dG + i * sc->K;
    for (int64_t c = 0; c < sc->K; c++) dG[c] += alpha * ((double)x[c] * y[c]);
}

/* Y_i = alpha X_i f_i for the block's l rows (X rows of ldx, Y rows of K), f_i the row's factor
 * from the block's start (to_end = 0) or to its end (to_end = 1) */
static void PA_FN(dp_gate_rows)(const PA_FN(dp_scratch) *sc, int64_t l, int to_end, real alpha,
                                const real *X, int64_t ldx, real *Y)
{
    for (int64_t i = 0; i < l; i++)
        PA_FN(la_side_row)(&sc->ks, l, to_end, i, Y + i * sc->K, X + i * ldx, alpha, 0);
}

/* A lower Gram's gradient Wm (l x l; its diagonal taken out into sc->dp and zeroed) reaching
 * its two ends: the rows' x_i (Tx_i = alpha sum_{j<i} Wm_ij E_ij Y_j, Y the columns' rows) and
 * the columns' y_j (Ty_j = alpha sum_{i>j} Wm_ij E_ij X_i), with the gate's terms: +x_i Tx_i at
 * row i, -y_j Ty_j at row j. The diagonal's pairs (E = 1) are added by the caller. */
static void PA_FN(dp_gram_grads)(PA_FN(dp_scratch) *sc, int64_t l, real alpha, real *Wm,
                                 const real *X, int64_t ldx, const real *Y, int64_t ldy)
{
    const int64_t K = sc->K;
    for (int64_t i = 0; i < l; i++) {
        sc->dp[i] = Wm[i * l + i];
        Wm[i * l + i] = 0;
    }
    memset(sc->Tq, 0, sizeof(real) * l * K);
    memset(sc->Tr, 0, sizeof(real) * l * K);
    PA_FN(la_apply)(&sc->ks, l, alpha, Wm, 0, Y, ldy, sc->Tq, K, &sc->bufs);
    PA_FN(la_apply)(&sc->ks, l, alpha, Wm, 1, X, ldx, sc->Tr, K, &sc->bufs);
    for (int64_t i = 0; i < l; i++) {
        PA_FN(dp_gate_terms)(sc, i, X + i * ldx, sc->Tq + i * K, 1);
        PA_FN(dp_gate_terms)(sc, i, Y + i * ldy, sc->Tr + i * K, -1);
    }
}

/* dp_gram_grads of a Gram of the rows of X and Y (both ld apart), added into their gradients
 * dX and dY, its diagonal's pairs too (gate factor 1) */
static void PA_FN(dp_gram_add)(PA_FN(dp_scratch) *sc, int64_t l, real alpha, real *Wm,
                               const real *X, const real *Y, int64_t ld, real *dX, real *dY)
{
    const int64_t K = sc->K;
    PA_FN(dp_gram_grads)(sc, l, alpha, Wm, X, ld, Y, ld);
    for (int64_t i = 0; i < l; i++) {
        PA_FN(axpy)(dX + i * ld, sc->Tq + i * K, K, 1);
        PA_FN(axpy)(dX + i * ld, Y + i * ld, K, alpha * sc->dp[i]);
        PA_FN(axpy)(dY + i * ld, sc->Tr + i * K, K, 1);
        PA_FN(axpy)(dY + i * ld, X + i * ld, K, alpha * sc->dp[i]);
    }
}

/* The block of rows c0 .. c0+l-1: its gate side, the shifted a rows, -A_ab (in A), A_ak (in
 * Mk) and Z = [W | U] = (I - A_ab)^-1 [a e^G_{i-1} | A_ak V]. */
static void PA_FN(dp_block)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, sk = u->sk, sv = u->sv;
    const real *a = u->a + c0 * sk, *b = u->b + c0 * sk, *k = u->k + c0 * sk;
    PA_FN(la_side) *s = &sc->ks;
    *s = (PA_FN(la_side)){.kind = PA_GATE_VECTOR, .D = K, .G = sc->Gk, .lo = sc->L * K};
    PA_FN(la_cumsum_hilo)(u->gk + c0 * sk, sk, l, K, 0, sc->Gk, s->lo, sc->acc);
    PA_FN(la_factor)(s, l, sc->Ek);
    for (int64_t m = 0; m + 1 < l; m++) memcpy(sc->Xa + m * K, a + (m + 1) * sk, sizeof(real) * K);
    memset(sc->Xa + (l - 1) * K, 0, sizeof(real) * K);
    PA_FN(la_gram)(s, l, 1, sc->Xa, K, b, sk, 0, sc->E, &sc->bufs);
    PA_FN(dp_shift_down)(sc->E, l, -1, sc->A);
    PA_FN(la_gram)(s, l, 1, sc->Xa, K, k, sk, 0, sc->E, &sc->bufs);
    PA_FN(dp_shift_down)(sc->E, l, 1, sc->Mk);
    memcpy(sc->Z, a, sizeof(real) * K);
    for (int64_t i = 1; i < l; i++)
        PA_FN(la_side_row)(s, l, 0, i - 1, sc->Z + i * W, a + i * sk, 1, 0);
    PA_FN(la_tri_product)(l, V, 1, sc->Mk, 0, 0, sc->Z + K, W, u->v + c0 * sv, sv, &sc->bufs);
    PA_FN(dr_solve_lower)(sc->A, l, sc->Z, W, sc->Bp, sc->work);
}

/* la_zero_start for rows c0 .. c0+l-1 of unit u: its inputs (do in a backward) and dS */
static int PA_FN(dp_zero_start)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, const real *dS,
                                const PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, sk = u->sk, sv = u->sv;
    const real *const x[] = {u->q, u->k, u->v, u->a, u->b, u->gk, u->dout};
    const int64_t ld[] = {sk, sk, sv, sk, sk, sk, sv}, w[] = {K, K, V, K, K, K, V};
    return PA_FN(la_zero_start)(7, x, ld, w, c0, l, dS, K, V);
}

/* The rows' u = U + W S, S the state entering the block (NULL: zeros, u = U) */
static void PA_FN(dp_values)(int64_t l, const real *S, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V;
    for (int64_t i = 0; i < l; i++) memcpy(sc->Un + i * V, sc->Z + i * W + K, sizeof(real) * V);
    if (S) PA_FN(gemm)(l, V, K, 1, sc->Z, W, 1, S, V, 1, 1, sc->Un, V, sc->work);
}

/* The output Grams of scale q with k (Pk) and with b (Pb), lower with the diagonal */
static void PA_FN(dp_scores)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, double scale,
                             PA_FN(dp_scratch) *sc)
{
    const int64_t sk = u->sk;
    const real *q = u->q + c0 * sk;
    PA_FN(la_gram)(&sc->ks, l, (real)scale, q, sk, u->k + c0 * sk, sk, 0, sc->Pk, &sc->bufs);
    PA_FN(la_gram)(&sc->ks, l, (real)scale, q, sk, u->b + c0 * sk, sk, 0, sc->Pb, &sc->bufs);
}

/* The block's o rows: (q~ f) S + Pk V + Pb u (S NULL: zeros) */
static void PA_FN(dp_output)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, double scale,
                             const real *S, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, sv = u->sv;
    real *o = u->o + c0 * sv;
    if (S) {
        PA_FN(dp_gate_rows)(sc, l, 0, (real)scale, u->q + c0 * u->sk, u->sk, sc->Tk);
        PA_FN(gemm)(l, V, K, 1, sc->Tk, K, 1, S, V, 1, 0, o, sv, sc->work);
    }
    PA_FN(dp_scores)(u, c0, l, scale, sc);
    PA_FN(la_tri_product)(l, V, 1, sc->Pk, 0, S ? 1 : 0, o, sv, u->v + c0 * sv, sv, &sc->bufs);
    PA_FN(la_tri_product)(l, V, 1, sc->Pb, 0, 1, o, sv, sc->Un, V, &sc->bufs);
}

/* rows c of X (K x V) times the block's total decay (into sc->f) */
static void PA_FN(dp_decay_state)(PA_FN(dp_scratch) *sc, int64_t l, real *X)
{
    PA_FN(la_total_decay)(&sc->ks, l, sc->f);
    for (int64_t c = 0; c < sc->K; c++) PA_FN(row_scale)(X + c * sc->V, sc->V, sc->f[c]);
}

/* S <- diag(e^G_last) S + (K f')^T V + (B f')^T u */
static void PA_FN(dp_state)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, real *S,
                            PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, sk = u->sk;
    PA_FN(dp_decay_state)(sc, l, S);
    PA_FN(dp_gate_rows)(sc, l, 1, 1, u->k + c0 * sk, sk, sc->Tk);
    PA_FN(gemm)(K, V, l, 1, sc->Tk, 1, K, u->v + c0 * u->sv, u->sv, 1, 1, S, V, sc->work);
    PA_FN(dp_gate_rows)(sc, l, 1, 1, u->b + c0 * sk, sk, sc->Tk);
    PA_FN(gemm)(K, V, l, 1, sc->Tk, 1, K, sc->Un, V, 1, 1, S, V, sc->work);
}

/* The end state's term through x f' (x: k with V, or b with u; Y l x V): dx = f' (Y dS'^T),
 * the gate's through f' at both ends, and dY += (x f') dS' */
static void PA_FN(dp_end_grads)(PA_FN(dp_scratch) *sc, int64_t l, const real *x, int64_t sk,
                                const real *Y, int64_t ldy, const real *dS, real *dx, real *dY,
                                int64_t lddy)
{
    const int64_t K = sc->K, V = sc->V;
    PA_FN(dp_gate_rows)(sc, l, 1, 1, x, sk, sc->Tk);
    PA_FN(gemm)(l, V, K, 1, sc->Tk, K, 1, dS, V, 1, 1, dY, lddy, sc->work);
    PA_FN(gemm)(l, K, V, 1, Y, ldy, 1, dS, 1, V, 0, sc->Tq, K, sc->work);
    for (int64_t i = 0; i < l; i++) {
        const real *tq = sc->Tq + i * K, *xf = sc->Tk + i * K;
        PA_FN(la_side_row)(&sc->ks, l, 1, i, dx + i * sk, tq, 1, 0);
        if (i < l - 1) { /* the last row's f' is e^0: its two terms cancel */
            PA_FN(dp_gate_terms)(sc, l - 1, xf, tq, 1);
            PA_FN(dp_gate_terms)(sc, i, xf, tq, -1);
        }
    }
}

/* A shifted Gram's gradient (in sc->E as the gradient of its l x l strictly lower form, sign
 * as dp_block gave it) reaching a (rows, shifted) and y (columns; dy rows of sk) */
static void PA_FN(dp_shifted_grads)(PA_FN(dp_scratch) *sc, int64_t l, real sign, const real *y,
                                    int64_t sk, real *da, real *dy)
{
    const int64_t K = sc->K;
    PA_FN(dp_shift_up)(sc->E, l, sign);
    PA_FN(dp_gram_grads)(sc, l, 1, sc->E, sc->Xa, K, y, sk);
    for (int64_t m = 0; m < l; m++) {
        if (m + 1 < l) {
            PA_FN(axpy)(da + (m + 1) * sk, sc->Tq + m * K, K, 1);
            PA_FN(axpy)(da + (m + 1) * sk, y + m * sk, K, sc->dp[m]);
        }
        PA_FN(axpy)(dy + m * sk, sc->Tr + m * K, K, 1);
        PA_FN(axpy)(dy + m * sk, sc->Xa + m * K, K, sc->dp[m]);
    }
}

/* The block's gradients: dq, dk, dv, da, db, dgk of its rows from its entering state S and dS,
 * the gradient reaching its end state (on return, the one reaching S). fresh: S is a unit's
 * zero start (no h0), whose products are left out where dp_zero_start allows. */
static void PA_FN(dp_block_grads)(const PA_FN(dp_unit) *u, int64_t c0, int64_t l, double scale,
                                  const real *S, int fresh, real *dS, PA_FN(dp_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, sk = u->sk, sv = u->sv;
    const real *q = u->q + c0 * sk, *k = u->k + c0 * sk, *v = u->v + c0 * sv;
    const real *a = u->a + c0 * sk, *b = u->b + c0 * sk, *dO = u->dout + c0 * sv;
    real *dq = u->dq + c0 * sk, *dk = u->dk + c0 * sk, *dv = u->dv + c0 * sv;
    real *da = u->da + c0 * sk, *db = u->db + c0 * sk;
    real *work = sc->work, *du = sc->R + K;
    const real sc_ = (real)scale;
    const PA_FN(la_side) plain_v = {.kind = PA_GATE_NONE, .D = V}, plain_w = {.kind = PA_GATE_NONE, .D = W};
    double *dG = sc->dG;
    PA_FN(dp_block)(u, c0, l, sc);
    if (fresh && PA_FN(dp_zero_start)(u, c0, l, dS, sc)) S = NULL;
    PA_FN(dp_values)(l, S, sc);
    PA_FN(dp_scores)(u, c0, l, scale, sc);
    memset(dG, 0, sizeof(double) * l * K);

    /* du = Pb^T dO + (B f') dS', dv = Pk^T dO + (K f') dS', and the end state's terms */
    PA_FN(la_tri_product)(l, V, 1, sc->Pb, 1, 0, du, W, dO, sv, &sc->bufs);
    PA_FN(la_tri_product)(l, V, 1, sc->Pk, 1, 0, dv, sv, dO, sv, &sc->bufs);
    PA_FN(dp_end_grads)(sc, l, b, sk, sc->Un, V, dS, db, du, W);
    PA_FN(dp_end_grads)(sc, l, k, sk, v, sv, dS, dk, dv, sv);
    PA_FN(la_total_decay)(&sc->ks, l, sc->f);
    for (int64_t c = 0; S && c < K; c++)
        dG[(l - 1) * K + c] += sc->f[c] * PA_FN(dot)(S + c * V, dS + c * V, V);

    /* dq = scale f (dO S^T), and the gate's term through f */
    if (S) {
        PA_FN(gemm)(l, K, V, sc_, dO, sv, 1, S, 1, V, 0, dq, sk, work);
        for (int64_t i = 0; i < l; i++) {
            PA_FN(la_side_row)(&sc->ks, l, 0, i, dq + i * sk, dq + i * sk, 1, 0);
            PA_FN(dp_gate_terms)(sc, i, q + i * sk, dq + i * sk, 1);
        }
    } else {
        for (int64_t i = 0; i < l; i++) memset(dq + i * sk, 0, sizeof(real) * K);
    }

    /* dPk = dO V^T and dPb = dO u^T: their pairs below the diagonal through the gated products,
     * then their diagonals, whose gate factor is 1 */
    PA_FN(la_gram_rows)(&plain_v, l, 1, dO, sv, v, sv, 0, sc->E, &sc->bufs);
    PA_FN(dp_gram_add)(sc, l, sc_, sc->E, q, k, sk, dq, dk);
    PA_FN(la_gram_rows)(&plain_v, l, 1, dO, sv, sc->Un, V, 0, sc->E, &sc->bufs);
    PA_FN(dp_gram_add)(sc, l, sc_, sc->E, q, b, sk, dq, db);

    /* dW = du S^T, then dS = diag(e^G_last) dS' + (Q~ f)^T dO + W^T du */
    if (S)
        PA_FN(gemm)(l, K, V, 1, du, W, 1, S, 1, V, 0, sc->R, W, work);
    else
        for (int64_t i = 0; i < l; i++) memset(sc->R + i * W, 0, sizeof(real) * K);
    PA_FN(dp_decay_state)(sc, l, dS);
    PA_FN(dp_gate_rows)(sc, l, 0, sc_, q, sk, sc->Tk);
    PA_FN(gemm)(K, V, l, 1, sc->Tk, 1, K, dO, sv, 1, 1, dS, V, work);
    PA_FN(gemm)(K, V, l, 1, sc->Z, 1, W, du, W, 1, 1, dS, V, work);

    /* dR = (I - A_ab)^-T [dW | dU]; the gradient of -A_ab, -strictly-lower(dR Z^T) */
    PA_FN(dr_solve_upper)(sc->A, l, sc->R, W, sc->Bp, work);
    /* the right-hand side's a e^G_{i-1}: a's term and the gate's */
    memcpy(da, sc->R, sizeof(real) * K);
    for (int64_t i = 1; i < l; i++) {
        real *t = sc->Tk + i * K;
        PA_FN(la_side_row)(&sc->ks, l, 0, i - 1, t, sc->R + i * W, 1, 0);
        memcpy(da + i * sk, t, sizeof(real) * K);
        PA_FN(dp_gate_terms)(sc, i - 1, a + i * sk, t, 1);
    }
    /* A_ak V: dA_ak = strictly-lower(dRv V^T), dv += A_ak^T dRv */
    PA_FN(la_gram_rows)(&plain_v, l, 1, sc->R + K, W, v, sv, 1, sc->E, &sc->bufs);
    PA_FN(la_tri_product)(l, V, 1, sc->Mk, 1, 1, dv, sv, sc->R + K, W, &sc->bufs);
    PA_FN(dp_shifted_grads)(sc, l, 1, k, sk, da, dk);
    PA_FN(la_gram_rows)(&plain_w, l, -1, sc->R, W, sc->Z, W, 1, sc->E, &sc->bufs);
    PA_FN(dp_shifted_grads)(sc, l, -1, b, sk, da, db);

    PA_FN(gate_grads_from_cumulative)(dG, l, K, u->gk + c0 * sk, u->dgk + c0 * sk, sk);
}

/* The unit's rows r0 .. r0+n-1 into L2 (prefetch_block_rows). state_only: the rows a block's
 * state reads (all but q and do). */
static inline __attribute__((always_inline)) void PA_FN(dp_prefetch_rows)(const PA_FN(dp_unit) *u,
                                                                         int64_t K, int64_t V,
                                                                         int64_t r0, int64_t n,
                                                                         int state_only)
{
    const real *krows[] = {u->k, u->a, u->b, u->gk, state_only ? NULL : u->q};
    for (int i = 0; i < 5; i++)
        if (krows[i]) PA_FN(prefetch_block_rows)(krows[i], u->sk, K, r0, n, u->T);
    PA_FN(prefetch_block_rows)(u->v, u->sv, V, r0, n, u->T);
    if (u->dout && !state_only) PA_FN(prefetch_block_rows)(u->dout, u->sv, V, r0, n, u->T);
}

/* The unit whose rows *r0 .. *r0+l-1 are unit u's rows c0 .. c0+l-1, for a block's
 * functions: u itself (*r0 = c0), or where the call stages its blocks, *b, those rows copied
 * contiguous into sc->stage (rows_copy; *r0 = 0): k, a, b, gk and v, and q and dout unless
 * state_only; the outputs written there go back to u by dp_unstage. */
static const PA_FN(dp_unit) *PA_FN(dp_stage)(const PA_FN(dp_call) *c, const PA_FN(dp_unit) *u,
                                             int64_t c0, int64_t l, int state_only,
                                             PA_FN(dp_scratch) *sc, PA_FN(dp_unit) *b,
                                             int64_t *r0)
{
    *r0 = c->staged ? 0 : c0;
    if (!c->staged) return u;
    const int64_t K = sc->K, V = sc->V, sk = u->sk, sv = u->sv;
    real *p = sc->stage;
    *b = (PA_FN(dp_unit)){.T = l, .sk = K, .sv = V};
    const real *const in[] = {u->k, u->a, u->b, u->gk, u->v, u->q, u->dout};
    const int64_t ld[] = {sk, sk, sk, sk, sv, sk, sv}, w[] = {K, K, K, K, V, K, V};
    const real **const to[] = {&b->k, &b->a, &b->b, &b->gk, &b->v, &b->q, &b->dout};
    PA_FN(stage_rows_in)(state_only ? 5 : 7, in, ld, w, c0, l, to, &p);
    if (state_only) return b;
    real *const out[] = {u->o, u->dv, u->dq, u->dk, u->da, u->db, u->dgk};
    const int64_t wo[] = {V, V, K, K, K, K, K};
    real **const into[] = {&b->o, &b->dv, &b->dq, &b->dk, &b->da, &b->db, &b->dgk};
    PA_FN(stage_rows_out)(7, out, wo, l, into, &p);
    return b;
}

/* The outputs of block b (as dp_stage gave it for rows c0 .. c0+l-1) into u's rows where it
 * is a staged copy (rows_put) */
static void PA_FN(dp_unstage)(const PA_FN(dp_call) *c, const PA_FN(dp_unit) *b, int64_t c0,
                              int64_t l, const PA_FN(dp_unit) *u)
{
    if (b == u) return;
    const int64_t K = c->d->K, V = c->d->V, sk = u->sk, sv = u->sv;
    real *const from[] = {b->o, b->dv, b->dq, b->dk, b->da, b->db, b->dgk};
    real *const to[] = {u->o, u->dv, u->dq, u->dk, u->da, u->db, u->dgk};
    const int64_t w[] = {V, V, K, K, K, K, K}, ld[] = {sv, sv, sk, sk, sk, sk, sk};
    PA_FN(unstage_rows)(7, from, w, to, ld, c0, l, c->stream);
}

static void PA_FN(dp_unit_forward)(const PA_FN(dp_call) *c, int64_t unit, PA_FN(dp_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V, L = sc->L;
    PA_FN(dp_unit) u;
    PA_FN(dp_unit_of)(c, unit, &u);
    real *S = sc->S, *slot = c->states ? c->states + c->first[unit] * KV : NULL;
    PA_FN(dr_copy_state)(c->h0 ? c->h0 + unit * KV : NULL, S, KV);
    if (L)
        for (int64_t c0 = 0; c0 < u.T; c0 += L) {
            const int64_t l = u.T - c0 < L ? u.T - c0 : L;
            PA_FN(dp_unit) staged;
            int64_t r;
            const PA_FN(dp_unit) *b = PA_FN(dp_stage)(c, &u, c0, l, 0, sc, &staged, &r);
            PA_FN(dp_prefetch_rows)(&u, d->K, d->V, c0 + L, L / 2, 0);
            PA_FN(dp_block)(b, r, l, sc);
            /* a unit without h0 enters its first block with zeros: their products left out */
            const int zero = c0 == 0 && !c->h0 && PA_FN(dp_zero_start)(b, r, l, NULL, sc);
            PA_FN(dp_values)(l, zero ? NULL : S, sc);
            PA_FN(dp_output)(b, r, l, d->scale, zero ? NULL : S, sc);
            PA_FN(dp_prefetch_rows)(&u, d->K, d->V, c0 + L + L / 2, L - L / 2, 0);
            PA_FN(la_keep_state)(&slot, S, KV, c->stream);
            PA_FN(dp_state)(b, r, l, S, sc);
            PA_FN(dp_unstage)(c, b, c0, l, &u);
        }
    else
        PA_FN(dp_recurrent)(&u, 0, u.T, d->scale, S, NULL, sc);
    PA_FN(la_keep_state)(&slot, S, KV, c->stream);
    if (c->ht) memcpy(c->ht + unit * KV, S, sizeof(real) * KV);
}

/* The backward of one unit: the states entering its blocks (chunk: kept by the forward, or
 * computed here) or pieces (recurrent), then one reverse pass carrying dS. */
static void PA_FN(dp_unit_backward)(const PA_FN(dp_call) *c, int64_t unit, PA_FN(dp_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V, L = sc->L, P = L ? L : DR_PIECE;
    PA_FN(dp_unit) u;
    PA_FN(dp_unit_of)(c, unit, &u);
    const int64_t np = (u.T + P - 1) / P;
    real *states = c->states ? c->states + c->first[unit] * KV : sc->states, *dS = sc->dS;
    if (!c->states) PA_FN(dr_copy_state)(c->h0 ? c->h0 + unit * KV : NULL, states, KV);
    for (int64_t p = 0; !c->states && L && p < np; p++) { /* the states entering blocks */
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        real *S = states + (p + 1) * KV;
        memcpy(S, S - KV, sizeof(real) * KV);
        PA_FN(dp_unit) staged;
        int64_t r;
        const PA_FN(dp_unit) *b = PA_FN(dp_stage)(c, &u, r0, n, 1, sc, &staged, &r);
        PA_FN(dp_prefetch_rows)(&u, d->K, d->V, r0 + P, P, 1);
        PA_FN(dp_block)(b, r, n, sc);
        PA_FN(dp_values)(n, p == 0 && !c->h0 && PA_FN(dp_zero_start)(b, r, n, NULL, sc) ? NULL : S, sc);
        PA_FN(dp_state)(b, r, n, S, sc);
    }
    PA_FN(dr_copy_state)(c->dht ? c->dht + unit * KV : NULL, dS, KV);
    if (!L) { /* the recurrent form: the states entering its pieces (the scratch's room), each
               * piece in reverse */
        PA_FN(dp_rows_reverse)(&u, 0, u.T, d->scale, states, dS, sc);
    } else {
        for (int64_t p = np - 1; p >= 0; p--) {
            const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
            PA_FN(dp_unit) staged;
            int64_t r;
            const PA_FN(dp_unit) *b = PA_FN(dp_stage)(c, &u, r0, n, 0, sc, &staged, &r);
            if (r0) PA_FN(dp_prefetch_rows)(&u, d->K, d->V, r0 - P, P, 0);
            /* an unclean block by the recurrent steps, unless their room cannot be had */
            real *room = PA_FN(dp_rows_unclean)(b, r, n, d->K, d->V)
                             ? PA_FN(dr_reverse_room)(states + p * KV, n, KV) : NULL;
            if (room)
                PA_FN(dp_rows_reverse)(b, r, n, d->scale, room, dS, sc);
            else
                PA_FN(dp_block_grads)(b, r, n, d->scale, states + p * KV, p == 0 && !c->h0, dS, sc);
            free(room);
            PA_FN(dp_unstage)(c, b, r0, n, &u);
        }
    }
    if (c->dh0) memcpy(c->dh0 + unit * KV, dS, sizeof(real) * KV);
}

static int PA_FN(dp_run)(PA_FN(dp_call) *c, int backward)
{
    const pa_linear_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    const int rec = d->form == PA_FORM_RECURRENT;
    const int64_t L = rec ? 0 : pa_linear_block_rows(d);
    if (c->states && !(c->first = PA_FN(la_slots)(d, L))) return PA_ENOMEM;
    c->stream = PA_FN(la_streams)(d);
    c->staged = PA_FN(rows_staged)(d->H * d->K, d->H * d->V);
    const int64_t nstates =
        PA_FN(dr_backward_states)(d, backward, c->states != NULL, rec ? DR_PIECE : L);
    const double rows = (double)d->cu[d->nseq] * (double)d->H, KV = (double)(d->K * d->V);
    /* multiply-adds; a recurrent step streams its state through memory, so it weighs more */
    const double work = rec ? rows * KV * 10 : rows * (KV * 4 + (double)L * (5 * d->K + 2 * d->V));
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        const int products = pa_bf16_products_begin(d->bf16 && d->form == PA_FORM_CHUNK);
        PA_FN(dp_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(dp_scratch_alloc)(&sc, L, d->K, d->V, nstates, c->staged),
                                    &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(dp_unit_backward)(c, un, &sc);
            else
                PA_FN(dp_unit_forward)(c, un, &sc);
        }
        if (ok) free(sc.block);
        pa_bf16_products_end(products);
        pa_subnormals_end(csr);
    }
    free((void *)c->first);
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(dplr_forward)(const pa_linear_desc *d, const void *q, const void *k,
                               const void *v, const void *a, const void *b, const void *gk,
                               const void *h0, void *o, void *ht, void *states)
{
    PA_FN(dp_call) c = {.d = d, .q = q, .k = k, .v = v, .a = a, .b = b, .gk = gk,
                        .h0 = h0, .o = o, .ht = ht,
                        .states = d->form == PA_FORM_CHUNK ? states : NULL};
    return PA_FN(dp_run)(&c, 0);
}

static int PA_FN(dplr_backward)(const pa_linear_desc *d, const void *q, const void *k,
                                const void *v, const void *a, const void *b, const void *gk,
                                const void *h0, const void *dout, const void *dht,
                                const void *states, void *dq, void *dk, void *dv, void *da,
                                void *db, void *dgk, void *dh0)
{
    PA_FN(dp_call) c = {.d = d, .q = q, .k = k, .v = v, .a = a, .b = b, .gk = gk,
                        .h0 = h0, .dout = dout, .dht = dht, .dq = dq, .dk = dk, .dv = dv,
                        .da = da, .db = db, .dgk = dgk, .dh0 = dh0,
                        .states = d->form == PA_FORM_CHUNK ? (real *)states : NULL};
    return PA_FN(dp_run)(&c, 1);
}
