/* The kernel table: what module.c may call. One table per (dtype, ISA), chosen at run time.
 * Buffers are void* so one table type serves both dtypes; each entry casts to its own real.
 * Every entry returns PA_OK or PA_ENOMEM (scratch could not be allocated). */
#ifndef PA_KERNELS_H
#define PA_KERNELS_H

#include <stdint.h>

enum { PA_OK = 0, PA_ENOMEM = 1 };
enum { PA_FORM_PARALLEL = 0, PA_FORM_FLASH = 1, PA_FORM_RECURRENT = 2, PA_FORM_CHUNK = 3 };

/* Softmax attention over packed rows. Sequence n owns query rows cu_q[n] .. cu_q[n+1]-1 and
 * key rows cu_k[n] .. cu_k[n+1]-1 of q [rows_q, H, Dk], k [rows_k, Hk, Dk], v [rows_k, Hk,
 * Dv] (a batch of B equal sequences is cu = b * T). Masking as docs/ops.md (bottom-right
 * causal, window (-1 = unbounded), sinks); alibi is [H] of the call's dtype or NULL. gate,
 * NULL or g [rows, H] of the call's dtype (the Forgetting Transformer's log forget gate per
 * position and query head): adds G_i - G_j to the score of query i and key j, G the running
 * sum of g along each sequence; it needs the queries at the keys' positions (cu_q = cu_k), a
 * causal mask with at most a left window, and the flash or parallel form. bf16: the inputs
 * are bfloat16 values (widened to float) and the products may round to bf16 (the softmax's P,
 * core/gemm_bf16.h), where the CPU multiplies bf16; the float forward of flash and parallel
 * forms honours it, other kernels ignore it. */
typedef struct {
    int64_t nseq;
    const int64_t *cu_q, *cu_k;
    int64_t H, Hk, Dk, Dv;
    int causal;
    int64_t window_left, window_right, sinks;
    const void *alibi;
    double softcap, scale;
    int form;
    const void *gate;
    int bf16;
} pa_softmax_desc;

/* Where the keys of a decode live (softmax_decode): sequence n has the end[n] - start[n] keys
 * j = 0, 1, ... at row start[n] + j of k [rows, Hk, Dk] and v [rows, Hk, Dv] (a contiguous
 * cache, or packed sequences), or, with a block table, at row block_table[n * table_stride +
 * j / block_size] * block_size + j % block_size (flash-attn's paged cache of blocks of
 * block_size rows). */
typedef struct {
    const int64_t *start, *end;
    const int32_t *block_table;
    int64_t table_stride, block_size;
} pa_key_rows;

/* DeepSeek sparse attention's selection over packed rows: sequence n owns query rows cu_q[n]
 * .. cu_q[n+1]-1 of index_q [rows_q, Hi, Di] and index_w [rows_q, Hi], key rows cu_k[n] ..
 * cu_k[n+1]-1 of index_k [rows_k, Di]; the queries are the last of their sequence's keys
 * (bottom-right); causal: a query sees the keys at or before it. */
typedef struct {
    int64_t nseq;
    const int64_t *cu_q, *cu_k;
    int64_t Hi, Di, top_k;
    int causal;
} pa_dsa_select_desc;

/* DeepSeek sparse attention's indexer loss over chosen keys: query rows Rq of q [Rq, H, D],
 * index_q [Rq, Hi, Di], index_w [Rq, Hi]; key rows Rk of k [Rk, Hk, D], index_k [Rk, Di];
 * the gradients are grad_scale times those of the per-row losses' sum. */
typedef struct {
    int64_t Rq, Rk, H, Hk, D, Hi, Di, top_k;
    double scale, grad_scale;
} pa_dsa_loss_desc;

/* MoBA's chosen blocks over packed rows: sequence n owns query rows cu_q[n] .. cu_q[n+1]-1
 * of q [rows_q, H, Dk] and key rows cu_k[n] .. cu_k[n+1]-1 of k [rows_k, Hk, Dk], v [rows_k,
 * Hk, Dv], its keys in blocks of block_size (the last maybe shorter), global blocks
 * first_block[n] .. first_block[n+1]-1 (block_seq: each global block's sequence). choice
 * int32 [rows_q, H, slots]: the blocks (of its sequence, 0-based) each (query, head) attends
 * to whole, -1 for none. causal: every query also attends to its own block (the one holding
 * its position; the queries are the last of their sequence's keys), up to itself; its
 * choices then lie before that block. */
