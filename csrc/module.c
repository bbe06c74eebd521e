/* pyattn._core: unpacks NumPy arrays, checks every buffer against the shapes the kernel will
 * assume, releases the GIL around the kernel and raises after it is back. No maths here.
 * Entry points take positional arguments only (METH_FASTCALL); pyattn's Python wrappers fill
 * defaults and allocate outputs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#include <numpy/arrayobject.h>

#include <math.h>
#include <string.h>

#include "array_cache.h"
#include "core/parallel.h"
#include "kernels.h"

#ifndef PYATTN_COMPILER
#define PYATTN_COMPILER "unknown"
#endif

/* ---- argument helpers: each sets a Python exception and returns -1 on bad input ---- */

static int expect_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments, got %zd", fn, want, nargs);
    return -1;
}

static void format_shape(char *buf, size_t size, int ndim, const npy_intp *shape)
{
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

/* obj must be a C-contiguous, aligned ndarray of typenum with ndim dims; shape entries < 0
 * are not checked. Returns the array (borrowed) or NULL with an exception set. */
static PyArrayObject *get_array(const char *fn, const char *name, PyObject *obj, int typenum,
                                int ndim, const npy_intp *shape, int writeable)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be a numpy.ndarray, got %s", fn,
                     name, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != typenum) {
        PyArray_Descr *want = PyArray_DescrFromType(typenum);
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must have dtype %S, got %S", fn, name,
                     (PyObject *)want, (PyObject *)PyArray_DESCR(a));
        Py_XDECREF(want);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): argument '%s' must be C-contiguous, aligned and in native byte order",
                     fn, name);
        return NULL;
    }
    if (writeable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must be writeable", fn, name);
        return NULL;
    }
    int bad = PyArray_NDIM(a) != ndim;
    for (int i = 0; !bad && i < ndim; i++) bad = shape[i] >= 0 && PyArray_DIM(a, i) != shape[i];
    if (bad) {
        char want[160], got[160];
        format_shape(want, sizeof want, ndim, shape);
        format_shape(got, sizeof got, PyArray_NDIM(a), PyArray_DIMS(a));
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must have shape %s, got %s", fn, name,
                     want, got);
        return NULL;
    }
    return a;
}

static int get_int(const char *fn, const char *name, PyObject *obj, long long lo, long long hi,
                   long long *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        int overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
        PyErr_Clear();
        if (overflow)
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must be in [%lld, %lld], got %R",
                         fn, name, lo, hi, obj);
        else
            PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be an int, got %s", fn, name,
                         Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must be in [%lld, %lld], got %lld", fn,
                     name, lo, hi, v);
        return -1;
    }
    *out = v;
    return 0;
}

static int get_double(const char *fn, const char *name, PyObject *obj, double lo, double *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be a float, got %s", fn, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!isfinite(v) || v < lo) {
        char msg[256]; /* PyErr_Format has no %g */
        snprintf(msg, sizeof msg, "%s(): argument '%s' must be finite and >= %g, got %g", fn, name,
                 lo, v);
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    *out = v;
    return 0;
}

/* float32 or float64 of the first array decides the dtype of the call */
static int float_type(const char *fn, const char *name, PyObject *obj, int *typenum)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be a numpy.ndarray, got %s", fn,
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int t = PyArray_TYPE((PyArrayObject *)obj);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        PyErr_Format(PyExc_TypeError, "%s(): argument '%s' must be float32 or float64, got %S", fn,
                     name, (PyObject *)PyArray_DESCR((PyArrayObject *)obj));
        return -1;
    }
    *typenum = t;
    return 0;
}

static const pa_kernels *kernels_for(int typenum)
{
    return pa_select_kernels(typenum == NPY_FLOAT64);
}

/* A kernel's status as None, or a MemoryError that says what could not be allocated. */
static PyObject *finish(int rc)
{
    if (rc != PA_ENOMEM) Py_RETURN_NONE;
    size_t bytes = pa_take_failed_bytes();
    if (!bytes)
        return PyErr_Format(PyExc_MemoryError, "the kernel could not allocate its scratch memory");
    char msg[160]; /* PyErr_Format has no %g */
    snprintf(msg, sizeof msg, "the kernel could not allocate %zu bytes (%.3g GiB) of scratch memory",
             bytes, (double)bytes / (1024.0 * 1024.0 * 1024.0));
    PyErr_SetString(PyExc_MemoryError, msg);
    return NULL;
}

/* cu must be int64 [n+1] with cu[0] = 0, non-decreasing, cu[n] = rows */
static const int64_t *get_cu(const char *fn, const char *name, PyObject *obj, int64_t rows,
                             int64_t *nseq)
{
    npy_intp any = -1;
    PyArrayObject *a = get_array(fn, name, obj, NPY_INT64, 1, &any, 0);
    if (!a) return NULL;
    const int64_t *cu = PyArray_DATA(a);
    int64_t n = PyArray_DIM(a, 0) - 1;
    int ok = n >= 0 && cu[0] == 0 && (rows < 0 || cu[n] == rows); /* rows < 0: any end */
    for (int64_t i = 0; ok && i < n; i++) ok = cu[i + 1] >= cu[i];
    if (!ok) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): argument '%s' must be non-decreasing from 0 to %lld (one entry more "
                     "than sequences)",
                     fn, name, (long long)rows);
        return NULL;
    }
    *nseq = n;
    return cu;
}

/* ---- softmax attention ---- */

/* The mask and score options causal, window_left, window_right, sinks, alibi_slopes,
 * softcap, scale from opt[0..6] into d (whose H is set). */
static int softmax_options(const char *fn, PyObject *const *opt, int typenum, pa_softmax_desc *d)
{
    long long wl, wr, sinks;
    int causal = PyObject_IsTrue(opt[0]);
    if (causal < 0) return -1;
    d->causal = causal;
    if (get_int(fn, "window_left", opt[1], -1, INT64_MAX, &wl) ||
        get_int(fn, "window_right", opt[2], -1, INT64_MAX, &wr) ||
        get_int(fn, "sinks", opt[3], 0, INT64_MAX, &sinks))
        return -1;
    d->window_left = wl;
    d->window_right = wr;
    d->sinks = sinks;
    if (opt[4] != Py_None) {
        npy_intp hshape[1] = {d->H};
        PyArrayObject *al = get_array(fn, "alibi_slopes", opt[4], typenum, 1, hshape, 0);
        if (!al) return -1;
        d->alibi = PyArray_DATA(al);
    }
    if (get_double(fn, "softcap", opt[5], 0.0, &d->softcap) ||
        get_double(fn, "scale", opt[6], -INFINITY, &d->scale))
        return -1;
    return 0;
}

/* Shared by forward and backward: q, k, v and the mask/score options from args[first..]. */
static int softmax_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                        PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                        pa_softmax_desc *d)
{
    if (float_type(fn, "q", a[0], typenum)) return -1;
    npy_intp four[4] = {-1, -1, -1, -1};
    if (!(*q = get_array(fn, "q", a[0], *typenum, 4, four, 0))) return -1;
    npy_intp B = PyArray_DIM(*q, 0), Tq = PyArray_DIM(*q, 1), H = PyArray_DIM(*q, 2),
             Dk = PyArray_DIM(*q, 3);
    npy_intp kshape[4] = {B, -1, -1, Dk};
    if (!(*k = get_array(fn, "k", a[1], *typenum, 4, kshape, 0))) return -1;
    npy_intp Tk = PyArray_DIM(*k, 1), Hk = PyArray_DIM(*k, 2);
    npy_intp vshape[4] = {B, Tk, Hk, -1};
    if (!(*v = get_array(fn, "v", a[2], *typenum, 4, vshape, 0))) return -1;
    if (Hk < 1 || H % Hk != 0 || Dk < 1 || PyArray_DIM(*v, 3) < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): need H %% Hk == 0 and head dims >= 1, got H=%lld Hk=%lld Dk=%lld "
                     "Dv=%lld",
                     fn, (long long)H, (long long)Hk, (long long)Dk,
                     (long long)PyArray_DIM(*v, 3));
        return -1;
    }
    memset(d, 0, sizeof *d);
    d->H = H;
    d->Hk = Hk;
    d->Dk = Dk;
    d->Dv = PyArray_DIM(*v, 3);
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", opt[0], B * Tq, &d->nseq))) return -1;
    int64_t nk;
    if (!(d->cu_k = get_cu(fn, "cu_seqlens_k", opt[1], B * Tk, &nk))) return -1;
    if (nk != d->nseq) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cu_seqlens_q and cu_seqlens_k must have the same length, got %lld and "
                     "%lld",
                     fn, (long long)d->nseq + 1, (long long)nk + 1);
        return -1;
    }
    long long form;
    if (get_int(fn, "form", opt[2], 0, 2, &form)) return -1;
    d->form = (int)form;
    return softmax_options(fn, opt + 3, *typenum, d);
}

/* softmax_forward(q, k, v, o, lse, cu_q, cu_k, form, causal, window_left, window_right,
 *                 sinks, alibi_slopes, softcap, scale) */
