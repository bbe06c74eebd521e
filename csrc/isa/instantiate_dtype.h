/* One (dtype, ISA) instantiation: the template bodies, then the table's void* entries. */
#include "../core/dtype.h"
#include "../core/vmath.h"
#include "../core/gemm.c"
#include "../ops/rows.h"
#include "../ops/decay.h"
#include "../ops/softmax_rows.h"
#include "../ops/softmax_attn.c"
#include "../ops/sparse_attn.c"
#include "../ops/feature_maps.c"
#include "../ops/linear_engine.h"
#include "../ops/linear_attn.c"
#include "../ops/delta_rule.c"
#include "../ops/dplr.c"
#include "../ops/log_linear.c"
#include "../ops/pointwise.c"

static int PA_FN(gemm_entry)(int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                             int64_t rsa, int64_t csa, const void *B, int64_t rsb, int64_t csb,
                             double beta, void *C, int64_t ldc)
{
    return PA_FN(gemm_threaded)(M, N, K, (real)alpha, A, rsa, csa, B, rsb, csb, (real)beta, C,
                                ldc);
}

static void PA_FN(exp_entry)(const void *x, void *y, int64_t n, int nonpos)
{
    PA_FN(exp_array_by)(x, y, n, nonpos);
}

const pa_kernels PA_FN(pa_kernels) = {
    .isa = PA_STR(PA_ISA),
    .gemm = PA_FN(gemm_entry),
    .exp = PA_FN(exp_entry),
    .fma_peak = PA_FN(fma_peak),
    .read_bandwidth = PA_FN(read_bandwidth),
    .softmax_forward = PA_FN(softmax_forward),
    .softmax_backward = PA_FN(softmax_backward),
    .softmax_decode = PA_FN(softmax_decode),
    .softmax_decode_backward = PA_FN(softmax_decode_backward),
    .dsa_select = PA_FN(dsa_select),
    .dsa_index_loss = PA_FN(dsa_index_loss),
    .moba_select = PA_FN(moba_select),
    .moba_forward = PA_FN(moba_forward),
    .moba_backward = PA_FN(moba_backward),
    .feature_map_forward = PA_FN(feature_map_forward),
    .feature_map_backward = PA_FN(feature_map_backward),
    .linear_forward = PA_FN(linear_forward),
    .linear_backward = PA_FN(linear_backward),
    .delta_forward = PA_FN(delta_forward),
    .delta_backward = PA_FN(delta_backward),
    .dplr_forward = PA_FN(dplr_forward),
    .dplr_backward = PA_FN(dplr_backward),
    .loglin_forward = PA_FN(loglin_forward),
    .loglin_backward = PA_FN(loglin_backward),
    .efficient_forward = PA_FN(efficient_forward),
    .efficient_backward = PA_FN(efficient_backward),
    .silu_forward = PA_FN(silu_forward),
    .silu_backward = PA_FN(silu_backward),
    .swiglu_backward = PA_FN(swiglu_backward),
    .adamw_step = PA_FN(adamw_step),
    .rms_norm_forward = PA_FN(rms_norm_forward),
    .rms_norm_backward = PA_FN(rms_norm_backward),
    .rotary = PA_FN(rotary),
    .short_conv_forward = PA_FN(short_conv_forward),
    .short_conv_backward = PA_FN(short_conv_backward),
};
