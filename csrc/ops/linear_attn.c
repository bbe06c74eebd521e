/* The gated linear engine, forward and backward. Template body (see
 * core/dtype.h); needs core/vmath.h, core/gemm.c, ops/rows.h, ops/decay.h and
 * ops/linear_engine.h before it.
 *
 * Per (sequence, head) unit, with S_0 = h0 (zeros when absent) and q~ = scale q:
 *   S_t = diag(exp(gk_t)) S_{t-1} diag(exp(gv_t)) + k_t v_t^T,   o_t = S_t^T q~_t
 * gk is absent, a scalar per step or a K-vector per step; gv is absent or a V-vector per step.
 *
 * Forms. recurrent: the recurrence, one step at a time. chunk: blocks of L rows; with G the
 * inclusive cumulative gate inside the block (so every exponent below is <= 0):
 *   O   = ((q~ e^Gk) S) e^Gv  +  sum_{j<=i} A_ij e^(Gv_i - Gv_j) v_j,
 *   A_ij = sum_k q~_ik k_jk e^(Gk_ik - Gk_jk)                         (the gated Gram)
 *   S'  = e^Gk_L S e^Gv_L + (k e^(Gk_L - Gk))^T (v e^(Gv_L - Gv)).
 * A scalar gate makes A a GEMM times a decay mask. A vector gate whose block spans at most
 * LA_FACTOR of log decay in every channel factors as e^(Gk_i - Gk_j) = e^(Gk_i - Gk_0)
 * e^(Gk_0 - Gk_j) with no factor above e^LA_FACTOR: A is then one GEMM of rescaled operands.
 * A stronger one splits the block into LA_SUB-row sub-blocks: off-diagonal ones are GEMMs of
 * operands rescaled to the sub-block's first row (bounded exponents both sides), diagonal
 * ones join that GEMM when their own gate spans at most LA_FACTOR, and are summed
 * elementwise otherwise.
 * parallel: the chunk algorithm with one block per sequence, i.e. the masked decay matrix.
 *
 * Backward. With dS_t the gradient reaching S_t: dq_t = scale S_t do_t needs the states
 * forward in time; dk_t = dS_t v_t and dv_t = dS_t^T k_t need dS backward in time. So a
 * forward pass keeps the state entering each piece of P rows (a chunk of the chunk form,
 * LA_PIECE rows otherwise; the recurrent form emits dq on the way), and one reverse pass
 * carries dS and emits the rest. The chunk form's intra-block terms use the gated Gram
 * B_ij = sum_v do_iv v_jv e^(Gv_iv - Gv_jv):
 *   dq_i += scale sum_{j<=i} B_ij e^(Gk_i - Gk_j) k_j,  dk_j += sum_{i>=j} B_ij e^(..) q~_i,
 *   dv_j += sum_{i>=j} A_ij e^(Gv_i - Gv_j) do_i.
 * Gates then follow for every form from one identity. The outputs after row a depend on the
 * gates G_t (t > a, cumulative from a) only through S_a e^G_t, q_t e^G_t and k_t e^-G_t (and
 * for gv through o_t and v_t), so with dS_a the gradient reaching S_a from the rows after a,
 *   dgk_t = rowsum(S_a * dS_a) - sum_{a<s<t} (q_s dq_s - k_s dk_s),
 *   dgv_t = colsum(S_a * dS_a) - sum_{a<s<t} (o_s do_s - v_s dv_s).
 * It is taken with a the row before t's piece: the terms, which cancel, then sum over fewer
 * than P rows rather than the whole sequence, which keeps float32 sums over time of dg (the
 * gradient of a per-head decay) accurate at any length. Two kinds of terms would leave only
 * their rounding where the gate is strong: those of s with itself (k_s v_s^T enters S_s
 * undecayed), equal in q_s dq_s and k_s dk_s (and in o_s do_s and v_s dv_s), so they are left
 * out; and those of the final state's cotangent with the last row, which this form (rather
 * than the suffix one, with S_b and dS_b at the piece's end) never meets. So the backward
 * first forms the off-diagonal dq, dk, dv (and o, kept in dgv until its gradient overwrites
 * it), takes the gates' gradients, then adds the diagonal:
 *   dq_s += scale (do_s . v_s) k_s,  dk_s += scale (do_s . v_s) q_s,  dv_s += scale (q_s . k_s) do_s.
 *
 * Two options serve Mamba-2 (v = x dt, y = o + D x) without arrays of their own: beta scales
 * each value row as every form reads it, v'_t = beta_t v_t (a block's rows are scaled once
 * into its scratch), and skip adds skip_h v_t to o_t. The backward works with v' throughout,
 * then per row dbeta_t = v_t . dv'_t, dv_t = beta_t dv'_t + skip_h do_t (la_finish_rows).
 *
 * Work is split over units when there are enough of them; otherwise over (unit, chunk)
 * items, with the states passed by a scan over chunks (the only sequential part). Where a
 * unit's rows lie a multiple of 1 KiB apart, the chunk backward works on a copy of each
 * block's rows, contiguous (la_stage).
 */

#define LA_PIECE 64   /* rows of a backward piece in the recurrent and parallel forms */

/* Per-thread scratch of the chunk form for blocks of up to L rows. */
typedef struct {
    int64_t L;
    real *Gk, *Gv, *Dm;   /* 2 x L x K, 2 x L x V (hi then lo parts), L x L */
    real *Ek, *Ev;        /* (2 L + 1) x K, (2 L + 1) x V: a factored vector gate's Ep, Em, E0 */
    double *Gs;           /* 2 x L: a scalar gate's cumulative sums, hi then lo parts */
    double *acc;          /* 4 x (K + V): the gate gradients' boundary terms (start, end), then
                           * the cumulative gates' running hi, lo sums */
    real *Gk2, *Gv2, *Dm2; /* as Gk, Gv, Dm: the sides of ke, ve */
    double *Gs2;          /* as Gs, for ke */
    int ends;             /* the block has a NaN gate: ke, ve below serve the products that
                           * look forward (la_block) */
    PA_FN(la_side) ke, ve;
    real *X, *Y;          /* L x W each */
    real *A, *B;          /* L x L each */
    PA_FN(la_bufs) bufs;  /* the Grams' and triangular products' (Tm, U: L x W; M: L x L) */
    real *S, *dS;         /* K x V each */
    real *deck, *decv;    /* K, V: a block's total decays */
    real *states;         /* backward: the state entering each piece, then the final one */
    real *Vb;             /* L x V: a block's value rows times their scales (la_block) */
    const real *vb;       /* the block's value rows as the products read them: v's, or Vb */
    int64_t ldv;
    int vb_packed;        /* bufs.Bp holds the block's value rows packed (la_block_output): the
                           * state product reads them there */
    real *Kf;             /* L x K: k times a factored key gate's factors to the block's end,
                           * made beside the Gram's copy of k (la_block_output) */
    int kf_ready;         /* Kf holds this block's rows: the state product reads them */
    real *Rc;             /* L x W: rows made contiguous for two products (la_rows_contiguous) */
    real *stage;          /* a block's input and output rows, contiguous (la_stage) */
    void *block;
} PA_FN(la_scratch);

/* L = 0: the recurrent form's scratch (states, step decays, one row), no block buffers;
 * nstates: room for that many K x V states (the backward's pieces); staged: room to stage
 * a block (a chunk backward's, la_stage; a streamed forward's output rows). */
static int PA_FN(la_scratch_alloc)(PA_FN(la_scratch) *s, int64_t L, int64_t K, int64_t V,
                                   int64_t nstates, int staged)
{
    int64_t W = K > V ? K : V, big = L > W ? L : W;
    const size_t r = sizeof(real), dbl = sizeof(double);
    const size_t packed = L ? (size_t)PA_FN(packed_b_elems)(big, big) * r : 0;
    const size_t work = L ? (size_t)PA_FN(gemm_work_elems)(big, big, big) * r : 0;
    size_t bytes[] = {2 * L * K * r, 2 * L * V * r, (2 * L + 1) * K * r, (2 * L + 1) * V * r, L * L * r,
                      L * W * r, L * W * r,
                      (L ? L : 1) * W * r, L * W * r, L * L * r, L * L * r, L * L * r, K * V * r,
                      K * V * r, K * r, V * r, nstates * K * V * r, packed, work,
                      2 * L * dbl, 4 * (K + V) * dbl, L * sizeof(int64_t), 2 * L * K * r,
                      2 * L * V * r, L * L * r, 2 * L * dbl, L * V * r, L * K * r,
                      L * W * r, staged ? L * (6 * K + 6 * V + 3) * r : 0};
    void **const parts[] = {(void **)&s->Gk, (void **)&s->Gv, (void **)&s->Ek, (void **)&s->Ev,
                            (void **)&s->Dm, (void **)&s->X,
                            (void **)&s->Y, (void **)&s->bufs.Tm, (void **)&s->bufs.U, (void **)&s->A,
                            (void **)&s->B, (void **)&s->bufs.M, (void **)&s->S, (void **)&s->dS,
                            (void **)&s->deck, (void **)&s->decv,
                            (void **)&s->states, (void **)&s->bufs.Bp, (void **)&s->bufs.work, (void **)&s->Gs,
                            (void **)&s->acc, (void **)&s->bufs.rows, (void **)&s->Gk2,
                            (void **)&s->Gv2, (void **)&s->Dm2, (void **)&s->Gs2, (void **)&s->Vb,
                            (void **)&s->Kf, (void **)&s->Rc, (void **)&s->stage};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    s->L = L;
    return s->block != NULL;
}