static PyObject *py_softmax_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_forward";
    if (expect_nargs(fn, nargs, 15)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    if (softmax_desc(fn, args, args + 5, &t, &q, &k, &v, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    PyArrayObject *o = get_array(fn, "o", args[3], t, 4, oshape, 1);
    PyArrayObject *lse = o ? get_array(fn, "lse", args[4], t, 3, oshape, 1) : NULL;
    if (!lse) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_forward(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                            PyArray_DATA(o), PyArray_DATA(lse));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* The arrays of an attention backward besides q, k, v: o (nd dims, shape oshape), lse (its
 * first nd - 1), do (as o) and dlse (None or as lse) from a[0..3], read; dq, dk, dv from
 * g[0..2], written, shaped as q, k, v. */
typedef struct {
    PyArrayObject *o, *lse, *dout, *dlse, *dq, *dk, *dv;
} attn_grads;

static int attn_grad_arrays(const char *fn, PyObject *const *a, PyObject *const *g, int t, int nd,
                            const npy_intp *oshape, PyArrayObject *q, PyArrayObject *k,
                            PyArrayObject *v, attn_grads *r)
{
    r->dlse = NULL;
    return (r->o = get_array(fn, "o", a[0], t, nd, oshape, 0)) &&
                   (r->lse = get_array(fn, "lse", a[1], t, nd - 1, oshape, 0)) &&
                   (r->dout = get_array(fn, "do", a[2], t, nd, oshape, 0)) &&
                   (a[3] == Py_None || (r->dlse = get_array(fn, "dlse", a[3], t, nd - 1, oshape, 0))) &&
                   (r->dq = get_array(fn, "dq", g[0], t, nd, PyArray_DIMS(q), 1)) &&
                   (r->dk = get_array(fn, "dk", g[1], t, nd, PyArray_DIMS(k), 1)) &&
                   (r->dv = get_array(fn, "dv", g[2], t, nd, PyArray_DIMS(v), 1))
               ? 0
               : -1;
}

/* softmax_backward(q, k, v, o, lse, do, dlse_or_None, dq, dk, dv, cu_q, cu_k, form, causal,
 *                  window_left, window_right, sinks, alibi_slopes, softcap, scale) */
static PyObject *py_softmax_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_backward";
    if (expect_nargs(fn, nargs, 20)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    if (softmax_desc(fn, args, args + 10, &t, &q, &k, &v, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + 3, args + 7, t, 4, oshape, q, k, v, &g)) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_backward(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                             PyArray_DATA(g.o), PyArray_DATA(g.lse), PyArray_DATA(g.dout),
                             g.dlse ? PyArray_DATA(g.dlse) : NULL, PyArray_DATA(g.dq),
                             PyArray_DATA(g.dk), PyArray_DATA(g.dv));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* Shared by softmax_decode and its backward: q [B, Tq, H, Dk] placed by cu_q; k [A, R, Hk,
 * Dk], v [A, R, Hk, Dv] hold the keys: sequence n's key j at row start[n] + j of the A R
 * rows, or, with block_table int32 [nseq, max_blocks], at row j % R of block
 * block_table[n, j // R] (R the block size). a = (q, k, v), c = (cu_q, start, end,
 * block_table), opt the mask/score options. Every listed row is checked to lie in the cache;
 * *maxk is the most keys of a sequence. */
static int decode_desc(const char *fn, PyObject *const *a, PyObject *const *c,
                       PyObject *const *opt, int *t, PyArrayObject **q, PyArrayObject **k,
                       PyArrayObject **v, pa_softmax_desc *d, pa_key_rows *rows, int64_t *maxk)
{
    if (float_type(fn, "q", a[0], t)) return -1;
    npy_intp four[4] = {-1, -1, -1, -1};
    if (!(*q = get_array(fn, "q", a[0], *t, 4, four, 0))) return -1;
    const npy_intp H = PyArray_DIM(*q, 2), Dk = PyArray_DIM(*q, 3);
    npy_intp kshape[4] = {-1, -1, -1, Dk};
    if (!(*k = get_array(fn, "k", a[1], *t, 4, kshape, 0))) return -1;
    const npy_intp A = PyArray_DIM(*k, 0), R = PyArray_DIM(*k, 1), Hk = PyArray_DIM(*k, 2);
    npy_intp vshape[4] = {A, R, Hk, -1};
    if (!(*v = get_array(fn, "v", a[2], *t, 4, vshape, 0))) return -1;
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
    d->form = PA_FORM_FLASH;
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", c[0], PyArray_DIM(*q, 0) * PyArray_DIM(*q, 1),
                           &d->nseq)) ||
        softmax_options(fn, opt, *t, d))
        return -1;
    npy_intp nshape[1] = {d->nseq};
    PyArrayObject *st = get_array(fn, "start", c[1], NPY_INT64, 1, nshape, 0);
    PyArrayObject *en = st ? get_array(fn, "end", c[2], NPY_INT64, 1, nshape, 0) : NULL;
    if (!en) return -1;
    *rows = (pa_key_rows){PyArray_DATA(st), PyArray_DATA(en), NULL, 0, R};
    int64_t max_blocks = 0;
    *maxk = 0;
    if (c[3] != Py_None) {
        npy_intp tshape[2] = {d->nseq, -1};
        PyArrayObject *bt = get_array(fn, "block_table", c[3], NPY_INT32, 2, tshape, 0);
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
static PyObject *py_softmax_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "softmax_decode";
    if (expect_nargs(fn, nargs, 18)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    pa_key_rows rows;
    int64_t maxk;
    PyObject *const cargs[4] = {args[5], args[6], args[7], args[8]};
    if (decode_desc(fn, args, cargs, args + 11, &t, &q, &k, &v, &d, &rows, &maxk)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    PyArrayObject *o = get_array(fn, "o", args[3], t, 4, oshape, 1);
    PyArrayObject *lse = o ? get_array(fn, "lse", args[4], t, 3, oshape, 1) : NULL;
    if (!lse) return NULL;
    long long splits;
    if (get_int(fn, "num_splits", args[9], 0, 1024, &splits)) return NULL;
    void *colsum = NULL;
    int64_t clen = 0;
    if (args[10] != Py_None) {
        npy_intp cshape[3] = {d.nseq, d.H, -1};
        PyArrayObject *cs = get_array(fn, "colsum", args[10], t, 3, cshape, 1);
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
static PyObject *py_softmax_decode_backward(PyObject *self, PyObject *const *args,
                                            Py_ssize_t nargs)
{
    const char *fn = "softmax_decode_backward";
    if (expect_nargs(fn, nargs, 21)) return NULL;
    int t;
    PyArrayObject *q, *k, *v;
    pa_softmax_desc d;
    pa_key_rows rows;
    int64_t maxk;
    if (decode_desc(fn, args, args + 10, args + 14, &t, &q, &k, &v, &d, &rows, &maxk))
        return NULL;
    if (d.alibi || d.softcap > 0) {
        PyErr_Format(PyExc_ValueError, "%s(): softcap and alibi_slopes are not supported", fn);
        return NULL;
    }
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + 3, args + 7, t, 4, oshape, q, k, v, &g)) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->softmax_decode_backward(&d, &rows, PyArray_DIM(k, 0) * PyArray_DIM(k, 1),
                                    PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                                    PyArray_DATA(g.o), PyArray_DATA(g.lse), PyArray_DATA(g.dout),
                                    g.dlse ? PyArray_DATA(g.dlse) : NULL, PyArray_DATA(g.dq),
                                    PyArray_DATA(g.dk), PyArray_DATA(g.dv));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* dsa_select(index_q, index_k, index_w, cu_q, cu_k, top_k, causal, rows, count, nan):
 * index_q [Rq, Hi, Di], index_k [Rk, Di], index_w [Rq, Hi]; rows int32 [Rq, top_k] (a block
 * table of single rows for softmax_decode), count int64 [Rq], nan uint8 [Rq] written */
static PyObject *py_dsa_select(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "dsa_select";
    if (expect_nargs(fn, nargs, 10)) return NULL;
    int t;
    if (float_type(fn, "index_q", args[0], &t)) return NULL;
    npy_intp qshape[3] = {-1, -1, -1};
    PyArrayObject *iq = get_array(fn, "index_q", args[0], t, 3, qshape, 0);
    if (!iq) return NULL;
    const npy_intp Rq = PyArray_DIM(iq, 0), Hi = PyArray_DIM(iq, 1), Di = PyArray_DIM(iq, 2);
    npy_intp kshape[2] = {-1, Di}, wshape[2] = {Rq, Hi};
    PyArrayObject *ik = get_array(fn, "index_k", args[1], t, 2, kshape, 0);
    PyArrayObject *iw = ik ? get_array(fn, "index_w", args[2], t, 2, wshape, 0) : NULL;
    if (!iw) return NULL;
    pa_dsa_select_desc d;
    memset(&d, 0, sizeof d);
    d.Hi = Hi;
    d.Di = Di;
    int64_t nk;
    long long top_k;
    if (!(d.cu_q = get_cu(fn, "cu_q", args[3], Rq, &d.nseq)) ||
        !(d.cu_k = get_cu(fn, "cu_k", args[4], PyArray_DIM(ik, 0), &nk)) ||
        get_int(fn, "top_k", args[5], 1, INT32_MAX, &top_k))
        return NULL;
    d.top_k = top_k;
    if ((d.causal = PyObject_IsTrue(args[6])) < 0) return NULL;
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
    PyArrayObject *rows = get_array(fn, "rows", args[7], NPY_INT32, 2, rshape, 1);
    PyArrayObject *count = rows ? get_array(fn, "count", args[8], NPY_INT64, 1, cshape, 1) : NULL;
    PyArrayObject *nan = count ? get_array(fn, "nan", args[9], NPY_UINT8, 1, cshape, 1) : NULL;
    if (!nan) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->dsa_select(&d, PyArray_DATA(iq), PyArray_DATA(ik), PyArray_DATA(iw), PyArray_DATA(rows),
                       PyArray_DATA(count), PyArray_DATA(nan));
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

/* MoBA's sequences and blocks from c[0..3] = cu_q, cu_k, block_size, causal (cu_q ending at
 * rq, cu_k at rk, or anywhere with rk < 0): fills d's cu_q, cu_k, nseq, block_size, causal,
 * first_block and block_seq, whose allocation is returned (NULL with an exception set). */
static int64_t *moba_layout(const char *fn, PyObject *const *c, int64_t rq, int64_t rk, pa_moba_desc *d)
{
    int64_t nk;
    long long bs, causal;
    if (!(d->cu_q = get_cu(fn, "cu_q", c[0], rq, &d->nseq)) || !(d->cu_k = get_cu(fn, "cu_k", c[1], rk, &nk)) ||
        get_int(fn, "block_size", c[2], 1, INT32_MAX, &bs) || get_int(fn, "causal", c[3], 0, 1, &causal))
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

/* Shared by moba_forward and moba_backward: q [Rq, H, Dk], k [Rk, Hk, Dk], v [Rk, Hk, Dv],
 * choice int32 [Rq, H, slots] (each entry -1 or a block of the row's sequence; causal, one
 * before the query's own), cu_q, cu_k, block_size, causal, scale from a[0..2], c[0..5].
 * Fills d, whose first_block and block_seq are one allocation at *blocks (freed by the
 * caller). */
static int moba_desc(const char *fn, PyObject *const *a, PyObject *const *c, int *t,
                     PyArrayObject **q, PyArrayObject **k, PyArrayObject **v,
                     PyArrayObject **choice, pa_moba_desc *d, int64_t **blocks)
{
    if (float_type(fn, "q", a[0], t)) return -1;
    npy_intp three[3] = {-1, -1, -1};
    if (!(*q = get_array(fn, "q", a[0], *t, 3, three, 0))) return -1;
    const npy_intp Rq = PyArray_DIM(*q, 0), H = PyArray_DIM(*q, 1), Dk = PyArray_DIM(*q, 2);
    npy_intp kshape[3] = {-1, -1, Dk};
    if (!(*k = get_array(fn, "k", a[1], *t, 3, kshape, 0))) return -1;
    npy_intp vshape[3] = {PyArray_DIM(*k, 0), PyArray_DIM(*k, 1), -1};
    if (!(*v = get_array(fn, "v", a[2], *t, 3, vshape, 0))) return -1;
    const npy_intp Hk = PyArray_DIM(*k, 1);
    if (Hk < 1 || H % Hk != 0 || Dk < 1 || PyArray_DIM(*v, 2) < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): need H %% Hk == 0 and head dims >= 1", fn);
        return -1;
    }
    npy_intp cshape[3] = {Rq, H, -1};
    if (!(*choice = get_array(fn, "choice", c[0], NPY_INT32, 3, cshape, 0))) return -1;
    memset(d, 0, sizeof *d);
    d->H = H;
    d->Hk = Hk;
    d->Dk = Dk;
    d->Dv = PyArray_DIM(*v, 2);
    d->slots = PyArray_DIM(*choice, 2);
    if (get_double(fn, "scale", c[5], -INFINITY, &d->scale)) return -1;
    int64_t *mem = moba_layout(fn, c + 1, Rq, PyArray_DIM(*k, 0), d);
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
static PyObject *py_moba_select(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_select";
    if (expect_nargs(fn, nargs, 8)) return NULL;
    int t;
    if (float_type(fn, "q", args[0], &t)) return NULL;
    npy_intp three[3] = {-1, -1, -1};
    PyArrayObject *q = get_array(fn, "q", args[0], t, 3, three, 0);
    if (!q) return NULL;
    npy_intp kshape[3] = {-1, -1, PyArray_DIM(q, 2)};
    PyArrayObject *km = get_array(fn, "kmean", args[1], t, 3, kshape, 0);
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
    if (get_int(fn, "slots", args[6], 0, INT32_MAX, &slots)) return NULL;
    d.slots = slots;
    npy_intp cshape[3] = {PyArray_DIM(q, 0), d.H, slots > 0 ? slots : 1};
    PyArrayObject *choice = get_array(fn, "choice", args[7], NPY_INT32, 3, cshape, 1);
    if (!choice) return NULL;
    int64_t *blocks = moba_layout(fn, args + 2, PyArray_DIM(q, 0), -1, &d);
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
static PyObject *py_moba_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_forward";
    if (expect_nargs(fn, nargs, 11)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *choice;
    pa_moba_desc d;
    int64_t *blocks;
    if (moba_desc(fn, args, args + 3, &t, &q, &k, &v, &choice, &d, &blocks)) return NULL;
    npy_intp oshape[3] = {PyArray_DIM(q, 0), d.H, d.Dv};
    PyArrayObject *o = get_array(fn, "o", args[9], t, 3, oshape, 1);
    PyArrayObject *lse = o ? get_array(fn, "lse", args[10], t, 2, oshape, 1) : NULL;
    if (!lse) {
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
static PyObject *py_moba_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "moba_backward";
    if (expect_nargs(fn, nargs, 16)) return NULL;
    int t;
    PyArrayObject *q, *k, *v, *choice;
    pa_moba_desc d;
    int64_t *blocks;
    if (moba_desc(fn, args, args + 7, &t, &q, &k, &v, &choice, &d, &blocks)) return NULL;
    npy_intp oshape[3] = {PyArray_DIM(q, 0), d.H, d.Dv};
    attn_grads g;
    if (attn_grad_arrays(fn, args + 3, args + 13, t, 3, oshape, q, k, v, &g)) {
        free(blocks);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->moba_backward(&d, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), PyArray_DATA(g.o),
                          PyArray_DATA(g.lse), PyArray_DATA(g.dout),
                          g.dlse ? PyArray_DATA(g.dlse) : NULL, PyArray_DATA(choice),
                          PyArray_DATA(g.dq), PyArray_DATA(g.dk), PyArray_DATA(g.dv));
    Py_END_ALLOW_THREADS
    free(blocks);
    return finish(rc);
}

/* ---- feature maps ---- */

static const char *const fm_names[PA_FM_COUNT] = {"identity", "elu1",   "relu",      "softmax",
                                                  "focused",  "taylor", "performer", "cosformer"};

/* Shared by forward and backward: x, then opt = (kind, p, max_len, projection_or_None). Fills
 * d (F included), *W (NULL unless performer) and yshape, the shape y and dy must have. */
static int feature_map_desc(const char *fn, PyObject *xobj, PyObject *const *opt, int *typenum,
                            PyArrayObject **x, PyArrayObject **W, npy_intp *yshape,
                            pa_feature_map_desc *d)
{
    if (float_type(fn, "x", xobj, typenum)) return -1;
    long long kind, p;
    if (get_int(fn, "kind", opt[0], 0, PA_FM_COUNT - 1, &kind)) return -1;
    const int nd = PyArray_NDIM((PyArrayObject *)xobj);
    if (nd < 1 || (kind == PA_FM_COSFORMER && nd != 4)) {
        char got[160];
        format_shape(got, sizeof got, nd, PyArray_DIMS((PyArrayObject *)xobj));
        PyErr_Format(PyExc_ValueError, "%s(): argument 'x' must be %s for kind '%s', got shape %s",
                     fn, kind == PA_FM_COSFORMER ? "4-D [B, T, H, D]" : "at least 1-D [..., D]",
                     fm_names[kind], got);
        return -1;
    }
    npy_intp any[NPY_MAXDIMS];
    for (int i = 0; i < nd; i++) any[i] = -1;
    if (!(*x = get_array(fn, "x", xobj, *typenum, nd, any, 0))) return -1;
    const npy_intp D = PyArray_DIM(*x, nd - 1);
    if (D < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'x' needs a feature dimension D >= 1, got D=%lld",
                     fn, (long long)D);
        return -1;
    }
    /* x exists, so D * 8 fits in npy_intp; taylor's D * D may not */
    if (kind == PA_FM_TAYLOR && D > 3037000498LL) {
        PyErr_Format(PyExc_ValueError, "%s(): kind 'taylor' needs D <= 3037000498, got D=%lld", fn,
                     (long long)D);
        return -1;
    }
    if (get_int(fn, "p", opt[1], 1, INT64_MAX, &p)) return -1;
    double max_len;
    if (get_double(fn, "max_len", opt[2], 0.0, &max_len)) return -1;
    if (max_len <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'max_len' must be > 0, got 0", fn);
        return -1;
    }
    memset(d, 0, sizeof *d);
    *W = NULL;
    if (kind == PA_FM_PERFORMER) {
        npy_intp wshape[2] = {-1, D};
        if (!(*W = get_array(fn, "projection", opt[3], *typenum, 2, wshape, 0))) return -1;
        if (PyArray_DIM(*W, 0) < 1) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): argument 'projection' must have m >= 1 rows, got shape (0, %lld)",
                         fn, (long long)D);
            return -1;
        }
        d->m = PyArray_DIM(*W, 0);
        d->projection = PyArray_DATA(*W);
    } else if (opt[3] != Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'projection' must be None for kind '%s', got %s",
                     fn, fm_names[kind], Py_TYPE(opt[3])->tp_name);
        return -1;
    }
    d->kind = (int)kind;
    d->D = D;
    d->F = kind == PA_FM_TAYLOR      ? 1 + D + D * D
           : kind == PA_FM_PERFORMER ? d->m
           : kind == PA_FM_COSFORMER ? 2 * D
                                     : D;
    d->rows = PyArray_SIZE(*x) / D;
    d->p = p;
    d->max_len = max_len;
    if (kind == PA_FM_COSFORMER) {
        d->T = PyArray_DIM(*x, 1);
        d->H = PyArray_DIM(*x, 2);
    }
    for (int i = 0; i < nd - 1; i++) yshape[i] = PyArray_DIM(*x, i);
    yshape[nd - 1] = d->F;
    return 0;
}

/* feature_map_forward(x, y, kind, p, max_len, projection_or_None) */
static PyObject *py_feature_map_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "feature_map_forward";
    if (expect_nargs(fn, nargs, 6)) return NULL;
    int t;
    PyArrayObject *x, *W;
    npy_intp yshape[NPY_MAXDIMS];
    pa_feature_map_desc d;
    if (feature_map_desc(fn, args[0], args + 2, &t, &x, &W, yshape, &d)) return NULL;
    PyArrayObject *y = get_array(fn, "y", args[1], t, PyArray_NDIM(x), yshape, 1);
    if (!y) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->feature_map_forward(&d, PyArray_DATA(x), PyArray_DATA(y));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* feature_map_backward(x, dy, dx, kind, p, max_len, projection_or_None, dprojection_or_None) */
static PyObject *py_feature_map_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "feature_map_backward";
    if (expect_nargs(fn, nargs, 8)) return NULL;
    int t;
    PyArrayObject *x, *W, *dy, *dx, *dW = NULL;
    npy_intp yshape[NPY_MAXDIMS];
    pa_feature_map_desc d;
    if (feature_map_desc(fn, args[0], args + 3, &t, &x, &W, yshape, &d)) return NULL;
    const int nd = PyArray_NDIM(x);
    if (!(dy = get_array(fn, "dy", args[1], t, nd, yshape, 0)) ||
        !(dx = get_array(fn, "dx", args[2], t, nd, PyArray_DIMS(x), 1)))
        return NULL;
    if (W) {
        if (!(dW = get_array(fn, "dprojection", args[7], t, 2, PyArray_DIMS(W), 1))) return NULL;
    } else if (args[7] != Py_None) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): argument 'dprojection' must be None for kind '%s', got %s", fn,
                     fm_names[d.kind], Py_TYPE(args[7])->tp_name);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->feature_map_backward(&d, PyArray_DATA(x), PyArray_DATA(dy), PyArray_DATA(dx),
                                 dW ? PyArray_DATA(dW) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* ---- the gated linear engine ---- */

/* Shared by forward and backward: a = (q, k, v, gk, gv, h0), opt = (cu, form, chunk, scale).
 * The gate kinds follow from gk's and gv's shapes (None, [B, T, H] or [B, T, H, K]). */
static int linear_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                       PyArrayObject **arr, pa_linear_desc *d)
{
    if (float_type(fn, "q", a[0], typenum)) return -1;
    npy_intp four[4] = {-1, -1, -1, -1};
    if (!(arr[0] = get_array(fn, "q", a[0], *typenum, 4, four, 0))) return -1;
    npy_intp B = PyArray_DIM(arr[0], 0), T = PyArray_DIM(arr[0], 1), Hqk = PyArray_DIM(arr[0], 2),
             K = PyArray_DIM(arr[0], 3);
    npy_intp vshape[4] = {B, T, -1, -1};
    if (!(arr[1] = get_array(fn, "k", a[1], *typenum, 4, PyArray_DIMS(arr[0]), 0)) ||
        !(arr[2] = get_array(fn, "v", a[2], *typenum, 4, vshape, 0)))
        return -1;
    npy_intp H = PyArray_DIM(arr[2], 2), V = PyArray_DIM(arr[2], 3);
    if (K < 1 || V < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): head dims must be >= 1, got K=%lld V=%lld", fn,
                     (long long)K, (long long)V);
        return -1;
    }
    if (Hqk < 1 ? H != 0 : H % Hqk != 0) { /* no q heads only with no v heads */
        PyErr_Format(PyExc_ValueError,
                     "%s(): q and k have %lld heads; v's H=%lld must be a multiple of it", fn,
                     (long long)Hqk, (long long)H);
        return -1;
    }
    memset(d, 0, sizeof *d);
    d->H = H;
    d->Hqk = Hqk;
    d->K = K;
    d->V = V;
    arr[3] = arr[4] = arr[5] = NULL;
    if (a[3] != Py_None) {
        int vec = PyArray_Check(a[3]) && PyArray_NDIM((PyArrayObject *)a[3]) == 4;
        npy_intp gshape[4] = {B, T, H, K};
        if (!(arr[3] = get_array(fn, "gk", a[3], *typenum, vec ? 4 : 3, gshape, 0))) return -1;
        d->gk = vec ? PA_GATE_VECTOR : PA_GATE_SCALAR;
    }
    if (a[4] != Py_None) {
        npy_intp gshape[4] = {B, T, H, V};
        if (!(arr[4] = get_array(fn, "gv", a[4], *typenum, 4, gshape, 0))) return -1;
        d->gv = PA_GATE_VECTOR;
    }
    if (!(d->cu = get_cu(fn, "cu_seqlens", opt[0], B * T, &d->nseq))) return -1;
    if (a[5] != Py_None) {
        npy_intp sshape[4] = {d->nseq, H, K, V};
        if (!(arr[5] = get_array(fn, "initial_state", a[5], *typenum, 4, sshape, 0))) return -1;
    }
    long long form, chunk;
    if (get_int(fn, "form", opt[1], 0, 3, &form) || get_int(fn, "chunk_size", opt[2], 1, 1 << 20, &chunk) ||
        get_double(fn, "scale", opt[3], -INFINITY, &d->scale))
        return -1;
    if (form == PA_FORM_FLASH) {
        PyErr_Format(PyExc_ValueError, "%s(): the linear engine has no flash form", fn);
        return -1;
    }
    d->form = (int)form;
    d->chunk = chunk;
    return 0;
}

