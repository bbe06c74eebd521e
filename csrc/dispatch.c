/* Run-time choice of the kernel tables: the first path of pa_isa_order this CPU (and OS)
 * supports, unless the environment variable PYATTN_ISA names another one it runs (for tests). */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PA_X86 1
extern const pa_kernels pa_kernels_f32_avx512, pa_kernels_f64_avx512;
extern const pa_kernels pa_kernels_f32_avx512_mr8, pa_kernels_f64_avx512_mr8;
extern const pa_kernels pa_kernels_f32_avx2, pa_kernels_f64_avx2;
#else
#define PA_X86 0
#endif
extern const pa_kernels pa_kernels_f32_generic, pa_kernels_f64_generic;

#if PA_X86
static int pa_cpu_has_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("fma");
}
#endif

const pa_kernels *pa_kernels_for_isa(const char *isa, int is_double)
{
#if PA_X86
    __builtin_cpu_init();
    if (!strcmp(isa, "avx512") && pa_cpu_has_avx512())
        return is_double ? &pa_kernels_f64_avx512 : &pa_kernels_f32_avx512;
    if (!strcmp(isa, "avx512_mr8") && pa_cpu_has_avx512())
        return is_double ? &pa_kernels_f64_avx512_mr8 : &pa_kernels_f32_avx512_mr8;
    if (!strcmp(isa, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return is_double ? &pa_kernels_f64_avx2 : &pa_kernels_f32_avx2;
#endif
    if (!strcmp(isa, "generic")) return is_double ? &pa_kernels_f64_generic : &pa_kernels_f32_generic;
    return NULL;
}

/* Every path, best first for this CPU: the two AVX-512 ones differ in their GEMM tile only,
 * and Intel CPUs run the 8-row one faster (csrc/isa/avx512_mr8.c). */
const char *const *pa_isa_order(void)
{
    static const char *const intel[PA_ISA_COUNT] = {"avx512_mr8", "avx512", "avx2", "generic"};
    static const char *const other[PA_ISA_COUNT] = {"avx512", "avx512_mr8", "avx2", "generic"};
#if PA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel")) return intel;
#endif
    return other;
}

static const char *selected_isa = "generic";
static const pa_kernels *selected[2] = {&pa_kernels_f32_generic, &pa_kernels_f64_generic};

void pa_dispatch_init(void)
{
    const char *const *order = pa_isa_order();
    const char *want = getenv("PYATTN_ISA");
    int pick = -1;
    for (int i = 0; i < PA_ISA_COUNT && pick < 0; i++)
        if (want && !strcmp(want, order[i]) && pa_kernels_for_isa(order[i], 0)) pick = i;
    for (int i = 0; i < PA_ISA_COUNT && pick < 0; i++)
        if (pa_kernels_for_isa(order[i], 0)) pick = i;
    selected_isa = order[pick];
    selected[0] = pa_kernels_for_isa(selected_isa, 0);
    selected[1] = pa_kernels_for_isa(selected_isa, 1);
}

const char *pa_selected_isa(void) { return selected_isa; }

const pa_kernels *pa_select_kernels(int is_double) { return selected[is_double != 0]; }
