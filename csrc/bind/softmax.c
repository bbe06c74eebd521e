/* pyattn._core's softmax attention: the flash/parallel/recurrent forward and backward over
 * packed sequences, the Forgetting Transformer's (the same kernels with a forget gate), and the
 * decode over keys in place in a cache (ops/softmax_attn.c; the decode's backward is in
 * ops/sparse_attn.c). */
#include "args.h"
#include "bind.h"

#include <math.h>
#include <string.h>

/* The mask and score options, last in every softmax entry point in this order */
enum { MASK_CAUSAL, MASK_WINDOW_LEFT, MASK_WINDOW_RIGHT, MASK_SINKS, MASK_ALIBI_SLOPES,
       MASK_SOFTCAP, MASK_SCALE };

/* The mask and score options opt into d (whose H is set). */
static int softmax_options(const char *fn, PyObject *const *opt, int typenum, pa_softmax_desc *d)
{
    long long wl, wr, sinks;
    int causal = PyObject_IsTrue(opt[MASK_CAUSAL]);
    if (causal < 0) return -1;
    d->causal = causal;
    if (get_int(fn, "window_left", opt[MASK_WINDOW_LEFT], -1, INT64_MAX, &wl) ||
        get_int(fn, "window_right", opt[MASK_WINDOW_RIGHT], -1, INT64_MAX, &wr) ||
        get_int(fn, "sinks", opt[MASK_SINKS], 0, INT64_MAX, &sinks))
        return -1;
    d->window_left = wl;
    d->window_right = wr;
    d->sinks = sinks;
    if (opt[MASK_ALIBI_SLOPES] != Py_None) {
        npy_intp hshape[1] = {d->H};
        PyArrayObject *al = get_array(fn, "alibi_slopes", opt[MASK_ALIBI_SLOPES], typenum, 1,
                                      hshape, 0);
        if (!al) return -1;
        d->alibi = PyArray_DATA(al);
    }
    if (get_double(fn, "softcap", opt[MASK_SOFTCAP], 0.0, &d->softcap) ||
        get_double(fn, "scale", opt[MASK_SCALE], -INFINITY, &d->scale))
        return -1;
    return 0;
}

/* q [B, Tq, H, Dk], k [B', R, Hk, Dk], v [B', R, Hk, Dv] from a, B' = B when batched (else
 * any: a cache's blocks); d cleared, with its heads and head dims set. */
static int softmax_qkv(const char *fn, PyObject *const *a, int batched, int *t,
                       PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                       pa_softmax_desc *d)
{
    if (!(*q = get_float_array(fn, "q", a[QKV_Q], 4, t))) return -1;
    const npy_intp H = PyArray_DIM(*q, 2), Dk = PyArray_DIM(*q, 3);
    npy_intp kshape[4] = {batched ? PyArray_DIM(*q, 0) : -1, -1, -1, Dk};
    if (!(*k = get_array(fn, "k", a[QKV_K], *t, 4, kshape, 0))) return -1;
    const npy_intp Hk = PyArray_DIM(*k, 2);
    npy_intp vshape[4] = {PyArray_DIM(*k, 0), PyArray_DIM(*k, 1), Hk, -1};
    if (!(*v = get_array(fn, "v", a[QKV_V], *t, 4, vshape, 0))) return -1;
    if (Hk < 1 || H % Hk != 0 || Dk < 1 || PyArray_DIM(*v, 3) < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): need H %% Hk == 0 and head dims >= 1, got H=%lld Hk=%lld Dk=%lld "
                     "Dv=%lld",
                     fn, (long long)H, (long long)Hk, (long long)Dk, (long long)PyArray_DIM(*v, 3));
        return -1;
    }
    memset(d, 0, sizeof *d);
    d->H = H;
    d->Hk = Hk;
    d->Dk = Dk;
    d->Dv = PyArray_DIM(*v, 3);
    return 0;
}

/* The sequences and options of the forward and backward: cu_q, cu_k, form, then the mask
 * options */
enum { SEQ_CU_Q, SEQ_CU_K, SEQ_FORM, SEQ_MASK };

