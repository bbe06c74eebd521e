/* pyattn._core's runtime, no op: the thread count, the array cache, what the build holds,
 * and the machine's peak rates for the benchmarks. */
#include "args.h"
#include "bind.h"

#include "array_cache.h"
#include "core/parallel.h"

#ifndef PYATTN_COMPILER
#define PYATTN_COMPILER "unknown"
#endif

/* fma_peak(double, seconds, threads) -> GFLOP/s of independent FMA chains */
enum { FMA_DOUBLE, FMA_SECONDS, FMA_THREADS, FMA_NARGS };

static PyObject *py_fma_peak(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("fma_peak", nargs, FMA_NARGS)) return NULL;
    int is_double = PyObject_IsTrue(args[FMA_DOUBLE]);
    double seconds;
    long long threads;
    if (is_double < 0 || get_double("fma_peak", "seconds", args[FMA_SECONDS], 0.0, &seconds) ||
        get_int("fma_peak", "threads", args[FMA_THREADS], 1, 4096, &threads))
        return NULL;
    const pa_kernels *K = pa_select_kernels(is_double);
    double g;
    Py_BEGIN_ALLOW_THREADS
    g = K->fma_peak(seconds, (int)threads);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(g);
}

/* read_bandwidth(seconds, threads, bytes) -> GB/s reading a buffer of that size */
enum { RB_SECONDS, RB_THREADS, RB_BYTES, RB_NARGS };

static PyObject *py_read_bandwidth(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const char *fn = "read_bandwidth";
    if (expect_nargs(fn, nargs, RB_NARGS)) return NULL;
    double seconds;
    long long threads, bytes;
    if (get_double(fn, "seconds", args[RB_SECONDS], 0.0, &seconds) ||
        get_int(fn, "threads", args[RB_THREADS], 1, 4096, &threads) ||
        get_int(fn, "bytes", args[RB_BYTES], 1 << 20, 1LL << 40, &bytes))
        return NULL;
    double g;
    Py_BEGIN_ALLOW_THREADS
    g = kernels_for(NPY_FLOAT32)->read_bandwidth(seconds, (int)threads, bytes);
    Py_END_ALLOW_THREADS
    if (g < 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(g);
}

/* set_num_threads(n) */
enum { SNT_N, SNT_NARGS };

static PyObject *py_set_num_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long n;
    if (expect_nargs("set_num_threads", nargs, SNT_NARGS) ||
        get_int("set_num_threads", "n", args[SNT_N], 1, 4096, &n))
        return NULL;
    pa_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("get_num_threads", nargs, 0)) return NULL;
    return PyLong_FromLong(pa_get_num_threads());
}

/* set_data_handler(handler) -> the previous handler */
enum { SDH_HANDLER, SDH_NARGS };

static PyObject *py_set_data_handler(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("set_data_handler", nargs, SDH_NARGS)) return NULL;
    PyObject *handler = args[SDH_HANDLER];
    if (handler != Py_None && !PyCapsule_IsValid(handler, "mem_handler")) {
        PyErr_SetString(PyExc_TypeError,
                        "set_data_handler: handler must be a NumPy 'mem_handler' capsule or None");
        return NULL;
    }
    return PyDataMem_SetHandler(handler == Py_None ? NULL : handler);
}

static PyObject *py_array_cache_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("array_cache_release", nargs, 0)) return NULL;
    return PyLong_FromSize_t(pa_cache_release());
}

static PyObject *py_array_cache_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("array_cache_kept", nargs, 0)) return NULL;
    return PyLong_FromSize_t(pa_cache_kept());
}

static PyObject *py_build_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (expect_nargs("build_info", nargs, 0)) return NULL;
    PyObject *isas = PyList_New(0);
    if (!isas) return NULL;
    for (int i = 0; i < PA_ISA_COUNT; i++) {
        if (!pa_kernels_for_isa(pa_isa_names[i], 0)) continue;
        PyObject *s = PyUnicode_FromString(pa_isa_names[i]);
        if (!s || PyList_Append(isas, s)) {
            Py_XDECREF(s);
            Py_DECREF(isas);
            return NULL;
        }
        Py_DECREF(s);
    }
    return Py_BuildValue("{s:s,s:N,s:s,s:O,s:i}", "isa", pa_selected_isa(), "isas_available",
                         isas, "compiler", PYATTN_COMPILER, "openmp",
                         pa_openmp_enabled() ? Py_True : Py_False, "num_threads",
                         pa_get_num_threads());
}

PyMethodDef pyattn_runtime_methods[] = {
    {"fma_peak", (PyCFunction)(void (*)(void))py_fma_peak, METH_FASTCALL,
     "fma_peak(double, seconds, threads) -> GFLOP/s of independent FMA chains"},
    {"read_bandwidth", (PyCFunction)(void (*)(void))py_read_bandwidth, METH_FASTCALL,
     "read_bandwidth(seconds, threads, bytes) -> GB/s reading a buffer of that size"},
    {"set_num_threads", (PyCFunction)(void (*)(void))py_set_num_threads, METH_FASTCALL,
     "set_num_threads(n)"},
    {"get_num_threads", (PyCFunction)(void (*)(void))py_get_num_threads, METH_FASTCALL,
     "get_num_threads() -> int"},
    {"set_data_handler", (PyCFunction)(void (*)(void))py_set_data_handler, METH_FASTCALL,
     "set_data_handler(handler) -> previous: NumPy's data-memory handler for the current "
     "context (a 'mem_handler' capsule such as ARRAY_CACHE, or None for NumPy's default)"},
    {"array_cache_release", (PyCFunction)(void (*)(void))py_array_cache_release, METH_FASTCALL,
     "array_cache_release() -> bytes: frees the blocks ARRAY_CACHE keeps"},
    {"array_cache_kept", (PyCFunction)(void (*)(void))py_array_cache_kept, METH_FASTCALL,
     "array_cache_kept() -> bytes: what ARRAY_CACHE keeps now"},
    {"build_info", (PyCFunction)(void (*)(void))py_build_info, METH_FASTCALL,
     "build_info() -> dict"},
    {NULL, NULL, 0, NULL},
};