/* Y_i = beta Y_i + alpha X_i f_i for the L rows of a block (rows of the side's width). */
static void PA_FN(la_gate_rows)(const PA_FN(la_side) *s, int64_t L, int to_end, real alpha,
                                const real *X, int64_t ldx, real beta, real *Y, int64_t ldy)
{
    for (int64_t i = 0; i < L; i++)
        PA_FN(la_side_row)(s, L, to_end, i, Y + i * ldy, X + i * ldx, alpha, beta);
}

/* The rows X_i f_i as a GEMM operand: X itself without a gate, else a scaled copy in buf. */
static const real *PA_FN(la_operand)(const PA_FN(la_side) *s, int64_t L, int to_end,
                                     const real *X, int64_t ldx, real *buf, int64_t *ld)
{
    if (s->kind == PA_GATE_NONE) {
        *ld = ldx;
        return X;
    }
    PA_FN(la_gate_rows)(s, L, to_end, 1, X, ldx, 0, buf, s->D);
    *ld = s->D;
    return buf;
}

/* Z_i = alpha ((X_i f_i) M) g_i for the L rows of a block: f the factors of the input side
 * `in` (X rows of in->D), g those of `out` (Z rows of out->D); M is in->D x out->D with strides
 * (rsm, csm), or NULL for a zero state (a unit's start without h0): Z = 0, no product. A scalar
 * factor moves to the output row; only a vector gate needs a copy. */
static void PA_FN(la_rows_times)(const PA_FN(la_side) *in, const PA_FN(la_side) *out, int64_t L,
                                 int to_end, real alpha, const real *X, int64_t ldx, const real *M,
                                 int64_t rsm, int64_t csm, real *Z, int64_t ldz,
                                 PA_FN(la_scratch) *sc)
{
    if (!M) {
        for (int64_t i = 0; i < L; i++) memset(Z + i * ldz, 0, sizeof(real) * out->D);
        return;
    }
    const real *A = X;
    int64_t lda = ldx;
    if (in->kind == PA_GATE_VECTOR) {
        PA_FN(la_gate_rows)(in, L, to_end, 1, X, ldx, 0, sc->X, in->D);
        A = sc->X;
        lda = in->D;
    }
    const int staged = out->kind == PA_GATE_VECTOR;
    real *C = staged ? sc->bufs.Tm : Z;
    const int64_t ldc = staged ? out->D : ldz;
    PA_FN(gemm)(L, out->D, in->D, alpha, A, lda, 1, M, rsm, csm, 0, C, ldc, sc->bufs.work);
    if (!staged && in->kind != PA_GATE_SCALAR && out->kind != PA_GATE_SCALAR) return;
    for (int64_t i = 0; i < L; i++)
        PA_FN(la_side_row)(out, L, to_end, i, Z + i * ldz, C + i * ldc,
                           PA_FN(la_row_scalar)(in, L, to_end, i), 0);
}

/* row = a prev b + c x over V entries: a state row decayed (prev NULL: zeros, which a NaN decay
 * still makes NaN, 0 e^NaN) plus, with x, a row of k v^T. prev may be row itself: each vector
 * is read before it is written. */
static inline __attribute__((always_inline)) void PA_FN(la_decay_row)(
    real *row, const real *prev, real a, const real *b, const real *x, real c, int64_t V)
{
    int64_t j = 0;
    for (; j + VL <= V; j += VL) { /* whole vectors, then the tail */
        const vreal p = prev ? PA_FN(vload)(prev + j) : PA_FN(vset)(0);
        vreal r = a * p * PA_FN(vload)(b + j);
        if (x) r += c * PA_FN(vload)(x + j);
        PA_FN(vstore)(row + j, r);
    }
    for (; j < V; j++) {
        real r = a * (prev ? prev[j] : 0) * b[j];
        row[j] = x ? r + c * x[j] : r;
    }
}

/* S = diag(a) S diag(b), S K x V */
static void PA_FN(la_state_decay)(real *S, const real *a, const real *b, int64_t K, int64_t V)
{
    for (int64_t i = 0; i < K; i++) PA_FN(la_decay_row)(S + i * V, S + i * V, a[i], b, NULL, 0, V);
}

/* A factored vector side's two copies of the rows X (L x D) for one read of X: Y1_i = X_i f_i
 * with f_i = e^(G_i - G_0) (to_end = 0) or e^(G_0 - G_i) (to_end = 1), the Gram's operand,
 * and Y2_i = Y1_i c with c = e^G_0 or e^(G_{L-1} - G_0): X_i times its factor from the start
 * of the sequence's gates or to the block's end (the last row's is 1, X itself), the same
 * bits as la_side_row's. */
static void PA_FN(la_factored_rows)(const PA_FN(la_side) *s, int64_t L, int to_end,
                                    const real *X, int64_t ldx, real *Y1, real *Y2)
{
    const int64_t D = s->D;
    const real *F = to_end ? s->Em : s->Ep, *c = to_end ? s->Ep + (L - 1) * D : s->E0;
    for (int64_t i = 0; i < L; i++) {
        const int one = to_end && i == L - 1;
        PA_FN(la_prefetch_ahead)(X, ldx, D, L, i);
        for (int64_t d = 0; d < D; d += VL) {
            const vreal x = PA_FN(row_ld)(X + i * ldx + d, D - d);
            const vreal y = x * PA_FN(row_ld)(F + i * D + d, D - d);
            PA_FN(row_st)(Y1 + i * D + d, y, D - d);
            PA_FN(row_st)(Y2 + i * D + d, one ? x : y * PA_FN(row_ld)(c + d, D - d), D - d);
        }
    }
}

/* ---- one (sequence, head) unit and its blocks ---- */

typedef struct {
    const pa_linear_desc *d;
    const real *q, *k, *v, *gk, *gv, *h0, *dout, *dht;
    const real *beta, *skip; /* the value rows' scales [rows, H] and the skip weights [H], or NULL */
    real *o, *ht, *dq, *dk, *dv, *dgk, *dgv, *dh0;
    real *dbeta, *dskip;     /* [rows, H] each, with beta and skip */
    real *states;        /* kept states (forward: written; backward: read), or NULL */
    const int64_t *first; /* their layout (la_slots) when given */
    int stream;           /* kept states and staged outputs put with non-temporal stores */
    int staged;           /* a chunk backward's blocks staged contiguous (rows_staged) */
} PA_FN(la_call);

typedef struct {
    const pa_linear_desc *d;
    int64_t T;                  /* rows of the sequence */
    int64_t sq, sk, sv, sg, sb; /* row strides: q/k, dq/dk, v/o/gv, gk, beta/dbeta/dskip */
    const real *q, *k, *v, *gk, *gv, *dout; /* at the unit's first row and head */
    const real *beta;           /* the rows' value scales (stride H), or NULL */
    real skip;                  /* the head's skip weight: o_t += skip v_t */
    int has_skip;
    real *o, *dq, *dk, *dv, *dgk, *dgv, *dbeta, *dskip;
} PA_FN(la_unit);

/* Unit `unit` (sequence unit / H, head unit % H) of a call: its arrays at its first row */
static void PA_FN(la_unit_of)(const PA_FN(la_call) *c, int64_t unit, PA_FN(la_unit) *u)
{
    const pa_linear_desc *d = c->d;
    const int64_t H = d->H;
    const pa_linear_unit_at at = pa_linear_unit(d, unit);
    u->d = d;
    u->T = at.T;
    u->sq = d->Hqk * d->K;
    u->sk = H * d->K;
    u->sv = H * d->V;
    u->sg = d->gk == PA_GATE_VECTOR ? H * d->K : H;
    u->sb = H;
    /* q and k have Hqk heads: head h reads head h / (H / Hqk) */
    const int64_t oq = at.r0 * u->sq + at.h / (H / d->Hqk) * d->K;
    const int64_t ok = at.k, ov = at.v, orow = at.row, og = d->gk == PA_GATE_VECTOR ? ok : orow;
    u->q = c->q + oq;
    u->k = c->k + oq;
    u->v = c->v + ov;
    u->gk = c->gk ? c->gk + og : NULL;
    u->gv = c->gv ? c->gv + ov : NULL;
    u->dout = c->dout ? c->dout + ov : NULL;
    u->beta = c->beta ? c->beta + orow : NULL;
    u->has_skip = c->skip != NULL;
    u->skip = c->skip ? c->skip[at.h] : 0;
    u->o = c->o ? c->o + ov : NULL;
    u->dq = c->dq ? c->dq + ok : NULL;
    u->dk = c->dk ? c->dk + ok : NULL;
    u->dv = c->dv ? c->dv + ov : NULL;
    u->dgk = c->dgk ? c->dgk + og : NULL;
    u->dgv = c->dgv ? c->dgv + ov : NULL;
    u->dbeta = c->dbeta ? c->dbeta + orow : NULL;
    u->dskip = c->dskip ? c->dskip + orow : NULL;
}

/* whether a side's gates over the block's L rows hold a NaN (it reaches the last cumulative row) */
static int PA_FN(la_has_nan)(const PA_FN(la_side) *s, int64_t L)
{
    if (s->kind == PA_GATE_SCALAR) return s->Gs[L - 1] != s->Gs[L - 1];
    for (int64_t d = 0; s->kind == PA_GATE_VECTOR && d < s->D; d++)
        if (s->G[(L - 1) * s->D + d] != s->G[(L - 1) * s->D + d]) return 1;
    return 0;
}