/* Shared by forward and backward: q, k, v from a, the sequences and options from opt. */
static int softmax_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *t,
                        PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                        pa_softmax_desc *d)
{
    if (softmax_qkv(fn, a, 1, t, q, k, v, d)) return -1;
    const npy_intp B = PyArray_DIM(*q, 0), Tq = PyArray_DIM(*q, 1), Tk = PyArray_DIM(*k, 1);
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", opt[SEQ_CU_Q], B * Tq, &d->nseq))) return -1;
    int64_t nk;
    if (!(d->cu_k = get_cu(fn, "cu_seqlens_k", opt[SEQ_CU_K], B * Tk, &nk))) return -1;
    if (nk != d->nseq) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cu_seqlens_q and cu_seqlens_k must have the same length, got %lld and "
                     "%lld",
                     fn, (long long)d->nseq + 1, (long long)nk + 1);
        return -1;
    }
    long long form;
    if (get_int(fn, "form", opt[SEQ_FORM], 0, 2, &form)) return -1;
    d->form = (int)form;
    return softmax_options(fn, opt + SEQ_MASK, *t, d);
}

/* The flash kernel's forward into the checked o [B, Tq, H, Dv] and lse arrays: softmax
 * attention's and FoX's (the gate rides in d). */
static PyObject *flash_forward(const char *fn, PyObject *o_arg, PyObject *lse_arg, int t,
                               PyArrayObject *q, PyArrayObject *k, PyArrayObject *v,
                               const pa_softmax_desc *d)
{
    PyArrayObject *o, *lse;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d->H, d->Dv};
    if (attn_outputs(fn, o_arg, lse_arg, t, 4, oshape, &o, &lse)) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_forward(d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                            PyArray_DATA(o), PyArray_DATA(lse));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* The flash kernel's backward from checked gradient arrays; dg: FoX's gate gradient or NULL */
