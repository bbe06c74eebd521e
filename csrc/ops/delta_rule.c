/* The delta-rule engine (DeltaNet, Gated DeltaNet), forward and backward. Template body (see
 * core/dtype.h); needs core/vmath.h, core/gemm.c, ops/rows.h, ops/decay.h and
 * ops/linear_engine.h before it.
 *
 * Per (sequence, head) unit, with S_0 = h0 (zeros when absent), q~ = scale q and a scalar log
 * gate g per step (absent: 0):
 *   S_t = e^g_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q~_t,
 * i.e. with the decayed state D_t = e^g_t S_{t-1} and the step's new value
 * u_t = beta_t (v_t - D_t^T k_t):  S_t = D_t + k_t u_t^T.
 *
 * Forms. recurrent: that step, one pass over S per step (the pass that writes S_t also forms
 * S_t^T k_{t+1} for the next step). chunk (the WY / UT form): blocks of l rows, G the inclusive
 * cumulative gate inside the block (every exponent below is <= 0), Dm_ij = e^(G_i - G_j):
 *   A = strictly-lower(diag(beta) K K^T * Dm),
 *   Z = [W | U] = (I + A)^-1 [diag(beta e^G) K | diag(beta) V]   (forward substitution by
 *       DR_SUB-row diagonal blocks, GEMMs below them; the inverse is never formed),
 *   V' = U - W S  (the rows' u_t, from the state S entering the block),
 *   O  = diag(e^G) Q~ S + (Q~ K^T * Dm, j <= i) V',
 *   S' = e^G_last S + K^T diag(e^(G_last - G)) V'.
 * parallel: the chunk algorithm with one block per sequence.
 *
 * Backward. chunk and parallel: a forward pass keeps the state entering each block (one K x V
 * state per block of the unit in progress); blocks in reverse then recompute A, Z, V' and,
 * with dS' the gradient reaching S' and lam = e^(G_last - G):
 *   dV' = P^T dO + diag(lam) K dS'   (P = Q~ K^T * Dm, lower),   dW = -dV' S^T,
 *   dR = [dX | dY] = (I + A)^-T [dW | dV'],   dA = -strictly-lower(dR Z^T),
 *   dS = e^G_last dS' + (diag(e^G) Q~)^T dO - W^T dV',
 * and q, k, v, beta take the products' derivatives. The gate's gradient is the derivative of
 * every factor with respect to G (each exponent's two ends), summed in reverse inside the
 * block: only bounded factors appear, so strong gates neither overflow nor cancel.
 * recurrent: states kept every DR_PIECE steps; each piece's states recomputed, then stepped
 * back one row at a time.
 *
 * Work is split over (sequence, head) units, each on one thread.
 */

#define DR_SUB 16   /* rows of a diagonal block of the triangular solves */
#define DR_TRI (2 * MR) /* row block of the triangular products: whole micro-tiles */
#define DR_PIECE 64 /* recurrent backward: steps between kept states */

typedef struct {
    int64_t T;          /* rows of the sequence */
    int64_t sk, sv, sg; /* row strides: q/k, v/o, g/beta */
    const real *q, *k, *v, *g, *beta, *dout;
    real *o, *dq, *dk, *dv, *dg, *dbeta;
} PA_FN(dr_unit);

typedef struct {
    const pa_linear_desc *d;
    const real *q, *k, *v, *g, *beta, *h0, *dout, *dht;
    real *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dh0;
    real *states;         /* chunk form: the kept states (forward: written; backward: read) */
    const int64_t *first; /* their layout (la_slots) when given */
} PA_FN(dr_call);

static void PA_FN(dr_unit_of)(const PA_FN(dr_call) *c, int64_t unit, PA_FN(dr_unit) *u)
{
    const pa_linear_desc *d = c->d;
    const pa_linear_unit_at at = pa_linear_unit(d, unit);
    u->T = at.T;
    u->sk = d->H * d->K;
    u->sv = d->H * d->V;
    u->sg = d->H;
    const int64_t ok = at.k, ov = at.v, og = at.row;
    u->q = c->q + ok;
    u->k = c->k + ok;
    u->v = c->v + ov;
    u->g = c->g ? c->g + og : NULL;
    u->beta = c->beta + og;
    u->dout = c->dout ? c->dout + ov : NULL;
    u->o = c->o ? c->o + ov : NULL;
    u->dq = c->dq ? c->dq + ok : NULL;
    u->dk = c->dk ? c->dk + ok : NULL;
    u->dv = c->dv ? c->dv + ov : NULL;
    u->dg = c->dg ? c->dg + og : NULL;
    u->dbeta = c->dbeta ? c->dbeta + og : NULL;
}