typedef struct {
    int64_t nseq;
    const int64_t *cu_q, *cu_k, *first_block, *block_seq;
    int64_t H, Hk, Dk, Dv, block_size, slots;
    int causal;
    double scale;
} pa_moba_desc;

/* Feature maps of linear attention (docs/ops.md), in this order (pyattn._core.FM_*). */
enum {
    PA_FM_IDENTITY = 0,
    PA_FM_ELU1 = 1,
    PA_FM_RELU = 2,
    PA_FM_SOFTMAX = 3,
    PA_FM_FOCUSED = 4,
    PA_FM_TAYLOR = 5,
    PA_FM_PERFORMER = 6,
    PA_FM_COSFORMER = 7,
    PA_FM_COUNT = 8
};

/* phi over the rows of x [rows, D] (every axis but the last flattened) into y [rows, F]:
 * F = D, except taylor 1 + D + D*D, performer m, cosformer 2 D. */
typedef struct {
    int kind;
    int64_t rows, D, F;
    int64_t p;              /* focused: the power, >= 1 */
    int64_t T, H;           /* cosformer: x is [B, T, H, D], row r is at time (r / H) % T */
    double max_len;         /* cosformer: > 0 */
    int64_t m;              /* performer: rows of the projection */
    const void *projection; /* performer: W [m, D] of the call's dtype; NULL otherwise */
} pa_feature_map_desc;

/* The gated linear engine (ops/linear_attn.c). Sequence n owns rows cu[n] .. cu[n+1]-1 of
 * q, k [rows, Hqk, K], v, o [rows, H, V]; head h reads q and k head h / (H / Hqk) (Mamba-2's
 * groups of B and C), and the backward sums the heads of a group into dq and dk; gk is NULL
 * (PA_GATE_NONE), [rows, H] (SCALAR) or [rows, H, K] (VECTOR); gv is NULL or [rows, H, V]
 * (VECTOR); states are [nseq, H, K, V]. */
enum { PA_GATE_NONE = 0, PA_GATE_SCALAR = 1, PA_GATE_VECTOR = 2 };

typedef struct {
    int64_t nseq;
    const int64_t *cu;
    int64_t H, Hqk, K, V; /* H a multiple of Hqk */
    int gk, gv;           /* PA_GATE_* */
    double scale;
    int form;      /* PA_FORM_PARALLEL, _RECURRENT or _CHUNK */
    int64_t chunk; /* rows per block of the chunk form */
    /* the inputs are bfloat16 values (widened to float): the chunk forward of the linear,
     * delta and DPLR engines may then multiply in bf16 where the CPU does (core/gemm_bf16.h) */
    int bf16;
} pa_linear_desc;

/* Log-linear attention (ops/log_linear.c). Sequence n owns rows cu[n] .. cu[n+1]-1 of q, k
 * [rows, H, K], v, o [rows, H, V], g [rows, H], level scales [rows, H, L], and starts at
 * position start[n] (NULL: 0) of its Fenwick tree; states are [nseq, H, L, K, V], level 0 of
 * the final state holding the next position at [0, 0]. L >= bit_length(start + T - 1) + 1 for
 * every sequence, and L >= bit_length(start + T) + 1 when the final state is written. */
typedef struct {
    int64_t nseq;
    const int64_t *cu, *start;
    int64_t H, K, V, L;
    double scale;
    int form;
    int64_t chunk; /* rows of a chunk-form block, a power of two */
} pa_loglin_desc;

static inline int64_t pa_linear_max_len(const pa_linear_desc *d)
{
    int64_t m = 0;
    for (int64_t n = 0; n < d->nseq; n++)
        if (d->cu[n + 1] - d->cu[n] > m) m = d->cu[n + 1] - d->cu[n];
    return m;
}

/* Where (sequence, head) unit n H + h of an engine call starts: its rows T, its first row r0,
 * its head h, and the offsets of its first row in the [rows, H, K], [rows, H, V] and
 * [rows, H] arrays. */
typedef struct {
    int64_t T, r0, h, k, v, row;
} pa_linear_unit_at;

static inline pa_linear_unit_at pa_linear_unit(const pa_linear_desc *d, int64_t unit)
{
    const int64_t H = d->H, n = unit / H, h = unit % H, r0 = d->cu[n];
    return (pa_linear_unit_at){.T = d->cu[n + 1] - r0, .r0 = r0, .h = h, .k = (r0 * H + h) * d->K,
                               .v = (r0 * H + h) * d->V, .row = r0 * H + h};
}

