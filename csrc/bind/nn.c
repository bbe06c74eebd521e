/* pyattn._core's building blocks of pyattn.nn and its training: the GEMM and exp of the
 * kernels (core/), and the pointwise steps (ops/pointwise.c). Outputs are written in place. */
#include "args.h"
#include "bind.h"

#include "core/gemm_bf16.h"

#include <math.h>

/* gemm(a, b, c, trans_a, trans_b, alpha, beta): c = alpha op(a) op(b) + beta c, 2-D arrays;
 * gemm_bf16, the same for float32 arrays multiplied in bf16 (beta 0 or 1) */
enum { GEMM_A, GEMM_B, GEMM_C, GEMM_TRANS_A, GEMM_TRANS_B, GEMM_ALPHA, GEMM_BETA, GEMM_NARGS };

static PyObject *gemm_binding(const char *fn, PyObject *const *args, Py_ssize_t nargs, int bf16)
{
    if (expect_nargs(fn, nargs, GEMM_NARGS)) return NULL;
    if (bf16 && pa_bf16_kind() == PA_BF16_NONE) {
        PyErr_Format(PyExc_RuntimeError, "%s(): this CPU (or PYATTN_ISA) gives no bf16 products "
                     "(AVX512-BF16 or AMX-BF16); pyattn.build_info()['isa'] says which path runs", fn);
        return NULL;
    }
    int t;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *a = get_float_array(fn, "a", args[GEMM_A], 2, &t);
    if (a && bf16 && t != NPY_FLOAT32) {
        PyErr_Format(PyExc_TypeError, "%s(): 'a' must be float32 (it is rounded to bf16)", fn);
        return NULL;
    }
    PyArrayObject *b = a ? get_array(fn, "b", args[GEMM_B], t, 2, any2, 0) : NULL;
    if (!b) return NULL;
    int ta = PyObject_IsTrue(args[GEMM_TRANS_A]), tb = PyObject_IsTrue(args[GEMM_TRANS_B]);
    if (ta < 0 || tb < 0) return NULL;
    npy_intp M = PyArray_DIM(a, ta ? 1 : 0), Ka = PyArray_DIM(a, ta ? 0 : 1);
    npy_intp Kb = PyArray_DIM(b, tb ? 1 : 0), N = PyArray_DIM(b, tb ? 0 : 1);
    if (Ka != Kb) {
        PyErr_Format(PyExc_ValueError, "%s(): inner dimensions differ: %lld and %lld", fn,
                     (long long)Ka, (long long)Kb);
        return NULL;
    }
    npy_intp cshape[2] = {M, N};
    PyArrayObject *c = get_array(fn, "c", args[GEMM_C], t, 2, cshape, 1);
    double alpha, beta;
    if (!c || get_double(fn, "alpha", args[GEMM_ALPHA], -INFINITY, &alpha) ||
        get_double(fn, "beta", args[GEMM_BETA], -INFINITY, &beta))
        return NULL;
    if (bf16 && beta != 0 && beta != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): beta must be 0 or 1, got %R", fn, args[GEMM_BETA]);
        return NULL;
    }
    npy_intp lda = PyArray_DIM(a, 1), ldb = PyArray_DIM(b, 1);
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (bf16)
        rc = pa_bf16_matmul(M, N, Ka, (float)alpha, PyArray_DATA(a), lda, ta, PyArray_DATA(b), ldb,
                            tb, (float)beta, PyArray_DATA(c), N);
    else
        rc = K->gemm(M, N, Ka, alpha, PyArray_DATA(a), ta ? 1 : lda, ta ? lda : 1, PyArray_DATA(b),
                     tb ? 1 : ldb, tb ? ldb : 1, beta, PyArray_DATA(c), N);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return gemm_binding("gemm", args, nargs, 0);
}

static PyObject *py_gemm_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return gemm_binding("gemm_bf16", args, nargs, 1);
}

/* exp(x, out), exp_nonpos(x, out): a vectorised exp (the general one, or the softmax's for
 * nonpos), elementwise over 1-D arrays */
