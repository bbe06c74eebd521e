/* The argument helpers of pyattn._core's binding (see args.h). */
#include "args.h"

#include <math.h>
#include <string.h>

#include "core/parallel.h"

int expect_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments, got %zd", fn, want, nargs);
    return -1;
}

void format_shape(char *buf, size_t size, int ndim, const npy_intp *shape)
{
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

PyArrayObject *get_array(const char *fn, const char *name, PyObject *obj, int typenum, int ndim,
                         const npy_intp *shape, int writeable)
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

PyArrayObject *get_float_array(const char *fn, const char *name, PyObject *obj, int ndim,
                               int *typenum)
{
    npy_intp any[NPY_MAXDIMS];
    for (int i = 0; i < ndim; i++) any[i] = -1;
    if (float_type(fn, name, obj, typenum)) return NULL;
    return get_array(fn, name, obj, *typenum, ndim, any, 0);
}

int get_int(const char *fn, const char *name, PyObject *obj, long long lo, long long hi,
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

int get_double(const char *fn, const char *name, PyObject *obj, double lo, double *out)
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

int float_type(const char *fn, const char *name, PyObject *obj, int *typenum)
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

const int64_t *get_cu(const char *fn, const char *name, PyObject *obj, int64_t rows,
                      int64_t *nseq)
{
    npy_intp any = -1;
    PyArrayObject *a = get_array(fn, name, obj, NPY_INT64, 1, &any, 0);
    if (!a) return NULL;
    const int64_t *cu = PyArray_DATA(a);
    int64_t n = PyArray_DIM(a, 0) - 1;
    int ok = n >= 0 && cu[0] == 0 && (rows < 0 || cu[n] == rows);
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

int optional_out(const char *fn, const char *name, PyObject *obj, int typenum, int ndim,
                 const npy_intp *shape, PyArrayObject **out)
{
    *out = NULL;
    if (obj == Py_None) return 0;
    return (*out = get_array(fn, name, obj, typenum, ndim, shape, 1)) ? 0 : -1;
}

PyObject *finish(int rc)
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

/* ---- attention outputs and gradients ---- */

int attn_outputs(const char *fn, PyObject *o_obj, PyObject *lse_obj, int t, int nd,
                 const npy_intp *oshape, PyArrayObject **o, PyArrayObject **lse)
{
    return (*o = get_array(fn, "o", o_obj, t, nd, oshape, 1)) &&
                   (*lse = get_array(fn, "lse", lse_obj, t, nd - 1, oshape, 1))
               ? 0
               : -1;
}

int attn_grad_arrays(const char *fn, PyObject *const *a, PyObject *const *g, int t, int nd,
                     const npy_intp *oshape, PyArrayObject *q, PyArrayObject *k,
                     PyArrayObject *v, attn_grads *r)
{
    r->dlse = NULL;
    return (r->o = get_array(fn, "o", a[GRAD_O], t, nd, oshape, 0)) &&
                   (r->lse = get_array(fn, "lse", a[GRAD_LSE], t, nd - 1, oshape, 0)) &&
                   (r->dout = get_array(fn, "do", a[GRAD_DO], t, nd, oshape, 0)) &&
                   (a[GRAD_DLSE] == Py_None ||
                    (r->dlse = get_array(fn, "dlse", a[GRAD_DLSE], t, nd - 1, oshape, 0))) &&
                   (r->dq = get_array(fn, "dq", g[GRAD_DQ], t, nd, PyArray_DIMS(q), 1)) &&
                   (r->dk = get_array(fn, "dk", g[GRAD_DK], t, nd, PyArray_DIMS(k), 1)) &&
                   (r->dv = get_array(fn, "dv", g[GRAD_DV], t, nd, PyArray_DIMS(v), 1))
               ? 0
               : -1;
}

int get_bf16_products(PyObject *obj, int typenum, int *out)
{
    int bf16 = PyObject_IsTrue(obj);
    if (bf16 < 0) return -1;
    *out = bf16 && typenum == NPY_FLOAT32;
    return 0;
}

/* ---- the linear and delta engines ---- */

int linear_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                PyArrayObject **arr, pa_linear_desc *d)
{
    if (!(arr[ENG_Q] = get_float_array(fn, "q", a[ENG_Q], 4, typenum))) return -1;
    PyArrayObject *q = arr[ENG_Q];
    npy_intp B = PyArray_DIM(q, 0), T = PyArray_DIM(q, 1), Hqk = PyArray_DIM(q, 2),
             K = PyArray_DIM(q, 3);
    npy_intp vshape[4] = {B, T, -1, -1};
    if (!(arr[ENG_K] = get_array(fn, "k", a[ENG_K], *typenum, 4, PyArray_DIMS(q), 0)) ||
        !(arr[ENG_V] = get_array(fn, "v", a[ENG_V], *typenum, 4, vshape, 0)))
        return -1;
    npy_intp H = PyArray_DIM(arr[ENG_V], 2), V = PyArray_DIM(arr[ENG_V], 3);
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
    arr[ENG_GK] = arr[ENG_GV] = arr[ENG_H0] = NULL;
    if (a[ENG_GK] != Py_None) {
        int vec = PyArray_Check(a[ENG_GK]) && PyArray_NDIM((PyArrayObject *)a[ENG_GK]) == 4;
        npy_intp gshape[4] = {B, T, H, K};
        if (!(arr[ENG_GK] = get_array(fn, "gk", a[ENG_GK], *typenum, vec ? 4 : 3, gshape, 0)))
            return -1;
        d->gk = vec ? PA_GATE_VECTOR : PA_GATE_SCALAR;
    }
    if (a[ENG_GV] != Py_None) {
        npy_intp gshape[4] = {B, T, H, V};
        if (!(arr[ENG_GV] = get_array(fn, "gv", a[ENG_GV], *typenum, 4, gshape, 0))) return -1;
        d->gv = PA_GATE_VECTOR;
    }
    if (!(d->cu = get_cu(fn, "cu_seqlens", opt[ENG_CU], B * T, &d->nseq))) return -1;
    if (a[ENG_H0] != Py_None) {
        npy_intp sshape[4] = {d->nseq, H, K, V};
        if (!(arr[ENG_H0] = get_array(fn, "initial_state", a[ENG_H0], *typenum, 4, sshape, 0)))
            return -1;
    }
    long long form, chunk;
    if (get_int(fn, "form", opt[ENG_FORM], 0, 3, &form) ||
        get_int(fn, "chunk_size", opt[ENG_CHUNK], 1, 1 << 20, &chunk) ||
        get_double(fn, "scale", opt[ENG_SCALE], -INFINITY, &d->scale))
        return -1;
    if (form == PA_FORM_FLASH) {
        PyErr_Format(PyExc_ValueError, "%s(): the linear engine has no flash form", fn);
        return -1;
    }
    d->form = (int)form;
    d->chunk = chunk;
    return 0;
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

PyObject *engine_outputs(const char *fn, PyObject *const *out, int t, PyArrayObject *q,
                         const pa_linear_desc *d, PyArrayObject **o, PyArrayObject **ht)
{
    npy_intp oshape[4] = {PyArray_DIM(q, 0), PyArray_DIM(q, 1), d->H, d->V};
    npy_intp sshape[4] = {d->nseq, d->H, d->K, d->V};
    if (!(*o = get_array(fn, "o", out[ENG_OUT_O], t, 4, oshape, 1)) ||
        optional_out(fn, "final_state", out[ENG_OUT_HT], t, 4, sshape, ht))
        return NULL;
    return kept_states_new(d, out[ENG_OUT_KEEP], t);
}

PyObject *engine_result(PyObject *states, int rc)
{
    if (rc == PA_OK) return states;
    Py_DECREF(states);
    return finish(rc);
}

int get_engine_grads(const char *fn, PyObject *const *g, PyObject *dh0, int t,
                     PyArrayObject *const *in, const pa_linear_desc *d, engine_grads *r)
{
    npy_intp oshape[4] = {PyArray_DIM(in[ENG_Q], 0), PyArray_DIM(in[ENG_Q], 1), d->H, d->V};
    npy_intp sshape[4] = {d->nseq, d->H, d->K, d->V};
    r->dht = NULL;
    if (!(r->dout = get_array(fn, "do", g[ENG_DO], t, 4, oshape, 0))) return -1;
    if (g[ENG_DHT] != Py_None && !(r->dht = get_array(fn, "dht", g[ENG_DHT], t, 4, sshape, 0)))
        return -1;
    if (get_kept_states(fn, d, g[ENG_STATES], t, &r->kept)) return -1;
    if (!(r->dq = get_array(fn, "dq", g[ENG_DQ], t, 4, PyArray_DIMS(in[ENG_Q]), 1)) ||
        !(r->dk = get_array(fn, "dk", g[ENG_DK], t, 4, PyArray_DIMS(in[ENG_K]), 1)) ||
        !(r->dv = get_array(fn, "dv", g[ENG_DV], t, 4, PyArray_DIMS(in[ENG_V]), 1)) ||
        optional_out(fn, "dh0", dh0, t, 4, sshape, &r->dh0))
        return -1;
    return 0;
}