/* Rows per block: the chunk size; the whole longest sequence for the parallel form. */
static inline int64_t pa_linear_block_rows(const pa_linear_desc *d)
{
    int64_t maxlen = pa_linear_max_len(d);
    int64_t L = d->form == PA_FORM_PARALLEL ? maxlen : d->chunk;
    if (L > maxlen) L = maxlen;
    return L < 1 ? 1 : L;
}

/* The states a chunk-form forward can keep for its backward ([count, K, V]): per sequence and
 * head (unit n H + h), in order, the state entering each block of L rows, then the final one. */
static inline int64_t pa_linear_unit_states(const pa_linear_desc *d, int64_t n, int64_t L)
{
    return (d->cu[n + 1] - d->cu[n] + L - 1) / L + 1;
}

static inline int64_t pa_linear_kept_states(const pa_linear_desc *d)
{
    const int64_t L = pa_linear_block_rows(d);
    int64_t count = 0;
    for (int64_t n = 0; n < d->nseq; n++) count += pa_linear_unit_states(d, n, L);
    return count * d->H;
}

/* Efficient attention (non-causal): o = softmax_row(scale q) (softmax_time(scale k)^T v) per
 * sequence and head; q [rows_q, H, K], k [rows_k, H, K], v [rows_k, H, V]. */
typedef struct {
    int64_t nseq;
    const int64_t *cu_q, *cu_k;
    int64_t H, K, V;
    double scale;
} pa_efficient_desc;