/* Per-thread scratch for blocks of up to L rows (L = 0: the recurrent form's). */
typedef struct {
    int64_t L, K, V;
    double *G, *Gl, *dG;   /* L each: the cumulative gate (hi and lo parts), its gradient */
    real *gam, *lam, *bet; /* L each: e^G_i, e^(G_last - G_i), beta_i */
    real *Dm, *M, *A, *P, *E; /* L x L each */
    real *Z, *R;           /* L x (K + V) each: [W | U], then [dW | dV'] and [dX | dY] */
    real *Vn, *Tv;         /* L x V each: V', a scratch */
    real *Tk;              /* L x K */
    real *w, *uv, *du;     /* V each: a recurrent step's S^T k, u, du */
    real *S, *dS;          /* K x V each */
    real *states;          /* backward: the kept states */
    real *Bk;              /* K^T packed once per block (pack_b), for the Grams with K */
    real *Bp;              /* one operand packed once for the products below */
    int64_t *rows;         /* L: the non-finite rows of a triangular product's operand */
    real *work;            /* GEMM packing of the other operand */
    void *block;
} PA_FN(dr_scratch);

static int PA_FN(dr_scratch_alloc)(PA_FN(dr_scratch) *s, int64_t L, int64_t K, int64_t V,
                                   int64_t nstates)
{
    const int64_t W = K + V, big = L > W ? L : W;
    const size_t r = sizeof(real), dbl = sizeof(double);
    const size_t work = L ? (size_t)PA_FN(gemm_work_elems)(big, big, big) * r : 0;
    const size_t packed = L ? (size_t)PA_FN(packed_b_elems)(big, big) * r : 0;
    const size_t packed_k = L ? (size_t)PA_FN(packed_b_elems)(K, L) * r : 0;
    size_t bytes[] = {L * dbl,   L * dbl,   L * dbl,   L * r,     L * r,     L * r,     L * L * r,
                      L * L * r, L * L * r, L * L * r, L * L * r, L * W * r, L * W * r,
                      L * V * r, L * V * r, L * K * r, V * r,     V * r,     V * r,
                      K * V * r, K * V * r, nstates * K * V * r, packed_k, packed,
                      L * sizeof(int64_t), work};
    void **const parts[] = {(void **)&s->G,  (void **)&s->Gl, (void **)&s->dG, (void **)&s->gam, (void **)&s->lam,
                            (void **)&s->bet, (void **)&s->Dm, (void **)&s->M,  (void **)&s->A,
                            (void **)&s->P,  (void **)&s->E,  (void **)&s->Z,   (void **)&s->R,
                            (void **)&s->Vn, (void **)&s->Tv, (void **)&s->Tk,  (void **)&s->w,
                            (void **)&s->uv, (void **)&s->du, (void **)&s->S,   (void **)&s->dS,
                            (void **)&s->states, (void **)&s->Bk, (void **)&s->Bp,
                            (void **)&s->rows, (void **)&s->work};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    s->L = L;
    s->K = K;
    s->V = V;
    return s->block != NULL;
}

/* dst = src (K V reals), or zeros when src is NULL */
static void PA_FN(dr_copy_state)(const real *src, real *dst, int64_t KV)
{
    if (src)
        memcpy(dst, src, sizeof(real) * KV);
    else
        memset(dst, 0, sizeof(real) * KV);
}

/* e^g of one step (1 without a gate), clamped as the block's cumulative sums are */
static inline real PA_FN(dr_step_decay)(const PA_FN(dr_unit) *u, int64_t t)
{
    if (!u->g) return 1;
    return (real)exp(PA_FN(gate_step)(u->g[t * u->sg]));
}

/* ---- the recurrent form ---- */

/* Steps t0 .. t0+n-1 from the entering state S0 (NULL: zeros; may be S) into S; o rows
 * written when u->o; with trail, the state after each step goes to trail + i K V. The state
 * is swept by columns of one vector: the new rows are written while the output and the next
 * step's S^T k accumulate in registers, so S is read once and written once per step. */