/* The block of rows c0 .. c0+L-1: cumulative gates into the scratch, a vector gate's factors
 * (every pass takes its row factors from them, so a state has the same bits in each), and
 * with `products` (the Gram and triangular products follow) the scalar mask; the key and
 * value sides. A NaN gate at row s makes G NaN from s on, so that the pairs after it
 * (which cannot see it) would meet NaN - NaN: with products, such a block also gets sides
 * summed from its end (sc->ke, sc->ve, la_cumsum_hilo's suffix), whose G is NaN only before
 * s, for the products whose rows look forward (the backward's dk, dv). */
static void PA_FN(la_block)(const PA_FN(la_unit) *u, int64_t c0, int64_t L, int products,
                            PA_FN(la_scratch) *sc, PA_FN(la_side) *ks, PA_FN(la_side) *vs)
{
    const pa_linear_desc *d = u->d;
    const int64_t K = d->K, V = d->V;
    double *acc = sc->acc + 2 * (K + V);
    const real *gk = u->gk ? u->gk + c0 * u->sg : NULL, *gv = u->gv ? u->gv + c0 * u->sv : NULL;
    *ks = (PA_FN(la_side)){.kind = d->gk, .D = K, .G = sc->Gk, .lo = sc->L * K};
    *vs = (PA_FN(la_side)){.kind = d->gv, .D = V, .G = sc->Gv, .lo = sc->L * V};
    if (d->gk == PA_GATE_SCALAR) {
        PA_FN(la_scalar_side)(ks, gk, u->sg, L, 0, sc->Gs, sc->L, products ? sc->Dm : NULL);
    } else if (d->gk == PA_GATE_VECTOR) {
        PA_FN(la_cumsum_hilo)(gk, u->sg, L, K, 0, sc->Gk, ks->lo, acc);
        PA_FN(la_factor)(ks, L, sc->Ek);
    }
    if (d->gv == PA_GATE_VECTOR) {
        PA_FN(la_cumsum_hilo)(gv, u->sv, L, V, 0, sc->Gv, vs->lo, acc);
        PA_FN(la_factor)(vs, L, sc->Ev);
    }
    sc->vb = u->v + c0 * u->sv;
    sc->ldv = u->sv;
    sc->vb_packed = sc->kf_ready = 0;
    if (u->beta) { /* v'_t = beta_t v_t, the rows every product of the block reads */
        for (int64_t i = 0; i < L; i++) {
            PA_FN(la_prefetch_ahead)(sc->vb, u->sv, V, L, i);
            PA_FN(la_gated)(sc->Vb + i * V, sc->vb + i * u->sv, NULL, NULL, 0, V,
                            u->beta[(c0 + i) * u->sb], 0);
        }
        sc->vb = sc->Vb;
        sc->ldv = V;
    }
    sc->ends = products && (PA_FN(la_has_nan)(ks, L) || PA_FN(la_has_nan)(vs, L));
    if (!sc->ends) return;
    sc->ke = (PA_FN(la_side)){.kind = d->gk, .D = K, .G = sc->Gk2, .lo = sc->L * K};
    sc->ve = (PA_FN(la_side)){.kind = d->gv, .D = V, .G = sc->Gv2, .lo = sc->L * V};
    if (d->gk == PA_GATE_SCALAR)
        PA_FN(la_scalar_side)(&sc->ke, gk, u->sg, L, 1, sc->Gs2, sc->L, sc->Dm2);
    else if (d->gk == PA_GATE_VECTOR)
        PA_FN(la_cumsum_hilo)(gk, u->sg, L, K, 1, sc->Gk2, sc->ke.lo, acc);
    if (d->gv == PA_GATE_VECTOR) PA_FN(la_cumsum_hilo)(gv, u->sv, L, V, 1, sc->Gv2, sc->ve.lo, acc);
}

/* The L rows of X (D each, *ldx apart) for a block whose two products read them as the A
 * operand of a GEMM: X itself, or, where the rows lie a multiple of 4 KiB apart (H K = 1024
 * floats), which the GEMM does not read in place but packs, a contiguous copy in buf
 * (*ldx = D) made once for both. The same FMAs in the same order either way. Rows that one
 * product reads, or that a vector gate's products copy with their factors, are left as they
 * are: one packing costs what the copy does. */
static const real *PA_FN(la_rows_contiguous)(const real *X, int64_t *ldx, int64_t L, int64_t D,
                                             real *buf)
{
    if (PA_FN(rows_in_place)(*ldx)) return X;
    for (int64_t i = 0; i < L; i++) {
        PA_FN(la_prefetch_ahead)(X, *ldx, D, L, i);
        memcpy(buf + i * D, X + i * *ldx, sizeof(real) * D);
    }
    *ldx = D;
    return buf;
}

/* la_zero_start for rows c0 .. c0+L-1 of unit u: its inputs, and do in a backward */
static int PA_FN(la_block_zero_start)(const PA_FN(la_unit) *u, int64_t c0, int64_t L)
{
    const int64_t K = u->d->K, V = u->d->V, G = u->d->gk == PA_GATE_VECTOR ? K : 1;
    const real *const x[] = {u->q, u->k, u->v, u->gk, u->gv, u->beta, u->dout};
    const int64_t ld[] = {u->sq, u->sq, u->sv, u->sg, u->sv, u->sb, u->sv};
    const int64_t w[] = {K, K, V, G, V, 1, V};
    return PA_FN(la_zero_start)(7, x, ld, w, c0, L, NULL, K, V);
}

/* The block's L output rows from its start state S (NULL: zeros) into o (rows of so) */
static void PA_FN(la_block_output)(const PA_FN(la_unit) *u, int64_t c0, int64_t L,
                                   const PA_FN(la_side) *ks, const PA_FN(la_side) *vs,
                                   const real *S, PA_FN(la_scratch) *sc, real *o, int64_t so)
{
    const int64_t V = u->d->V, sq = u->sq, sv = u->sv;
    const real scale = (real)u->d->scale;
    const real *q = u->q + c0 * sq, *k = u->k + c0 * sq;
    if (ks->kind == PA_GATE_VECTOR && ks->Ep) {
        /* q and k read once each for both of their copies: the Gram's (Tm, U) and the
         * state's (X: q to the block's start; Kf: k to its end, for la_block_state) */
        const int64_t K = ks->D;
        const PA_FN(la_side) none = {.kind = PA_GATE_NONE, .D = K};
        PA_FN(la_factored_rows)(ks, L, 0, q, sq, sc->bufs.Tm, sc->X);
        PA_FN(la_factored_rows)(ks, L, 1, k, sq, sc->bufs.U, sc->Kf);
        sc->kf_ready = 1;
        PA_FN(la_gram_rows)(ks, L, scale, sc->bufs.Tm, K, sc->bufs.U, K, 0, sc->A, &sc->bufs);
        PA_FN(la_rows_times)(&none, vs, L, 0, scale, sc->X, K, S, V, 1, o, so, sc);
    } else {
        int64_t ldq = sq;
        if (ks->kind != PA_GATE_VECTOR) q = PA_FN(la_rows_contiguous)(q, &ldq, L, ks->D, sc->Rc);
        PA_FN(la_rows_times)(ks, vs, L, 0, scale, q, ldq, S, V, 1, o, so, sc);
        PA_FN(la_gram)(ks, L, scale, q, ldq, k, sq, 0, sc->A, &sc->bufs);
    }
    PA_FN(la_apply)(vs, L, 1, sc->A, 0, sc->vb, sc->ldv, o, so, &sc->bufs);
    sc->vb_packed = vs->kind == PA_GATE_NONE; /* la_tri_product's packing, restored whole */
    if (u->has_skip)
        for (int64_t i = 0; i < L; i++) PA_FN(axpy)(o + i * so, u->v + (c0 + i) * sv, V, u->skip);
}

/* S = (decay of the block) S + alpha (X f)^T (Y f') over the block's rows, f and f' the key and
 * value sides' factors (to the block's end, or from its start); keeps the decays in sc->deck,
 * sc->decv. The state pass (X, Y = k, v) and its reverse (q, do) alike. Xf: X's rows times
 * their factors already (K each), or NULL; Yp: Y already packed (pack_b of its L rows), for a
 * value side without a gate, or NULL. */
static void PA_FN(la_state_product)(const PA_FN(la_side) *ks, const PA_FN(la_side) *vs,
                                    int64_t L, int to_end, real alpha, const real *X,
                                    int64_t ldx, const real *Xf, const real *Y, int64_t ldy,
                                    const real *Yp, real *S, PA_FN(la_scratch) *sc)
{
    const int64_t K = ks->D, V = vs->D;
    int64_t lda, ldb;
    PA_FN(la_total_decay)(ks, L, sc->deck);
    PA_FN(la_total_decay)(vs, L, sc->decv);
    PA_FN(la_state_decay)(S, sc->deck, sc->decv, K, V);
    if (Xf) lda = K;
    const real *A = Xf ? Xf : PA_FN(la_operand)(ks, L, to_end, X, ldx, sc->X, &lda);
    if (Yp) {
        PA_FN(gemm_packed_b)(K, V, L, alpha, A, 1, lda, Yp, L * NR, 1, S, V, sc->bufs.work);
        return;
    }
    const real *B = PA_FN(la_operand)(vs, L, to_end, Y, ldy, sc->Y, &ldb);
    PA_FN(gemm)(K, V, L, alpha, A, 1, lda, B, ldb, 1, 1, S, V, sc->bufs.work);
}

