/* pyattn._core's sparse attention (ops/sparse_attn.c): DeepSeek sparse attention's key
 * selection and MoBA's block selection, forward and backward. */
#include "args.h"
#include "bind.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* dsa_select(index_q, index_k, index_w, cu_q, cu_k, top_k, causal, rows, count, nan):
 * index_q [Rq, Hi, Di], index_k [Rk, Di], index_w [Rq, Hi]; rows int32 [Rq, top_k] (a block
 * table of single rows for softmax_decode), count int64 [Rq], nan uint8 [Rq] written */
enum { DS_INDEX_Q, DS_INDEX_K, DS_INDEX_W, DS_CU_Q, DS_CU_K, DS_TOP_K, DS_CAUSAL, DS_ROWS,
       DS_COUNT, DS_NAN, DS_NARGS };

static PyObject *py_dsa_select(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "dsa_select";
    if (expect_nargs(fn, nargs, DS_NARGS)) return NULL;
    int t;
    PyArrayObject *iq = get_float_array(fn, "index_q", args[DS_INDEX_Q], 3, &t);
    if (!iq) return NULL;
    const npy_intp Rq = PyArray_DIM(iq, 0), Hi = PyArray_DIM(iq, 1), Di = PyArray_DIM(iq, 2);
    npy_intp kshape[2] = {-1, Di}, wshape[2] = {Rq, Hi};
    PyArrayObject *ik = get_array(fn, "index_k", args[DS_INDEX_K], t, 2, kshape, 0);
    PyArrayObject *iw = ik ? get_array(fn, "index_w", args[DS_INDEX_W], t, 2, wshape, 0) : NULL;
    if (!iw) return NULL;
    pa_dsa_select_desc d;
    memset(&d, 0, sizeof d);
    d.Hi = Hi;
    d.Di = Di;
    int64_t nk;
    long long top_k;
    if (!(d.cu_q = get_cu(fn, "cu_q", args[DS_CU_Q], Rq, &d.nseq)) ||
        !(d.cu_k = get_cu(fn, "cu_k", args[DS_CU_K], PyArray_DIM(ik, 0), &nk)) ||
        get_int(fn, "top_k", args[DS_TOP_K], 1, INT32_MAX, &top_k))
        return NULL;
    d.top_k = top_k;
    if ((d.causal = PyObject_IsTrue(args[DS_CAUSAL])) < 0) return NULL;
    int ok = nk == d.nseq;
    for (int64_t n = 0; ok && n < d.nseq; n++)
        ok = d.cu_q[n + 1] - d.cu_q[n] <= d.cu_k[n + 1] - d.cu_k[n];
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cu_q and cu_k must have the same length, each sequence with no more "
                     "queries than keys",
                     fn);
        return NULL;
    }
    npy_intp rshape[2] = {Rq, d.top_k}, cshape[1] = {Rq};
    if (PyArray_DIM(ik, 0) > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s(): at most %d key rows, got %lld", fn, INT32_MAX,
                     (long long)PyArray_DIM(ik, 0));
        return NULL;
    }
    PyArrayObject *rows = get_array(fn, "rows", args[DS_ROWS], NPY_INT32, 2, rshape, 1);
    PyArrayObject *count =
        rows ? get_array(fn, "count", args[DS_COUNT], NPY_INT64, 1, cshape, 1) : NULL;
    PyArrayObject *nan = count ? get_array(fn, "nan", args[DS_NAN], NPY_UINT8, 1, cshape, 1) : NULL;
    if (!nan) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->dsa_select(&d, PyArray_DATA(iq), PyArray_DATA(ik), PyArray_DATA(iw), PyArray_DATA(rows),
                       PyArray_DATA(count), PyArray_DATA(nan));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* dsa_index_loss(q, k, index_q, index_k, index_w, rows, count, scale, grad_scale, loss,
 * d_index_q, d_index_k, d_index_w): q [Rq, H, D], k [Rk, Hk, D], index_q [Rq, Hi, Di],
 * index_k [Rk, Di], index_w [Rq, Hi]; rows int32 [Rq, top_k] and count int64 [Rq] as
 * dsa_select writes them; loss [Rq] and the three gradients (index arrays' shapes) written */
enum { DL_Q, DL_K, DL_INDEX_Q, DL_INDEX_K, DL_INDEX_W, DL_ROWS, DL_COUNT, DL_SCALE, DL_GRAD_SCALE,
       DL_LOSS, DL_D_INDEX_Q, DL_D_INDEX_K, DL_D_INDEX_W, DL_NARGS };

static PyObject *py_dsa_index_loss(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "dsa_index_loss";
    if (expect_nargs(fn, nargs, DL_NARGS)) return NULL;
    int t;
    PyArrayObject *q = get_float_array(fn, "q", args[DL_Q], 3, &t);
    if (!q) return NULL;
    const npy_intp Rq = PyArray_DIM(q, 0), H = PyArray_DIM(q, 1), D = PyArray_DIM(q, 2);
    npy_intp kshape[3] = {-1, -1, D};
    PyArrayObject *k = get_array(fn, "k", args[DL_K], t, 3, kshape, 0);
    if (!k) return NULL;
    const npy_intp Rk = PyArray_DIM(k, 0), Hk = PyArray_DIM(k, 1);
    if (Hk == 0 || H % Hk) {
        PyErr_Format(PyExc_ValueError, "%s(): k has Hk=%lld heads; q's H=%lld must be a multiple of it",
                     fn, (long long)Hk, (long long)H);
        return NULL;
    }
    npy_intp iqshape[3] = {Rq, -1, -1};
    PyArrayObject *iq = get_array(fn, "index_q", args[DL_INDEX_Q], t, 3, iqshape, 0);
    if (!iq) return NULL;
    const npy_intp Hi = PyArray_DIM(iq, 1), Di = PyArray_DIM(iq, 2);
    npy_intp ikshape[2] = {Rk, Di}, iwshape[2] = {Rq, Hi}, rshape[2] = {Rq, -1}, cshape[1] = {Rq};
    PyArrayObject *ik = get_array(fn, "index_k", args[DL_INDEX_K], t, 2, ikshape, 0);
    PyArrayObject *iw = ik ? get_array(fn, "index_w", args[DL_INDEX_W], t, 2, iwshape, 0) : NULL;
    PyArrayObject *rows = iw ? get_array(fn, "rows", args[DL_ROWS], NPY_INT32, 2, rshape, 0) : NULL;
    PyArrayObject *count = rows ? get_array(fn, "count", args[DL_COUNT], NPY_INT64, 1, cshape, 0) : NULL;
    if (!count) return NULL;
    pa_dsa_loss_desc d = {.Rq = Rq, .Rk = Rk, .H = H, .Hk = Hk, .D = D, .Hi = Hi, .Di = Di,
                          .top_k = PyArray_DIM(rows, 1)};
    if (get_double(fn, "scale", args[DL_SCALE], -INFINITY, &d.scale) ||
        get_double(fn, "grad_scale", args[DL_GRAD_SCALE], -INFINITY, &d.grad_scale))
        return NULL;
    /* the kernel indexes k and index_k by the listed rows: each must be one of theirs */
    const int32_t *r = PyArray_DATA(rows);
    const int64_t *c = PyArray_DATA(count);
    for (npy_intp i = 0; i < Rq; i++) {
        if (c[i] < 0 || c[i] > d.top_k) {
            PyErr_Format(PyExc_ValueError, "%s(): count[%lld]=%lld must lie in [0, %lld]", fn,
                         (long long)i, (long long)c[i], (long long)d.top_k);
            return NULL;
        }
        for (int64_t j = 0; j < c[i]; j++)
            if (r[i * d.top_k + j] < 0 || r[i * d.top_k + j] >= Rk) {
                PyErr_Format(PyExc_ValueError, "%s(): rows[%lld, %lld]=%d is not a key row of %lld", fn,
                             (long long)i, (long long)j, (int)r[i * d.top_k + j], (long long)Rk);
                return NULL;
            }
    }
    PyArrayObject *loss = get_array(fn, "loss", args[DL_LOSS], t, 1, cshape, 1);
    PyArrayObject *diq = loss ? get_array(fn, "d_index_q", args[DL_D_INDEX_Q], t, 3, PyArray_DIMS(iq), 1) : NULL;
    PyArrayObject *dik = diq ? get_array(fn, "d_index_k", args[DL_D_INDEX_K], t, 2, ikshape, 1) : NULL;
    PyArrayObject *diw = dik ? get_array(fn, "d_index_w", args[DL_D_INDEX_W], t, 2, iwshape, 1) : NULL;
    if (!diw) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->dsa_index_loss(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(iq), PyArray_DATA(ik),
                           PyArray_DATA(iw), r, c, PyArray_DATA(loss), PyArray_DATA(diq),
                           PyArray_DATA(dik), PyArray_DATA(diw));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* The blocks of d's key sequences (block_size each, the last of a sequence maybe shorter):
 * sets d->first_block and d->block_seq in one allocation, returned (NULL: MemoryError). */
static int64_t *moba_blocks(pa_moba_desc *d)
{
    const int64_t bs = d->block_size;
    int64_t nb = 0;
    for (int64_t n = 0; n < d->nseq; n++) nb += (d->cu_k[n + 1] - d->cu_k[n] + bs - 1) / bs;
    int64_t *mem = malloc(sizeof(int64_t) * (d->nseq + 1 + nb + 1));
    if (!mem) {
        PyErr_NoMemory();
        return NULL;
    }
    int64_t *first = mem, *seq = mem + d->nseq + 1;
    first[0] = 0;
    for (int64_t n = 0; n < d->nseq; n++) {
        first[n + 1] = first[n] + (d->cu_k[n + 1] - d->cu_k[n] + bs - 1) / bs;
        for (int64_t b = first[n]; b < first[n + 1]; b++) seq[b] = n;
    }
    d->first_block = first;
    d->block_seq = seq;
    return mem;
}

/* MoBA's sequences and blocks, in this order in every MoBA entry point */
enum { LAYOUT_CU_Q, LAYOUT_CU_K, LAYOUT_BLOCK_SIZE, LAYOUT_CAUSAL };

/* MoBA's sequences and blocks from c (cu_q ending at rq, cu_k at rk, or anywhere with
 * rk < 0): fills d's cu_q, cu_k, nseq, block_size, causal, first_block and block_seq, whose
 * allocation is returned (NULL with an exception set). */
static int64_t *moba_layout(const char *fn, PyObject *const *c, int64_t rq, int64_t rk, pa_moba_desc *d)
{
    int64_t nk;
    long long bs, causal;
    if (!(d->cu_q = get_cu(fn, "cu_q", c[LAYOUT_CU_Q], rq, &d->nseq)) ||
        !(d->cu_k = get_cu(fn, "cu_k", c[LAYOUT_CU_K], rk, &nk)) ||
        get_int(fn, "block_size", c[LAYOUT_BLOCK_SIZE], 1, INT32_MAX, &bs) ||
        get_int(fn, "causal", c[LAYOUT_CAUSAL], 0, 1, &causal))
        return NULL;
    d->causal = (int)causal;
    if (nk != d->nseq) {
        PyErr_Format(PyExc_ValueError, "%s(): cu_q and cu_k must have the same length", fn);
        return NULL;
    }
    int64_t longest = 1;
    for (int64_t n = 0; n < d->nseq; n++) {
        if (d->cu_q[n + 1] - d->cu_q[n] > d->cu_k[n + 1] - d->cu_k[n]) {
            PyErr_Format(PyExc_ValueError, "%s(): sequence %lld has more queries than keys", fn,
                         (long long)n);
            return NULL;
        }
        longest = d->cu_k[n + 1] - d->cu_k[n] > longest ? d->cu_k[n + 1] - d->cu_k[n] : longest;
    }
    /* a block longer than every sequence holds the whole sequence, as one of the longest's
     * length does: the kernels' buffers follow the keys, not the argument */
    d->block_size = bs < longest ? bs : longest;
    return moba_blocks(d);
}

/* The choice and options of moba_forward and moba_backward: cu_q .. causal as moba_layout
 * reads them */
enum { MOBA_CHOICE, MOBA_CU_Q, MOBA_CU_K, MOBA_BLOCK_SIZE, MOBA_CAUSAL, MOBA_SCALE };

/* Shared by moba_forward and moba_backward: q [Rq, H, Dk], k [Rk, Hk, Dk], v [Rk, Hk, Dv]
 * from a, choice int32 [Rq, H, slots] (each entry -1 or a block of the row's sequence;
 * causal, one before the query's own) and the options from c. Fills d, whose first_block and
 * block_seq are one allocation at *blocks (freed by the caller). */
static int moba_desc(const char *fn, PyObject *const *a, PyObject *const *c, int *t,
                     PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                     PyArrayObject **choice, pa_moba_desc *d, int64_t **blocks)
{
    if (!(*q = get_float_array(fn, "q", a[QKV_Q], 3, t))) return -1;
    const npy_intp Rq = PyArray_DIM(*q, 0), H = PyArray_DIM(*q, 1), Dk = PyArray_DIM(*q, 2);
    npy_intp kshape[3] = {-1, -1, Dk};
    if (!(*k = get_array(fn, "k", a[QKV_K], *t, 3, kshape, 0))) return -1;
    npy_intp vshape[3] = {PyArray_DIM(*k, 0), PyArray_DIM(*k, 1), -1};
    if (!(*v = get_array(fn, "v", a[QKV_V], *t, 3, vshape, 0))) return -1;
    const npy_intp Hk = PyArray_DIM(*k, 1);
    if (Hk < 1 || H % Hk != 0 || Dk < 1 || PyArray_DIM(*v, 2) < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): need H %% Hk == 0 and head dims >= 1", fn);
        return -1;
    }
    npy_intp cshape[3] = {Rq, H, -1};
    if (!(*choice = get_array(fn, "choice", c[MOBA_CHOICE], NPY_INT32, 3, cshape, 0))) return -1;
    memset(d, 0, sizeof *d);
    d->H = H;
    d->Hk = Hk;
    d->Dk = Dk;
    d->Dv = PyArray_DIM(*v, 2);
    d->slots = PyArray_DIM(*choice, 2);
    if (get_double(fn, "scale", c[MOBA_SCALE], -INFINITY, &d->scale)) return -1;
    int64_t *mem = moba_layout(fn, c + MOBA_CU_Q, Rq, PyArray_DIM(*k, 0), d);
    if (!mem) return -1;
    const int64_t *first = d->first_block, bs = d->block_size;
    const int32_t *ch = PyArray_DATA(*choice);
    const int64_t per_row = H * d->slots;
    for (int64_t n = 0; n < d->nseq; n++) {
        const int64_t lag = (d->cu_k[n + 1] - d->cu_k[n]) - (d->cu_q[n + 1] - d->cu_q[n]);
        for (int64_t x = d->cu_q[n] * per_row; x < d->cu_q[n + 1] * per_row; x++) {
            /* causal: only the blocks before the query's own */
            const int64_t limit = d->causal ? (x / per_row - d->cu_q[n] + lag) / bs : first[n + 1] - first[n];
            if (ch[x] < -1 || ch[x] >= limit) {
                PyErr_Format(PyExc_ValueError,
                             "%s(): 'choice' holds block %d for a query of sequence %lld, which "
                             "may choose blocks below %lld",
                             fn, (int)ch[x], (long long)n, (long long)limit);
                free(mem);
                return -1;
            }
            /* a block listed twice by one (query, head) would count twice */
            for (int64_t y = x - x % d->slots; y < x; y++)
                if (ch[x] >= 0 && ch[y] == ch[x]) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s(): 'choice' lists block %d twice for one (query, head)", fn,
                                 (int)ch[x]);
                    free(mem);
                    return -1;
                }
        }
    }
    *blocks = mem;
    return 0;
}