enum { EXP_X, EXP_OUT, EXP_NARGS };

static PyObject *exp_binding(const char *fn, PyObject *const *args, Py_ssize_t nargs, int nonpos)
{
    if (expect_nargs(fn, nargs, EXP_NARGS)) return NULL;
    int t;
    PyArrayObject *x = get_float_array(fn, "x", args[EXP_X], 1, &t);
    if (!x) return NULL;
    npy_intp n = PyArray_DIM(x, 0);
    PyArrayObject *y = get_array(fn, "out", args[EXP_OUT], t, 1, &n, 1);
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

/* args[first .. last) (names[i] each) as arrays of dtype t and shape (nd, shape) into
 * a[first .. last), writeable from slot `outputs` on; a[i] NULL for a None where bit i of
 * `optional` is set. 0, or -1 with the error set. */
static int shaped_arrays(const char *fn, PyObject *const *args, const char *const *names,
                         int first, int last, int outputs, unsigned optional, int t, int nd,
                         const npy_intp *shape, PyArrayObject **a)
{
    for (int i = first; i < last; i++) {
        a[i] = NULL;
        if ((optional >> i & 1) && args[i] == Py_None) continue;
        if (!(a[i] = get_array(fn, names[i], args[i], t, nd, shape, i >= outputs))) return -1;
    }
    return 0;
}

/* shaped_arrays over args[0 .. n) with args[0]'s float dtype and shape (args[0] is never
 * optional); the element count, or -1 with the error set. */
static npy_intp same_shape_arrays(const char *fn, PyObject *const *args, const char *const *names,
                                  int n, int outputs, unsigned optional, PyArrayObject **a)
{
    int t;
    if (float_type(fn, names[0], args[0], &t)) return -1;
    PyArrayObject *first = (PyArrayObject *)args[0];
    if (shaped_arrays(fn, args, names, 0, n, outputs, optional & ~1u, t, PyArray_NDIM(first),
                      PyArray_DIMS(first), a))
        return -1;
    return PyArray_SIZE(a[0]);
}

/* silu(x, mul, y, s): s = sigmoid(x), y = x s, times mul (SwiGLU's product); mul None: no
 * factor; y None: the sigmoid only; any shape */
enum { SILU_X, SILU_MUL, SILU_Y, SILU_S, SILU_NARGS };

static PyObject *py_silu(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[SILU_NARGS] = {"x", "mul", "y", "s"};
    PyArrayObject *a[SILU_NARGS];
    npy_intp n;
    if (expect_nargs("silu", nargs, SILU_NARGS) ||
        (n = same_shape_arrays("silu", args, names, SILU_NARGS, SILU_Y,
                               1u << SILU_MUL | 1u << SILU_Y, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[SILU_X]));
    Py_BEGIN_ALLOW_THREADS
    K->silu_forward(n, PyArray_DATA(a[SILU_X]), data_or_null(a[SILU_MUL]),
                    a[SILU_Y] ? PyArray_DATA(a[SILU_Y]) : NULL, PyArray_DATA(a[SILU_S]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_backward(dy, y, s, dx): dx = dy (s + y (1 - s)); any shape */
enum { SILUB_DY, SILUB_Y, SILUB_S, SILUB_DX, SILUB_NARGS };

static PyObject *py_silu_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[SILUB_NARGS] = {"dy", "y", "s", "dx"};
    PyArrayObject *a[SILUB_NARGS];
    npy_intp n;
    if (expect_nargs("silu_backward", nargs, SILUB_NARGS) ||
        (n = same_shape_arrays("silu_backward", args, names, SILUB_NARGS, SILUB_DX, 0, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[SILUB_DY]));
    Py_BEGIN_ALLOW_THREADS
    K->silu_backward(n, PyArray_DATA(a[SILUB_DY]), PyArray_DATA(a[SILUB_Y]),
                     PyArray_DATA(a[SILUB_S]), PyArray_DATA(a[SILUB_DX]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* swiglu_backward(dh, a, b, s, da, db); any shape */
enum { SWB_DH, SWB_A, SWB_B, SWB_S, SWB_DA, SWB_DB, SWB_NARGS };

static PyObject *py_swiglu_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[SWB_NARGS] = {"dh", "a", "b", "s", "da", "db"};
    PyArrayObject *a[SWB_NARGS];
    npy_intp n;
    if (expect_nargs("swiglu_backward", nargs, SWB_NARGS) ||
        (n = same_shape_arrays("swiglu_backward", args, names, SWB_NARGS, SWB_DA, 0, a)) < 0)
        return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[SWB_DH]));
    Py_BEGIN_ALLOW_THREADS
    K->swiglu_backward(n, PyArray_DATA(a[SWB_DH]), PyArray_DATA(a[SWB_A]), PyArray_DATA(a[SWB_B]),
                       PyArray_DATA(a[SWB_S]), PyArray_DATA(a[SWB_DA]), PyArray_DATA(a[SWB_DB]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x [rows, d], eps, xhat [rows, d], rstd [rows], mean) */
enum { RMS_X, RMS_EPS, RMS_XHAT, RMS_RSTD, RMS_MEAN, RMS_NARGS };

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rms_norm";
    int t;
    double eps;
    int mean;
    if (expect_nargs(fn, nargs, RMS_NARGS) || float_type(fn, "x", args[RMS_X], &t) ||
        (mean = PyObject_IsTrue(args[RMS_MEAN])) < 0)
        return NULL;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *x = get_array(fn, "x", args[RMS_X], t, 2, any2, 0);
    if (!x || get_double(fn, "eps", args[RMS_EPS], 0.0, &eps)) return NULL;
    PyArrayObject *xhat = get_array(fn, "xhat", args[RMS_XHAT], t, 2, PyArray_DIMS(x), 1);
    PyArrayObject *rstd =
        xhat ? get_array(fn, "rstd", args[RMS_RSTD], t, 1, PyArray_DIMS(x), 1) : NULL;
    if (!rstd) return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->rms_norm_forward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), eps, mean, PyArray_DATA(x),
                        PyArray_DATA(xhat), PyArray_DATA(rstd));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm_backward(dxhat [rows, d], xhat [rows, d], rstd [rows], dx [rows, d], mean) */
enum { RMSB_DXHAT, RMSB_XHAT, RMSB_RSTD, RMSB_DX, RMSB_MEAN, RMSB_NARGS };

static PyObject *py_rms_norm_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rms_norm_backward";
    int t;
    int mean;
    if (expect_nargs(fn, nargs, RMSB_NARGS) || float_type(fn, "dxhat", args[RMSB_DXHAT], &t) ||
        (mean = PyObject_IsTrue(args[RMSB_MEAN])) < 0)
        return NULL;
    npy_intp any2[2] = {-1, -1};
    PyArrayObject *g = get_array(fn, "dxhat", args[RMSB_DXHAT], t, 2, any2, 0);
    PyArrayObject *h = g ? get_array(fn, "xhat", args[RMSB_XHAT], t, 2, PyArray_DIMS(g), 0) : NULL;
    PyArrayObject *r = h ? get_array(fn, "rstd", args[RMSB_RSTD], t, 1, PyArray_DIMS(g), 0) : NULL;
    PyArrayObject *dx = r ? get_array(fn, "dx", args[RMSB_DX], t, 2, PyArray_DIMS(g), 1) : NULL;
    if (!dx) return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->rms_norm_backward(PyArray_DIM(g, 0), PyArray_DIM(g, 1), mean, PyArray_DATA(g),
                         PyArray_DATA(h), PyArray_DATA(r), PyArray_DATA(dx));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* adamw_step(g, p, m, v, b1, b2, eps, decay, lr_c1, c2): p, m, v updated in place; any shape */
enum { AW_G, AW_P, AW_M, AW_V, AW_ARRAYS, AW_B1 = AW_ARRAYS, AW_B2, AW_EPS, AW_DECAY, AW_LR_C1,
       AW_C2, AW_NARGS };

static PyObject *py_adamw_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[AW_NARGS] = {"g",  "p",  "m",   "v",     "b1",
                                                "b2", "eps", "decay", "lr_c1", "c2"};
    PyArrayObject *a[AW_ARRAYS];
    double s[AW_NARGS];
    npy_intp n;
    if (expect_nargs("adamw_step", nargs, AW_NARGS) ||
        (n = same_shape_arrays("adamw_step", args, names, AW_ARRAYS, AW_P, 0, a)) < 0)
        return NULL;
    for (int i = AW_B1; i < AW_NARGS; i++) /* decay = 1 - lr wd may be negative, the others not */
        if (get_double("adamw_step", names[i], args[i], i == AW_DECAY ? -HUGE_VAL : 0.0, &s[i]))
            return NULL;
    const pa_kernels *K = kernels_for(PyArray_TYPE(a[AW_G]));
    Py_BEGIN_ALLOW_THREADS
    K->adamw_step(n, PyArray_DATA(a[AW_G]), PyArray_DATA(a[AW_P]), PyArray_DATA(a[AW_M]),
                  PyArray_DATA(a[AW_V]), s[AW_B1], s[AW_B2], s[AW_EPS], s[AW_DECAY], s[AW_LR_C1],
                  s[AW_C2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rotary(x [rows, H, D], cos [n, D], sin [n, D], sign, y [rows, H, D]): rows a multiple of
 * n, row r rotated by the tables' row r % n; D even; sign +1 or -1 */
enum { ROT_X, ROT_COS, ROT_SIN, ROT_SIGN, ROT_Y, ROT_NARGS };

static PyObject *py_rotary(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "rotary";
    int t;
    long long sign;
    if (expect_nargs(fn, nargs, ROT_NARGS)) return NULL;
    PyArrayObject *x = get_float_array(fn, "x", args[ROT_X], 3, &t);
    if (!x) return NULL;
    npy_intp tshape[2] = {-1, PyArray_DIM(x, 2)};
    PyArrayObject *c = get_array(fn, "cos", args[ROT_COS], t, 2, tshape, 0);
    if (c) tshape[0] = PyArray_DIM(c, 0);
    PyArrayObject *sn = c ? get_array(fn, "sin", args[ROT_SIN], t, 2, tshape, 0) : NULL;
    if (!sn || get_int(fn, "sign", args[ROT_SIGN], -1, 1, &sign)) return NULL;
    PyArrayObject *y = get_array(fn, "y", args[ROT_Y], t, 3, PyArray_DIMS(x), 1);
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

/* The inputs of a ShortConv call, first in both its entry points */
enum { CONV_X, CONV_STATE, CONV_W, CONV_BIAS };

/* The inputs a of a ShortConv call: x [B, T, C] (its dtype into *t), state None or
 * [B, K-1, C], w [K, C], bias None or [C] (None: NULL). */
static int conv_inputs(const char *fn, PyObject *const *a, int *t, PyArrayObject **x,
                       PyArrayObject **state, PyArrayObject **w, PyArrayObject **bias)
{
    npy_intp wshape[2] = {-1, -1};
    if (!(*x = get_float_array(fn, "x", a[CONV_X], 3, t))) return -1;
    wshape[1] = PyArray_DIM(*x, 2);
    if (!(*w = get_array(fn, "w", a[CONV_W], *t, 2, wshape, 0))) return -1;
    npy_intp K = PyArray_DIM(*w, 0);
    if (K < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): the kernel needs at least one tap, got w of %lld",
                     fn, (long long)K);
        return -1;
    }
    npy_intp sshape[3] = {PyArray_DIM(*x, 0), K - 1, PyArray_DIM(*x, 2)};
    *state = *bias = NULL;
    if (a[CONV_STATE] != Py_None &&
        !(*state = get_array(fn, "state", a[CONV_STATE], *t, 3, sshape, 0)))
        return -1;
    if (a[CONV_BIAS] != Py_None &&
        !(*bias = get_array(fn, "bias", a[CONV_BIAS], *t, 1, sshape + 2, 0)))
        return -1;
    return 0;
}

/* short_conv(x, state, w, bias, y, s): y = silu(u), s = sigmoid(u) of the causal depthwise
 * convolution u (see kernels.h) */
enum { SC_X, SC_STATE, SC_W, SC_BIAS, SC_Y, SC_S, SC_NARGS };

static PyObject *py_short_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "short_conv";
    int t;
    PyArrayObject *x, *state, *w, *bias, *a[SC_NARGS];
    static const char *const names[SC_NARGS] = {"x", "state", "w", "bias", "y", "s"};
    if (expect_nargs(fn, nargs, SC_NARGS) || conv_inputs(fn, args + SC_X, &t, &x, &state, &w, &bias) ||
        shaped_arrays(fn, args, names, SC_Y, SC_NARGS, SC_Y, 0, t, 3, PyArray_DIMS(x), a))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    Py_BEGIN_ALLOW_THREADS
    K->short_conv_forward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), PyArray_DIM(x, 2),
                          PyArray_DIM(w, 0), PyArray_DATA(x), data_or_null(state),
                          PyArray_DATA(w), data_or_null(bias), PyArray_DATA(a[SC_Y]),
                          PyArray_DATA(a[SC_S]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* short_conv_backward(x, state, w, bias, dy, y, s, dx, dw, dbias): dx, dw [K, C] and dbias
 * (None: not wanted) overwritten */
enum { SCB_X, SCB_STATE, SCB_W, SCB_BIAS, SCB_DY, SCB_Y, SCB_S, SCB_DX, SCB_DW, SCB_DBIAS,
       SCB_NARGS };

static PyObject *py_short_conv_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "short_conv_backward";
    int t;
    PyArrayObject *x, *state, *w, *bias, *a[SCB_NARGS], *dw, *db = NULL;
    static const char *const names[SCB_NARGS] = {"x",  "state", "w",  "bias", "dy",
                                                 "y",  "s",     "dx", "dw",   "dbias"};
    if (expect_nargs(fn, nargs, SCB_NARGS) ||
        conv_inputs(fn, args + SCB_X, &t, &x, &state, &w, &bias) ||
        shaped_arrays(fn, args, names, SCB_DY, SCB_DW, SCB_DX, 0, t, 3, PyArray_DIMS(x), a))
        return NULL;
    if (!(dw = get_array(fn, "dw", args[SCB_DW], t, 2, PyArray_DIMS(w), 1)) ||
        (args[SCB_DBIAS] != Py_None &&
         !(db = get_array(fn, "dbias", args[SCB_DBIAS], t, 1, PyArray_DIMS(x) + 2, 1))))
        return NULL;
    const pa_kernels *K = kernels_for(t);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = K->short_conv_backward(PyArray_DIM(x, 0), PyArray_DIM(x, 1), PyArray_DIM(x, 2),
                                PyArray_DIM(w, 0), PyArray_DATA(x), data_or_null(state),
                                PyArray_DATA(w), PyArray_DATA(a[SCB_DY]), PyArray_DATA(a[SCB_Y]),
                                PyArray_DATA(a[SCB_S]), PyArray_DATA(a[SCB_DX]), PyArray_DATA(dw),
                                db ? PyArray_DATA(db) : NULL);
    Py_END_ALLOW_THREADS
    return finish(rc);
}

PyMethodDef pyattn_nn_methods[] = {
    {"gemm", (PyCFunction)(void (*)(void))py_gemm, METH_FASTCALL,
     "gemm(a, b, c, trans_a, trans_b, alpha, beta): c = alpha op(a) op(b) + beta c"},
    {"gemm_bf16", (PyCFunction)(void (*)(void))py_gemm_bf16, METH_FASTCALL,
     "gemm_bf16(a, b, c, trans_a, trans_b, alpha, beta): gemm of float32 arrays with a and b "
     "rounded to bf16 and multiplied on the CPU's bf16 instructions, float32 accumulation; "
     "beta 0 or 1; a RuntimeError where the CPU has none"},
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
    {NULL, NULL, 0, NULL},
};