/* S from the block's start to its end. The block's gates must be in the scratch (la_block). */
static void PA_FN(la_block_state)(const PA_FN(la_unit) *u, int64_t c0, int64_t L,
                                  const PA_FN(la_side) *ks, const PA_FN(la_side) *vs, real *S,
                                  PA_FN(la_scratch) *sc)
{
    PA_FN(la_state_product)(ks, vs, L, 1, 1, u->k + c0 * u->sq, u->sq,
                            sc->kf_ready ? sc->Kf : NULL, sc->vb, sc->ldv,
                            sc->vb_packed ? sc->bufs.Bp : NULL, S, sc);
}

/* dS from the block's end to its start: decayed, plus (q~ e^Gk)^T (do e^Gv) */
static void PA_FN(la_block_dstate)(const PA_FN(la_unit) *u, int64_t c0, int64_t L,
                                   const PA_FN(la_side) *ks, const PA_FN(la_side) *vs, real *dS,
                                   PA_FN(la_scratch) *sc)
{
    PA_FN(la_state_product)(ks, vs, L, 0, (real)u->d->scale, u->q + c0 * u->sq, u->sq,
                            NULL, u->dout + c0 * u->sv, u->sv, NULL, dS, sc);
}

/* The off-diagonal parts (header) of dq, dk, dv rows of the block from S, its start state
 * (NULL: zeros), and dS, the gradient reaching its end state from later rows; with a value
 * gate, o's too, into dgv. The Gram B serves dq and dk. */
static void PA_FN(la_block_grads)(const PA_FN(la_unit) *u, int64_t c0, int64_t L,
                                  const PA_FN(la_side) *ks, const PA_FN(la_side) *vs,
                                  const real *S, const real *dS, PA_FN(la_scratch) *sc)
{
    const int64_t V = u->d->V, sq = u->sq, sk = u->sk, sv = u->sv, ldv = sc->ldv;
    const real scale = (real)u->d->scale;
    const real *q = u->q + c0 * sq, *k = u->k + c0 * sq, *v = sc->vb;
    int64_t ldo = sv;
    const real *dout = u->dout + c0 * sv;
    if (vs->kind != PA_GATE_VECTOR) dout = PA_FN(la_rows_contiguous)(dout, &ldo, L, V, sc->Rc);
    real *dq = u->dq + c0 * sk, *dk = u->dk + c0 * sk, *dv = u->dv + c0 * sv;
    PA_FN(la_gram)(vs, L, 1, dout, ldo, v, ldv, 1, sc->B, &sc->bufs);
    PA_FN(la_rows_times)(vs, ks, L, 0, scale, dout, ldo, S, 1, V, dq, sk, sc);
    PA_FN(la_apply)(ks, L, scale, sc->B, 0, k, sq, dq, sk, &sc->bufs);
    const PA_FN(la_side) *ke = sc->ends ? &sc->ke : ks, *ve = sc->ends ? &sc->ve : vs;
    if (sc->ends) PA_FN(la_gram)(ve, L, 1, dout, ldo, v, ldv, 1, sc->B, &sc->bufs);
    PA_FN(la_gram)(ke, L, scale, q, sq, k, sq, 1, sc->A, &sc->bufs);
    PA_FN(la_rows_times)(ve, ke, L, 1, 1, v, ldv, dS, 1, V, dk, sk, sc);
    PA_FN(la_apply)(ke, L, scale, sc->B, 1, q, sq, dk, sk, &sc->bufs);
    PA_FN(la_rows_times)(ke, ve, L, 1, 1, k, sq, dS, V, 1, dv, sv, sc);
    PA_FN(la_apply)(ve, L, 1, sc->A, 1, dout, ldo, dv, sv, &sc->bufs);
    if (u->dgv) {
        real *oo = u->dgv + c0 * sv;
        if (sc->ends) PA_FN(la_gram)(ks, L, scale, q, sq, k, sq, 1, sc->A, &sc->bufs);
        PA_FN(la_rows_times)(ks, vs, L, 0, scale, q, sq, S, V, 1, oo, sv, sc);
        PA_FN(la_apply)(vs, L, 1, sc->A, 0, v, ldv, oo, sv, &sc->bufs);
    }
}

/* A row's value scale beta_t (1 without them) */
static inline real PA_FN(la_vscale)(const PA_FN(la_unit) *u, int64_t t)
{
    return u->beta ? u->beta[t * u->sb] : 1;
}

/* The diagonal parts (header) added to rows r0 .. r0+n-1 of dq, dk, dv (dv: the gradient
 * reaching the scaled rows beta_t v_t) */
static void PA_FN(la_add_diagonal)(const PA_FN(la_unit) *u, int64_t r0, int64_t n)
{
    const int64_t K = u->d->K, V = u->d->V, sq = u->sq, sk = u->sk, sv = u->sv;
    const real scale = (real)u->d->scale;
    for (int64_t t = r0; t < r0 + n; t++) {
        const real *q = u->q + t * sq, *k = u->k + t * sq, *v = u->v + t * sv;
        const real *dout = u->dout + t * sv;
        const real b = scale * PA_FN(la_vscale)(u, t) * PA_FN(dot)(dout, v, V);
        const real a = scale * PA_FN(dot)(q, k, K);
        PA_FN(axpy)(u->dq + t * sk, k, K, b);
        PA_FN(axpy)(u->dk + t * sk, q, K, b);
        PA_FN(axpy)(u->dv + t * sv, dout, V, a);
    }
}

/* The last step of rows r0 .. r0+n-1 of a backward, once dv holds the whole gradient reaching
 * the scaled rows v'_t = beta_t v_t: dbeta_t = v_t . dv_t, then dv_t = beta_t dv_t; and with a
 * skip, dskip_t = do_t . v_t (the caller sums them) and dv_t += skip do_t. */
static void PA_FN(la_finish_rows)(const PA_FN(la_unit) *u, int64_t r0, int64_t n)
{
    const int64_t V = u->d->V, sb = u->sb, sv = u->sv;
    for (int64_t t = r0; t < r0 + n && (u->beta || u->has_skip); t++) {
        const real *v = u->v + t * sv, *dout = u->dout + t * sv;
        real *dv = u->dv + t * sv;
        if (u->beta) {
            u->dbeta[t * sb] = PA_FN(dot)(v, dv, V);
            PA_FN(la_gated)(dv, dv, NULL, NULL, 0, V, u->beta[t * sb], 0);
        }
        if (u->has_skip) {
            u->dskip[t * sb] = PA_FN(dot)(dout, v, V);
            PA_FN(axpy)(dv, dout, V, u->skip);
        }
    }
}

/* ---- the recurrent form ---- */

/* a (K) and b (V): the decays of step t */
static void PA_FN(la_step_decay)(const PA_FN(la_unit) *u, int64_t t, real *a, real *b)
{
    const int64_t K = u->d->K, V = u->d->V;
    if (u->d->gk == PA_GATE_VECTOR) {
        PA_FN(exp_array)(u->gk + t * u->sg, a, K);
    } else {
        real s = u->d->gk == PA_GATE_SCALAR ? (real)exp(u->gk[t * u->sg]) : 1;
        for (int64_t i = 0; i < K; i++) a[i] = s;
    }
    if (u->gv)
        PA_FN(exp_array)(u->gv + t * u->sv, b, V);
    else
        for (int64_t j = 0; j < V; j++) b[j] = 1;
}

/* Forward over the unit's steps t0 .. t0+n-1 (n >= 1) from the state src (NULL: zeros) into S,
 * which may be src: a single pass over the state, as a decode step wants. With o: writes o_t.
 * With dq (backward): writes the off-diagonal parts (header) of dq_t = scale S_t do_t instead,
 * and with a value gate those of o_t into dgv. */
static void PA_FN(la_recurrent_sweep)(const PA_FN(la_unit) *u, int64_t t0, int64_t n,
                                      const real *src, real *S, real *o, real *dq,
                                      PA_FN(la_scratch) *sc)
{
    const int64_t K = u->d->K, V = u->d->V;
    const real scale = (real)u->d->scale;
    for (int64_t t = t0; t < t0 + n; t++) {
        const real *q = u->q + t * u->sq, *k = u->k + t * u->sq, *v = u->v + t * u->sv;
        const real *prev = t == t0 ? src : S, bt = PA_FN(la_vscale)(u, t);
        PA_FN(la_step_decay)(u, t, sc->deck, sc->decv);
        real *acc = sc->bufs.Tm;
        for (int64_t j = 0; j < V; j++) acc[j] = 0;
        for (int64_t i = 0; i < K; i++) {
            real *row = S + i * V, a = sc->deck[i], ki = k[i] * bt, qi = scale * q[i];
            const real *pr = prev ? prev + i * V : NULL;
            if (dq) { /* S_{t-1} decayed first, then k_t v_t^T */
                PA_FN(la_decay_row)(row, pr, a, sc->decv, NULL, 0, V);
                dq[t * u->sk + i] = scale * PA_FN(dot)(row, u->dout + t * u->sv, V);
                if (u->dgv) PA_FN(axpy)(acc, row, V, qi);
                PA_FN(axpy)(row, v, V, ki);
                continue;
            }
            PA_FN(la_decay_row)(row, pr, a, sc->decv, v, ki, V);
            PA_FN(axpy)(acc, row, V, qi);
        }
        if (o) {
            memcpy(o + t * u->sv, acc, sizeof(real) * V);
            if (u->has_skip) PA_FN(axpy)(o + t * u->sv, v, V, u->skip);
        }
        if (dq && u->dgv) memcpy(u->dgv + t * u->sv, acc, sizeof(real) * V);
    }
}