static const void *data_or_null(PyArrayObject *a) { return a ? PyArray_DATA(a) : NULL; }

/* An optional output: None, or an array of the given shape. */
static int optional_out(const char *fn, const char *name, PyObject *obj, int typenum, int ndim,
                        const npy_intp *shape, PyArrayObject **out)
{
    *out = NULL;
    if (obj == Py_None) return 0;
    return (*out = get_array(fn, name, obj, typenum, ndim, shape, 1)) ? 0 : -1;
}

/* The [count, K, V] shape of the states a chunk forward keeps (pa_linear_kept_states) */
static void kept_shape(const pa_linear_desc *d, npy_intp *shape)
{
    shape[0] = pa_linear_kept_states(d);
    shape[1] = d->K;
    shape[2] = d->V;
}

/* A new array for the states a chunk forward keeps when `keep` is true, else None (a new
 * reference either way; NULL with an exception set) */
static PyObject *kept_states_new(const pa_linear_desc *d, PyObject *keep, int typenum)
{
    int want = PyObject_IsTrue(keep);
    if (want < 0) return NULL;
    if (!want || d->form != PA_FORM_CHUNK) Py_RETURN_NONE;
    npy_intp kshape[3];
    kept_shape(d, kshape);
    return PyArray_SimpleNew(3, kshape, typenum);
}

