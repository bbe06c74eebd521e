/* pyattn._core's log-linear attention (ops/log_linear.c), forward and backward. */
#include "args.h"
#include "bind.h"

/* The arrays first in both entry points, and the options after the outputs/gradients */
enum { LL_Q, LL_K, LL_V, LL_G, LL_LS, LL_H0 };
enum { LL_CU, LL_START, LL_FORM, LL_CHUNK, LL_SCALE };

static int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* Checks the arrays a (into arr, in a's order; arr[LL_H0] NULL for None) and the options opt
 * into d; want_state: whether the final state will be written (it needs one level more when
 * a sequence ends on a power of two). */
static int loglin_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int want_state,
                       int *typenum, PyArrayObject **arr, pa_loglin_desc *d)
{
    if (!(arr[LL_Q] = get_float_array(fn, "q", a[LL_Q], 4, typenum))) return -1;
    npy_intp *qs = PyArray_DIMS(arr[LL_Q]);
    const npy_intp B = qs[0], T = qs[1], H = qs[2], K = qs[3];
    npy_intp vshape[4] = {B, T, H, -1}, gshape[3] = {B, T, H}, lshape[4] = {B, T, H, -1};
    if (!(arr[LL_K] = get_array(fn, "k", a[LL_K], *typenum, 4, qs, 0)) ||
        !(arr[LL_V] = get_array(fn, "v", a[LL_V], *typenum, 4, vshape, 0)) ||
        !(arr[LL_G] = get_array(fn, "g", a[LL_G], *typenum, 3, gshape, 0)) ||
        !(arr[LL_LS] = get_array(fn, "level_scales", a[LL_LS], *typenum, 4, lshape, 0)))
        return -1;
    const npy_intp V = PyArray_DIM(arr[LL_V], 3), L = PyArray_DIM(arr[LL_LS], 3);
    if (K < 1 || V < 1 || L < 1 || L > 62) {
        PyErr_Format(PyExc_ValueError, "%s(): need K, V >= 1 and 1 <= L <= 62, got K=%lld, "
                     "V=%lld, L=%lld", fn, (long long)K, (long long)V, (long long)L);
        return -1;
    }
    if (!(d->cu = get_cu(fn, "cu_seqlens", opt[LL_CU], B * T, &d->nseq))) return -1;
    arr[LL_H0] = NULL;
    if (a[LL_H0] != Py_None) {
        npy_intp sshape[5] = {d->nseq, H, L, K, V};
        if (!(arr[LL_H0] = get_array(fn, "initial_state", a[LL_H0], *typenum, 5, sshape, 0)))
            return -1;
    }
    d->start = NULL;
    if (opt[LL_START] != Py_None) {
        npy_intp n = d->nseq;
        PyArrayObject *s = get_array(fn, "start", opt[LL_START], NPY_INT64, 1, &n, 0);
        if (!s) return -1;
        d->start = PyArray_DATA(s);
    }
    for (int64_t n = 0; n < d->nseq; n++) {
        const int64_t p0 = d->start ? d->start[n] : 0, len = d->cu[n + 1] - d->cu[n];
        if (p0 < 0 || p0 > ((int64_t)1 << 61) - len) {
            PyErr_Format(PyExc_ValueError, "%s(): start[%lld]=%lld out of range", fn,
                         (long long)n, (long long)p0);
            return -1;
        }
        const int need = len == 0 ? 1 : bit_length((uint64_t)(p0 + len - 1)) + 1;
        const int need_state = bit_length((uint64_t)(p0 + len)) + 1;
        if (L < need || (want_state && L < need_state)) {
            PyErr_Format(PyExc_ValueError, "%s(): level_scales has L=%lld levels; sequence %lld "
                         "needs %d", fn, (long long)L, (long long)n,
                         want_state && need_state > need ? need_state : need);
            return -1;
        }
    }
    long long form, chunk;
    if (get_int(fn, "form", opt[LL_FORM], 0, 3, &form) ||
        get_int(fn, "chunk_size", opt[LL_CHUNK], 1, 1 << 20, &chunk) ||
        get_double(fn, "scale", opt[LL_SCALE], -INFINITY, &d->scale))
        return -1;
    if (form == PA_FORM_FLASH) {
        PyErr_Format(PyExc_ValueError, "%s(): log-linear attention has no flash form", fn);
        return -1;
    }
    if (chunk & (chunk - 1)) {
        PyErr_Format(PyExc_ValueError, "%s(): chunk_size must be a power of two, got %lld", fn,
                     chunk);
        return -1;
    }
    d->form = (int)form;
    d->chunk = chunk;
    d->H = H;
    d->K = K;
    d->V = V;
    d->L = L;
    return 0;
}