/* Reverse over the unit's steps t0+n-1 .. t0 from dS (the gradient reaching S_{t0+n-1} from
 * later steps, updated in place to that reaching S_{t0-1}): writes the off-diagonal parts
 * (header) of dk_t, dv_t. */
static void PA_FN(la_recurrent_reverse)(const PA_FN(la_unit) *u, int64_t t0, int64_t n, real *dS,
                                        PA_FN(la_scratch) *sc)
{
    const int64_t K = u->d->K, V = u->d->V;
    const real scale = (real)u->d->scale;
    for (int64_t t = t0 + n - 1; t >= t0; t--) {
        const real *q = u->q + t * u->sq, *k = u->k + t * u->sq, *v = u->v + t * u->sv;
        const real *dout = u->dout + t * u->sv;
        real *dk = u->dk + t * u->sk, *dv = u->dv + t * u->sv;
        const real bt = PA_FN(la_vscale)(u, t);
        PA_FN(la_step_decay)(u, t, sc->deck, sc->decv);
        for (int64_t j = 0; j < V; j++) dv[j] = 0;
        for (int64_t i = 0; i < K; i++) {
            real *row = dS + i * V, a = sc->deck[i];
            dk[i] = bt * PA_FN(dot)(row, v, V);
            PA_FN(axpy)(dv, row, V, k[i]);
            PA_FN(axpy)(row, dout, V, scale * q[i]);
            PA_FN(la_decay_row)(row, row, a, sc->decv, NULL, 0, V);
        }
    }
}

/* ---- gate gradients, for every form (the identity in the header) ---- */

/* dg_t = acc - sum_{0<=s<t} (x_s dx_s - y_s dy_s), per column (vec) or summed over the row;
 * rows of D, x and y at stride ld, dx and dy at stride ldd, dg at stride ldg (dg may be x: x's row is read before dg's is
 * written); acc, end: the D boundary terms at the piece's start and at its end.
 * A start term that is not finite while the end's is means a NaN or inf of q, do (or a row's
 * own k, v) inside the piece reached dS_a; the rows after it cannot see it, so that channel
 * is summed back from the end instead, dg_t = end + sum_{t<=s<n} (x_s dx_s - y_s dy_s) (the
 * same values where both are finite). */
static void PA_FN(la_gate_cumsum)(int64_t n, int64_t D, int vec, const real *x, const real *dx,
                                  const real *y, const real *dy, int64_t ld, int64_t ldd,
                                  real *dg, int64_t ldg, double *acc, double *end)
{
    if (!vec)
        for (int64_t i = 1; i < D; i++) {
            acc[0] += acc[i];
            end[0] += end[i];
        }
    int from_end = 0;
    for (int64_t c = 0; c < (vec ? D : 1); c++) {
        if (isfinite(acc[c]) || !isfinite(end[c])) {
            end[c] = 0;
            continue;
        }
        double run = end[c];
        for (int64_t t = n - 1; t >= 0; t--) {
            const int64_t r = t * ld, rd = t * ldd;
            for (int64_t i = vec ? c : 0; i < (vec ? c + 1 : D); i++)
                run += (double)x[r + i] * dx[rd + i] - (double)y[r + i] * dy[rd + i];
            dg[t * ldg + c] = (real)run;
        }
        end[c] = NAN; /* marks the channel done for the pass below */
        from_end = 1;
    }
    if (from_end && !vec) return;
    for (int64_t t = 0; t < n; t++) {
        const int64_t r = t * ld, rd = t * ldd;
        double sum = 0;
        for (int64_t i = 0; i < D; i++) {
            double term = (double)x[r + i] * dx[rd + i] - (double)y[r + i] * dy[rd + i];
            if (!vec) {
                sum += term;
                continue;
            }
            if (from_end && end[i] != end[i]) continue;
            dg[t * ldg + i] = (real)acc[i];
            acc[i] -= term;
        }
        if (!vec) {
            dg[t * ldg] = (real)acc[0];
            acc[0] -= sum;
        }
    }
}

/* The identity's boundary terms of a piece entered with state Sb, whose gradient from later
 * rows is dSb: acc[0..K) = rowsum(Sb * dSb) for gk, acc[K..K+V) = colsum for gv. */
static void PA_FN(la_gate_bound)(const pa_linear_desc *d, const real *Sb, const real *dSb,
                                 double *acc)
{
    const int64_t K = d->K, V = d->V;
    if (d->gk != PA_GATE_NONE)
        for (int64_t i = 0; i < K; i++) acc[i] = PA_FN(dot)(Sb + i * V, dSb + i * V, V);
    if (d->gv == PA_GATE_NONE) return;
    for (int64_t j = 0; j < V; j++) acc[K + j] = 0;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < V; j++) acc[K + j] += (double)Sb[i * V + j] * dSb[i * V + j];
}

/* dg = 0 where the step's gate was clamped (gate_step): n rows of D at stride ld */
static void PA_FN(la_clamped_grads)(const real *g, real *dg, int64_t n, int64_t D, int64_t ld)
{
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < D; i++)
            if (g[t * ld + i] < -PA_GATE_RESET) dg[t * ld + i] = 0;
}

/* The gates' gradients of rows r0 .. r0+n-1 of a unit, a piece whose boundary terms are in acc
 * (la_gate_bound: those of its start, then at acc + K + V those of its end), from the
 * off-diagonal parts of its dq, dk (and of o, in dgv, and dv). */
static void PA_FN(la_gate_piece)(const PA_FN(la_unit) *u, int64_t r0, int64_t n, double *acc)
{
    const pa_linear_desc *d = u->d;
    const int64_t sq = u->sq, sk = u->sk, sv = u->sv;
    if (d->gk != PA_GATE_NONE) {
        const int vec = d->gk == PA_GATE_VECTOR;
        PA_FN(la_gate_cumsum)(n, d->K, vec, u->q + r0 * sq, u->dq + r0 * sk, u->k + r0 * sq,
                              u->dk + r0 * sk, sq, sk, u->dgk + r0 * u->sg, u->sg, acc,
                              acc + d->K + d->V);
        PA_FN(la_clamped_grads)(u->gk + r0 * u->sg, u->dgk + r0 * u->sg, n, vec ? d->K : 1, u->sg);
    }
    if (d->gv != PA_GATE_NONE) {
        PA_FN(la_gate_cumsum)(n, d->V, 1, u->dgv + r0 * sv, u->dout + r0 * sv, u->v + r0 * sv,
                              u->dv + r0 * sv, sv, sv, u->dgv + r0 * sv, sv, acc + d->K,
                              acc + 2 * d->K + d->V);
        PA_FN(la_clamped_grads)(u->gv + r0 * sv, u->dgv + r0 * sv, n, d->V, sv);
    }
}

/* ---- drivers ---- */

static int PA_FN(la_threads)(const pa_linear_desc *d, int64_t L, int64_t items)
{
    double rows = (double)d->cu[d->nseq] * (double)d->H, KV = (double)(d->K * d->V);
    /* multiply-adds; a recurrent step streams its K x V state through memory rather than
     * computing, so it weighs 4 times its 2 K V: a decode step then uses every thread */
    double work = d->form == PA_FORM_RECURRENT ? rows * KV * 8
                                               : rows * (KV * 2 + (double)L * (d->K + d->V));
    return pa_threads_for(work, items);
}

/* Chunk items for the chunk-parallel schedule: item i is block block[i] of unit unit[i], its
 * slot i + unit[i] (first: la_slots); returns the item count, or -1 when out of memory. */
static int64_t PA_FN(la_items)(const pa_linear_desc *d, const int64_t *first, int64_t **unit,
                               int64_t **block)
{
    const int64_t units = d->nseq * d->H, total = first[units] - units;
    *unit = malloc(sizeof(int64_t) * (total + 1));
    *block = malloc(sizeof(int64_t) * (total + 1));
    if (!*unit || !*block) {
        free(*unit);
        free(*block);
        return -1;
    }
    for (int64_t u = 0, i = 0; u < units; u++)
        for (int64_t b = 0; b < first[u + 1] - first[u] - 1; b++, i++) {
            (*unit)[i] = u;
            (*block)[i] = b;
        }
    return total;
}

/* rows r0 .. r1-1 of unit u's K x V state in src (zeros when NULL) into S */
static void PA_FN(la_load_rows)(const real *src, int64_t unit, int64_t K, int64_t V, int64_t r0,
                                int64_t r1, real *S)
{
    if (src)
        memcpy(S + r0 * V, src + (unit * K + r0) * V, sizeof(real) * (r1 - r0) * V);
    else
        memset(S + r0 * V, 0, sizeof(real) * (r1 - r0) * V);
}

/* Rows of a backward piece: a block of the chunk form, LA_PIECE rows otherwise. */
static int64_t PA_FN(la_piece_rows)(const pa_linear_desc *d, int64_t L)
{
    return d->form == PA_FORM_CHUNK ? L : LA_PIECE;
}

/* Rows r0 .. r0+n-1 (those before T) of the unit's inputs into L2: the next block's, while
 * this one computes. Each row is one head's, H rows apart, so hardware prefetchers miss
 * them; without this the first pass over a block's gates waited on memory. state_only: the
 * rows a block's state reads (k, v, gates), not q and do. */