/* The kept states given to a backward: None, or what a chunk forward of the same call kept */
static int get_kept_states(const char *fn, const pa_linear_desc *d, PyObject *obj, int typenum,
                           PyArrayObject **kept)
{
    *kept = NULL;
    if (obj == Py_None) return 0;
    if (d->form != PA_FORM_CHUNK) {
        PyErr_Format(PyExc_ValueError, "%s(): kept states exist for the chunk form only", fn);
        return -1;
    }
    npy_intp kshape[3];
    kept_shape(d, kshape);
    return (*kept = get_array(fn, "states", obj, typenum, 3, kshape, 0)) ? 0 : -1;
}

/* The forward's outputs of the linear and delta engines, args[6..8]: o (written), the final
 * state (None: not wanted) and keep. Returns the new array of states to keep, or None (a new
 * reference), or NULL with an exception set. */
static PyObject *engine_outputs(const char *fn, PyObject *const *args, int t, PyArrayObject *q,
                                const pa_linear_desc *d, PyArrayObject **o, PyArrayObject **ht)
{
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d->H, d->V};
    npy_intp sshape[4] = {d->nseq, d->H, d->K, d->V};
    if (!(*o = get_array(fn, "o", args[6], t, 4, oshape, 1)) ||
        optional_out(fn, "final_state", args[7], t, 4, sshape, ht))
        return NULL;
    return kept_states_new(d, args[8], t);
}

/* The forward's result: the kept states, or the error of rc (the states dropped) */
static PyObject *engine_result(PyObject *states, int rc)
{
    if (rc == PA_OK) return states;
    Py_DECREF(states);
    return finish(rc);
}

/* The backward's arrays shared by the linear and delta engines: args[6..11] do, dht (None:
 * zero), the kept states (None: recompute), dq, dk, dv, and args[14] dh0 (None: not wanted) */
typedef struct {
    PyArrayObject *dout, *dht, *kept, *dq, *dk, *dv, *dh0;
} engine_grads;

static int get_engine_grads(const char *fn, PyObject *const *args, int t, PyArrayObject *const *in,
                            const pa_linear_desc *d, engine_grads *g)
{
    npy_intp oshape[4] = {PyArray_DIM(in[0], 0), PyArray_DIM(in[0], 1), d->H, d->V};
    npy_intp sshape[4] = {d->nseq, d->H, d->K, d->V};
    g->dht = NULL;
    if (!(g->dout = get_array(fn, "do", args[6], t, 4, oshape, 0))) return -1;
    if (args[7] != Py_None && !(g->dht = get_array(fn, "dht", args[7], t, 4, sshape, 0))) return -1;
    if (get_kept_states(fn, d, args[8], t, &g->kept)) return -1;
    if (!(g->dq = get_array(fn, "dq", args[9], t, 4, PyArray_DIMS(in[0]), 1)) ||
        !(g->dk = get_array(fn, "dk", args[10], t, 4, PyArray_DIMS(in[1]), 1)) ||
        !(g->dv = get_array(fn, "dv", args[11], t, 4, PyArray_DIMS(in[2]), 1)) ||
        optional_out(fn, "dh0", args[14], t, 4, sshape, &g->dh0))
        return -1;
    return 0;
}

/* The engine's value options a = (beta, skip): None, or beta [B, T, H] (not with a value
 * gate) and skip [H] into arr[0], arr[1] */
static int linear_value_opts(const char *fn, PyObject *const *a, int t, PyArrayObject *const *in,
                             const pa_linear_desc *d, PyArrayObject **arr)
{
    npy_intp bshape[3] = {PyArray_DIM(in[0], 0), PyArray_DIM(in[0], 1), d->H}, hshape[1] = {d->H};
    arr[0] = arr[1] = NULL;
    if (a[0] != Py_None && d->gv != PA_GATE_NONE) {
        PyErr_Format(PyExc_ValueError, "%s(): 'beta' needs gv None", fn);
        return -1;
    }
    if (a[0] != Py_None && !(arr[0] = get_array(fn, "beta", a[0], t, 3, bshape, 0))) return -1;
    if (a[1] != Py_None && !(arr[1] = get_array(fn, "skip", a[1], t, 1, hshape, 0))) return -1;
    return 0;
}

/* linear_forward(q, k, v, gk, gv, h0, o, ht, keep, cu, form, chunk, scale, beta, skip) -> the
 * states kept for the backward (a new array; keep true and the chunk form), or None */
