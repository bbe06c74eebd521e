/* pyattn._core's delta-rule engine (ops/delta_rule.c), forward and backward: the linear
 * engine's description (args.c) with the gate g as its key gate, scalar [B, T, H] or vector
 * [B, T, H, K] (KDA), H the value heads (q and k may have fewer: groups), plus beta. */
#include "args.h"
#include "bind.h"

/* The delta rule's arrays, first in both entry points */
enum { DELTA_Q, DELTA_K, DELTA_V, DELTA_G, DELTA_BETA, DELTA_H0 };

/* Shared by forward and backward: the arrays a, the options opt as linear_desc reads them. */
static int delta_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                      PyArrayObject **arr, PyArrayObject **beta, pa_linear_desc *d)
{
    PyObject *const lin[ENG_ARRAYS] = {[ENG_Q] = a[DELTA_Q], [ENG_K] = a[DELTA_K],
                                       [ENG_V] = a[DELTA_V], [ENG_GK] = a[DELTA_G],
                                       [ENG_GV] = Py_None,   [ENG_H0] = a[DELTA_H0]};
    PyObject *g = a[DELTA_G];
    if (g != Py_None && PyArray_Check(g) && PyArray_NDIM((PyArrayObject *)g) != 3 &&
        PyArray_NDIM((PyArrayObject *)g) != 4) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): argument 'g' must be 3-D [B, T, H] or 4-D [B, T, H, K], got %d-D", fn,
                     PyArray_NDIM((PyArrayObject *)g));
        return -1;
    }
    if (linear_desc(fn, lin, opt, typenum, arr, d)) return -1;
    npy_intp bshape[3] = {PyArray_DIM(arr[ENG_Q], 0), PyArray_DIM(arr[ENG_Q], 1), d->H};
    return (*beta = get_array(fn, "beta", a[DELTA_BETA], *typenum, 3, bshape, 0)) ? 0 : -1;
}

/* delta_forward(q, k, v, g, beta, h0, o, ht, keep, cu, form, chunk, scale, bf16) -> the states
 * kept for the backward (keep true and the chunk form), or None; bf16 as linear_forward's */
enum { DF_Q, DF_K, DF_V, DF_G, DF_BETA, DF_H0, DF_O, DF_HT, DF_KEEP, DF_CU, DF_FORM, DF_CHUNK,
       DF_SCALE, DF_BF16, DF_NARGS };

static PyObject *py_delta_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "delta_forward";
    if (expect_nargs(fn, nargs, DF_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *beta, *o, *ht;
    pa_linear_desc d;
    if (delta_desc(fn, args + DF_Q, args + DF_CU, &t, in, &beta, &d) ||
        get_bf16_products(args[DF_BF16], t, &d.bf16))
        return NULL;
    PyObject *states = engine_outputs(fn, args + DF_O, t, in[ENG_Q], &d, &o, &ht);
    if (!states) return NULL;
    const pa_kernels *K = kernels_for(t);
    void *kept = states == Py_None ? NULL : PyArray_DATA((PyArrayObject *)states);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->delta_forward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                          PyArray_DATA(in[ENG_V]), data_or_null(in[ENG_GK]), PyArray_DATA(beta),
                          data_or_null(in[ENG_H0]), PyArray_DATA(o), ht ? PyArray_DATA(ht) : NULL,
                          kept);
    Py_END_ALLOW_THREADS
    return engine_result(states, rc);
}

/* delta_backward(q, k, v, g, beta, h0, do, dht, states, dq, dk, dv, dg, dbeta, dh0, cu, form,
 *                chunk, scale); states: what delta_forward kept, or None */
enum { DB_Q, DB_K, DB_V, DB_G, DB_BETA, DB_H0, DB_DO, DB_DHT, DB_STATES, DB_DQ, DB_DK, DB_DV,
       DB_DG, DB_DBETA, DB_DH0, DB_CU, DB_FORM, DB_CHUNK, DB_SCALE, DB_NARGS };

static PyObject *py_delta_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "delta_backward";
    if (expect_nargs(fn, nargs, DB_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *beta, *dg = NULL, *dbeta;
    engine_grads gr;
    pa_linear_desc d;
    if (delta_desc(fn, args + DB_Q, args + DB_CU, &t, in, &beta, &d) ||
        get_engine_grads(fn, args + DB_DO, args[DB_DH0], t, in, &d, &gr) ||
        !(dbeta = get_array(fn, "dbeta", args[DB_DBETA], t, 3, PyArray_DIMS(beta), 1)))
        return NULL;
    if (!in[ENG_GK] != (args[DB_DG] == Py_None)) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'dg' must be given exactly when 'g' is", fn);
        return NULL;
    }
    if (in[ENG_GK] && !(dg = get_array(fn, "dg", args[DB_DG], t, PyArray_NDIM(in[ENG_GK]),
                                        PyArray_DIMS(in[ENG_GK]), 1)))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->delta_backward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                           PyArray_DATA(in[ENG_V]), data_or_null(in[ENG_GK]), PyArray_DATA(beta),
                           data_or_null(in[ENG_H0]), PyArray_DATA(gr.dout), data_or_null(gr.dht),
                           data_or_null(gr.kept), PyArray_DATA(gr.dq), PyArray_DATA(gr.dk),
                           PyArray_DATA(gr.dv), dg ? PyArray_DATA(dg) : NULL, PyArray_DATA(dbeta),
                           gr.dh0 ? PyArray_DATA(gr.dh0) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_delta_methods[] = {
    {"delta_forward", (PyCFunction)(void (*)(void))py_delta_forward, METH_FASTCALL,
     "delta_forward(q, k, v, g, beta, h0, o, ht, keep, cu, form, chunk, scale, bf16): the "
     "delta-rule engine; q, k [B, T, Hqk, K], v [B, T, H, V] (H a multiple of Hqk); g None, "
     "[B, T, H] or [B, T, H, K]; beta [B, T, H]; h0, ht None or [N, H, K, V]; o written; bf16: "
     "float32 inputs holding bfloat16 values, which the chunk form may multiply in bf16; "
     "returns the states kept for delta_backward (keep true, chunk form) or None"},
    {"delta_backward", (PyCFunction)(void (*)(void))py_delta_backward, METH_FASTCALL,
     "delta_backward(q, k, v, g, beta, h0, do, dht, states, dq, dk, dv, dg, dbeta, dh0, cu, "
     "form, chunk, scale): gradients written in place; dg None exactly when g is, and of its "
     "shape; states: what delta_forward kept, or None"},
    {NULL, NULL, 0, NULL},
};