/* moba_select(q, kmean, cu_q, cu_k, block_size, causal, slots, choice) */
enum { MS_Q, MS_KMEAN, MS_CU_Q, MS_CU_K, MS_BLOCK_SIZE, MS_CAUSAL, MS_SLOTS, MS_CHOICE,
       MS_NARGS };

static PyObject *py_moba_select(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_select";
    if (expect_nargs(fn, nargs, MS_NARGS)) return NULL;
    int t;
    PyArrayObject *q = get_float_array(fn, "q", args[MS_Q], 3, &t);
    if (!q) return NULL;
    npy_intp kshape[3] = {-1, -1, PyArray_DIM(q, 2)};
    PyArrayObject *km = get_array(fn, "kmean", args[MS_KMEAN], t, 3, kshape, 0);
    if (!km) return NULL;
    pa_moba_desc d;
    memset(&d, 0, sizeof d);
    d.H = PyArray_DIM(q, 1);
    d.Hk = PyArray_DIM(km, 1);
    d.Dk = PyArray_DIM(q, 2);
    long long slots;
    if (d.Hk < 1 || d.H % d.Hk != 0) {
        PyErr_Format(PyExc_ValueError, "%s(): need H %% Hk == 0", fn);
        return NULL;
    }
    if (get_int(fn, "slots", args[MS_SLOTS], 0, INT32_MAX, &slots)) return NULL;
    d.slots = slots;
    npy_intp cshape[3] = {PyArray_DIM(q, 0), d.H, slots > 0 ? slots : 1};
    PyArrayObject *choice = get_array(fn, "choice", args[MS_CHOICE], NPY_INT32, 3, cshape, 1);
    if (!choice) return NULL;
    int64_t *blocks = moba_layout(fn, args + MS_CU_Q, PyArray_DIM(q, 0), -1, &d);
    if (!blocks) return NULL;
    if (PyArray_DIM(km, 0) != d.first_block[d.nseq]) {
        PyErr_Format(PyExc_ValueError, "%s(): 'kmean' must have a row per block (%lld), got %lld", fn,
                     (long long)d.first_block[d.nseq], (long long)PyArray_DIM(km, 0));
        free(blocks);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->moba_select(&d, PyArray_DATA(q), PyArray_DATA(km), PyArray_DATA(choice));
    Py_END_ALLOW_THREADS
    free(blocks);
    return finish(rc);
}

/* moba_forward(q, k, v, choice, cu_q, cu_k, block_size, causal, scale, o, lse) */
enum { MF_Q, MF_K, MF_V, MF_CHOICE, MF_CU_Q, MF_CU_K, MF_BLOCK_SIZE, MF_CAUSAL, MF_SCALE, MF_O,
       MF_LSE, MF_NARGS };

static PyObject *py_moba_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_forward";
    if (expect_nargs(fn, nargs, MF_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *choice, *o, *lse;
    pa_moba_desc d;
    int64_t *blocks;
    if (moba_desc(fn, args + MF_Q, args + MF_CHOICE, &t, &q, &k, &v, &choice, &d, &blocks))
        return NULL;
    npy_intp oshape[3] = {PyArray_DIM(q, 0), d.H, d.Dv};
    if (attn_outputs(fn, args[MF_O], args[MF_LSE], t, 3, oshape, &o, &lse)) {
        free(blocks);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->moba_forward(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), PyArray_DATA(choice),
                         PyArray_DATA(o), PyArray_DATA(lse));
    Py_END_ALLOW_THREADS
    free(blocks);
    return finish(rc);
}

/* moba_backward(q, k, v, o, lse, do, dlse_or_None, choice, cu_q, cu_k, block_size, causal,
 *               scale, dq, dk, dv) */
enum { MB_Q, MB_K, MB_V, MB_O, MB_LSE, MB_DO, MB_DLSE, MB_CHOICE, MB_CU_Q, MB_CU_K,
       MB_BLOCK_SIZE, MB_CAUSAL, MB_SCALE, MB_DQ, MB_DK, MB_DV, MB_NARGS };

static PyObject *py_moba_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_backward";
    if (expect_nargs(fn, nargs, MB_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *choice;
    pa_moba_desc d;
    int64_t *blocks;
    if (moba_desc(fn, args + MB_Q, args + MB_CHOICE, &t, &q, &k, &v, &choice, &d, &blocks))
        return NULL;
    npy_intp oshape[3] = {PyArray_DIM(q, 0), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + MB_O, args + MB_DQ, t, 3, oshape, q, k, v, &g)) {
        free(blocks);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->moba_backward(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), PyArray_DATA(g.o),
                          PyArray_DATA(g.lse), PyArray_DATA(g.dout), data_or_null(g.dlse),
                          PyArray_DATA(choice), PyArray_DATA(g.dq), PyArray_DATA(g.dk),
                          PyArray_DATA(g.dv));
    Py_END_ALLOW_THREADS
    free(blocks);
    return finish(rc);
}

PyMethodDef pyattn_sparse_methods[] = {
    {"dsa_select", (PyCFunction)(void (*)(void))py_dsa_select, METH_FASTCALL,
     "dsa_select(index_q, index_k, index_w, cu_q, cu_k, top_k, causal, rows, count, nan): each "
     "query's top_k visible keys by the lightning indexer's scores"},
    {"dsa_index_loss", (PyCFunction)(void (*)(void))py_dsa_index_loss, METH_FASTCALL,
     "dsa_index_loss(q, k, index_q, index_k, index_w, rows, count, scale, grad_scale, loss, "
     "d_index_q, d_index_k, d_index_w): the indexer's KL loss per query over its chosen keys, "
     "and the gradients of grad_scale times their sum"},
    {"moba_select", (PyCFunction)(void (*)(void))py_moba_select, METH_FASTCALL,
     "moba_select(q, kmean, cu_q, cu_k, block_size, causal, slots, choice): MoBA's choice of "
     "blocks"},
    {"moba_forward", (PyCFunction)(void (*)(void))py_moba_forward, METH_FASTCALL,
     "moba_forward(q, k, v, choice, cu_q, cu_k, block_size, causal, scale, o, lse): attention of each "
     "(query, head) to the whole key blocks it chose"},
    {"moba_backward", (PyCFunction)(void (*)(void))py_moba_backward, METH_FASTCALL,
     "moba_backward(q, k, v, o, lse, do, dlse, choice, cu_q, cu_k, block_size, causal, scale, dq, dk, "
     "dv): the backward of moba_forward"},
    {NULL, NULL, 0, NULL},
};