static inline __attribute__((always_inline)) void PA_FN(la_prefetch_rows)(const PA_FN(la_unit) *u,
                                                                         int64_t r0, int64_t n,
                                                                         int state_only)
{
    const int64_t K = u->d->K, V = u->d->V, T = u->T;
    if (!state_only) PA_FN(prefetch_block_rows)(u->q, u->sq, K, r0, n, T);
    PA_FN(prefetch_block_rows)(u->k, u->sq, K, r0, n, T);
    PA_FN(prefetch_block_rows)(u->v, u->sv, V, r0, n, T);
    if (u->d->gk == PA_GATE_VECTOR) PA_FN(prefetch_block_rows)(u->gk, u->sg, K, r0, n, T);
    if (u->d->gv == PA_GATE_VECTOR) PA_FN(prefetch_block_rows)(u->gv, u->sv, V, r0, n, T);
    if (u->dout && !state_only) PA_FN(prefetch_block_rows)(u->dout, u->sv, V, r0, n, T);
}

/* The unit whose rows *r0 .. *r0+l-1 are unit u's rows c0 .. c0+l-1, for a chunk
 * backward's block: u itself (*r0 = c0), or where the call stages its blocks, *b, those rows
 * copied contiguous into sc->stage (rows_copy; *r0 = 0), the outputs written there going back
 * to u by la_unstage. (The forward reads each of a block's rows about once, copies
 * included: it is not staged.) */
static const PA_FN(la_unit) *PA_FN(la_stage)(const PA_FN(la_call) *c, const PA_FN(la_unit) *u,
                                             int64_t c0, int64_t l, PA_FN(la_scratch) *sc,
                                             PA_FN(la_unit) *b, int64_t *r0)
{
    *r0 = c->staged ? 0 : c0;
    if (!c->staged) return u;
    const int64_t K = u->d->K, V = u->d->V, G = u->d->gk == PA_GATE_VECTOR ? K : 1;
    const int64_t sq = u->sq, sv = u->sv;
    real *p = sc->stage;
    *b = (PA_FN(la_unit)){.d = u->d, .T = l, .sq = K, .sk = K, .sv = V, .sg = G, .sb = 1,
                          .skip = u->skip, .has_skip = u->has_skip};
    const real *const in[] = {u->k, u->v, u->gk, u->gv, u->beta, u->q, u->dout};
    const int64_t ld[] = {sq, sv, u->sg, sv, u->sb, sq, sv}, w[] = {K, V, G, V, 1, K, V};
    const real **const to[] = {&b->k, &b->v, &b->gk, &b->gv, &b->beta, &b->q, &b->dout};
    PA_FN(stage_rows_in)(7, in, ld, w, c0, l, to, &p);
    real *const out[] = {u->o, u->dq, u->dk, u->dv, u->dgk, u->dgv, u->dbeta, u->dskip};
    const int64_t wo[] = {V, K, K, V, G, V, 1, 1};
    real **const into[] = {&b->o, &b->dq, &b->dk, &b->dv, &b->dgk, &b->dgv, &b->dbeta, &b->dskip};
    PA_FN(stage_rows_out)(8, out, wo, l, into, &p);
    return b;
}

/* The outputs of block b (as la_stage gave it for rows c0 .. c0+l-1) into u's rows where it
 * is a staged copy (rows_put) */
static void PA_FN(la_unstage)(const PA_FN(la_call) *c, const PA_FN(la_unit) *b, int64_t c0,
                              int64_t l, const PA_FN(la_unit) *u)
{
    if (b == u) return;
    const int64_t K = u->d->K, V = u->d->V, G = b->sg, sv = u->sv, sk = u->sk, sb = u->sb;
    real *const from[] = {b->o, b->dq, b->dk, b->dv, b->dgk, b->dgv, b->dbeta, b->dskip};
    real *const to[] = {u->o, u->dq, u->dk, u->dv, u->dgk, u->dgv, u->dbeta, u->dskip};
    const int64_t w[] = {V, K, K, V, G, V, 1, 1}, ld[] = {sv, sk, sk, sv, u->sg, sv, sb, sb};
    PA_FN(unstage_rows)(8, from, w, to, ld, c0, l, c->stream);
}

/* One unit's forward, every block in order, on one thread; with kept states each block's
 * state goes to its own slot. */
static void PA_FN(la_unit_forward)(const PA_FN(la_call) *c, int64_t unit, int64_t L,
                                   PA_FN(la_scratch) *sc)
{
    const int64_t KV = c->d->K * c->d->V;
    PA_FN(la_unit) u;
    PA_FN(la_unit_of)(c, unit, &u);
    if (c->d->form == PA_FORM_RECURRENT && u.T) { /* h0 read and the final state written once */
        real *S = c->ht ? c->ht + unit * KV : sc->S;
        PA_FN(la_recurrent_sweep)(&u, 0, u.T, c->h0 ? c->h0 + unit * KV : NULL, S, u.o,
                                  NULL, sc);
        return;
    }
    real *S = sc->S, *slot = c->states ? c->states + c->first[unit] * KV : NULL;
    PA_FN(la_side) ks, vs;
    PA_FN(la_load_rows)(c->h0, unit, c->d->K, c->d->V, 0, c->d->K, S);
    for (int64_t c0 = 0; c0 < u.T; c0 += L) {
        int64_t l = u.T - c0 < L ? u.T - c0 : L;
        PA_FN(la_prefetch_rows)(&u, c0 + L, L / 2, 0);
        PA_FN(la_block)(&u, c0, l, 1, sc, &ks, &vs);
        /* a streamed call's rows go through the stage, put with non-temporal stores */
        real *o = c->stream ? sc->stage : u.o + c0 * u.sv;
        const int64_t so = c->stream ? c->d->V : u.sv;
        /* a unit without h0 enters its first block with zeros: their products left out */
        const int zero = c0 == 0 && !c->h0 && PA_FN(la_block_zero_start)(&u, c0, l);
        PA_FN(la_block_output)(&u, c0, l, &ks, &vs, zero ? NULL : S, sc, o, so);
        if (c->stream) PA_FN(rows_put)(o, so, l, so, u.o + c0 * u.sv, u.sv, 1);
        PA_FN(la_prefetch_rows)(&u, c0 + L + L / 2, L - L / 2, 0);
        PA_FN(la_keep_state)(&slot, S, KV, c->stream);
        PA_FN(la_block_state)(&u, c0, l, &ks, &vs, S, sc);
    }
    PA_FN(la_keep_state)(&slot, S, KV, c->stream);
    if (c->ht) memcpy(c->ht + unit * KV, S, sizeof(real) * KV);
}

/* One unit's backward on one thread: the states entering its pieces (kept by the forward, or
 * computed here), then one reverse pass over the pieces. */
static void PA_FN(la_unit_backward)(const PA_FN(la_call) *c, int64_t unit, int64_t L,
                                    PA_FN(la_scratch) *sc)
{
    const pa_linear_desc *d = c->d;
    const int64_t KV = d->K * d->V, P = PA_FN(la_piece_rows)(d, L);
    const int rec = d->form == PA_FORM_RECURRENT, chunk = d->form == PA_FORM_CHUNK;
    PA_FN(la_unit) u;
    PA_FN(la_unit_of)(c, unit, &u);
    const int64_t np = (u.T + P - 1) / P;
    real *states = c->states ? c->states + c->first[unit] * KV : sc->states, *dS = sc->dS;
    PA_FN(la_side) ks, vs;
    if (!c->states) PA_FN(la_load_rows)(c->h0, unit, d->K, d->V, 0, d->K, states);
    for (int64_t p = 0; !c->states && p < np; p++) {
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        real *S = states + (p + 1) * KV;
        if (rec) {
            PA_FN(la_recurrent_sweep)(&u, r0, n, S - KV, S, NULL, u.dq, sc);
        } else {
            memcpy(S, S - KV, sizeof(real) * KV);
            PA_FN(la_prefetch_rows)(&u, r0 + P, P, 1);
            PA_FN(la_block)(&u, r0, n, 0, sc, &ks, &vs);
            PA_FN(la_block_state)(&u, r0, n, &ks, &vs, S, sc);
        }
    }
    PA_FN(la_load_rows)(c->dht, unit, d->K, d->V, 0, d->K, dS);
    if (d->form == PA_FORM_PARALLEL && u.T) { /* one block; the pieces only for the gates */
        PA_FN(la_block)(&u, 0, u.T, 1, sc, &ks, &vs);
        PA_FN(la_block_grads)(&u, 0, u.T, &ks, &vs, states, dS, sc);
    }
    for (int64_t p = np - 1; p >= 0; p--) {
        const int64_t r0 = p * P, n = u.T - r0 < P ? u.T - r0 : P;
        PA_FN(la_gate_bound)(d, states + (p + 1) * KV, dS, sc->acc + d->K + d->V);
        /* a chunk block's rows staged (la_stage); the other forms' pieces read u's rows */
        PA_FN(la_unit) staged;
        int64_t r = r0;
        const PA_FN(la_unit) *b = chunk ? PA_FN(la_stage)(c, &u, r0, n, sc, &staged, &r) : &u;
        if (rec) {
            PA_FN(la_recurrent_reverse)(&u, r0, n, dS, sc);
        } else {
            if (r0) PA_FN(la_prefetch_rows)(&u, r0 - P, P, 0);
            PA_FN(la_block)(b, r, n, chunk, sc, &ks, &vs);
            if (chunk) {
                const int zero = p == 0 && !c->h0 && PA_FN(la_block_zero_start)(b, r, n);
                PA_FN(la_block_grads)(b, r, n, &ks, &vs, zero ? NULL : states + p * KV, dS, sc);
            }
            PA_FN(la_block_dstate)(b, r, n, &ks, &vs, dS, sc);
        }
        PA_FN(la_gate_bound)(d, states + p * KV, dS, sc->acc);
        PA_FN(la_gate_piece)(b, r, n, sc->acc);
        if (d->form != PA_FORM_PARALLEL) {
            PA_FN(la_add_diagonal)(b, r, n);
            PA_FN(la_finish_rows)(b, r, n);
        }
        PA_FN(la_unstage)(c, b, r0, n, &u);
    }
    if (d->form == PA_FORM_PARALLEL) {
        PA_FN(la_add_diagonal)(&u, 0, u.T);
        PA_FN(la_finish_rows)(&u, 0, u.T);
    }
    if (c->dh0) memcpy(c->dh0 + unit * KV, dS, sizeof(real) * KV);
}

