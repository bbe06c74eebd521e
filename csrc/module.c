/* pyattn._core, the module: its entry points are in bind/, each file with its slice of the
 * method table; this file joins the slices and sets the module up. */
#define PA_DEFINE_NUMPY_API
#include "bind/args.h"
#include "bind/bind.h"

#include <stdio.h>

#include "array_cache.h"
#include "core/parallel.h"

/* The slices, in the order their functions enter the module */
static PyMethodDef *const method_slices[] = {
    pyattn_softmax_methods, pyattn_sparse_methods, pyattn_feature_map_methods,
    pyattn_linear_methods,  pyattn_delta_methods,  pyattn_dplr_methods,
    pyattn_loglin_methods,  pyattn_nn_methods,     pyattn_runtime_methods,
    pyattn_bf16_methods,
};

/* Every slice's entries in one table ended by a {NULL} entry, built once: the module
 * definition keeps pointing at it for the life of the process. NULL: no memory. */
static PyMethodDef *joined_methods(void)
{
    static PyMethodDef *table;
    if (table) return table;
    const size_t nslices = sizeof method_slices / sizeof *method_slices;
    size_t count = 0;
    for (size_t s = 0; s < nslices; s++)
        for (const PyMethodDef *m = method_slices[s]; m->ml_name; m++) count++;
    PyMethodDef *joined = PyMem_Calloc(count + 1, sizeof *joined);
    if (!joined) return NULL;
    size_t at = 0;
    for (size_t s = 0; s < nslices; s++)
        for (const PyMethodDef *m = method_slices[s]; m->ml_name; m++) joined[at++] = *m;
    return table = joined;
}

/* NumPy's data-memory handler over array_cache.c; ARRAY_CACHE is its capsule (each array
 * made through it holds a reference; the handler itself is static). */
static PyDataMem_Handler array_cache_handler = {
    "pyattn_array_cache",
    1,
    {NULL, pa_cache_malloc, pa_cache_calloc, pa_cache_realloc, pa_cache_free},
};

static int core_exec(PyObject *m)
{
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    pa_dispatch_init();
    pa_parallel_init();
    pa_cache_init();
    PyObject *cache = PyCapsule_New(&array_cache_handler, "mem_handler", NULL);
    if (!cache || PyModule_AddObject(m, "ARRAY_CACHE", cache)) {
        Py_XDECREF(cache);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "FORM_PARALLEL", PA_FORM_PARALLEL) ||
        PyModule_AddIntConstant(m, "FORM_FLASH", PA_FORM_FLASH) ||
        PyModule_AddIntConstant(m, "FORM_RECURRENT", PA_FORM_RECURRENT) ||
        PyModule_AddIntConstant(m, "FORM_CHUNK", PA_FORM_CHUNK))
        return -1;
    for (int k = 0; k < PA_FM_COUNT; k++) {
        char name[32];
        snprintf(name, sizeof name, "FM_%s", pa_feature_map_names[k]);
        for (char *c = name + 3; *c; c++)
            if (*c >= 'a' && *c <= 'z') *c = (char)(*c - 'a' + 'A');
        if (PyModule_AddIntConstant(m, name, k)) return -1;
    }
    return 0;
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pyattn._core",
    .m_doc = "pyattn's C kernels. Use the pyattn package; these entry points check buffers but "
             "take every argument positionally.",
    .m_size = 0,
    .m_slots = core_slots,
};

PyMODINIT_FUNC PyInit__core(void)
{
    if (!(core_module.m_methods = joined_methods())) return PyErr_NoMemory();
    return PyModuleDef_Init(&core_module);
}