static PyObject *flash_backward(int t, PyArrayObject *q, PyArrayObject *k, PyArrayObject *v,
                                const pa_softmax_desc *d, const attn_grads *g, PyArrayObject *dg)
{
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_backward(d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                             PyArray_DATA(g->o), PyArray_DATA(g->lse), PyArray_DATA(g->dout),
                             data_or_null(g->dlse), PyArray_DATA(g->dq), PyArray_DATA(g->dk),
                             PyArray_DATA(g->dv), dg ? PyArray_DATA(dg) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* softmax_forward(q, k, v, o, lse, cu_q, cu_k, form, causal, window_left, window_right,
 *                 sinks, alibi_slopes, softcap, scale, bf16) */
enum { SF_Q, SF_K, SF_V, SF_O, SF_LSE, SF_CU_Q, SF_CU_K, SF_FORM, SF_CAUSAL, SF_WINDOW_LEFT,
       SF_WINDOW_RIGHT, SF_SINKS, SF_ALIBI_SLOPES, SF_SOFTCAP, SF_SCALE, SF_BF16, SF_NARGS };

static PyObject *py_softmax_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_forward";
    if (expect_nargs(fn, nargs, SF_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    if (softmax_desc(fn, args + SF_Q, args + SF_CU_Q, &t, &q, &k, &v, &d) ||
        get_bf16_products(args[SF_BF16], t, &d.bf16))
        return NULL;
    return flash_forward(fn, args[SF_O], args[SF_LSE], t, q, k, v, &d);
}

/* softmax_backward(q, k, v, o, lse, do, dlse_or_None, dq, dk, dv, cu_q, cu_k, form, causal,
 *                  window_left, window_right, sinks, alibi_slopes, softcap, scale, bf16) */
enum { SB_Q, SB_K, SB_V, SB_O, SB_LSE, SB_DO, SB_DLSE, SB_DQ, SB_DK, SB_DV, SB_CU_Q, SB_CU_K,
       SB_FORM, SB_CAUSAL, SB_WINDOW_LEFT, SB_WINDOW_RIGHT, SB_SINKS, SB_ALIBI_SLOPES,
       SB_SOFTCAP, SB_SCALE, SB_BF16, SB_NARGS };

static PyObject *py_softmax_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_backward";
    if (expect_nargs(fn, nargs, SB_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    if (softmax_desc(fn, args + SB_Q, args + SB_CU_Q, &t, &q, &k, &v, &d) ||
        get_bf16_products(args[SB_BF16], t, &d.bf16))
        return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + SB_O, args + SB_DQ, t, 4, oshape, q, k, v, &g)) return NULL;
    return flash_backward(t, q, k, v, &d, &g, NULL);
}

/* The gate and options of the forgetting entry points: g, then cu_seqlens, form, window_left,
 * scale */
enum { FOX_G, FOX_CU, FOX_FORM, FOX_WINDOW_LEFT, FOX_SCALE };

/* Shared by forgetting_forward and its backward: q [B, T, H, Dk], k [B, T, Hk, Dk], v [B, T,
 * Hk, Dv] from a; from opt, g [B, T, H] (the log forget gate per query head) and the options
 * (one cu_seqlens for queries and keys, the flash or parallel form, a causal mask with a left
 * window). */
static int forgetting_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *t,
                           PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                           pa_softmax_desc *d)
{
    if (softmax_qkv(fn, a, 1, t, q, k, v, d)) return -1;
    const npy_intp B = PyArray_DIM(*q, 0), T = PyArray_DIM(*q, 1);
    if (PyArray_DIM(*k, 1) != T) {
        PyErr_Format(PyExc_ValueError, "%s(): q and k must have the same length T, got %lld and %lld",
                     fn, (long long)T, (long long)PyArray_DIM(*k, 1));
        return -1;
    }
    npy_intp gshape[3] = {B, T, d->H};
    PyArrayObject *g = get_array(fn, "g", opt[FOX_G], *t, 3, gshape, 0);
    if (!g || !(d->cu_q = d->cu_k = get_cu(fn, "cu_seqlens", opt[FOX_CU], B * T, &d->nseq)))
        return -1;
    long long form, wl;
    if (get_int(fn, "form", opt[FOX_FORM], PA_FORM_PARALLEL, PA_FORM_FLASH, &form) ||
        get_int(fn, "window_left", opt[FOX_WINDOW_LEFT], -1, INT64_MAX, &wl) ||
        get_double(fn, "scale", opt[FOX_SCALE], -INFINITY, &d->scale))
        return -1;
    d->gate = PyArray_DATA(g);
    d->form = (int)form;
    d->causal = 1;
    d->window_left = wl;
    d->window_right = -1;
    return 0;
}

/* forgetting_forward(q, k, v, g, o, lse, cu_seqlens, form, window_left, scale, bf16) */
enum { FF_Q, FF_K, FF_V, FF_G, FF_O, FF_LSE, FF_CU, FF_FORM, FF_WINDOW_LEFT, FF_SCALE, FF_BF16,
       FF_NARGS };

static PyObject *py_forgetting_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "forgetting_forward";
    if (expect_nargs(fn, nargs, FF_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    PyObject *const opt[] = {args[FF_G], args[FF_CU], args[FF_FORM], args[FF_WINDOW_LEFT],
                             args[FF_SCALE]};
    if (forgetting_desc(fn, args + FF_Q, opt, &t, &q, &k, &v, &d) ||
        get_bf16_products(args[FF_BF16], t, &d.bf16))
        return NULL;
    return flash_forward(fn, args[FF_O], args[FF_LSE], t, q, k, v, &d);
}

/* forgetting_backward(q, k, v, g, o, lse, do, dq, dk, dv, dg, cu_seqlens, form, window_left,
 *                     scale, bf16): no lse cotangent (the op returns o alone) */
enum { FB_Q, FB_K, FB_V, FB_G, FB_O, FB_LSE, FB_DO, FB_DQ, FB_DK, FB_DV, FB_DG, FB_CU, FB_FORM,
       FB_WINDOW_LEFT, FB_SCALE, FB_BF16, FB_NARGS };

static PyObject *py_forgetting_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "forgetting_backward";
    if (expect_nargs(fn, nargs, FB_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *dg;
    pa_softmax_desc d;
    PyObject *const opt[] = {args[FB_G], args[FB_CU], args[FB_FORM], args[FB_WINDOW_LEFT],
                             args[FB_SCALE]};
    if (forgetting_desc(fn, args + FB_Q, opt, &t, &q, &k, &v, &d) ||
        get_bf16_products(args[FB_BF16], t, &d.bf16))
        return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    PyObject *const grad_in[] = {args[FB_O], args[FB_LSE], args[FB_DO], Py_None};
    attn_grads g;
    if (attn_grad_arrays(fn, grad_in, args + FB_DQ, t, 4, oshape, q, k, v, &g) ||
        !(dg = get_array(fn, "dg", args[FB_DG], t, 3, oshape, 1)))
        return NULL;
    return flash_backward(t, q, k, v, &d, &g, dg);
}

/* Where the decode's keys lie: cu_q, start, end, block_table */
enum { KEYS_CU_Q, KEYS_START, KEYS_END, KEYS_BLOCK_TABLE };

/* Shared by softmax_decode and its backward: q [B, Tq, H, Dk] placed by cu_q; k [A, R, Hk,
 * Dk], v [A, R, Hk, Dv] hold the keys: sequence n's key j at row start[n] + j of the A R
 * rows, or, with block_table int32 [nseq, max_blocks], at row j % R of block
 * block_table[n, j // R] (R the block size). a = (q, k, v), c the keys' places, opt the
 * mask/score options. Every listed row is checked to lie in the cache; *maxk is the most keys
 * of a sequence. */
static int decode_desc(const char *fn, PyObject *const *a, PyObject *const *c,
                       PyObject *const *opt, int *t, PyArrayObject **q, PyArrayObject **k,
                       PyArrayObject **v, pa_softmax_desc *d, pa_key_rows *rows, int64_t *maxk)
{
    if (softmax_qkv(fn, a, 0, t, q, k, v, d)) return -1;
    const npy_intp A = PyArray_DIM(*k, 0), R = PyArray_DIM(*k, 1);
    d->form = PA_FORM_FLASH;
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", c[KEYS_CU_Q],
                           PyArray_DIM(*q, 0) * PyArray_DIM(*q, 1), &d->nseq)) ||
        softmax_options(fn, opt, *t, d))
        return -1;
    npy_intp nshape[1] = {d->nseq};
    PyArrayObject *st = get_array(fn, "start", c[KEYS_START], NPY_INT64, 1, nshape, 0);
    PyArrayObject *en = st ? get_array(fn, "end", c[KEYS_END], NPY_INT64, 1, nshape, 0) : NULL;
    if (!en) return -1;
    *rows = (pa_key_rows){PyArray_DATA(st), PyArray_DATA(en), NULL, 0, R};
    int64_t max_blocks = 0;
    *maxk = 0;
    if (c[KEYS_BLOCK_TABLE] != Py_None) {
        npy_intp tshape[2] = {d->nseq, -1};
        PyArrayObject *bt = get_array(fn, "block_table", c[KEYS_BLOCK_TABLE], NPY_INT32, 2,
                                      tshape, 0);
        if (!bt) return -1;
        rows->block_table = PyArray_DATA(bt);
        rows->table_stride = max_blocks = PyArray_DIM(bt, 1);
    }
    for (int64_t n = 0; n < d->nseq; n++) {
        const int64_t len = rows->end[n] - rows->start[n];
        int ok = rows->start[n] >= 0 && len >= 0 &&
                 (rows->block_table ? R > 0 && len <= max_blocks * R : rows->end[n] <= A * R);
        for (int64_t b = 0; ok && rows->block_table && b < (len + R - 1) / R; b++) {
            const int32_t blk = rows->block_table[n * max_blocks + b];
            ok = blk >= 0 && blk < A;
        }
        if (!ok) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): the keys of sequence %lld (rows %lld .. %lld) lie outside the "
                         "cache (%lld rows%s)",
                         fn, (long long)n, (long long)rows->start[n], (long long)rows->end[n],
                         (long long)(A * R), rows->block_table ? ", paged" : "");
            return -1;
        }
        *maxk = len > *maxk ? len : *maxk;
    }
    return 0;
}