static PyObject *py_linear_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "linear_forward";
    if (expect_nargs(fn, nargs, 15)) return NULL;
    int t;
    PyArrayObject *in[6], *o, *ht, *vopt[2];
    pa_linear_desc d;
    if (linear_desc(fn, args, args + 9, &t, in, &d) ||
        linear_value_opts(fn, args + 13, t, in, &d, vopt))
        return NULL;
    PyObject *states = engine_outputs(fn, args, t, in[0], &d, &o, &ht);
    if (!states) return NULL;
    const pa_kernels *K = kernels_for(t);
    void *kept = states == Py_None ? NULL : PyArray_DATA((PyArrayObject *)states);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->linear_forward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                           data_or_null(in[3]), data_or_null(in[4]), data_or_null(in[5]),
                           data_or_null(vopt[0]), data_or_null(vopt[1]), PyArray_DATA(o),
                           ht ? PyArray_DATA(ht) : NULL, kept);
    Py_END_ALLOW_THREADS
    return engine_result(states, rc);
}

/* linear_backward(q, k, v, gk, gv, h0, do, dht, states, dq, dk, dv, dgk, dgv, dh0, cu, form, chunk,
 *                 scale, beta, skip, dbeta, dskip); states: what linear_forward kept, or None */
static PyObject *py_linear_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "linear_backward";
    if (expect_nargs(fn, nargs, 23)) return NULL;
    int t;
    PyArrayObject *in[6], *vopt[2], *dgk = NULL, *dgv = NULL, *dbeta = NULL, *dskip = NULL;
    engine_grads gr;
    pa_linear_desc d;
    if (linear_desc(fn, args, args + 15, &t, in, &d) ||
        linear_value_opts(fn, args + 19, t, in, &d, vopt) ||
        get_engine_grads(fn, args, t, in, &d, &gr))
        return NULL;
    /* each gradient of these is None exactly when its input is; dskip has beta's shape */
    const char *gnames[4] = {"dgk", "dgv", "dbeta", "dskip"};
    PyArrayObject **gout[4] = {&dgk, &dgv, &dbeta, &dskip};
    PyArrayObject *const gin[4] = {in[3], in[4], vopt[0], vopt[1]};
    PyObject *const gobj[4] = {args[12], args[13], args[21], args[22]};
    npy_intp rshape[3] = {PyArray_DIM(in[0], 0), PyArray_DIM(in[0], 1), d.H};
    for (int g = 0; g < 4; g++) {
        if (!gin[g] && gobj[g] != Py_None) {
            PyErr_Format(PyExc_ValueError, "%s(): argument '%s' must be None without its input",
                         fn, gnames[g]);
            return NULL;
        }
        if (gin[g] && !(*gout[g] = get_array(fn, gnames[g], gobj[g], t, g < 2 ? PyArray_NDIM(gin[g]) : 3,
                                             g < 2 ? PyArray_DIMS(gin[g]) : rshape, 1)))
            return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->linear_backward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                            data_or_null(in[3]), data_or_null(in[4]), data_or_null(in[5]),
                            data_or_null(vopt[0]), data_or_null(vopt[1]),
                            PyArray_DATA(gr.dout), data_or_null(gr.dht), data_or_null(gr.kept),
                            PyArray_DATA(gr.dq), PyArray_DATA(gr.dk), PyArray_DATA(gr.dv),
                            dgk ? PyArray_DATA(dgk) : NULL, dgv ? PyArray_DATA(dgv) : NULL,
                            gr.dh0 ? PyArray_DATA(gr.dh0) : NULL,
                            dbeta ? PyArray_DATA(dbeta) : NULL, dskip ? PyArray_DATA(dskip) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* ---- the delta-rule engine ---- */

/* Shared by forward and backward: a = (q, k, v, g, beta, h0), opt = (cu, form, chunk, scale);
 * the linear engine's description with g as its scalar key gate. */
static int delta_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                      PyArrayObject **arr, PyArrayObject **beta, pa_linear_desc *d)
{
    PyObject *const lin[6] = {a[0], a[1], a[2], a[3], Py_None, a[5]};
    if (a[3] != Py_None && PyArray_Check(a[3]) && PyArray_NDIM((PyArrayObject *)a[3]) != 3) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'g' must be 3-D [B, T, H]", fn);
        return -1;
    }
    if (linear_desc(fn, lin, opt, typenum, arr, d)) return -1;
    if (d->Hqk != d->H) {
        PyErr_Format(PyExc_ValueError, "%s(): v must have q's %lld heads, got %lld", fn,
                     (long long)d->Hqk, (long long)d->H);
        return -1;
    }
    npy_intp bshape[3] = {PyArray_DIM(arr[0], 0), PyArray_DIM(arr[0], 1), d->H};
    return (*beta = get_array(fn, "beta", a[4], *typenum, 3, bshape, 0)) ? 0 : -1;
}

/* delta_forward(q, k, v, g, beta, h0, o, ht, keep, cu, form, chunk, scale) -> the states kept
 * for the backward (keep true and the chunk form), or None */
static PyObject *py_delta_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "delta_forward";
    if (expect_nargs(fn, nargs, 13)) return NULL;
    int t;
    PyArrayObject *in[6], *beta, *o, *ht;
    pa_linear_desc d;
    if (delta_desc(fn, args, args + 9, &t, in, &beta, &d)) return NULL;
    PyObject *states = engine_outputs(fn, args, t, in[0], &d, &o, &ht);
    if (!states) return NULL;
    const pa_kernels *K = kernels_for(t);
    void *kept = states == Py_None ? NULL : PyArray_DATA((PyArrayObject *)states);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->delta_forward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                          data_or_null(in[3]), PyArray_DATA(beta), data_or_null(in[5]),
                          PyArray_DATA(o), ht ? PyArray_DATA(ht) : NULL, kept);
    Py_END_ALLOW_THREADS
    return engine_result(states, rc);
}

/* delta_backward(q, k, v, g, beta, h0, do, dht, states, dq, dk, dv, dg, dbeta, dh0, cu, form,
 *                chunk, scale); states: what delta_forward kept, or None */
static PyObject *py_delta_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "delta_backward";
    if (expect_nargs(fn, nargs, 19)) return NULL;
    int t;
    PyArrayObject *in[6], *beta, *dg = NULL, *dbeta;
    engine_grads gr;
    pa_linear_desc d;
    if (delta_desc(fn, args, args + 15, &t, in, &beta, &d) ||
        get_engine_grads(fn, args, t, in, &d, &gr) ||
        !(dbeta = get_array(fn, "dbeta", args[13], t, 3, PyArray_DIMS(beta), 1)))
        return NULL;
    if (!in[3] != (args[12] == Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'dg' must be given exactly when 'g' is", fn);
        return NULL;
    }
    if (in[3] && !(dg = get_array(fn, "dg", args[12], t, 3, PyArray_DIMS(beta), 1))) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->delta_backward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                           data_or_null(in[3]), PyArray_DATA(beta), data_or_null(in[5]),
                           PyArray_DATA(gr.dout), data_or_null(gr.dht), data_or_null(gr.kept),
                           PyArray_DATA(gr.dq), PyArray_DATA(gr.dk), PyArray_DATA(gr.dv),
                           dg ? PyArray_DATA(dg) : NULL, PyArray_DATA(dbeta),
                           gr.dh0 ? PyArray_DATA(gr.dh0) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* Shared by forward and backward: a = (q, k, v), opt = (cu_q, cu_k, scale). */
static int efficient_desc(const char *fn, PyObject *const *a, PyObject *const *opt,
                          int *typenum, PyArrayObject **arr, pa_efficient_desc *d)
{
    if (float_type(fn, "q", a[0], typenum)) return -1;
    npy_intp four[4] = {-1, -1, -1, -1};
    if (!(arr[0] = get_array(fn, "q", a[0], *typenum, 4, four, 0))) return -1;
    npy_intp B = PyArray_DIM(arr[0], 0), Tq = PyArray_DIM(arr[0], 1), H = PyArray_DIM(arr[0], 2),
             K = PyArray_DIM(arr[0], 3);
    npy_intp kshape[4] = {B, -1, H, K};
    if (!(arr[1] = get_array(fn, "k", a[1], *typenum, 4, kshape, 0))) return -1;
    npy_intp Tk = PyArray_DIM(arr[1], 1);
    npy_intp vshape[4] = {B, Tk, H, -1};
    if (!(arr[2] = get_array(fn, "v", a[2], *typenum, 4, vshape, 0))) return -1;
    memset(d, 0, sizeof *d);
    d->H = H;
    d->K = K;
    d->V = PyArray_DIM(arr[2], 3);
    if (K < 1 || d->V < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): head dims must be >= 1, got K=%lld V=%lld", fn,
                     (long long)K, (long long)d->V);
        return -1;
    }
    int64_t nk;
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", opt[0], B * Tq, &d->nseq)) ||
        !(d->cu_k = get_cu(fn, "cu_seqlens_k", opt[1], B * Tk, &nk)))
        return -1;
    if (nk != d->nseq) {
        PyErr_Format(PyExc_ValueError, "%s(): cu_seqlens_q and cu_seqlens_k must have the same length",
                     fn);
        return -1;
    }
    return get_double(fn, "scale", opt[2], -INFINITY, &d->scale);
}

/* efficient_forward(q, k, v, o, cu_q, cu_k, scale) */
static PyObject *py_efficient_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "efficient_forward";
    if (expect_nargs(fn, nargs, 7)) return NULL;
    int t;
    PyArrayObject *in[3], *o;
    pa_efficient_desc d;
    if (efficient_desc(fn, args, args + 4, &t, in, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(in[0], 0), PyArray_DIM(in[0], 1), d.H, d.V};
    if (!(o = get_array(fn, "o", args[3], t, 4, oshape, 1))) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->efficient_forward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                              PyArray_DATA(o));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* efficient_backward(q, k, v, do, dq, dk, dv, cu_q, cu_k, scale) */
