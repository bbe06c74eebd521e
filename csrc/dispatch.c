/* Run-time choice of the kernel tables: the widest ISA this CPU (and OS) supports, unless
 * the environment variable PYATTN_ISA names another one the CPU runs (for tests). The two
 * bf16 paths, amx and avx512_bf16, are the AVX-512 tables with that kind of bf16 products
 * (core/gemm_bf16.h); avx512 and the narrower ones compute bf16 calls in float. */
#include <stdlib.h>
#include <string.h>

#include "core/gemm_bf16.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PA_X86 1
extern const pa_kernels pa_kernels_f32_avx512, pa_kernels_f64_avx512;
extern const pa_kernels pa_kernels_f32_avx2, pa_kernels_f64_avx2;
#else
#define PA_X86 0
#endif
extern const pa_kernels pa_kernels_f32_generic, pa_kernels_f64_generic;

const char *const pa_isa_names[PA_ISA_COUNT] = {"amx", "avx512_bf16", "avx512", "avx2", "generic"};
/* each name's kind of bf16 products */
static const int isa_bf16[PA_ISA_COUNT] = {PA_BF16_AMX, PA_BF16_AVX512, PA_BF16_NONE,
                                           PA_BF16_NONE, PA_BF16_NONE};

static int isa_index(const char *isa)
{
    for (int i = 0; i < PA_ISA_COUNT; i++)
        if (!strcmp(isa, pa_isa_names[i])) return i;
    return -1;
}

const pa_kernels *pa_kernels_for_isa(const char *isa, int is_double)
{
    const int i = isa_index(isa);
    if (i < 0 || !pa_bf16_available(isa_bf16[i])) return NULL;
#if PA_X86
    __builtin_cpu_init();
    if (i <= isa_index("avx512") && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma"))
        return is_double ? &pa_kernels_f64_avx512 : &pa_kernels_f32_avx512;
    if (i == isa_index("avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return is_double ? &pa_kernels_f64_avx2 : &pa_kernels_f32_avx2;
#endif
    if (i == isa_index("generic")) return is_double ? &pa_kernels_f64_generic : &pa_kernels_f32_generic;
    return NULL;
}

static const char *selected_isa = "generic";
static const pa_kernels *selected[2] = {&pa_kernels_f32_generic, &pa_kernels_f64_generic};

void pa_dispatch_init(void)
{
    const char *want = getenv("PYATTN_ISA");
    int pick = want && pa_kernels_for_isa(want, 0) ? isa_index(want) : -1;
    for (int i = 0; i < PA_ISA_COUNT && pick < 0; i++)
        if (pa_kernels_for_isa(pa_isa_names[i], 0)) pick = i;
    selected_isa = pa_isa_names[pick];
    selected[0] = pa_kernels_for_isa(selected_isa, 0);
    selected[1] = pa_kernels_for_isa(selected_isa, 1);
    pa_bf16_select(isa_bf16[pick]);
}

const char *pa_selected_isa(void) { return selected_isa; }

const pa_kernels *pa_select_kernels(int is_double) { return selected[is_double != 0]; }