/* softmax_decode(q, k, v, o, lse, cu_q, start, end, block_table, num_splits, colsum, causal,
 *                window_left, window_right, sinks, alibi_slopes, softcap, scale): the keys as
 * decode_desc places them; colsum None or [nseq, H, L] (L >= every end - start), added to */
enum { SD_Q, SD_K, SD_V, SD_O, SD_LSE, SD_CU_Q, SD_START, SD_END, SD_BLOCK_TABLE,
       SD_NUM_SPLITS, SD_COLSUM, SD_CAUSAL, SD_WINDOW_LEFT, SD_WINDOW_RIGHT, SD_SINKS,
       SD_ALIBI_SLOPES, SD_SOFTCAP, SD_SCALE, SD_NARGS };

static PyObject *py_softmax_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_decode";
    if (expect_nargs(fn, nargs, SD_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *o, *lse;
    pa_softmax_desc d;
    pa_key_rows rows;
    int64_t maxk;
    if (decode_desc(fn, args + SD_Q, args + SD_CU_Q, args + SD_CAUSAL, &t, &q, &k, &v, &d, &rows,
                    &maxk))
        return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    if (attn_outputs(fn, args[SD_O], args[SD_LSE], t, 4, oshape, &o, &lse)) return NULL;
    long long splits;
    if (get_int(fn, "num_splits", args[SD_NUM_SPLITS], 0, 1024, &splits)) return NULL;
    void *colsum = NULL;
    int64_t clen = 0;
    if (args[SD_COLSUM] != Py_None) {
        npy_intp cshape[3] = {d.nseq, d.H, -1};
        PyArrayObject *cs = get_array(fn, "colsum", args[SD_COLSUM], t, 3, cshape, 1);
        if (!cs) return NULL;
        clen = PyArray_DIM(cs, 2);
        if (clen < maxk) {
            PyErr_Format(PyExc_ValueError, "%s(): 'colsum' needs room for %lld keys, has %lld",
                         fn, (long long)maxk, (long long)clen);
            return NULL;
        }
        colsum = PyArray_DATA(cs);
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_decode(&d, &rows, splits, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                           PyArray_DATA(o), PyArray_DATA(lse), colsum, clen);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* softmax_decode_backward(q, k, v, o, lse, do, dlse_or_None, dq, dk, dv, cu_q, start, end,
 *                         block_table, causal, window_left, window_right, sinks,
 *                         alibi_slopes, softcap, scale): the keys as decode_desc places them;
 * dk, dv (shaped as k, v) are overwritten. No softcap or ALiBi. */
enum { SDB_Q, SDB_K, SDB_V, SDB_O, SDB_LSE, SDB_DO, SDB_DLSE, SDB_DQ, SDB_DK, SDB_DV, SDB_CU_Q,
       SDB_START, SDB_END, SDB_BLOCK_TABLE, SDB_CAUSAL, SDB_WINDOW_LEFT, SDB_WINDOW_RIGHT,
       SDB_SINKS, SDB_ALIBI_SLOPES, SDB_SOFTCAP, SDB_SCALE, SDB_NARGS };

static PyObject *py_softmax_decode_backward(PyObject *self, PyObject *const *args,
                                            Py_ssize_t nargs)
{
    const char *fn = "softmax_decode_backward";
    if (expect_nargs(fn, nargs, SDB_NARGS)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    pa_key_rows rows;
    int64_t maxk;
    if (decode_desc(fn, args + SDB_Q, args + SDB_CU_Q, args + SDB_CAUSAL, &t, &q, &k, &v, &d,
                    &rows, &maxk))
        return NULL;
    if (d.alibi || d.softcap > 0) {
        PyErr_Format(PyExc_ValueError, "%s(): softcap and alibi_slopes are not supported", fn);
        return NULL;
    }
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + SDB_O, args + SDB_DQ, t, 4, oshape, q, k, v, &g)) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_decode_backward(&d, &rows, PyArray_DIM(k, 0) * PyArray_DIM(k, 1),
                                    PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                                    PyArray_DATA(g.o), PyArray_DATA(g.lse), PyArray_DATA(g.dout),
                                    data_or_null(g.dlse), PyArray_DATA(g.dq), PyArray_DATA(g.dk),
                                    PyArray_DATA(g.dv));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_softmax_methods[] = {
    {"softmax_forward", (PyCFunction)(void (*)(void))py_softmax_forward, METH_FASTCALL,
     "softmax_forward(q, k, v, o, lse, cu_q, cu_k, form, causal, window_left, window_right, "
     "sinks, alibi_slopes, softcap, scale, bf16): bf16 true when q, k, v (float32) hold "
     "bfloat16 values and the products may round to bf16"},
    {"softmax_backward", (PyCFunction)(void (*)(void))py_softmax_backward, METH_FASTCALL,
     "softmax_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, cu_q, cu_k, form, causal, "
     "window_left, window_right, sinks, alibi_slopes, softcap, scale, bf16)"},
    {"forgetting_forward", (PyCFunction)(void (*)(void))py_forgetting_forward, METH_FASTCALL,
     "forgetting_forward(q, k, v, g, o, lse, cu_seqlens, form, window_left, scale, bf16): causal "
     "softmax attention with the scores biased by G_i - G_j, G the running sum of the log forget gate g "
     "(the Forgetting Transformer)"},
    {"forgetting_backward", (PyCFunction)(void (*)(void))py_forgetting_backward, METH_FASTCALL,
     "forgetting_backward(q, k, v, g, o, lse, do, dq, dk, dv, dg, cu_seqlens, form, window_left, "
     "scale, bf16)"},
    {"softmax_decode", (PyCFunction)(void (*)(void))py_softmax_decode, METH_FASTCALL,
     "softmax_decode(q, k, v, o, lse, cu_q, start, end, block_table, num_splits, colsum, causal, "
     "window_left, window_right, sinks, alibi_slopes, softcap, scale): few queries against keys "
     "in place in a cache (contiguous rows start .. end, or paged through block_table)"},
    {"softmax_decode_backward", (PyCFunction)(void (*)(void))py_softmax_decode_backward,
     METH_FASTCALL,
     "softmax_decode_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, cu_q, start, end, "
     "block_table, causal, window_left, window_right, sinks, alibi_slopes, softcap, scale): the "
     "backward of softmax_decode over the same keys"},
    {NULL, NULL, 0, NULL},
};