static PyObject *py_efficient_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "efficient_backward";
    if (expect_nargs(fn, nargs, 10)) return NULL;
    int t;
    PyArrayObject *in[3], *dout, *dq, *dk, *dv;
    pa_efficient_desc d;
    if (efficient_desc(fn, args, args + 7, &t, in, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(in[0], 0), PyArray_DIM(in[0], 1), d.H, d.V};
    if (!(dout = get_array(fn, "do", args[3], t, 4, oshape, 0)) ||
        !(dq = get_array(fn, "dq", args[4], t, 4, PyArray_DIMS(in[0]), 1)) ||
        !(dk = get_array(fn, "dk", args[5], t, 4, PyArray_DIMS(in[1]), 1)) ||
        !(dv = get_array(fn, "dv", args[6], t, 4, PyArray_DIMS(in[2]), 1)))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->efficient_backward(&d, PyArray_DATA(in[0]), PyArray_DATA(in[1]), PyArray_DATA(in[2]),
                               PyArray_DATA(dout), PyArray_DATA(dq), PyArray_DATA(dk),
                               PyArray_DATA(dv));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* ---- core building blocks, exposed for tests and benchmarks ---- */

/* gemm(a, b, c, trans_a, trans_b, alpha, beta): c = alpha op(a) op(b) + beta c, 2-D arrays */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "gemm";
    if (expect_nargs(fn, nargs, 7)) return NULL;
    int t;
    if (float_type(fn, "a", args[0], &t)) return NULL;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *a = get_array(fn, "a", args[0], t, 2, any2, 0);
    PyArrayObject *b = a ? get_array(fn, "b", args[1], t, 2, any2, 0) : NULL;
    if (!b) return NULL;
    int ta = PyObject_IsTrue(args[3]), tb = PyObject_IsTrue(args[4]);
    if (ta < 0 || tb < 0) return NULL;
    npy_intp M = PyArray_DIM(a, ta ? 1 : 0), Ka = PyArray_DIM(a, ta ? 0 : 1);
    npy_intp Kb = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1);
    if (Ka != Kb) {
        PyErr_Format(PyExc_ValueError, "gemm(): inner dimensions differ: %lld and %lld",
                     (long long)Ka, (long long)Kb);
        return NULL;
    }
    npy_intp cshape[2] = {M, N};
    PyArrayObject *c = get_array(fn, "c", args[2], t, 2, cshape, 1);
    double alpha, beta;
    if (!c || get_double(fn, "alpha", args[5], -INFINITY, &alpha) ||
        get_double(fn, "beta", args[6], -INFINITY, &beta))
        return NULL;
    npy_intp lda = PyArray_DIM(a, 1), ldb = PyArray_DIM(b, 1);
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->gemm(M, N, Ka, alpha, PyArray_DATA(a), ta ? 1 : lda, ta ? lda : 1, PyArray_DATA(b),
                 tb ? 1 : ldb, tb ? ldb : 1, beta, PyArray_DATA(c), N);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* fn(x, out): a vectorised exp (the general one, or the softmax's for nonpos), elementwise
 * over 1-D arrays */
static PyObject *exp_binding(const char *fn, PyObject *const *args, Py_ssize_t nargs, int nonpos)
{
    if (expect_nargs(fn, nargs, 2)) return NULL;
    int t;
    if (float_type(fn, "x", args[0], &t)) return NULL;
    npy_intp any = -1;
    PyArrayObject *x = get_array(fn, "x", args[0], t, 1, &any, 0);
    if (!x) return NULL;
    npy_intp n = PyArray_DIM(x, 0);
    PyArrayObject *y = get_array(fn, "out", args[1], t, 1, &n, 1);
    if (!y) return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->exp(PyArray_DATA(x), PyArray_DATA(y), n, nonpos);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_exp(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return exp_binding("exp", args, nargs, 0);
}

static PyObject *py_exp_nonpos(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return exp_binding("exp_nonpos", args, nargs, 1);
}

/* The pointwise steps of pyattn.nn (ops/pointwise.c). Each array after the first must have
 * the first's dtype and the shape given; outputs are written in place. */

/* args[0..n) as arrays of dtype t and shape (nd, shape), the last `outputs` writeable; a[i]
 * NULL for a None where bit i of `optional` is set. 0, or -1 with the error set. */
static int shaped_arrays(const char *fn, PyObject *const *args, const char *const *names, int n,
                         int outputs, unsigned optional, int t, int nd, const npy_intp *shape,
                         PyArrayObject **a)
{
    for (int i = 0; i < n; i++) {
        a[i] = NULL;
        if ((optional >> i & 1) && args[i] == Py_None) continue;
        if (!(a[i] = get_array(fn, names[i], args[i], t, nd, shape, i >= n - outputs))) return -1;
    }
    return 0;
}

/* shaped_arrays with args[0]'s float dtype and shape (args[0] is never optional); the element
 * count, or -1 with the error set. */
static npy_intp same_shape_arrays(const char *fn, PyObject *const *args, const char *const *names,
                                  int n, int outputs, unsigned optional, PyArrayObject **a)
{
    int t;
    if (float_type(fn, names[0], args[0], &t)) return -1;
    PyArrayObject *first = (PyArrayObject *)args[0];
    if (shaped_arrays(fn, args, names, n, outputs, optional & ~1u, t, PyArray_NDIM(first),
                      PyArray_DIMS(first), a))
        return -1;
    return PyArray_SIZE(a[0]);
}

/* silu(x, mul, y, s): s = sigmoid(x), y = x s, times mul (SwiGLU's product); mul None: no
 * factor; y None: the sigmoid only; any shape */
static PyObject *py_silu(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[4] = {"x", "mul", "y", "s"};
    PyArrayObject *a[4];
    npy_intp n;
    if (expect_nargs("silu", nargs, 4) ||
        (n = same_shape_arrays("silu", args, names, 4, 2, 1u << 1 | 1u << 2, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[0]));
    Py_BEGIN_ALLOW_THREADS
    K->silu_forward(n, PyArray_DATA(a[0]), data_or_null(a[1]), a[2] ? PyArray_DATA(a[2]) : NULL,
                    PyArray_DATA(a[3]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_backward(dy, y, s, dx): dx = dy (s + y (1 - s)); any shape */
static PyObject *py_silu_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[4] = {"dy", "y", "s", "dx"};
    PyArrayObject *a[4];
    npy_intp n;
    if (expect_nargs("silu_backward", nargs, 4) ||
        (n = same_shape_arrays("silu_backward", args, names, 4, 1, 0, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[0]));
    Py_BEGIN_ALLOW_THREADS
    K->silu_backward(n, PyArray_DATA(a[0]), PyArray_DATA(a[1]), PyArray_DATA(a[2]),
                     PyArray_DATA(a[3]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* swiglu_backward(dh, a, b, s, da, db); any shape */
static PyObject *py_swiglu_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[6] = {"dh", "a", "b", "s", "da", "db"};
    PyArrayObject *a[6];
    npy_intp n;
    if (expect_nargs("swiglu_backward", nargs, 6) ||
        (n = same_shape_arrays("swiglu_backward", args, names, 6, 2, 0, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[0]));
    Py_BEGIN_ALLOW_THREADS
    K->swiglu_backward(n, PyArray_DATA(a[0]), PyArray_DATA(a[1]), PyArray_DATA(a[2]),
                       PyArray_DATA(a[3]), PyArray_DATA(a[4]), PyArray_DATA(a[5]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x [rows, d], eps, xhat [rows, d], rstd [rows], mean) */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rms_norm";
    int t;
    double eps;
    int mean;
    if (expect_nargs(fn, nargs, 5) || float_type(fn, "x", args[0], &t) ||
        (mean = PyObject_IsTrue(args[4])) < 0)
        return NULL;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *x = get_array(fn, "x", args[0], t, 2, any2, 0);
    if (!x || get_double(fn, "eps", args[1], 0.0, &eps)) return NULL;
    PyArrayObject *xhat = get_array(fn, "xhat", args[2], t, 2, PyArray_DIMS(x), 1);
    PyArrayObject *rstd = xhat ? get_array(fn, "rstd", args[3], t, 1, PyArray_DIMS(x), 1) : NULL;
    if (!rstd) return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->rms_norm_forward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), eps, mean, PyArray_DATA(x),
                        PyArray_DATA(xhat), PyArray_DATA(rstd));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm_backward(dxhat [rows, d], xhat [rows, d], rstd [rows], dx [rows, d], mean) */
static PyObject *py_rms_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rms_norm_backward";
    int t;
    int mean;
    if (expect_nargs(fn, nargs, 5) || float_type(fn, "dxhat", args[0], &t) ||
        (mean = PyObject_IsTrue(args[4])) < 0)
        return NULL;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *g = get_array(fn, "dxhat", args[0], t, 2, any2, 0);
    PyArrayObject *h = g ? get_array(fn, "xhat", args[1], t, 2, PyArray_DIMS(g), 0) : NULL;
    PyArrayObject *r = h ? get_array(fn, "rstd", args[2], t, 1, PyArray_DIMS(g), 0) : NULL;
    PyArrayObject *dx = r ? get_array(fn, "dx", args[3], t, 2, PyArray_DIMS(g), 1) : NULL;
    if (!dx) return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->rms_norm_backward(PyArray_DIM(g, 0), PyArray_DIM(g, 1), mean, PyArray_DATA(g),
                         PyArray_DATA(h), PyArray_DATA(r), PyArray_DATA(dx));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* adamw_step(g, p, m, v, b1, b2, eps, decay, lr_c1, c2): p, m, v updated in place; any shape */
static PyObject *py_adamw_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[4] = {"g", "p", "m", "v"};
    static const char *const scalars[6] = {"b1", "b2", "eps", "decay", "lr_c1", "c2"};
    PyArrayObject *a[4];
    double s[6];
    npy_intp n;
    if (expect_nargs("adamw_step", nargs, 10) ||
        (n = same_shape_arrays("adamw_step", args, names, 4, 3, 0, a)) < 0)
        return NULL;
    for (int i = 0; i < 6; i++) /* decay = 1 - lr wd may be negative, the others not */
        if (get_double("adamw_step", scalars[i], args[4 + i], i == 3 ? -HUGE_VAL : 0.0, &s[i]))
            return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[0]));
    Py_BEGIN_ALLOW_THREADS
    K->adamw_step(n, PyArray_DATA(a[0]), PyArray_DATA(a[1]), PyArray_DATA(a[2]),
                  PyArray_DATA(a[3]), s[0], s[1], s[2], s[3], s[4], s[5]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rotary(x [rows, H, D], cos [n, D], sin [n, D], sign, y [rows, H, D]): rows a multiple of
 * n, row r rotated by the tables' row r % n; D even; sign +1 or -1 */
static PyObject *py_rotary(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rotary";
    int t;
    long long sign;
    if (expect_nargs(fn, nargs, 5) || float_type(fn, "x", args[0], &t)) return NULL;
    npy_intp any3[3] = {-1, -1, -1};
    PyArrayObject *x = get_array(fn, "x", args[0], t, 3, any3, 0);
    if (!x) return NULL;
    npy_intp tshape[2] = {-1, PyArray_DIM(x, 2)};
    PyArrayObject *c = get_array(fn, "cos", args[1], t, 2, tshape, 0);
    if (c) tshape[0] = PyArray_DIM(c, 0);
    PyArrayObject *sn = c ? get_array(fn, "sin", args[2], t, 2, tshape, 0) : NULL;
    if (!sn || get_int(fn, "sign", args[3], -1, 1, &sign)) return NULL;
    PyArrayObject *y = get_array(fn, "y", args[4], t, 3, PyArray_DIMS(x), 1);
    if (!y) return NULL;
    npy_intp rows = PyArray_DIM(x, 0), n = tshape[0], D = PyArray_DIM(x, 2);
    if (sign == 0 || D % 2 || (rows > 0 && (n == 0 || rows % n))) {
        PyErr_Format(PyExc_ValueError,
                     "rotary(): needs sign +-1, an even D and rows a multiple of the tables' "
                     "rows; got sign %lld, D %lld, %lld rows and %lld table rows",
                     sign, (long long)D, (long long)rows, (long long)n);
        return NULL;
    }
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->rotary(rows, PyArray_DIM(x, 1), D, n, PyArray_DATA(c), PyArray_DATA(sn), (int)sign,
              PyArray_DATA(x), PyArray_DATA(y));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The arrays of a ShortConv call: x [B, T, C], state None or [B, K-1, C], w [K, C], bias None
 * or [C] (None: NULL); -1 with the error set when one is wrong. */
static int conv_inputs(const char *fn, PyObject *const *args, int t, PyArrayObject **x,
                       PyArrayObject **state, PyArrayObject **w, PyArrayObject **bias)
{
    npy_intp any3[3] = {-1, -1, -1}, wshape[2] = {-1, -1};
    if (!(*x = get_array(fn, "x", args[0], t, 3, any3, 0))) return -1;
    wshape[1] = PyArray_DIM(*x, 2);
    if (!(*w = get_array(fn, "w", args[2], t, 2, wshape, 0))) return -1;
    npy_intp K = PyArray_DIM(*w, 0);
    if (K < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): the kernel needs at least one tap, got w of %lld",
                     fn, (long long)K);
        return -1;
    }
    npy_intp sshape[3] = {PyArray_DIM(*x, 0), K - 1, PyArray_DIM(*x, 2)};
    *state = *bias = NULL;
    if (args[1] != Py_None && !(*state = get_array(fn, "state", args[1], t, 3, sshape, 0)))
        return -1;
    if (args[3] != Py_None && !(*bias = get_array(fn, "bias", args[3], t, 1, sshape + 2, 0)))
        return -1;
    return 0;
}

/* short_conv(x, state, w, bias, y, s): y = silu(u), s = sigmoid(u) of the causal depthwise
 * convolution u (see kernels.h) */
static PyObject *py_short_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "short_conv";
    int t;
    PyArrayObject *x, *state, *w, *bias, *ys[2];
    static const char *const names[2] = {"y", "s"};
    if (expect_nargs(fn, nargs, 6) || float_type(fn, "x", args[0], &t) ||
        conv_inputs(fn, args, t, &x, &state, &w, &bias) ||
        shaped_arrays(fn, args + 4, names, 2, 2, 0, t, 3, PyArray_DIMS(x), ys))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->short_conv_forward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), PyArray_DIM(x, 2),
                          PyArray_DIM(w, 0), PyArray_DATA(x), data_or_null(state),
                          PyArray_DATA(w), data_or_null(bias), PyArray_DATA(ys[0]),
                          PyArray_DATA(ys[1]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* short_conv_backward(x, state, w, bias, dy, y, s, dx, dw, dbias): dx, dw [K, C] and dbias
 * (None: not wanted) overwritten */
static PyObject *py_short_conv_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "short_conv_backward";
    int t;
    PyArrayObject *x, *state, *w, *bias, *a[4], *dw, *db = NULL;
    static const char *const names[4] = {"dy", "y", "s", "dx"};
    if (expect_nargs(fn, nargs, 10) || float_type(fn, "x", args[0], &t) ||
        conv_inputs(fn, args, t, &x, &state, &w, &bias) ||
        shaped_arrays(fn, args + 4, names, 4, 1, 0, t, 3, PyArray_DIMS(x), a))
        return NULL;
    if (!(dw = get_array(fn, "dw", args[8], t, 2, PyArray_DIMS(w), 1)) ||
        (args[9] != Py_None && !(db = get_array(fn, "dbias", args[9], t, 1, PyArray_DIMS(x) + 2, 1))))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->short_conv_backward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), PyArray_DIM(x, 2),
                                PyArray_DIM(w, 0), PyArray_DATA(x), data_or_null(state),
                                PyArray_DATA(w), PyArray_DATA(a[0]), PyArray_DATA(a[1]),
                                PyArray_DATA(a[2]), PyArray_DATA(a[3]), PyArray_DATA(dw),
                                db ? PyArray_DATA(db) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* fma_peak(double, seconds, threads) -> GFLOP/s of independent FMA chains */
static PyObject *py_fma_peak(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("fma_peak", nargs, 3)) return NULL;
    int is_double = PyObject_IsTrue(args[0]);
    double seconds;
    long long threads;
    if (is_double < 0 || get_double("fma_peak", "seconds", args[1], 0.0, &seconds) ||
        get_int("fma_peak", "threads", args[2], 1, 4096, &threads))
        return NULL;
    const pa_kernels *K = pa_select_kernels(is_double);
    double g;
    Py_BEGIN_ALLOW_THREADS
    g = K->fma_peak(seconds, (int)threads);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(g);
}

/* read_bandwidth(seconds, threads, bytes) -> GB/s reading a buffer of that size */
static PyObject *py_read_bandwidth(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "read_bandwidth";
    if (expect_nargs(fn, nargs, 3)) return NULL;
    double seconds;
    long long threads, bytes;
    if (get_double(fn, "seconds", args[0], 0.0, &seconds) ||
        get_int(fn, "threads", args[1], 1, 4096, &threads) ||
        get_int(fn, "bytes", args[2], 1 << 20, 1LL << 40, &bytes))
        return NULL;
    double g;
    Py_BEGIN_ALLOW_THREADS
    g = kernels_for(NPY_FLOAT32)->read_bandwidth(seconds, (int)threads, bytes);
    Py_END_ALLOW_THREADS
    if (g < 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(g);
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long n;
    if (expect_nargs("set_num_threads", nargs, 1) ||
        get_int("set_num_threads", "n", args[0], 1, 4096, &n))
        return NULL;
    pa_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("get_num_threads", nargs, 0)) return NULL;
    return PyLong_FromLong(pa_get_num_threads());
}

/* NumPy's data-memory handler over array_cache.c; ARRAY_CACHE is its capsule (each array
 * made through it holds a reference; the handler itself is static). */
static PyDataMem_Handler array_cache_handler = {
    "pyattn_array_cache",
    1,
    {NULL, pa_cache_malloc, pa_cache_calloc, pa_cache_realloc, pa_cache_free},
};

static PyObject *py_set_data_handler(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("set_data_handler", nargs, 1)) return NULL;
    if (args[0] != Py_None && !PyCapsule_IsValid(args[0], "mem_handler")) {
        PyErr_SetString(PyExc_TypeError,
                        "set_data_handler: handler must be a NumPy 'mem_handler' capsule or None");
        return NULL;
    }
    return PyDataMem_SetHandler(args[0] == Py_None ? NULL : args[0]);
}

static PyObject *py_array_cache_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("array_cache_release", nargs, 0)) return NULL;
    return PyLong_FromSize_t(pa_cache_release());
}

static PyObject *py_array_cache_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("array_cache_kept", nargs, 0)) return NULL;
    return PyLong_FromSize_t(pa_cache_kept());
}

