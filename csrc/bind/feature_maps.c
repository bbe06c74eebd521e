/* pyattn._core's feature maps of linear attention (ops/feature_maps.c), forward and backward. */
#include "args.h"
#include "bind.h"

#include <string.h>

const char *const pa_feature_map_names[PA_FM_COUNT] = {
    "identity", "elu1", "relu", "softmax", "focused", "taylor", "performer", "cosformer"};

/* The map and its parameters, in this order in both entry points */
enum { MAP_KIND, MAP_P, MAP_MAX_LEN, MAP_PROJECTION };

/* Shared by forward and backward: x, then the map from opt. Fills d (F included), *W (NULL
 * unless performer) and yshape, the shape y and dy must have. */
static int feature_map_desc(const char *fn, PyObject *xobj, PyObject *const *opt, int *typenum,
                            PyArrayObject **x, PyArrayObject **W, npy_intp *yshape,
                            pa_feature_map_desc *d)
{
    if (float_type(fn, "x", xobj, typenum)) return -1;
    long long kind, p;
    if (get_int(fn, "kind", opt[MAP_KIND], 0, PA_FM_COUNT - 1, &kind)) return -1;
    const int nd = PyArray_NDIM((PyArrayObject *)xobj);
    if (nd < 1 || (kind == PA_FM_COSFORMER && nd != 4)) {
        char got[160];
        format_shape(got, sizeof got, nd, PyArray_DIMS((PyArrayObject *)xobj));
        PyErr_Format(PyExc_ValueError, "%s(): argument 'x' must be %s for kind '%s', got shape %s",
                     fn, kind == PA_FM_COSFORMER ? "4-D [B, T, H, D]" : "at least 1-D [..., D]",
                     pa_feature_map_names[kind], got);
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
    if (get_int(fn, "p", opt[MAP_P], 1, INT64_MAX, &p)) return -1;
    double max_len;
    if (get_double(fn, "max_len", opt[MAP_MAX_LEN], 0.0, &max_len)) return -1;
    if (max_len <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'max_len' must be > 0, got 0", fn);
        return -1;
    }
    memset(d, 0, sizeof *d);
    *W = NULL;
    if (kind == PA_FM_PERFORMER) {
        npy_intp wshape[2] = {-1, D};
        if (!(*W = get_array(fn, "projection", opt[MAP_PROJECTION], *typenum, 2, wshape, 0)))
            return -1;
        if (PyArray_DIM(*W, 0) < 1) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): argument 'projection' must have m >= 1 rows, got shape (0, %lld)",
                         fn, (long long)D);
            return -1;
        }
        d->m = PyArray_DIM(*W, 0);
        d->projection = PyArray_DATA(*W);
    } else if (opt[MAP_PROJECTION] != Py_None) {
        PyErr_Format(PyExc_ValueError, "%s(): argument 'projection' must be None for kind '%s', got %s",
                     fn, pa_feature_map_names[kind], Py_TYPE(opt[MAP_PROJECTION])->tp_name);
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
enum { FMF_X, FMF_Y, FMF_KIND, FMF_P, FMF_MAX_LEN, FMF_PROJECTION, FMF_NARGS };

static PyObject *py_feature_map_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "feature_map_forward";
    if (expect_nargs(fn, nargs, FMF_NARGS)) return NULL;
    int t;
    PyArrayObject *x, *W;
    npy_intp yshape[NPY_MAXDIMS];
    pa_feature_map_desc d;
    if (feature_map_desc(fn, args[FMF_X], args + FMF_KIND, &t, &x, &W, yshape, &d)) return NULL;
    PyArrayObject *y = get_array(fn, "y", args[FMF_Y], t, PyArray_NDIM(x), yshape, 1);
    if (!y) return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->feature_map_forward(&d, PyArray_DATA(x), PyArray_DATA(y));
    Py_END_ALLOW_THREADS
    return finish(rc);
}

/* feature_map_backward(x, dy, dx, kind, p, max_len, projection_or_None, dprojection_or_None) */
enum { FMB_X, FMB_DY, FMB_DX, FMB_KIND, FMB_P, FMB_MAX_LEN, FMB_PROJECTION, FMB_DPROJECTION,
       FMB_NARGS };

static PyObject *py_feature_map_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "feature_map_backward";
    if (expect_nargs(fn, nargs, FMB_NARGS)) return NULL;
    int t;
    PyArrayObject *x, *W, *dy, *dx, *dW = NULL;
    npy_intp yshape[NPY_MAXDIMS];
    pa_feature_map_desc d;
    if (feature_map_desc(fn, args[FMB_X], args + FMB_KIND, &t, &x, &W, yshape, &d)) return NULL;
    const int nd = PyArray_NDIM(x);
    if (!(dy = get_array(fn, "dy", args[FMB_DY], t, nd, yshape, 0)) ||
        !(dx = get_array(fn, "dx", args[FMB_DX], t, nd, PyArray_DIMS(x), 1)))
        return NULL;
    if (W) {
        if (!(dW = get_array(fn, "dprojection", args[FMB_DPROJECTION], t, 2, PyArray_DIMS(W), 1)))
            return NULL;
    } else if (args[FMB_DPROJECTION] != Py_None) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): argument 'dprojection' must be None for kind '%s', got %s", fn,
                     pa_feature_map_names[d.kind], Py_TYPE(args[FMB_DPROJECTION])->tp_name);
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

PyMethodDef pyattn_feature_map_methods[] = {
    {"feature_map_forward", (PyCFunction)(void (*)(void))py_feature_map_forward, METH_FASTCALL,
     "feature_map_forward(x, y, kind, p, max_len, projection): y = phi(x) in place. x [..., D] "
     "(cosformer: [B, T, H, D]); y [..., F]; kind one of FM_*; p (int >= 1, focused) and max_len "
     "(float > 0, cosformer) are checked for every kind; projection W [m, D] for performer, "
     "else None"},
    {"feature_map_backward", (PyCFunction)(void (*)(void))py_feature_map_backward, METH_FASTCALL,
     "feature_map_backward(x, dy, dx, kind, p, max_len, projection, dprojection): dx (and for "
     "performer dprojection [m, D], else None) written in place from dy [..., F]"},
    {NULL, NULL, 0, NULL},
};