/* loglin_forward(q, k, v, g, level_scales, h0, o, ht, cu, start, form, chunk, scale) -> None */
enum { PF_O = LL_H0 + 1, PF_HT, PF_OPT, PF_NARGS = PF_OPT + 5 };

static PyObject *py_loglin_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "loglin_forward";
    if (expect_nargs(fn, nargs, PF_NARGS)) return NULL;
    int t;
    PyArrayObject *in[LL_H0 + 1], *o, *ht = NULL;
    pa_loglin_desc d;
    if (loglin_desc(fn, args, args + PF_OPT, args[PF_HT] != Py_None, &t, in, &d)) return NULL;
    npy_intp *qs = PyArray_DIMS(in[LL_Q]);
    npy_intp oshape[4] = {qs[0], qs[1], d.H, d.V}, sshape[5] = {d.nseq, d.H, d.L, d.K, d.V};
    if (!(o = get_array(fn, "o", args[PF_O], t, 4, oshape, 1)) ||
        optional_out(fn, "final_state", args[PF_HT], t, 5, sshape, &ht))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->loglin_forward(&d, PyArray_DATA(in[LL_Q]), PyArray_DATA(in[LL_K]),
                           PyArray_DATA(in[LL_V]), PyArray_DATA(in[LL_G]),
                           PyArray_DATA(in[LL_LS]), data_or_null(in[LL_H0]), PyArray_DATA(o),
                           ht ? PyArray_DATA(ht) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* loglin_backward(q, k, v, g, level_scales, h0, do, dht, dq, dk, dv, dg, dlevel_scales, dh0,
 *                 cu, start, form, chunk, scale) -> None */
enum { PB_DO = LL_H0 + 1, PB_DHT, PB_DQ, PB_DK, PB_DV, PB_DG, PB_DLS, PB_DH0, PB_OPT,
       PB_NARGS = PB_OPT + 5 };

static PyObject *py_loglin_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "loglin_backward";
    if (expect_nargs(fn, nargs, PB_NARGS)) return NULL;
    int t;
    PyArrayObject *in[LL_H0 + 1], *dout, *dht = NULL, *dh0 = NULL, *grad[5];
    pa_loglin_desc d;
    if (loglin_desc(fn, args, args + PB_OPT, args[PB_DHT] != Py_None, &t, in, &d)) return NULL;
    npy_intp *qs = PyArray_DIMS(in[LL_Q]);
    npy_intp oshape[4] = {qs[0], qs[1], d.H, d.V}, sshape[5] = {d.nseq, d.H, d.L, d.K, d.V};
    static const char *const names[5] = {"dq", "dk", "dv", "dg", "dlevel_scales"};
    for (int i = 0; i < 5; i++) {
        PyArrayObject *like = in[LL_Q + i];
        if (!(grad[i] = get_array(fn, names[i], args[PB_DQ + i], t, PyArray_NDIM(like),
                                  PyArray_DIMS(like), 1)))
            return NULL;
    }
    if (!(dout = get_array(fn, "do", args[PB_DO], t, 4, oshape, 0)) ||
        (args[PB_DHT] != Py_None &&
         !(dht = get_array(fn, "dht", args[PB_DHT], t, 5, sshape, 0))) ||
        optional_out(fn, "dh0", args[PB_DH0], t, 5, sshape, &dh0))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->loglin_backward(&d, PyArray_DATA(in[LL_Q]), PyArray_DATA(in[LL_K]),
                            PyArray_DATA(in[LL_V]), PyArray_DATA(in[LL_G]),
                            PyArray_DATA(in[LL_LS]), data_or_null(in[LL_H0]),
                            PyArray_DATA(dout), data_or_null(dht), PyArray_DATA(grad[0]),
                            PyArray_DATA(grad[1]), PyArray_DATA(grad[2]), PyArray_DATA(grad[3]),
                            PyArray_DATA(grad[4]), dh0 ? PyArray_DATA(dh0) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_loglin_methods[] = {
    {"loglin_forward", (PyCFunction)(void (*)(void))py_loglin_forward, METH_FASTCALL,
     "loglin_forward(q, k, v, g, level_scales, h0, o, ht, cu, start, form, chunk, scale): log-linear "
     "attention; g [B, T, H], level_scales [B, T, H, L]; h0, ht None or [N, H, L, K, V]; start "
     "None or int64 [N]; o written"},
    {"loglin_backward", (PyCFunction)(void (*)(void))py_loglin_backward, METH_FASTCALL,
     "loglin_backward(q, k, v, g, level_scales, h0, do, dht, dq, dk, dv, dg, dlevel_scales, "
     "dh0, cu, start, form, chunk, scale): gradients written in place; dht None (zero), dh0 None (not "
     "wanted)"},
    {NULL, NULL, 0, NULL},
};