static PyObject *py_build_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("build_info", nargs, 0)) return NULL;
    PyObject *isas = PyList_New(0);
    if (!isas) return NULL;
    static const char *const all[] = {"avx512", "avx2", "generic"};
    for (int i = 0; i < 3; i++) {
        if (!pa_kernels_for_isa(all[i], 0)) continue;
        PyObject *s = PyUnicode_FromString(all[i]);
        if (!s || PyList_Append(isas, s)) {
            Py_XDECREF(s);
            Py_DECREF(isas);
            return NULL;
        }
        Py_DECREF(s);
    }
    return Py_BuildValue("{s:s,s:N,s:s,s:O,s:i}", "isa", pa_selected_isa(), "isas_available",
                         isas, "compiler", PYATTN_COMPILER, "openmp",
                         pa_openmp_enabled() ? Py_True : Py_False, "num_threads",
                         pa_get_num_threads());
}

static PyMethodDef core_methods[] = {
    {"softmax_forward", (PyCFunction)(void (*)(void))py_softmax_forward, METH_FASTCALL,
     "softmax_forward(q, k, v, o, lse, cu_q, cu_k, form, causal, window_left, window_right, "
     "sinks, alibi_slopes, softcap, scale)"},
    {"softmax_backward", (PyCFunction)(void (*)(void))py_softmax_backward, METH_FASTCALL,
     "softmax_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, cu_q, cu_k, form, causal, "
     "window_left, window_right, sinks, alibi_slopes, softcap, scale)"},
    {"softmax_decode", (PyCFunction)(void (*)(void))py_softmax_decode, METH_FASTCALL,
     "softmax_decode(q, k, v, o, lse, cu_q, start, end, block_table, num_splits, colsum, causal, "
     "window_left, window_right, sinks, alibi_slopes, softcap, scale): few queries against keys "
     "in place in a cache (contiguous rows start .. end, or paged through block_table)"},
    {"softmax_decode_backward", (PyCFunction)(void (*)(void))py_softmax_decode_backward,
     METH_FASTCALL,
     "softmax_decode_backward(q, k, v, o, lse, do, dlse, dq, dk, dv, cu_q, start, end, "
     "block_table, causal, window_left, window_right, sinks, alibi_slopes, softcap, scale): the "
     "backward of softmax_decode over the same keys"},
    {"dsa_select", (PyCFunction)(void (*)(void))py_dsa_select, METH_FASTCALL,
     "dsa_select(index_q, index_k, index_w, cu_q, cu_k, top_k, causal, rows, count, nan): each "
     "query's top_k visible keys by the lightning indexer's scores"},
    {"moba_select", (PyCFunction)(void (*)(void))py_moba_select, METH_FASTCALL,
     "moba_select(q, kmean, cu_q, cu_k, block_size, causal, slots, choice): MoBA's choice of "
     "blocks"},
    {"moba_forward", (PyCFunction)(void (*)(void))py_moba_forward, METH_FASTCALL,
     "moba_forward(q, k, v, choice, cu_q, cu_k, block_size, causal, scale, o, lse): attention of each "
     "(query, head) to the whole key blocks it chose"},
    {"moba_backward", (PyCFunction)(void (*)(void))py_moba_backward, METH_FASTCALL,
     "moba_backward(q, k, v, o, lse, do, dlse, choice, cu_q, cu_k, block_size, causal, scale, dq, dk, "
     "dv): the backward of moba_forward"},
    {"feature_map_forward", (PyCFunction)(void (*)(void))py_feature_map_forward, METH_FASTCALL,
     "feature_map_forward(x, y, kind, p, max_len, projection): y = phi(x) in place. x [..., D] "
     "(cosformer: [B, T, H, D]); y [..., F]; kind one of FM_*; p (int >= 1, focused) and max_len "
     "(float > 0, cosformer) are checked for every kind; projection W [m, D] for performer, "
     "else None"},
    {"feature_map_backward", (PyCFunction)(void (*)(void))py_feature_map_backward, METH_FASTCALL,
     "feature_map_backward(x, dy, dx, kind, p, max_len, projection, dprojection): dx (and for "
     "performer dprojection [m, D], else None) written in place from dy [..., F]"},
    {"linear_forward", (PyCFunction)(void (*)(void))py_linear_forward, METH_FASTCALL,
     "linear_forward(q, k, v, gk, gv, h0, o, ht, keep, cu, form, chunk, scale, beta, skip): the "
     "gated linear engine; gk None, [B, T, H] or [B, T, H, K]; gv None or [B, T, H, V]; h0, ht "
     "None or [N, H, K, V]; beta None or [B, T, H] (v's rows read as beta_t v_t; not with gv); "
     "skip None or [H] (o_t += skip_h v_t); o written; returns the states kept for "
     "linear_backward (keep true, chunk form) or None"},
    {"delta_forward", (PyCFunction)(void (*)(void))py_delta_forward, METH_FASTCALL,
     "delta_forward(q, k, v, g, beta, h0, o, ht, keep, cu, form, chunk, scale): the delta-rule "
     "engine; g None or [B, T, H]; beta [B, T, H]; h0, ht None or [N, H, K, V]; o written; "
     "returns the states kept for delta_backward (keep true, chunk form) or None"},
    {"delta_backward", (PyCFunction)(void (*)(void))py_delta_backward, METH_FASTCALL,
     "delta_backward(q, k, v, g, beta, h0, do, dht, states, dq, dk, dv, dg, dbeta, dh0, cu, "
     "form, chunk, scale): gradients written in place; dg None exactly when g is; states: what "
     "delta_forward kept, or None"},
    {"linear_backward", (PyCFunction)(void (*)(void))py_linear_backward, METH_FASTCALL,
     "linear_backward(q, k, v, gk, gv, h0, do, dht, states, dq, dk, dv, dgk, dgv, dh0, cu, "
     "form, chunk, scale, beta, skip, dbeta, dskip): gradients written in place; states: what "
     "linear_forward kept, or None; dgk, dgv, dbeta, dskip None exactly when gk, gv, beta, skip "
     "are; dskip [B, T, H] holds the rows' do_t . v_t"},
    {"efficient_forward", (PyCFunction)(void (*)(void))py_efficient_forward, METH_FASTCALL,
     "efficient_forward(q, k, v, o, cu_q, cu_k, scale)"},
    {"efficient_backward", (PyCFunction)(void (*)(void))py_efficient_backward, METH_FASTCALL,
     "efficient_backward(q, k, v, do, dq, dk, dv, cu_q, cu_k, scale)"},
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(a, b, c, trans_a, trans_b, alpha, beta): c = alpha op(a) op(b) + beta c"},
    {"exp", (PyCFunction)(void (*)(void))py_exp, METH_FASTCALL,
     "exp(x, out): the vectorised exp of the kernels"},
    {"exp_nonpos", (PyCFunction)(void (*)(void))py_exp_nonpos, METH_FASTCALL,
     "exp_nonpos(x, out): the softmax kernels' exp, for x <= 0 (correct up to 88.37 in float, "
     "709.43 in double; 0 below -87.6, -708.7)"},
    {"silu", (PyCFunction)(void (*)(void))py_silu, METH_FASTCALL,
     "silu(x, mul, y, s): s = sigmoid(x), y = x s times mul (None: no factor; y None: s only)"},
    {"silu_backward", (PyCFunction)(void (*)(void))py_silu_backward, METH_FASTCALL,
     "silu_backward(dy, y, s, dx): dx = dy (s + y (1 - s))"},
    {"swiglu_backward", (PyCFunction)(void (*)(void))py_swiglu_backward, METH_FASTCALL,
     "swiglu_backward(dh, a, b, s, da, db): da = dh b silu'(a), db = dh silu(a)"},
    {"adamw_step", (PyCFunction)(void (*)(void))py_adamw_step, METH_FASTCALL,
     "adamw_step(g, p, m, v, b1, b2, eps, decay, lr_c1, c2): one AdamW step of p, m, v in place"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, eps, xhat, rstd, mean): rstd = 1 / sqrt(mean(x^2) + eps) per row (sum(x^2) "
     "when not mean), xhat = x rstd"},
    {"rms_norm_backward", (PyCFunction)(void (*)(void))py_rms_norm_backward, METH_FASTCALL,
     "rms_norm_backward(dxhat, xhat, rstd, dx, mean): dx = (dxhat - xhat mean(dxhat xhat)) rstd "
     "(the sum when not mean)"},
    {"rotary", (PyCFunction)(void (*)(void))py_rotary, METH_FASTCALL,
     "rotary(x, cos, sin, sign, y): rotary embedding of x [rows, H, D] by tables [n, D]"},
    {"short_conv", (PyCFunction)(void (*)(void))py_short_conv, METH_FASTCALL,
     "short_conv(x, state, w, bias, y, s): causal depthwise convolution [K, C] and SiLU"},
    {"short_conv_backward", (PyCFunction)(void (*)(void))py_short_conv_backward, METH_FASTCALL,
     "short_conv_backward(x, state, w, bias, dy, y, s, dx, dw, dbias)"},
    {"fma_peak", (PyCFunction)(void (*)(void))py_fma_peak, METH_FASTCALL,
     "fma_peak(double, seconds, threads) -> GFLOP/s of independent FMA chains"},
    {"read_bandwidth", (PyCFunction)(void (*)(void))py_read_bandwidth, METH_FASTCALL,
     "read_bandwidth(seconds, threads, bytes) -> GB/s reading a buffer of that size"},
    {"set_num_threads", (PyCFunction)(void (*)(void))py_set_num_threads, METH_FASTCALL,
     "set_num_threads(n)"},
    {"get_num_threads", (PyCFunction)(void (*)(void))py_get_num_threads, METH_FASTCALL,
     "get_num_threads() -> int"},
    {"set_data_handler", (PyCFunction)(void (*)(void))py_set_data_handler, METH_FASTCALL,
     "set_data_handler(handler) -> previous: NumPy's data-memory handler for the current "
     "context (a 'mem_handler' capsule such as ARRAY_CACHE, or None for NumPy's default)"},
    {"array_cache_release", (PyCFunction)(void (*)(void))py_array_cache_release, METH_FASTCALL,
     "array_cache_release() -> bytes: frees the blocks ARRAY_CACHE keeps"},
    {"array_cache_kept", (PyCFunction)(void (*)(void))py_array_cache_kept, METH_FASTCALL,
     "array_cache_kept() -> bytes: what ARRAY_CACHE keeps now"},
    {"build_info", (PyCFunction)(void (*)(void))py_build_info, METH_FASTCALL,
     "build_info() -> dict"},
    {NULL, NULL, 0, NULL},
};