static void PA_FN(dr_recurrent)(const PA_FN(dr_unit) *u, int64_t t0, int64_t n, double scale,
                                const real *S0, real *S, real *trail, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V;
    real *restrict w = sc->w, *restrict uv = sc->uv;
    if (n == 0) {
        if (S0 != S) PA_FN(dr_copy_state)(S0, S, K * V);
        return;
    }
    for (int64_t j = 0; j < V; j += VL) { /* w = S0^T k_t0 */
        vreal a0 = PA_FN(vset)(0), a1 = a0;
        const real *kt = u->k + t0 * u->sk;
        for (int64_t r = 0; S0 && r + 1 < K; r += 2) {
            a0 += kt[r] * PA_FN(row_ld)(S0 + r * V + j, V - j);
            a1 += kt[r + 1] * PA_FN(row_ld)(S0 + (r + 1) * V + j, V - j);
        }
        if (S0 && K % 2) a0 += kt[K - 1] * PA_FN(row_ld)(S0 + (K - 1) * V + j, V - j);
        PA_FN(row_st)(w + j, a0 + a1, V - j);
    }
    for (int64_t t = t0; t < t0 + n; t++) {
        const real e = PA_FN(dr_step_decay)(u, t), b = u->beta[t * u->sg], sq = (real)scale;
        const real *restrict kt = u->k + t * u->sk, *restrict qt = u->q + t * u->sk;
        const real *restrict vt = u->v + t * u->sv;
        const real *restrict kn = t + 1 < t0 + n ? u->k + (t + 1) * u->sk : kt;
        const real *src = t == t0 ? S0 : S;
        real *ot = u->o ? u->o + t * u->sv : NULL;
        for (int64_t j = 0; j < V; j++) uv[j] = b * (vt[j] - e * w[j]);
        for (int64_t j = 0; j < V; j += VL) {
            const int64_t left = V - j;
            const vreal vu = PA_FN(row_ld)(uv + j, left);
            vreal o0 = PA_FN(vset)(0), o1 = o0, w0 = o0, w1 = o0;
            for (int64_t r = 0; r < K; r++) {
                const vreal x = (src ? e * PA_FN(row_ld)(src + r * V + j, left) : PA_FN(vset)(0)) +
                                kt[r] * vu;
                PA_FN(row_st)(S + r * V + j, x, left);
                if (r % 2) {
                    o1 += (sq * qt[r]) * x;
                    w1 += kn[r] * x;
                } else {
                    o0 += (sq * qt[r]) * x;
                    w0 += kn[r] * x;
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
static void PA_FN(dr_recurrent_reverse)(const PA_FN(dr_unit) *u, int64_t t0, int64_t n,
                                        double scale, const real *trail, real *restrict dS,
                                        PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, KV = K * V;
    real *restrict w = sc->w, *restrict uv = sc->uv, *restrict du = sc->du;
    const real sc_ = (real)scale;
    for (int64_t t = t0 + n - 1; t >= t0; t--) {
        const real *restrict Sp = trail + (t - t0) * KV, *restrict Sc = Sp + KV;
        const real e = PA_FN(dr_step_decay)(u, t), b = u->beta[t * u->sg];
        const real *restrict kt = u->k + t * u->sk, *restrict qt = u->q + t * u->sk;
        const real *restrict vt = u->v + t * u->sv, *restrict dot_ = u->dout + t * u->sv;
        real *restrict dqt = u->dq + t * u->sk, *restrict dkt = u->dk + t * u->sk;
        real *restrict dvt = u->dv + t * u->sv;
        for (int64_t j = 0; j < V; j++) w[j] = du[j] = 0;
        for (int64_t r = 0; r < K; r++) { /* dS += q~ do^T; du = dS^T k; S_{t-1}^T k */
            real *restrict row = dS + r * V;
            const real qr = sc_ * qt[r], kr = kt[r];
            dqt[r] = sc_ * PA_FN(dot)(Sc + r * V, dot_, V);
            for (int64_t j = 0; j < V; j++) {
                row[j] += qr * dot_[j];
                du[j] += kr * row[j];
                w[j] += kr * Sp[r * V + j];
            }
        }
        double db = 0;
        for (int64_t j = 0; j < V; j++) {
            const real res = vt[j] - e * w[j]; /* v - D^T k */
            uv[j] = b * res;
            db += (double)du[j] * res;
            dvt[j] = b * du[j];
        }
        u->dbeta[t * u->sg] = (real)db;
        double dg = 0;
        for (int64_t r = 0; r < K; r++) { /* dD = dS - beta k du^T; dS_{t-1} = e dD */
            real *restrict row = dS + r * V;
            const real *restrict sp = Sp + r * V;
            const real kr = b * kt[r];
            dkt[r] = PA_FN(dot)(row, uv, V) - b * e * PA_FN(dot)(sp, du, V);
            for (int64_t j = 0; j < V; j++) row[j] -= kr * du[j];
            if (u->dg) dg += (double)PA_FN(dot)(sp, row, V);
            for (int64_t j = 0; j < V; j++) row[j] *= e;
        }
        if (u->dg) {
            const double x = u->g[t * u->sg];
            u->dg[t * u->sg] = x < -PA_GATE_RESET ? 0 : (real)(e * dg);
        }
    }
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
    for (int64_t b0 = 0; b0 < l; b0 += DR_SUB) {
        const int64_t b1 = b0 + DR_SUB < l ? b0 + DR_SUB : l;
        PA_FN(gemm_packed_b)(b1 - b0, W, b0, -1, A + b0 * l, l, 1, Bp, l * NR, 1, X + b0 * W, W,
                             work);
        for (int64_t i = b0 + 1; i < b1; i++)
            for (int64_t j = b0; j < i; j++) PA_FN(axpy)(X + i * W, X + j * W, W, -A[i * l + j]);
        PA_FN(dr_pack_rows)(b0, b1, l, W, X, W, Bp);
    }
}

/* Solves (I + A)^T X = X in place: the same blocks from the last, transposed. */
static void PA_FN(dr_solve_upper)(const real *A, int64_t l, real *X, int64_t W, real *Bp,
                                  real *work)
{
    for (int64_t b0 = (l - 1) / DR_SUB * DR_SUB; b0 >= 0; b0 -= DR_SUB) {
        const int64_t b1 = b0 + DR_SUB < l ? b0 + DR_SUB : l;
        PA_FN(gemm_packed_b)(b1 - b0, W, l - b1, -1, A + b1 * l + b0, 1, l, Bp + b1 * NR, l * NR,
                             1, X + b0 * W, W, work);
        for (int64_t i = b1 - 2; i >= b0; i--)
            for (int64_t j = i + 1; j < b1; j++) PA_FN(axpy)(X + i * W, X + j * W, W, -A[j * l + i]);
        PA_FN(dr_pack_rows)(b0, b1, l, W, X, W, Bp);
    }
}

/* ---- products with a triangle, by DR_TRI-row blocks: about half a full GEMM's work, and a
 * row reads no operand row its triangle does not reach, beyond its own block ---- */

/* C = alpha L B + beta C for the l x l lower triangular L (leading dimension l, diagonal
 * included); B and C rows of ldb and ldc; B is packed once into Bp. A row block's GEMM also
 * multiplies the zeros above its diagonal with later rows of B, and 0 * NaN would carry a
 * non-finite later row to rows that cannot see it: when B has one, every row sums only the
 * rows it sees. */
static void PA_FN(dr_lower_product)(int64_t l, int64_t N, real alpha, const real *Lm,
                                    const real *B, int64_t ldb, real beta, real *C, int64_t ldc,
                                    real *Bp, int64_t *rows, real *work)
{
    if (PA_FN(la_nonfinite_rows)(B, ldb, l, N, rows)) {
        for (int64_t i = 0; i < l; i++) {
            real *c = C + i * ldc;
            if (beta == 0)
                memset(c, 0, sizeof(real) * N);
            else
                PA_FN(row_scale)(c, N, beta);
            for (int64_t j = 0; j <= i; j++) PA_FN(axpy)(c, B + j * ldb, N, alpha * Lm[i * l + j]);
        }
        return;
    }
    PA_FN(dr_pack_rows)(0, l, l, N, B, ldb, Bp);
    for (int64_t r0 = 0; r0 < l; r0 += DR_TRI) {
        const int64_t r1 = r0 + DR_TRI < l ? r0 + DR_TRI : l;
        PA_FN(gemm_packed_b)(r1 - r0, N, r1, alpha, Lm + r0 * l, l, 1, Bp, l * NR, beta,
                             C + r0 * ldc, ldc, work);
    }
}

/* C = alpha L^T B + beta C, L and the packing as in dr_lower_product */
static void PA_FN(dr_lower_t_product)(int64_t l, int64_t N, real alpha, const real *Lm,
                                      const real *B, int64_t ldb, real beta, real *C,
                                      int64_t ldc, real *Bp, real *work)
{
    PA_FN(dr_pack_rows)(0, l, l, N, B, ldb, Bp);
    for (int64_t r0 = 0; r0 < l; r0 += DR_TRI) {
        const int64_t r1 = r0 + DR_TRI < l ? r0 + DR_TRI : l;
        PA_FN(gemm_packed_b)(r1 - r0, N, l - r0, alpha, Lm + r0 * l + r0, 1, l, Bp + r0 * NR,
                             l * NR, beta, C + r0 * ldc, ldc, work);
    }
}

/* Y^T packed for dr_lower_gram: Y l x D (rows of ldy) as the D x l operand B = Y^T */
static void PA_FN(dr_pack_t)(int64_t l, int64_t D, const real *Y, int64_t ldy, real *Bp)
{
    PA_FN(pack_b)(D, l, Y, 1, ldy, Bp);
}

/* The lower triangle (and the diagonal blocks whole) of C = alpha X Y^T, l x l of leading
 * dimension l, X l x D with rows of ldx and Y^T packed in Bp (dr_pack_t); above the diagonal
 * blocks C is not written. */
static void PA_FN(dr_lower_gram)(int64_t l, int64_t D, real alpha, const real *X, int64_t ldx,
                                 const real *Bp, real *C, real *work)
{
    for (int64_t r0 = 0; r0 < l; r0 += DR_TRI) {
        const int64_t r1 = r0 + DR_TRI < l ? r0 + DR_TRI : l;
        PA_FN(gemm_packed_b)(r1 - r0, r1, D, alpha, X + r0 * ldx, ldx, 1, Bp, D * NR, 0,
                             C + r0 * l, l, work);
    }
}

/* The block of rows c0 .. c0+l-1: G and its factors, beta, the decay mask Dm, the Gram
 * M = K K^T, A, and Z = [W | U]. */
static void PA_FN(dr_block)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, sk = u->sk, sv = u->sv;
    const real *k = u->k + c0 * sk, *v = u->v + c0 * sv;
    if (u->g) PA_FN(gate_cumsum)(u->g + c0 * u->sg, u->sg, l, 0, sc->G, sc->Gl);
    for (int64_t i = 0; i < l; i++) {
        sc->gam[i] = u->g ? (real)exp(PA_FN(gate_diff)(sc->G, sc->Gl, i, -1)) : 1;
        sc->lam[i] = u->g ? (real)exp(PA_FN(gate_diff)(sc->G, sc->Gl, l - 1, i)) : 1;
        sc->bet[i] = u->beta[(c0 + i) * u->sg];
    }
    PA_FN(decay_mask)(u->g ? sc->G : NULL, sc->Gl, l, sc->Dm);
    PA_FN(dr_pack_t)(l, K, k, sk, sc->Bk);
    PA_FN(dr_lower_gram)(l, K, 1, k, sk, sc->Bk, sc->M, sc->work);
    for (int64_t i = 0; i < l; i++) {
        real *a = sc->A + i * l;
        const real *m = sc->M + i * l, *dm = sc->Dm + i * l;
        for (int64_t j = 0; j < i; j++) a[j] = sc->bet[i] * dm[j] * m[j];
        for (int64_t j = i; j < l; j++) a[j] = 0;
        real *z = sc->Z + i * W;
        const real bg = sc->bet[i] * sc->gam[i];
        for (int64_t c = 0; c < K; c++) z[c] = bg * k[i * sk + c];
        for (int64_t c = 0; c < V; c++) z[K + c] = sc->bet[i] * v[i * sv + c];
    }
    PA_FN(dr_solve_lower)(sc->A, l, sc->Z, W, sc->Bp, sc->work);
}

/* V' = U - W S */
static void PA_FN(dr_values)(int64_t l, const real *S, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V;
    for (int64_t i = 0; i < l; i++) memcpy(sc->Vn + i * V, sc->Z + i * W + K, sizeof(real) * V);
    PA_FN(gemm)(l, V, K, -1, sc->Z, W, 1, S, V, 1, 1, sc->Vn, V, sc->work);
}

/* P = scale Q K^T * Dm (lower, diagonal included; 0 above), with the block's K^T packed by
 * dr_block */
static void PA_FN(dr_scores)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                             PA_FN(dr_scratch) *sc)
{
    PA_FN(dr_lower_gram)(l, sc->K, (real)scale, u->q + c0 * u->sk, u->sk, sc->Bk, sc->P, sc->work);
    for (int64_t i = 0; i < l; i++) { /* by selection above: a later row's NaN stays there */
        real *p = sc->P + i * l;
        const real *dm = sc->Dm + i * l;
        for (int64_t j = 0; j <= i; j++) p[j] *= dm[j];
        for (int64_t j = i + 1; j < l; j++) p[j] = 0;
    }
}

/* The block's o rows from its entering state S (dr_block and dr_values done) */
static void PA_FN(dr_output)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                             const real *S, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, sv = u->sv;
    real *o = u->o + c0 * sv;
    PA_FN(gemm)(l, V, K, (real)scale, u->q + c0 * u->sk, u->sk, 1, S, V, 1, 0, o, sv, sc->work);
    if (u->g)
        for (int64_t i = 0; i < l; i++) PA_FN(row_scale)(o + i * sv, V, sc->gam[i]);
    PA_FN(dr_scores)(u, c0, l, scale, sc);
    PA_FN(dr_lower_product)(l, V, 1, sc->P, sc->Vn, V, 1, o, sv, sc->Bp, sc->rows, sc->work);
}

/* S <- e^G_last S + K^T diag(lam) V' */
static void PA_FN(dr_state)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, real *S,
                            PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V;
    if (u->g) PA_FN(row_scale)(S, K * V, sc->gam[l - 1]);
    for (int64_t i = 0; i < l; i++)
        for (int64_t j = 0; j < V; j++) sc->Tv[i * V + j] = sc->lam[i] * sc->Vn[i * V + j];
    PA_FN(gemm)(K, V, l, 1, u->k + c0 * u->sk, 1, u->sk, sc->Tv, V, 1, 1, S, V, sc->work);
}

/* The block's gradients: dq, dk, dv, dbeta, dg of its rows from its entering state S and dS,
 * the gradient reaching its end state (on return, the one reaching S). */
static void PA_FN(dr_block_grads)(const PA_FN(dr_unit) *u, int64_t c0, int64_t l, double scale,
                                  const real *S, real *dS, PA_FN(dr_scratch) *sc)
{
    const int64_t K = sc->K, V = sc->V, W = K + V, KV = K * V, sk = u->sk, sv = u->sv;
    const real *q = u->q + c0 * sk, *k = u->k + c0 * sk, *v = u->v + c0 * sv;
    const real *dO = u->dout + c0 * sv;
    real *dq = u->dq + c0 * sk, *dk = u->dk + c0 * sk, *dv = u->dv + c0 * sv;
    real *work = sc->work, *dVn = sc->R + K;
    double *dG = sc->dG;
    const int gated = u->g != NULL;
    PA_FN(dr_block)(u, c0, l, sc);
    PA_FN(dr_values)(l, S, sc);
    PA_FN(dr_scores)(u, c0, l, scale, sc);
    for (int64_t i = 0; i < l; i++) dG[i] = 0;

    /* dV' = P^T dO + diag(lam) K dS' */
    PA_FN(dr_lower_t_product)(l, V, 1, sc->P, dO, sv, 0, dVn, W, sc->Bp, work);
    PA_FN(gemm)(l, V, K, 1, k, sk, 1, dS, V, 1, 0, sc->Tv, V, work);
    for (int64_t i = 0; i < l; i++) PA_FN(axpy)(dVn + i * W, sc->Tv + i * V, V, sc->lam[i]);

    /* dq = scale diag(e^G) dO S^T + scale (dP * Dm) K, dP = dO V'^T; dk from dP */
    PA_FN(gemm)(l, K, V, (real)scale, dO, sv, 1, S, 1, V, 0, dq, sk, work);
    for (int64_t i = 0; gated && i < l; i++) {
        PA_FN(row_scale)(dq + i * sk, K, sc->gam[i]);
        dG[i] += PA_FN(dot)(q + i * sk, dq + i * sk, K);
    }
    PA_FN(dr_pack_t)(l, V, sc->Vn, V, sc->Bp);
    PA_FN(dr_lower_gram)(l, V, 1, dO, sv, sc->Bp, sc->E, work);
    for (int64_t i = 0; i < l; i++) {
        real *e = sc->E + i * l;
        const real *p = sc->P + i * l, *dm = sc->Dm + i * l;
        for (int64_t j = 0; gated && j < i; j++) {
            const double x = (double)e[j] * p[j];
            dG[i] += x;
            dG[j] -= x;
        }
        for (int64_t j = 0; j <= i; j++) e[j] *= dm[j];
        for (int64_t j = i + 1; j < l; j++) e[j] = 0;
    }
    PA_FN(dr_lower_product)(l, K, (real)scale, sc->E, k, sk, 1, dq, sk, sc->Bp, sc->rows, work);
    PA_FN(dr_lower_t_product)(l, K, (real)scale, sc->E, q, sk, 0, dk, sk, sc->Bp, work);

    /* the end state's terms: dk += diag(lam) V' dS'^T, and the gate's through lam and e^G_last */
    PA_FN(gemm)(l, K, V, 1, sc->Vn, V, 1, dS, 1, V, 0, sc->Tk, K, work);
    for (int64_t i = 0; i < l; i++) {
        const real *tk = sc->Tk + i * K;
        if (gated && i < l - 1) { /* the last row's lam is e^0: its two terms cancel */
            const double x = (double)sc->lam[i] * PA_FN(dot)(k + i * sk, tk, K);
            dG[l - 1] += x;
            dG[i] -= x;
        }
        PA_FN(axpy)(dk + i * sk, tk, K, sc->lam[i]);
    }
    if (gated) {
        double s = 0;
        for (int64_t i = 0; i < KV; i++) s += (double)S[i] * dS[i];
        dG[l - 1] += sc->gam[l - 1] * s;
    }

    /* dW = -dV' S^T, then dS = e^G_last dS' + Q~^T diag(e^G) dO - W^T dV' */
    PA_FN(gemm)(l, K, V, -1, dVn, W, 1, S, 1, V, 0, sc->R, W, work);
    if (gated) PA_FN(row_scale)(dS, KV, sc->gam[l - 1]);
    for (int64_t i = 0; i < l; i++)
        for (int64_t j = 0; j < V; j++) sc->Tv[i * V + j] = sc->gam[i] * dO[i * sv + j];
    PA_FN(gemm)(K, V, l, (real)scale, q, 1, sk, sc->Tv, V, 1, 1, dS, V, work);
    PA_FN(gemm)(K, V, l, -1, sc->Z, 1, W, dVn, W, 1, 1, dS, V, work);

    /* [dX | dY] = (I + A)^-T [dW | dV'];  dA = -strictly-lower([dX | dY] Z^T) */
    PA_FN(dr_solve_upper)(sc->A, l, sc->R, W, sc->Bp, work);
    PA_FN(dr_pack_t)(l, W, sc->Z, W, sc->Bp);
    PA_FN(dr_lower_gram)(l, W, -1, sc->R, W, sc->Bp, sc->E, work);
    /* A_ij = beta_i Dm_ij M_ij: beta's and the gate's terms, and dM (symmetrised, in P) */
    for (int64_t i = 0; i < l; i++) {
        const real *da = sc->E + i * l, *a = sc->A + i * l, *dm = sc->Dm + i * l, *m = sc->M + i * l;
        double db = 0;
        for (int64_t j = 0; j < i; j++) {
            const real x = da[j] * dm[j];
            db += (double)x * m[j];
            if (gated) {
                dG[i] += (double)da[j] * a[j];
                dG[j] -= (double)da[j] * a[j];
            }
            sc->P[i * l + j] = sc->P[j * l + i] = sc->bet[i] * x;
        }
        sc->P[i * l + i] = 0;
        const real *dx = sc->R + i * W, *dy = dx + K;
        const real xk = PA_FN(dot)(dx, k + i * sk, K);
        /* fused explicitly: whether the compiler fuses it depends on what it inlines here */
        db += fma((double)sc->gam[i], xk, PA_FN(dot)(dy, v + i * sv, V));
        u->dbeta[(c0 + i) * u->sg] = (real)db;
        if (gated) dG[i] += (double)sc->bet[i] * sc->gam[i] * xk;
        PA_FN(axpy)(dk + i * sk, dx, K, sc->bet[i] * sc->gam[i]);
        for (int64_t j = 0; j < V; j++) dv[i * sv + j] = sc->bet[i] * dy[j];
    }
    PA_FN(gemm)(l, K, l, 1, sc->P, l, 1, k, sk, 1, 1, dk, sk, work);

    /* g_s enters G_i for every i >= s of the block */
    if (gated) {
        double acc = 0;
        for (int64_t i = l - 1; i >= 0; i--) {
            acc += dG[i];
            const double x = u->g[(c0 + i) * u->sg];
            u->dg[(c0 + i) * u->sg] = x < -PA_GATE_RESET ? 0 : (real)acc;
        }
    }
}

/* ---- drivers ---- */

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
    real *S = c->states ? c->states + c->first[unit] * KV : c->ht ? c->ht + unit * KV : sc->S;
    if (S != h0) PA_FN(dr_copy_state)(h0, S, KV);
    for (int64_t c0 = 0; c0 < u.T; c0 += L) {
        const int64_t l = u.T - c0 < L ? u.T - c0 : L;
        PA_FN(dr_block)(&u, c0, l, sc);
        PA_FN(dr_values)(l, S, sc);
        PA_FN(dr_output)(&u, c0, l, d->scale, S, sc);
        if (c->states) {
            memcpy(S + KV, S, sizeof(real) * KV);
            S += KV;
        }
        PA_FN(dr_state)(&u, c0, l, S, sc);
    }
    if (c->states && c->ht) memcpy(c->ht + unit * KV, S, sizeof(real) * KV);
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
    for (int64_t p = 0; !c->states && p < np; p++) {
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        real *S = states + (p + 1) * KV;
        if (rec) {
            PA_FN(dr_recurrent)(&u, r0, n, d->scale, S - KV, S, NULL, sc);
        } else {
            memcpy(S, S - KV, sizeof(real) * KV);
            PA_FN(dr_block)(&u, r0, n, sc);
            PA_FN(dr_values)(n, S - KV, sc);
            PA_FN(dr_state)(&u, r0, n, S, sc);
        }
    }
    PA_FN(dr_copy_state)(c->dht ? c->dht + unit * KV : NULL, dS, KV);
    real *trail = sc->states + (np + 1) * KV; /* recurrent: a piece's states */
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        if (rec) {
            memcpy(trail, states + p * KV, sizeof(real) * KV);
            PA_FN(dr_recurrent)(&u, r0, n, d->scale, trail, sc->S, trail + KV, sc);
            PA_FN(dr_recurrent_reverse)(&u, r0, n, d->scale, trail, dS, sc);
        } else {
            PA_FN(dr_block_grads)(&u, r0, n, d->scale, states + p * KV, dS, sc);
        }
    }
    if (c->dh0) memcpy(c->dh0 + unit * KV, dS, sizeof(real) * KV);
}

