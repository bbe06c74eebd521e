/* pyattn._core's gated linear engine and efficient attention (ops/linear_attn.c), forward
 * and backward. The engine's arrays and outputs are unpacked by args.c, which the delta-rule
 * engine's entry points share. */
#include "args.h"
#include "bind.h"

#include <math.h>
#include <string.h>

/* The engine's value options: beta, skip */
enum { VALUE_BETA, VALUE_SKIP, VALUE_OPTS };

/* The value options a: None, or beta [B, T, H] (not with a value gate) and skip [H] into
 * arr[VALUE_BETA], arr[VALUE_SKIP] */
static int linear_value_opts(const char *fn, PyObject *const *a, int t, PyArrayObject *const *in,
                             const pa_linear_desc *d, PyArrayObject **arr)
{
    npy_intp bshape[3] = {PyArray_DIM(in[ENG_Q], 0), PyArray_DIM(in[ENG_Q], 1), d->H},
             hshape[1] = {d->H};
    arr[VALUE_BETA] = arr[VALUE_SKIP] = NULL;
    if (a[VALUE_BETA] != Py_None && d->gv != PA_GATE_NONE) {
        PyErr_Format(PyExc_ValueError, "%s(): 'beta' needs gv None", fn);
        return -1;
    }
    if (a[VALUE_BETA] != Py_None &&
        !(arr[VALUE_BETA] = get_array(fn, "beta", a[VALUE_BETA], t, 3, bshape, 0)))
        return -1;
    if (a[VALUE_SKIP] != Py_None &&
        !(arr[VALUE_SKIP] = get_array(fn, "skip", a[VALUE_SKIP], t, 1, hshape, 0)))
        return -1;
    return 0;
}

/* linear_forward(q, k, v, gk, gv, h0, o, ht, keep, cu, form, chunk, scale, beta, skip, bf16) ->
 * the states kept for the backward (a new array; keep true and the chunk form), or None; bf16:
 * the float32 inputs hold bfloat16 values (the chunk form may multiply in bf16) */
enum { LF_Q, LF_K, LF_V, LF_GK, LF_GV, LF_H0, LF_O, LF_HT, LF_KEEP, LF_CU, LF_FORM, LF_CHUNK,
       LF_SCALE, LF_BETA, LF_SKIP, LF_BF16, LF_NARGS };

static PyObject *py_linear_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "linear_forward";
    if (expect_nargs(fn, nargs, LF_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *o, *ht, *vopt[VALUE_OPTS];
    pa_linear_desc d;
    if (linear_desc(fn, args + LF_Q, args + LF_CU, &t, in, &d) ||
        linear_value_opts(fn, args + LF_BETA, t, in, &d, vopt) ||
        get_bf16_products(args[LF_BF16], t, &d.bf16))
        return NULL;
    PyObject *states = engine_outputs(fn, args + LF_O, t, in[ENG_Q], &d, &o, &ht);
    if (!states) return NULL;
    const pa_kernels *K = kernels_for(t);
    void *kept = states == Py_None ? NULL : PyArray_DATA((PyArrayObject *)states);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->linear_forward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                           PyArray_DATA(in[ENG_V]), data_or_null(in[ENG_GK]),
                           data_or_null(in[ENG_GV]), data_or_null(in[ENG_H0]),
                           data_or_null(vopt[VALUE_BETA]), data_or_null(vopt[VALUE_SKIP]),
                           PyArray_DATA(o), ht ? PyArray_DATA(ht) : NULL, kept);
    Py_END_ALLOW_THREADS
    return engine_result(states, rc);
}

/* linear_backward(q, k, v, gk, gv, h0, do, dht, states, dq, dk, dv, dgk, dgv, dh0, cu, form, chunk,
 *                 scale, beta, skip, dbeta, dskip); states: what linear_forward kept, or None */
enum { LB_Q, LB_K, LB_V, LB_GK, LB_GV, LB_H0, LB_DO, LB_DHT, LB_STATES, LB_DQ, LB_DK, LB_DV,
       LB_DGK, LB_DGV, LB_DH0, LB_CU, LB_FORM, LB_CHUNK, LB_SCALE, LB_BETA, LB_SKIP, LB_DBETA,
       LB_DSKIP, LB_NARGS };