/* In place over rows r0 .. r1-1 of a unit's nb blocks' states: buf[b] holds the block's own
 * contribution (its state from a zero start, or its dS from a zero end) and dec[b] its decays
 * (K then V); on return buf[b] holds the state entering block b in the scan's direction, and
 * `carry` (the start value on entry) the state leaving the last. Rows are independent, so
 * a unit's scan splits across threads by rows. */
static void PA_FN(la_scan)(real *buf, const real *dec, int64_t nb, int reverse, int64_t K,
                           int64_t V, int64_t r0, int64_t r1, real *carry)
{
    for (int64_t n = 0; n < nb; n++) {
        const int64_t b = reverse ? nb - 1 - n : n;
        const real *a = dec + b * (K + V), *c = a + K;
        for (int64_t i = r0; i < r1; i++) {
            real *restrict cur = buf + b * K * V + i * V, *restrict s = carry + i * V;
            for (int64_t j = 0; j < V; j++) {
                real t = cur[j];
                cur[j] = s[j];
                s[j] = a[i] * s[j] * c[j] + t;
            }
        }
    }
}

/* The chunk-parallel schedule, for fewer units than threads. The states sit in the kept
 * layout (the caller's when kept, else a buffer of this call): item i's at slot i + unit,
 * the final one after a unit's last block. Their gradients sit in the same layout: the one
 * reaching a block's start state at its slot, the final state's cotangent after the last. */
static int PA_FN(la_run_items)(const PA_FN(la_call) *c, int backward, int64_t L, int nthreads)
{
    const pa_linear_desc *d = c->d;
    const int64_t K = d->K, V = d->V, KV = K * V, units = d->nseq * d->H;
    const int64_t *first = c->first;
    int64_t *iunit, *iblock;
    int64_t items = PA_FN(la_items)(d, first, &iunit, &iblock);
    if (items < 0) return PA_ENOMEM;
    const int kept = backward && c->states; /* the forward's states: no state pass */
    /* the scan splits each unit's rows into bands, so every thread has one */
    const int64_t bands = (nthreads + units - 1) / units, band = (K + bands - 1) / bands;
    real *states = c->states ? c->states : pa_alloc(sizeof(real) * (items + units) * KV);
    real *dstates = backward ? pa_alloc(sizeof(real) * (items + units) * KV) : NULL;
    real *decs = pa_alloc(sizeof(real) * (items + 1) * (K + V));
    int failed = !states || !decs || (backward && !dstates);
    if (!failed) {
#pragma omp parallel num_threads(nthreads)
        {
            const unsigned csr = pa_subnormals_flush();
            const int products = pa_bf16_products_begin(d->bf16);
            PA_FN(la_scratch) sc;
            int ok = pa_scratch_ok(PA_FN(la_scratch_alloc)(&sc, L, K, V, 0, backward && c->staged),
                                   &failed);
            PA_FN(la_unit) u, staged;
            PA_FN(la_side) ks, vs;
            /* each block's own state contribution (and dS) and decays */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) {
                if (!ok) continue;
                PA_FN(la_unit_of)(c, iunit[i], &u);
                int64_t c0 = iblock[i] * L, l = u.T - c0 < L ? u.T - c0 : L;
                PA_FN(la_block)(&u, c0, l, 0, &sc, &ks, &vs);
                if (kept) {
                    PA_FN(la_total_decay)(&ks, l, sc.deck);
                    PA_FN(la_total_decay)(&vs, l, sc.decv);
                } else {
                    real *S = states + (i + iunit[i]) * KV;
                    memset(S, 0, sizeof(real) * KV);
                    PA_FN(la_block_state)(&u, c0, l, &ks, &vs, S, &sc);
                }
                memcpy(decs + i * (K + V), sc.deck, sizeof(real) * K);
                memcpy(decs + i * (K + V) + K, sc.decv, sizeof(real) * V);
                if (backward) { /* into the next slot: the scan leaves the block's end there */
                    real *dS = dstates + (i + iunit[i] + 1) * KV;
                    memset(dS, 0, sizeof(real) * KV);
                    PA_FN(la_block_dstate)(&u, c0, l, &ks, &vs, dS, &sc);
                }
            }
            /* the scans, by bands of rows: states forward (into the final slot), their
             * gradients backward (carried in dS: the band's rows of a K x V scratch) */
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < units * bands; w++) {
                const int64_t un = w / bands, r0 = w % bands * band, r1 = r0 + band < K ? r0 + band : K;
                if (!ok || r0 >= K) continue;
                const int64_t nb = first[un + 1] - first[un] - 1, i0 = first[un] - un;
                real *buf = states + first[un] * KV, *fin = buf + nb * KV;
                if (!kept) {
                    PA_FN(la_load_rows)(c->h0, un, K, V, r0, r1, fin);
                    PA_FN(la_scan)(buf, decs + i0 * (K + V), nb, 0, K, V, r0, r1, fin);
                    if (c->ht) memcpy(c->ht + un * KV + r0 * V, fin + r0 * V, sizeof(real) * (r1 - r0) * V);
                }
                if (!backward) continue;
                real *dbuf = dstates + first[un] * KV;
                PA_FN(la_load_rows)(c->dht, un, K, V, r0, r1, dbuf);
                PA_FN(la_scan)(dbuf + KV, decs + i0 * (K + V), nb, 1, K, V, r0, r1, dbuf);
                if (c->dh0)
                    memcpy(c->dh0 + un * KV + r0 * V, dbuf + r0 * V, sizeof(real) * (r1 - r0) * V);
            }
            /* the blocks' outputs (or gradients) from the states entering them */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) {
                if (!ok) continue;
                PA_FN(la_unit_of)(c, iunit[i], &u);
                int64_t c0 = iblock[i] * L, l = u.T - c0 < L ? u.T - c0 : L;
                const real *S = states + (i + iunit[i]) * KV;
                int zero = iblock[i] == 0 && !c->h0; /* as in la_unit_forward */
                if (!backward) {
                    PA_FN(la_block)(&u, c0, l, 1, &sc, &ks, &vs);
                    zero = zero && PA_FN(la_block_zero_start)(&u, c0, l);
                    PA_FN(la_block_output)(&u, c0, l, &ks, &vs, zero ? NULL : S, &sc,
                                           u.o + c0 * u.sv, u.sv);
                    continue;
                }
                const real *dS = dstates + (i + iunit[i]) * KV; /* at the start; its end next */
                int64_t r;
                const PA_FN(la_unit) *b = PA_FN(la_stage)(c, &u, c0, l, &sc, &staged, &r);
                PA_FN(la_block)(b, r, l, 1, &sc, &ks, &vs);
                zero = zero && PA_FN(la_block_zero_start)(b, r, l);
                PA_FN(la_block_grads)(b, r, l, &ks, &vs, zero ? NULL : S, dS + KV, &sc);
                PA_FN(la_gate_bound)(d, S + KV, dS + KV, sc.acc + K + V);
                PA_FN(la_gate_bound)(d, S, dS, sc.acc);
                PA_FN(la_gate_piece)(b, r, l, sc.acc);
                PA_FN(la_add_diagonal)(b, r, l);
                PA_FN(la_finish_rows)(b, r, l);
                PA_FN(la_unstage)(c, b, c0, l, &u);
            }
            if (ok) free(sc.block);
            pa_bf16_products_end(products);
            pa_subnormals_end(csr);
        }
    }
    if (!c->states) free(states);
    free(dstates);
    free(decs);
    free(iunit);
    free(iblock);
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(la_run)(PA_FN(la_call) *c, int backward)
{
    const pa_linear_desc *d = c->d;
    const int64_t units = d->nseq * d->H;
    if (units == 0) return PA_OK;
    const int64_t L = pa_linear_block_rows(d);
    const int64_t blocks = d->form == PA_FORM_CHUNK ? (d->cu[d->nseq] + L - 1) / L + d->nseq : 0;
    const int nthreads = PA_FN(la_threads)(d, L, units > blocks ? units : blocks * d->H);
    const int items = d->form == PA_FORM_CHUNK && units < nthreads;
    int64_t *first = NULL;
    if ((c->states || items) && !(first = PA_FN(la_slots)(d, L))) return PA_ENOMEM;
    c->first = first;
    c->stream = PA_FN(la_streams)(d);
    c->staged = PA_FN(rows_staged)(d->Hqk * d->K, d->H * d->V);
    int failed = 0;
    if (items) {
        failed = PA_FN(la_run_items)(c, backward, L, nthreads) != PA_OK;
        free(first);
        return failed ? PA_ENOMEM : PA_OK;
    }
    /* a backward without kept states keeps the state entering each piece of the longest
     * sequence, and the last, in its scratch */
    const int64_t P = PA_FN(la_piece_rows)(d, L);
    const int64_t nstates = backward && !c->states ? (pa_linear_max_len(d) + P - 1) / P + 1 : 0;
    /* a stage for the blocks of a staged chunk backward, or a streamed forward's output rows */
    const int stage = backward ? d->form == PA_FORM_CHUNK && c->staged : c->stream;
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = pa_subnormals_flush();
        const int products = pa_bf16_products_begin(d->bf16 && d->form == PA_FORM_CHUNK);
        PA_FN(la_scratch) sc;
        int ok = pa_scratch_ok(PA_FN(la_scratch_alloc)(&sc, d->form == PA_FORM_RECURRENT ? 0 : L,
                                                       d->K, d->V, nstates, stage),
                               &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            if (backward)
                PA_FN(la_unit_backward)(c, un, L, &sc);
            else
                PA_FN(la_unit_forward)(c, un, L, &sc);
        }
        if (ok) free(sc.block);
        pa_bf16_products_end(products);
        pa_subnormals_end(csr);
    }
    free(first);
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(linear_forward)(const pa_linear_desc *d, const void *q, const void *k,
                                 const void *v, const void *gk, const void *gv, const void *h0,
                                 const void *beta, const void *skip, void *o, void *ht,
                                 void *states)
{
    PA_FN(la_call) c = {.d = d, .q = q, .k = k, .v = v, .gk = gk, .gv = gv, .h0 = h0,
                        .beta = beta, .skip = skip, .o = o, .ht = ht, .states = d->form == PA_FORM_CHUNK ? states : NULL};
    return PA_FN(la_run)(&c, 0);
}