static int PA_FN(dr_run)(PA_FN(dr_call) *c, int backward)
{
    const pa_linear_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    const int rec = d->form == PA_FORM_RECURRENT;
    const int64_t L = rec ? 0 : pa_linear_block_rows(d), maxlen = pa_linear_max_len(d);
    const int64_t P = rec ? DR_PIECE : L;
    if (c->states && !(c->first = PA_FN(la_slots)(d, L))) return PA_ENOMEM;
    /* backward without kept states: the state entering each block or piece and the last;
     * recurrent: also a piece's states */
    const int64_t nstates = !backward ? 0
                            : (c->states ? 0 : (maxlen + P - 1) / P + 1) + (rec ? DR_PIECE + 1 : 0);
    const double rows = (double)d->cu[d->nseq] * (double)d->H, KV = (double)(d->K * d->V);
    /* multiply-adds; a recurrent step streams its state through memory, so it weighs more */
    const double work = rec ? rows * KV * 8 : rows * (KV * 3 + (double)L * (2 * d->K + d->V));
    const int nthreads = pa_threads_for(backward ? 3 * work : work, units);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        PA_FN(dr_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(dr_scratch_alloc)(&sc, L, d->K, d->V, nstates), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(dr_unit_backward)(c, un, L, &sc);
            else
                PA_FN(dr_unit_forward)(c, un, L, &sc);
        }
        if (ok) free(sc.block);
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
    PA_FN(dr_call) c = {.d = d, .q = q, .k = k, .v = v, .g = g, .beta = beta, .h0 = h0,
                        .dout = dout, .dht = dht, .dq = dq, .dk = dk, .dv = dv, .dg = dg,
                        .dbeta = dbeta, .dh0 = dh0,
                        .states = d->form == PA_FORM_CHUNK ? (real *)states : NULL};
    return PA_FN(dr_run)(&c, 1);
}
