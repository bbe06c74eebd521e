/* bfloat16 <-> float32 conversion of whole arrays (core/bf16_convert.h): what a bf16 call
 * computed in float32 goes through on its way in and out. bf16 arrays arrive as uint16 views
 * of their bits. */
#include "args.h"
#include "bind.h"

#include "core/bf16_convert.h"

/* bf16_convert(src, dst): src uint16 (bf16 bits) and dst float32, or src float32 and dst
 * uint16; both flat and of one length */
enum { CONV_SRC, CONV_DST, CONV_NARGS };

static PyObject *py_bf16_convert(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "bf16_convert";
    if (expect_nargs(fn, nargs, CONV_NARGS)) return NULL;
    int widen = PyArray_Check(args[CONV_SRC]) &&
                PyArray_TYPE((PyArrayObject *)args[CONV_SRC]) == NPY_UINT16;
    npy_intp any = -1;
    PyArrayObject *src = get_array(fn, "src", args[CONV_SRC], widen ? NPY_UINT16 : NPY_FLOAT32, 1, &any, 0);
    if (!src) return NULL;
    npy_intp n = PyArray_DIM(src, 0);
    PyArrayObject *dst = get_array(fn, "dst", args[CONV_DST], widen ? NPY_FLOAT32 : NPY_UINT16, 1, &n, 1);
    if (!dst) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (widen)
        pa_f32_from_bf16(n, PyArray_DATA(src), PyArray_DATA(dst));
    else
        pa_bf16_from_f32(n, PyArray_DATA(src), PyArray_DATA(dst));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyMethodDef pyattn_bf16_methods[] = {
    {"bf16_convert", (PyCFunction)(void (*)(void))py_bf16_convert, METH_FASTCALL,
     "bf16_convert(src, dst): uint16 src (bfloat16 bits) to float32 dst, exactly; or float32 "
     "src to uint16 dst, rounded to nearest, ties to even, NaN staying NaN (1-D, one length)"},
    {NULL, NULL, 0, NULL},
};