static int core_exec(PyObject *m)
{
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    pa_dispatch_init();
    pa_parallel_init();
    pa_cache_init();
    PyObject *cache = PyCapsule_New(&array_cache_handler, "mem_handler", NULL);
    if (!cache || PyModule_AddObject(m, "ARRAY_CACHE", cache)) {
        Py_XDECREF(cache);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "FORM_PARALLEL", PA_FORM_PARALLEL) ||
        PyModule_AddIntConstant(m, "FORM_FLASH", PA_FORM_FLASH) ||
        PyModule_AddIntConstant(m, "FORM_RECURRENT", PA_FORM_RECURRENT) ||
        PyModule_AddIntConstant(m, "FORM_CHUNK", PA_FORM_CHUNK))
        return -1;
    for (int k = 0; k < PA_FM_COUNT; k++) {
        char name[32];
        snprintf(name, sizeof name, "FM_%s", fm_names[k]);
        for (char *c = name + 3; *c; c++)
            if (*c >= 'a' && *c <= 'z') *c = (char)(*c - 'a' + 'A');
        if (PyModule_AddIntConstant(m, name, k)) return -1;
    }
    return 0;
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pyattn._core",
    .m_doc = "pyattn's C kernels. Use the pyattn package; these entry points check buffers but "
             "take every argument positionally.",
    .m_size = 0,
    .m_methods = core_methods,
    .m_slots = core_slots,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
