/* pyattn._core's binding (the files of csrc/bind/, one per op family) unpacks NumPy arrays,
 * checks every buffer against the shapes the kernel will assume, releases the GIL around the
 * kernel and raises after it is back. No maths here. Entry points take positional arguments
 * only (METH_FASTCALL), each naming its argument slots with an enum; pyattn's Python wrappers
 * fill defaults and allocate outputs.
 *
 * What every bind file shares: Python and NumPy set up alike, and the argument helpers. Each
 * helper checks one argument, or a group several entry points take, and on bad input sets a
 * Python exception and returns -1, or NULL. */
#ifndef PA_BIND_ARGS_H
#define PA_BIND_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
/* One NumPy API table for the extension: module.c defines it (PA_DEFINE_NUMPY_API) and fills
 * it at import; the other files use it. */
#define PY_ARRAY_UNIQUE_SYMBOL pyattn_ARRAY_API
#ifndef PA_DEFINE_NUMPY_API
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <stdint.h>

#include "kernels.h"

/* The arguments every attention entry point starts with, and where the helpers below read
 * them from the pointer they are given. */
enum { QKV_Q, QKV_K, QKV_V, QKV_ARRAYS };

int expect_nargs(const char *fn, Py_ssize_t nargs, Py_ssize_t want);

/* "(2, 3)" into buf, "(2,)" for one dimension */
void format_shape(char *buf, size_t size, int ndim, const npy_intp *shape);

/* obj must be a C-contiguous, aligned ndarray of typenum with ndim dims; shape entries < 0
 * are not checked. Returns the array (borrowed). */
PyArrayObject *get_array(const char *fn, const char *name, PyObject *obj, int typenum, int ndim,
                         const npy_intp *shape, int writeable);

/* The array that decides a call's dtype (float32 or float64, into *typenum), of any shape
 * with ndim dims. */
PyArrayObject *get_float_array(const char *fn, const char *name, PyObject *obj, int ndim,
                               int *typenum);

int get_int(const char *fn, const char *name, PyObject *obj, long long lo, long long hi,
            long long *out);
int get_double(const char *fn, const char *name, PyObject *obj, double lo, double *out);

/* *out from the last argument of the entry points whose kernels may multiply in bf16: whether
 * the float32 arrays hold bfloat16 values (obj true, typenum float32) */
int get_bf16_products(PyObject *obj, int typenum, int *out);

/* float32 or float64 of obj into *typenum: the first array decides the dtype of the call */
int float_type(const char *fn, const char *name, PyObject *obj, int *typenum);

/* cu must be int64 [n+1] with cu[0] = 0, non-decreasing, cu[n] = rows (rows < 0: any end);
 * n into *nseq */
const int64_t *get_cu(const char *fn, const char *name, PyObject *obj, int64_t rows,
                      int64_t *nseq);

/* An optional output: None (*out NULL), or a writeable array of the given shape. */
int optional_out(const char *fn, const char *name, PyObject *obj, int typenum, int ndim,
                 const npy_intp *shape, PyArrayObject **out);

static inline const pa_kernels *kernels_for(int typenum)
{
    return pa_select_kernels(typenum == NPY_FLOAT64);
}

static inline const void *data_or_null(PyArrayObject *a) { return a ? PyArray_DATA(a) : NULL; }

/* A kernel's status as None, or a MemoryError that says what could not be allocated. */
PyObject *finish(int rc);

/* ---- attention outputs and gradients (softmax and sparse attention) ---- */

/* The forward's outputs o (nd dims, shape oshape) and lse (its first nd - 1), written */
int attn_outputs(const char *fn, PyObject *o_obj, PyObject *lse_obj, int t, int nd,
                 const npy_intp *oshape, PyArrayObject **o, PyArrayObject **lse);

/* The arrays of an attention backward besides q, k, v: o (nd dims, shape oshape), lse (its
 * first nd - 1), do (as o) and dlse (None or as lse) from a, read; dq, dk, dv from g,
 * written, shaped as q, k, v. */
enum { GRAD_O, GRAD_LSE, GRAD_DO, GRAD_DLSE };
enum { GRAD_DQ, GRAD_DK, GRAD_DV };

typedef struct {
    PyArrayObject *o, *lse, *dout, *dlse, *dq, *dk, *dv;
} attn_grads;

int attn_grad_arrays(const char *fn, PyObject *const *a, PyObject *const *g, int t, int nd,
                     const npy_intp *oshape, PyArrayObject *q, PyArrayObject *k,
                     PyArrayObject *v, attn_grads *r);

/* ---- the linear and delta engines (one description, pa_linear_desc) ---- */

/* The engine's arrays a = (q, k, v, gk, gv, h0) and options opt = (cu, form, chunk, scale).
 * The gate kinds follow from gk's and gv's shapes (None, [B, T, H] or [B, T, H, K]); the
 * arrays (NULL for None) go to arr in a's order. */
enum { ENG_Q, ENG_K, ENG_V, ENG_GK, ENG_GV, ENG_H0, ENG_ARRAYS };
enum { ENG_CU, ENG_FORM, ENG_CHUNK, ENG_SCALE };

int linear_desc(const char *fn, PyObject *const *a, PyObject *const *opt, int *typenum,
                PyArrayObject **arr, pa_linear_desc *d);

/* A forward's outputs out = (o, final state or None, keep): o and the final state (NULL for
 * None) written; returns the new array of states to keep (keep true and the chunk form), or
 * None (a new reference either way). */
enum { ENG_OUT_O, ENG_OUT_HT, ENG_OUT_KEEP };

PyObject *engine_outputs(const char *fn, PyObject *const *out, int t, PyArrayObject *q,
                         const pa_linear_desc *d, PyArrayObject **o, PyArrayObject **ht);

/* The forward's result: the kept states, or the error of rc (the states dropped) */
PyObject *engine_result(PyObject *states, int rc);

/* A backward's arrays g = (do, dht (None: zero), the kept states (None: recompute), dq, dk,
 * dv) and dh0 (None: not wanted), given the engine's arrays in. */
enum { ENG_DO, ENG_DHT, ENG_STATES, ENG_DQ, ENG_DK, ENG_DV };

typedef struct {
    PyArrayObject *dout, *dht, *kept, *dq, *dk, *dv, *dh0;
} engine_grads;

int get_engine_grads(const char *fn, PyObject *const *g, PyObject *dh0, int t,
                     PyArrayObject *const *in, const pa_linear_desc *d, engine_grads *r);

#endif
