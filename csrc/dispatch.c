/* Run-time choice of the kernel tables: the widest ISA this CPU (and OS) supports, unless
 * the environment variable PYATTN_ISA names another one the CPU runs (for tests). */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PA_X86 1
extern const pa_kernels pa_kernels_f32_avx512, pa_kernels_f64_avx512;
extern const pa_kernels pa_kernels_f32_avx2, pa_kernels_f64_avx2;
#else
#define PA_X86 0
#endif
extern const pa_kernels pa_kernels_f32_generic, pa_kernels_f64_generic;

const pa_kernels *pa_kernels_for_isa(const char *isa, int is_double)
{
#if PA_X86
    __builtin_cpu_init();
    if (!strcmp(isa, "avx512") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma"))
        return is_double ? &pa_kernels_f64_avx512 : &pa_kernels_f32_avx512;
    if (!strcmp(isa, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return is_double ? &pa_kernels_f64_avx2 : &pa_kernels_f32_avx2;
#endif
    if (!strcmp(isa, "generic")) return is_double ? &pa_kernels_f64_generic : &pa_kernels_f32_generic;
    return NULL;
}

static const char *selected_isa = "generic";
static const pa_kernels *selected[2] = {&pa_kernels_f32_generic, &pa_kernels_f64_generic};

void pa_dispatch_init(void)
{
    static const char *const order[] = {"avx512", "avx2", "generic"};
    const char *want = getenv("PYATTN_ISA");
    int pick = -1;
    for (int i = 0; i < 3 && pick < 0; i++)
        if (want && !strcmp(want, order[i]) && pa_kernels_for_isa(order[i], 0)) pick = i;
    for (int i = 0; i < 3 && pick < 0; i++)
        if (pa_kernels_for_isa(order[i], 0)) pick = i;
    selected_isa = order[pick];
    selected[0] = pa_kernels_for_isa(selected_isa, 0);
    selected[1] = pa_kernels_for_isa(selected_isa, 1);
}

const char *pa_selected_isa(void) { return selected_isa; }

const pa_kernels *pa_select_kernels(int is_double) { return selected[is_double != 0]; }