typedef struct {
    const char *isa;
    /* C = alpha op(A) op(B) + beta C, strided A and B, row-major C (see core/gemm.c) */
    int (*gemm)(int64_t M, int64_t N, int64_t K, double alpha, const void *A, int64_t rsa,
                int64_t csa, const void *B, int64_t rsb, int64_t csb, double beta, void *C,
                int64_t ldc);
    void (*exp)(const void *x, void *y, int64_t n, int nonpos); /* nonpos: the softmax's exp */
    double (*fma_peak)(double seconds, int threads);
    /* GB/s reading a buffer of `bytes` on `threads` threads; -1: no memory for it */
    double (*read_bandwidth)(double seconds, int threads, int64_t bytes);
    int (*softmax_forward)(const pa_softmax_desc *d, const void *q, const void *k,
                           const void *v, void *o, void *lse);
    /* dlse may be NULL (zero cotangent of the log-sum-exp); with d->gate, dg [rows_k, H]
     * receives the gate's gradient, and dlse must be NULL */
    int (*softmax_backward)(const pa_softmax_desc *d, const void *q, const void *k,
                            const void *v, const void *o, const void *lse, const void *dout,
                            const void *dlse, void *dq, void *dk, void *dv, void *dg);
    /* Few queries against keys wherever they lie (a KV cache, paged or not): d places the
     * queries by cu_q (cu_k is unused), rows the keys. Each query's visible keys split into
     * num_splits parts (0: chosen from the threads and key counts) merged by their
     * log-sum-exp. colsum, NULL or [nseq, H, colsum_len] (colsum_len >= every key count):
     * adds, per head and key j, the attention probabilities of the sequence's queries */
    int (*softmax_decode)(const pa_softmax_desc *d, const pa_key_rows *rows, int64_t num_splits,
                          const void *q, const void *k, const void *v, void *o, void *lse,
                          void *colsum, int64_t colsum_len);
    /* The backward of softmax_decode over the same key rows (no softcap or ALiBi): dq, and dk,
     * dv of the key_rows rows of k and v (overwritten); dlse may be NULL */
    int (*softmax_decode_backward)(const pa_softmax_desc *d, const pa_key_rows *rows,
                                   int64_t key_rows, const void *q, const void *k,
                                   const void *v, const void *o, const void *lse,
                                   const void *dout, const void *dlse, void *dq, void *dk,
                                   void *dv);
    /* rows int32 [rows_q, top_k]: each query's chosen key rows (of index_k), ascending, -1 after
     * the last; count [rows_q] how many; nan [rows_q] 1 where a visible score is NaN */
    int (*dsa_select)(const pa_dsa_select_desc *d, const void *index_q, const void *index_k,
                      const void *index_w, int32_t *rows, int64_t *count, uint8_t *nan);
    /* rows, count as dsa_select's (every listed row < Rk): loss [Rq] the KL of each query's
     * indexer distribution from its main attention's over the listed keys; diq, dik, diw
     * (overwritten) the gradients of grad_scale * sum(loss) (the target held constant) */
    int (*dsa_index_loss)(const pa_dsa_loss_desc *d, const void *q, const void *k,
                          const void *index_q, const void *index_k, const void *index_w,
                          const int32_t *rows, const int64_t *count, void *loss, void *diq,
                          void *dik, void *diw);
    /* choice [rows_q, H, slots] (d->slots picks each) from the block means kmean [nblocks, Hk,
     * Dk] */
    int (*moba_select)(const pa_moba_desc *d, const void *q, const void *kmean, int32_t *choice);
    /* o [rows_q, H, Dv], lse [rows_q, H] (0 and -inf where nothing is chosen) */
    int (*moba_forward)(const pa_moba_desc *d, const void *q, const void *k, const void *v,
                        const int32_t *choice, void *o, void *lse);
    /* dq, dk, dv (overwritten) from the forward's o, lse and dout, dlse (NULL: zero) */
    int (*moba_backward)(const pa_moba_desc *d, const void *q, const void *k, const void *v,
                         const void *o, const void *lse, const void *dout, const void *dlse,
                         const int32_t *choice, void *dq, void *dk, void *dv);
    int (*feature_map_forward)(const pa_feature_map_desc *d, const void *x, void *y);
    /* dx [rows, D] from dy [rows, F]; dprojection: performer's dW [m, D] (overwritten), NULL
     * for the other kinds */
    int (*feature_map_backward)(const pa_feature_map_desc *d, const void *x, const void *dy,
                                void *dx, void *dprojection);
    /* h0, ht may be NULL (zero initial state; final state not wanted); states: NULL, or (chunk
     * form) room for the pa_linear_kept_states() states the backward can reuse. beta [rows, H]
     * (NULL: ones) scales the value rows, v'_t = beta_t v_t, and needs gv NULL; skip [H] (NULL:
     * none) adds skip_h v_t to o_t (Mamba-2's v = x dt and D x). */
    int (*linear_forward)(const pa_linear_desc *d, const void *q, const void *k, const void *v,
                          const void *gk, const void *gv, const void *h0, const void *beta,
                          const void *skip, void *o, void *ht, void *states);
    /* dht, h0 may be NULL (zero); dgk, dgv are NULL exactly when their gate is; dh0 may be
     * NULL (not wanted); states: what a chunk forward kept, or NULL (then recomputed); dbeta
     * [rows, H] with beta; dskip [rows, H] with skip: the rows' terms do_t . v_t of the skip's
     * gradient, for the caller to sum */
    int (*linear_backward)(const pa_linear_desc *d, const void *q, const void *k,
                           const void *v, const void *gk, const void *gv, const void *h0,
                           const void *beta, const void *skip, const void *dout,
                           const void *dht, const void *states, void *dq, void *dk, void *dv,
                           void *dgk, void *dgv, void *dh0, void *dbeta, void *dskip);
    /* The delta-rule engine (ops/delta_rule.c) over the linear engine's description (gk any
     * kind, gv PA_GATE_NONE; groups as the linear engine's): g NULL, [rows, H] or [rows, H, K],
     * beta [rows, H]; h0, ht may be NULL (zero initial state; final state not wanted); states
     * as the linear engine's (pa_linear_kept_states) */
    int (*delta_forward)(const pa_linear_desc *d, const void *q, const void *k, const void *v,
                         const void *g, const void *beta, const void *h0, void *o, void *ht,
                         void *states);
    /* dht, h0 may be NULL (zero); dg is NULL exactly when g is; dh0 may be NULL; states: what
     * a chunk forward kept, or NULL (then recomputed) */
    int (*delta_backward)(const pa_linear_desc *d, const void *q, const void *k, const void *v,
                          const void *g, const void *beta, const void *h0, const void *dout,
                          const void *dht, const void *states, void *dq, void *dk, void *dv,
                          void *dg, void *dbeta, void *dh0);
    /* The DPLR delta rule (ops/dplr.c) over the linear engine's description (recurrent or
     * chunk form; gk PA_GATE_VECTOR): a, b, gk [rows, H, K]; h0, ht may be NULL (zero initial
     * state; final state not wanted); states as delta_forward's */
    int (*dplr_forward)(const pa_linear_desc *d, const void *q, const void *k, const void *v,
                        const void *a, const void *b, const void *gk, const void *h0, void *o,
                        void *ht, void *states);
    /* dht, h0 may be NULL (zero); dh0 may be NULL (not wanted); states as delta_backward's */
    int (*dplr_backward)(const pa_linear_desc *d, const void *q, const void *k, const void *v,
                         const void *a, const void *b, const void *gk, const void *h0,
                         const void *dout, const void *dht, const void *states, void *dq,
                         void *dk, void *dv, void *da, void *db, void *dgk, void *dh0);
    /* Log-linear attention: h0, ht may be NULL (zero initial state; final
     * state not wanted) */
    int (*loglin_forward)(const pa_loglin_desc *d, const void *q, const void *k, const void *v,
                          const void *g, const void *ls, const void *h0, void *o, void *ht);
    /* dht, h0 may be NULL (zero); dh0 may be NULL (not wanted) */
    int (*loglin_backward)(const pa_loglin_desc *d, const void *q, const void *k,
                           const void *v, const void *g, const void *ls, const void *h0,
                           const void *dout, const void *dht, void *dq, void *dk, void *dv,
                           void *dg, void *dls, void *dh0);
    int (*efficient_forward)(const pa_efficient_desc *d, const void *q, const void *k,
                             const void *v, void *o);
    int (*efficient_backward)(const pa_efficient_desc *d, const void *q, const void *k,
                              const void *v, const void *dout, void *dq, void *dk, void *dv);
    /* pyattn.nn's pointwise steps (ops/pointwise.c), over n elements or rows of d. silu: s =
     * sigmoid(x) and y = x s, times mul (SwiGLU's product; y, mul may be NULL); its backward
     * dx = dy (s + y (1 - s)); SwiGLU's backward da, db from dh. RMSNorm: xhat = x rstd,
     * rstd = 1 / sqrt(mean(x^2) + eps) (the sum for mean = 0: an L2 norm); its backward dx from
     * dxhat. rotary: x [rows, H, D] by
     * the tables cos, sin [table_rows, D] (row r uses r % table_rows), sign -1 the opposite
     * angles */
    void (*silu_forward)(int64_t n, const void *x, const void *mul, void *y, void *s);
    void (*silu_backward)(int64_t n, const void *dy, const void *y, const void *s, void *dx);
    void (*swiglu_backward)(int64_t n, const void *dh, const void *a, const void *b,
                            const void *s, void *da, void *db);
    /* AdamW: one step of n parameters p and their moments m, v in place from gradients g */
    void (*adamw_step)(int64_t n, const void *g, void *p, void *m, void *v, double b1, double b2,
                       double eps, double decay, double lr_c1, double c2);
    void (*rms_norm_forward)(int64_t rows, int64_t d, double eps, int mean, const void *x,
                             void *xhat, void *rstd);
    void (*rms_norm_backward)(int64_t rows, int64_t d, int mean, const void *dxhat,
                              const void *xhat, const void *rstd, void *dx);
    void (*rotary)(int64_t rows, int64_t H, int64_t D, int64_t table_rows, const void *cos,
                   const void *sin, int sign, const void *x, void *y);
    /* ShortConv: x [B, T, C] through a causal depthwise convolution, w [K, C], state NULL or
     * [B, K-1, C] (the inputs before x), bias NULL or [C], then SiLU: y and s = sigmoid(u);
     * the backward overwrites dx, dw and dbias (NULL: not wanted) */
    void (*short_conv_forward)(int64_t B, int64_t T, int64_t C, int64_t K, const void *x,
                               const void *state, const void *w, const void *bias, void *y,
                               void *s);
    int (*short_conv_backward)(int64_t B, int64_t T, int64_t C, int64_t K, const void *x,
                               const void *state, const void *w, const void *dy, const void *y,
                               const void *s, void *dx, void *dw, void *dbias);
} pa_kernels;

/* The kernel paths, widest first: amx, avx512_bf16 (the AVX-512 tables with bf16 products of
 * that kind), avx512, avx2, generic. */
#define PA_ISA_COUNT 5
extern const char *const pa_isa_names[PA_ISA_COUNT];
/* Chooses the tables once (at import): the widest ISA this CPU runs, or PYATTN_ISA's. */
void pa_dispatch_init(void);
/* The chosen table, for float (is_double = 0) or double; and its ISA's name. */
const pa_kernels *pa_select_kernels(int is_double);
const char *pa_selected_isa(void);
/* The tables of another ISA (for tests); NULL when this CPU or build lacks it. */
const pa_kernels *pa_kernels_for_isa(const char *isa, int is_double);

#endif
