/* pyattn._core's DPLR delta rule (ops/dplr.c), forward and backward: the linear engine's
 * description (args.c) with gk its per-channel gate, plus a and b. */
#include "args.h"
#include "bind.h"

/* The DPLR delta rule's arrays, first in both entry points */
enum { DPLR_Q, DPLR_K, DPLR_V, DPLR_A, DPLR_B, DPLR_GK, DPLR_H0 };

/* Shared by forward and backward: the arrays a (into arr, and ab for a and b), the options
 * opt as linear_desc reads them. */
static int dplr_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                     PyArrayObject **arr, PyArrayObject **ab, pa_linear_desc *d)
{
    PyObject *const lin[ENG_ARRAYS] = {[ENG_Q] = a[DPLR_Q], [ENG_K] = a[DPLR_K],
                                       [ENG_V] = a[DPLR_V], [ENG_GK] = a[DPLR_GK],
                                       [ENG_GV] = Py_None,  [ENG_H0] = a[DPLR_H0]};
    PyObject *gk = a[DPLR_GK];
    if (!PyArray_Check(gk) || PyArray_NDIM((PyArrayObject *)gk) != 4) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'gk' must be a 4-D array [B, T, H, K]", fn);
        return -1;
    }
    if (linear_desc(fn, lin, opt, typenum, arr, d)) return -1;
    if (d->Hqk != d->H) {
        PyErr_Format(PyExc_ValueError, "%s(): v must have q's %lld heads, got %lld", fn,
                     (long long)d->Hqk, (long long)d->H);
        return -1;
    }
    if (d->form != PA_FORM_RECURRENT && d->form != PA_FORM_CHUNK) {
        PyErr_Format(PyExc_ValueError, "%s(): form must be recurrent or chunk", fn);
        return -1;
    }
    if (!(ab[0] = get_array(fn, "a", a[DPLR_A], *typenum, 4, PyArray_DIMS(arr[ENG_Q]), 0)) ||
        !(ab[1] = get_array(fn, "b", a[DPLR_B], *typenum, 4, PyArray_DIMS(arr[ENG_Q]), 0)))
        return -1;
    return 0;
}

/* dplr_forward(q, k, v, a, b, gk, h0, o, ht, keep, cu, form, chunk, scale, bf16) -> the
 * states kept for the backward (keep true and the chunk form), or None; bf16: the float32
 * inputs hold bfloat16 values (the chunk form may multiply in bf16) */
enum { PF_Q, PF_K, PF_V, PF_A, PF_B, PF_GK, PF_H0, PF_O, PF_HT, PF_KEEP, PF_CU, PF_FORM,
       PF_CHUNK, PF_SCALE, PF_BF16, PF_NARGS };

static PyObject *py_dplr_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "dplr_forward";
    if (expect_nargs(fn, nargs, PF_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *ab[2], *o, *ht;
    pa_linear_desc d;
    if (dplr_desc(fn, args + PF_Q, args + PF_CU, &t, in, ab, &d) ||
        get_bf16_products(args[PF_BF16], t, &d.bf16))
        return NULL;
    PyObject *states = engine_outputs(fn, args + PF_O, t, in[ENG_Q], &d, &o, &ht);
    if (!states) return NULL;
    const pa_kernels *K = kernels_for(t);
    void *kept = states == Py_None ? NULL : PyArray_DATA((PyArrayObject *)states);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->dplr_forward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                         PyArray_DATA(in[ENG_V]), PyArray_DATA(ab[0]), PyArray_DATA(ab[1]),
                         PyArray_DATA(in[ENG_GK]), data_or_null(in[ENG_H0]), PyArray_DATA(o),
                         ht ? PyArray_DATA(ht) : NULL, kept);
    Py_END_ALLOW_THREADS
    return engine_result(states, rc);
}

/* dplr_backward(q, k, v, a, b, gk, h0, do, dht, states, dq, dk, dv, da, db, dgk, dh0, cu, form,
 *               chunk, scale); states: what dplr_forward kept, or None */
enum { PB_Q, PB_K, PB_V, PB_A, PB_B, PB_GK, PB_H0, PB_DO, PB_DHT, PB_STATES, PB_DQ, PB_DK, PB_DV,
       PB_DA, PB_DB, PB_DGK, PB_DH0, PB_CU, PB_FORM, PB_CHUNK, PB_SCALE, PB_NARGS };

static PyObject *py_dplr_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "dplr_backward";
    if (expect_nargs(fn, nargs, PB_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *ab[2], *da, *db, *dgk;
    engine_grads gr;
    pa_linear_desc d;
    if (dplr_desc(fn, args + PB_Q, args + PB_CU, &t, in, ab, &d)) return NULL;
    npy_intp *kshape = PyArray_DIMS(in[ENG_Q]);
    if (get_engine_grads(fn, args + PB_DO, args[PB_DH0], t, in, &d, &gr) ||
        !(da = get_array(fn, "da", args[PB_DA], t, 4, kshape, 1)) ||
        !(db = get_array(fn, "db", args[PB_DB], t, 4, kshape, 1)) ||
        !(dgk = get_array(fn, "dgk", args[PB_DGK], t, 4, kshape, 1)))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->dplr_backward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                          PyArray_DATA(in[ENG_V]), PyArray_DATA(ab[0]), PyArray_DATA(ab[1]),
                          PyArray_DATA(in[ENG_GK]), data_or_null(in[ENG_H0]),
                          PyArray_DATA(gr.dout), data_or_null(gr.dht), data_or_null(gr.kept),
                          PyArray_DATA(gr.dq),
                          PyArray_DATA(gr.dk), PyArray_DATA(gr.dv), PyArray_DATA(da),
                          PyArray_DATA(db), PyArray_DATA(dgk),
                          gr.dh0 ? PyArray_DATA(gr.dh0) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_dplr_methods[] = {
    {"dplr_forward", (PyCFunction)(void (*)(void))py_dplr_forward, METH_FASTCALL,
     "dplr_forward(q, k, v, a, b, gk, h0, o, ht, keep, cu, form, chunk, scale, bf16): the DPLR "
     "delta rule (recurrent or chunk form); a, b, gk [B, T, H, K]; h0, ht None or [N, H, K, V]; "
     "o written; returns the states kept for dplr_backward (keep true, chunk form) or None"},
    {"dplr_backward", (PyCFunction)(void (*)(void))py_dplr_backward, METH_FASTCALL,
     "dplr_backward(q, k, v, a, b, gk, h0, do, dht, states, dq, dk, dv, da, db, dgk, dh0, cu, "
     "form, chunk, scale): gradients written in place; dht None (zero), dh0 None (not wanted); "
     "states: what dplr_forward kept, or None"},
    {NULL, NULL, 0, NULL},
};