static PyObject *py_linear_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "linear_backward";
    if (expect_nargs(fn, nargs, LB_NARGS)) return NULL;
    int t;
    PyArrayObject *in[ENG_ARRAYS], *vopt[VALUE_OPTS], *dgk = NULL, *dgv = NULL, *dbeta = NULL, *dskip = NULL;
    engine_grads gr;
    pa_linear_desc d;
    if (linear_desc(fn, args + LB_Q, args + LB_CU, &t, in, &d) ||
        linear_value_opts(fn, args + LB_BETA, t, in, &d, vopt) ||
        get_engine_grads(fn, args + LB_DO, args[LB_DH0], t, in, &d, &gr))
        return NULL;
    /* each gradient of these is None exactly when its input is; dskip has beta's shape */
    const char *gnames[4] = {"dgk", "dgv", "dbeta", "dskip"};
    PyArrayObject **gout[4] = {&dgk, &dgv, &dbeta, &dskip};
    PyArrayObject *const gin[4] = {in[ENG_GK], in[ENG_GV], vopt[VALUE_BETA], vopt[VALUE_SKIP]};
    PyObject *const gobj[4] = {args[LB_DGK], args[LB_DGV], args[LB_DBETA], args[LB_DSKIP]};
    npy_intp rshape[3] = {PyArray_DIM(in[ENG_Q], 0), PyArray_DIM(in[ENG_Q], 1), d.H};
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
    rc = K->linear_backward(&d, PyArray_DATA(in[ENG_Q]), PyArray_DATA(in[ENG_K]),
                            PyArray_DATA(in[ENG_V]), data_or_null(in[ENG_GK]),
                            data_or_null(in[ENG_GV]), data_or_null(in[ENG_H0]),
                            data_or_null(vopt[VALUE_BETA]), data_or_null(vopt[VALUE_SKIP]),
                            PyArray_DATA(gr.dout), data_or_null(gr.dht), data_or_null(gr.kept),
                            PyArray_DATA(gr.dq), PyArray_DATA(gr.dk), PyArray_DATA(gr.dv),
                            dgk ? PyArray_DATA(dgk) : NULL, dgv ? PyArray_DATA(dgv) : NULL,
                            gr.dh0 ? PyArray_DATA(gr.dh0) : NULL,
                            dbeta ? PyArray_DATA(dbeta) : NULL, dskip ? PyArray_DATA(dskip) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* Efficient attention's sequences and scale: cu_q, cu_k, scale */
enum { EFF_CU_Q, EFF_CU_K, EFF_SCALE };

/* Shared by forward and backward: a = (q, k, v), the sequences and scale from opt. */
static int efficient_desc(const char *fn, PyObject *const *a, PyObject *const *opt,
                          int *typenum, PyArrayObject **arr, pa_efficient_desc *d)
{
    if (!(arr[QKV_Q] = get_float_array(fn, "q", a[QKV_Q], 4, typenum))) return -1;
    npy_intp B = PyArray_DIM(arr[QKV_Q], 0), Tq = PyArray_DIM(arr[QKV_Q], 1),
             H = PyArray_DIM(arr[QKV_Q], 2), K = PyArray_DIM(arr[QKV_Q], 3);
    npy_intp kshape[4] = {B, -1, H, K};
    if (!(arr[QKV_K] = get_array(fn, "k", a[QKV_K], *typenum, 4, kshape, 0))) return -1;
    npy_intp Tk = PyArray_DIM(arr[QKV_K], 1);
    npy_intp vshape[4] = {B, Tk, H, -1};
    if (!(arr[QKV_V] = get_array(fn, "v", a[QKV_V], *typenum, 4, vshape, 0))) return -1;
    memset(d, 0, sizeof *d);
    d->H = H;
    d->K = K;
    d->V = PyArray_DIM(arr[QKV_V], 3);
    if (K < 1 || d->V < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): head dims must be >= 1, got K=%lld V=%lld", fn,
                     (long long)K, (long long)d->V);
        return -1;
    }
    int64_t nk;
    if (!(d->cu_q = get_cu(fn, "cu_seqlens_q", opt[EFF_CU_Q], B * Tq, &d->nseq)) ||
        !(d->cu_k = get_cu(fn, "cu_seqlens_k", opt[EFF_CU_K], B * Tk, &nk)))
        return -1;
    if (nk != d->nseq) {
        PyErr_Format(PyExc_ValueError, "%s(): cu_seqlens_q and cu_seqlens_k must have the same length",
                     fn);
        return -1;
    }
    return get_double(fn, "scale", opt[EFF_SCALE], -INFINITY, &d->scale);
}

