/* Scalar log-space decays inside a block of rows: the cumulative gate and the decay mask.
 * Template body (see core/dtype.h); needs core/vmath.h before it. */

#ifndef PA_GATE_FLOOR
/* A per-step log decay at or below this is a full reset in either dtype (e^-1000 is 0 in
 * double); clamping there keeps a block's cumulative sums finite, so a -inf gate gives the
 * same zeros as the recurrence instead of NaN from -inf - -inf. NaN passes unchanged. */
#define PA_GATE_FLOOR (-1000.0)
#endif

/* G[i] = g[0] + ... + g[i] over l steps of stride ldg (each step clamped at PA_GATE_FLOOR),
 * summed in double so that G_i - G_j keeps its digits; g NULL: all zeros. */
static inline void PA_FN(gate_cumsum)(const real *g, int64_t ldg, int64_t l, double *G)
{
    double acc = 0;
    for (int64_t i = 0; i < l; i++) {
        if (g) {
            double x = g[i * ldg];
            acc += x < PA_GATE_FLOOR ? PA_GATE_FLOOR : x;
        }
        G[i] = acc;
    }
}

/* Dm (l x l, leading dimension l): e^(G_i - G_j) on and below the diagonal, 0 above. */
static void PA_FN(decay_mask)(const double *G, int64_t l, real *Dm)
{
    for (int64_t i = 0; i < l; i++) {
        real *row = Dm + i * l;
        for (int64_t j = 0; j <= i; j++) row[j] = (real)(G[i] - G[j]);
        PA_FN(exp_array)(row, row, i + 1);
        for (int64_t j = i + 1; j < l; j++) row[j] = 0;
    }
}