static int PA_FN(linear_backward)(const pa_linear_desc *d, const void *q, const void *k,
                                  const void *v, const void *gk, const void *gv, const void *h0,
                                  const void *beta, const void *skip, const void *dout,
                                  const void *dht, const void *states, void *dq, void *dk,
                                  void *dv, void *dgk, void *dgv, void *dh0, void *dbeta,
                                  void *dskip)
{
    int nomem;
    real *heads = PA_FN(la_group_heads)(d, &nomem);
    if (nomem) return PA_ENOMEM;
    PA_FN(la_call) c = {.d = d, .q = q, .k = k, .v = v, .gk = gk, .gv = gv, .h0 = h0,
                        .dout = dout, .dht = dht, .dq = heads ? heads : dq,
                        .dk = heads ? heads + d->cu[d->nseq] * d->H * d->K : dk, .dv = dv,
                        .dgk = dgk, .dgv = dgv, .dh0 = dh0, .beta = beta, .skip = skip,
                        .dbeta = dbeta, .dskip = dskip,
                        .states = d->form == PA_FORM_CHUNK ? (real *)states : NULL};
    int rc = PA_FN(la_run)(&c, 1);
    if (heads && rc == PA_OK) PA_FN(la_sum_groups)(d, heads, dq, dk);
    free(heads);
    return rc;
}

/* ---- efficient attention (Shen et al.): non-causal, so one context matrix per unit ----
 *   Kc = softmax over time of scale k (per feature), C = Kc^T v, Qs = softmax over features of
 *   scale q, o = Qs C. Backward: dQs = dO C^T, dC = Qs^T dO, dKc = v dC^T, dv = Kc dC, and
 *   the two softmax backwards (down columns for Kc). */

typedef struct {
    real *Kc, *Qs, *dKc, *dQs, *C, *dC, *m, *s, *work;
    void *block;
} PA_FN(ea_scratch);

static int PA_FN(ea_scratch_alloc)(PA_FN(ea_scratch) *s, int64_t tq, int64_t tk, int64_t K,
                                   int64_t V)
{
    int64_t big = tq > tk ? tq : tk;
    big = big > K ? big : K;
    big = big > V ? big : V;
    const size_t r = sizeof(real);
    size_t bytes[] = {tk * K * r, tq * K * r, tk * K * r, tq * K * r, K * V * r, K * V * r,
                      K * r, K * r, PA_FN(gemm_work_elems)(big, big, big) * r};
    void **const parts[] = {(void **)&s->Kc, (void **)&s->Qs, (void **)&s->dKc, (void **)&s->dQs,
                            (void **)&s->C, (void **)&s->dC, (void **)&s->m, (void **)&s->s,
                            (void **)&s->work};
    s->block = pa_alloc_parts(parts, bytes, (int)(sizeof bytes / sizeof bytes[0]));
    return s->block != NULL;
}

/* Kc, Qs and C of one unit */
static void PA_FN(ea_prepare)(const pa_efficient_desc *d, const real *q, const real *k,
                              const real *v, int64_t tq, int64_t tk, PA_FN(ea_scratch) *s)
{
    const int64_t H = d->H, K = d->K, V = d->V;
    const real scale = (real)d->scale;
    for (int64_t j = 0; j < K; j++) {
        s->m[j] = -(real)INFINITY;
        s->s[j] = 0;
    }
    for (int64_t t = 0; t < tk; t++) {
        real *row = s->Kc + t * K;
        for (int64_t j = 0; j < K; j++) row[j] = scale * k[t * H * K + j];
    }
    PA_FN(col_max_into)(s->m, s->Kc, K, tk, K);
    PA_FN(col_exp_sub_acc)(s->Kc, K, tk, s->m, s->s, K);
    for (int64_t j = 0; j < K; j++) s->s[j] = 1 / s->s[j];
    for (int64_t t = 0; t < tk; t++)
        for (int64_t j = 0; j < K; j++) s->Kc[t * K + j] *= s->s[j];
    PA_FN(gemm)(K, V, tk, 1, s->Kc, 1, K, v, H * V, 1, 0, s->C, V, s->work);
    for (int64_t t = 0; t < tq; t++) {
        real *row = s->Qs + t * K;
        for (int64_t j = 0; j < K; j++) row[j] = scale * q[t * H * K + j];
        PA_FN(softmax_inplace)(row, K);
    }
}

static int PA_FN(ea_run)(const pa_efficient_desc *d, const real *q, const real *k,
                         const real *v, real *o, const real *dout, real *dq, real *dk, real *dv)
{
    const int64_t H = d->H, K = d->K, V = d->V, units = d->nseq * H;
    int64_t tqmax = 1, tkmax = 1;
    double work = 0;
    for (int64_t n = 0; n < d->nseq; n++) {
        int64_t tq = d->cu_q[n + 1] - d->cu_q[n], tk = d->cu_k[n + 1] - d->cu_k[n];
        tqmax = tq > tqmax ? tq : tqmax;
        tkmax = tk > tkmax ? tk : tkmax;
        work += (double)(tq + tk) * H * K * V;
    }
    int failed = 0;
#pragma omp parallel num_threads(pa_threads_for(work * (dout ? 3 : 1), units))
    {
        PA_FN(ea_scratch) s;
        int ok = pa_scratch_ok(PA_FN(ea_scratch_alloc)(&s, tqmax, tkmax, K, V), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t un = 0; un < units; un++) {
            if (!ok) continue;
            const int64_t n = un / H, h = un % H;
            const int64_t rq = d->cu_q[n], rk = d->cu_k[n];
            const int64_t tq = d->cu_q[n + 1] - rq, tk = d->cu_k[n + 1] - rk;
            const int64_t oq = rq * H * K + h * K, ok_ = rk * H * K + h * K;
            const int64_t oo = rq * H * V + h * V, ov = rk * H * V + h * V;
            PA_FN(ea_prepare)(d, q + oq, k + ok_, v + ov, tq, tk, &s);
            if (!dout) {
                PA_FN(gemm)(tq, V, K, 1, s.Qs, K, 1, s.C, V, 1, 0, o + oo, H * V, s.work);
                continue;
            }
            const real scale = (real)d->scale;
            PA_FN(gemm)(tq, K, V, 1, dout + oo, H * V, 1, s.C, 1, V, 0, s.dQs, K, s.work);
            for (int64_t t = 0; t < tq; t++)
                PA_FN(softmax_vjp)(s.Qs + t * K, s.dQs + t * K, dq + oq + t * H * K, K, scale);
            PA_FN(gemm)(K, V, tq, 1, s.Qs, 1, K, dout + oo, H * V, 1, 0, s.dC, V, s.work);
            PA_FN(gemm)(tk, K, V, 1, v + ov, H * V, 1, s.dC, 1, V, 0, s.dKc, K, s.work);
            PA_FN(gemm)(tk, V, K, 1, s.Kc, K, 1, s.dC, V, 1, 0, dv + ov, H * V, s.work);
            for (int64_t j = 0; j < K; j++) s.s[j] = 0;
            for (int64_t t = 0; t < tk; t++)
                for (int64_t j = 0; j < K; j++) s.s[j] += s.Kc[t * K + j] * s.dKc[t * K + j];
            for (int64_t t = 0; t < tk; t++)
                for (int64_t j = 0; j < K; j++)
                    dk[ok_ + t * H * K + j] = scale * s.Kc[t * K + j] * (s.dKc[t * K + j] - s.s[j]);
        }
        if (ok) free(s.block);
    }
    return failed ? PA_ENOMEM : PA_OK;
}

static int PA_FN(efficient_forward)(const pa_efficient_desc *d, const void *q, const void *k,
                                    const void *v, void *o)
{
    return PA_FN(ea_run)(d, q, k, v, o, NULL, NULL, NULL, NULL);
}

static int PA_FN(efficient_backward)(const pa_efficient_desc *d, const void *q, const void *k,
                                     const void *v, const void *dout, void *dq, void *dk,
                                     void *dv)
{
    return PA_FN(ea_run)(d, q, k, v, NULL, dout, dq, dk, dv);
}