/* efficient_forward(q, k, v, o, cu_q, cu_k, scale) */
enum { EF_Q, EF_K, EF_V, EF_O, EF_CU_Q, EF_CU_K, EF_SCALE, EF_NARGS };

static PyObject *py_efficient_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "efficient_forward";
    if (expect_nargs(fn, nargs, EF_NARGS)) return NULL;
    int t;
    PyArrayObject *in[QKV_ARRAYS], *o;
    pa_efficient_desc d;
    if (efficient_desc(fn, args + EF_Q, args + EF_CU_Q, &t, in, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(in[QKV_Q], 0), PyArray_DIM(in[QKV_Q], 1), d.H, d.V};
    if (!(o = get_array(fn, "o", args[EF_O], t, 4, oshape, 1))) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->efficient_forward(&d, PyArray_DATA(in[QKV_Q]), PyArray_DATA(in[QKV_K]),
                              PyArray_DATA(in[QKV_V]), PyArray_DATA(o));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* efficient_backward(q, k, v, do, dq, dk, dv, cu_q, cu_k, scale) */
enum { EB_Q, EB_K, EB_V, EB_DO, EB_DQ, EB_DK, EB_DV, EB_CU_Q, EB_CU_K, EB_SCALE, EB_NARGS };

static PyObject *py_efficient_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "efficient_backward";
    if (expect_nargs(fn, nargs, EB_NARGS)) return NULL;
    int t;
    PyArrayObject *in[QKV_ARRAYS], *dout, *dq, *dk, *dv;
    pa_efficient_desc d;
    if (efficient_desc(fn, args + EB_Q, args + EB_CU_Q, &t, in, &d)) return NULL;
    npy_intp oshape[4] = {PyArray_DIM(in[QKV_Q], 0), PyArray_DIM(in[QKV_Q], 1), d.H, d.V};
    if (!(dout = get_array(fn, "do", args[EB_DO], t, 4, oshape, 0)) ||
        !(dq = get_array(fn, "dq", args[EB_DQ], t, 4, PyArray_DIMS(in[QKV_Q]), 1)) ||
        !(dk = get_array(fn, "dk", args[EB_DK], t, 4, PyArray_DIMS(in[QKV_K]), 1)) ||
        !(dv = get_array(fn, "dv", args[EB_DV], t, 4, PyArray_DIMS(in[QKV_V]), 1)))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->efficient_backward(&d, PyArray_DATA(in[QKV_Q]), PyArray_DATA(in[QKV_K]),
                               PyArray_DATA(in[QKV_V]), PyArray_DATA(dout), PyArray_DATA(dq),
                               PyArray_DATA(dk), PyArray_DATA(dv));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_linear_methods[] = {
    {"linear_forward", (PyCFunction)(void (*)(void))py_linear_forward, METH_FASTCALL,
     "linear_forward(q, k, v, gk, gv, h0, o, ht, keep, cu, form, chunk, scale, beta, skip, "
     "bf16): the gated linear engine; gk None, [B, T, H] or [B, T, H, K]; gv None or [B, T, H, "
     "V]; h0, ht None or [N, H, K, V]; beta None or [B, T, H] (v's rows read as beta_t v_t; not "
     "with gv); skip None or [H] (o_t += skip_h v_t); bf16: float32 inputs holding bfloat16 "
     "values, which the chunk form may multiply in bf16; o written; returns the states kept for "
     "linear_backward (keep true, chunk form) or None"},
    {"linear_backward", (PyCFunction)(void (*)(void))py_linear_backward, METH_FASTCALL,
     "linear_backward(q, k, v, gk, gv, h0, do, dht, states, dq, dk, dv, dgk, dgv, dh0, cu, "
     "form, chunk, scale, beta, skip, dbeta, dskip): gradients written in place; states: what "
     "linear_forward kept, or None; dgk, dgv, dbeta, dskip None exactly when gk, gv, beta, skip "
     "are; dskip [B, T, H] holds the rows' do_t . v_t"},
    {"efficient_forward", (PyCFunction)(void (*)(void))py_efficient_forward, METH_FASTCALL,
     "efficient_forward(q, k, v, o, cu_q, cu_k, scale)"},
    {"efficient_backward", (PyCFunction)(void (*)(void))py_efficient_backward, METH_FASTCALL,
     "efficient_backward(q, k, v, do, dq, dk, dv, cu_q, cu_k, scale)"},
    {NULL, NULL, 0, NULL},
};
