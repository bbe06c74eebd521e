/* bfloat16 <-> float32 conversion of whole arrays (core/bf16_convert.h): what a bf16 call
 * computed in float32 goes through on its way in and out. bf16 arrays arrive as uint16 views
 * of their bits; both arrays are flat and of one length. */
#include "args.h"
#include "bind.h"

#include "core/bf16_convert.h"

enum { CONV_SRC, CONV_DST, CONV_NARGS };

/* src and dst: 1-D arrays of the given dtypes and one length */
static int conversion_arrays(const char *fn, PyObject *const *args, Py_ssize_t nargs,
                             int src_type, int dst_type, PyArrayObject **src, PyArrayObject **dst)
{
    if (expect_nargs(fn, nargs, CONV_NARGS)) return -1;
    npy_intp any = -1;
    *src = get_array(fn, "src", args[CONV_SRC], src_type, 1, &any, 0);
    if (!*src) return -1;
    npy_intp n = PyArray_DIM(*src, 0);
    *dst = get_array(fn, "dst", args[CONV_DST], dst_type, 1, &n, 1);
    return *dst ? 0 : -1;
}

/* bf16_to_float32(src uint16 [n], dst float32 [n]) */
static PyObject *py_bf16_to_float32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyArrayObject *src, *dst;
    if (conversion_arrays("bf16_to_float32", args, nargs, NPY_UINT16, NPY_FLOAT32, &src, &dst))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pa_f32_from_bf16(PyArray_DIM(src, 0), PyArray_DATA(src), PyArray_DATA(dst));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* float32_to_bf16(src float32 [n], dst uint16 [n]) */
static PyObject *py_float32_to_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyArrayObject *src, *dst;
    if (conversion_arrays("float32_to_bf16", args, nargs, NPY_FLOAT32, NPY_UINT16, &src, &dst))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pa_bf16_from_f32(PyArray_DIM(src, 0), PyArray_DATA(src), PyArray_DATA(dst));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef pyattn_bf16_methods[] = {
    {"bf16_to_float32", (PyCFunction)(void (*)(void))py_bf16_to_float32, METH_FASTCALL,
     "bf16_to_float32(src, dst): dst (float32 [n]) = the values of src's bfloat16 bits "
     "(uint16 [n]), exactly"},
    {"float32_to_bf16", (PyCFunction)(void (*)(void))py_float32_to_bf16, METH_FASTCALL,
     "float32_to_bf16(src, dst): dst (uint16 [n]) = the bfloat16 bits of src (float32 [n]) "
     "rounded to nearest, ties to even; NaN stays NaN"},
    {NULL, NULL, 0, NULL},
};
