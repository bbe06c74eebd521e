/* Scalar log-space decays inside a block of rows: the clamped step, the cumulative gate kept
 * as a double hi + lo pair, and the decay mask. Template body (see core/dtype.h); needs
 * core/vmath.h before it. */

#ifndef PA_GATE_RESET
/* A step's log gate below -PA_GATE_RESET counts as -PA_GATE_RESET. exp underflows to exactly
 * 0 below -745.2 in double and -104 in float, so such a step still resets the state exactly,
 * as exp(-inf) does in the recurrence; but a gate of -inf no longer makes the cumulative sums
 * -inf (whose differences are NaN). The gradient of a clamped step is 0, as exp's is there. */
#define PA_GATE_RESET 1024
#endif

/* g clamped at -PA_GATE_RESET; NaN stays NaN. The quiet comparison (no invalid flag on NaN)
 * lets loops over channels vectorise it as a select. */
static inline double PA_FN(gate_step)(double g)
{
    return __builtin_isless(g, -PA_GATE_RESET) ? -PA_GATE_RESET : g;
}

/* (hi, lo) += x, lo collecting the rounding error of hi (Knuth's TwoSum): a cumulative gate
 * keeps the digits of small steps that follow large ones (-1e30, or a clamped reset). */
static inline void PA_FN(gate_sum2)(double *hi, double *lo, double x)
{
    const double s = *hi + x, b = s - *hi;
    *lo += (*hi - (s - b)) + (x - b);
    *hi = s;
}

/* G[i] + Gl[i] = g[0] + ... + g[i] over l clamped steps of stride ldg; with suffix,
 * -(g[i+1] + ... + g[l-1]) instead (the same differences G_i - G_j, taken from the block's
 * end: a NaN step then spoils only the rows before it). */
static inline void PA_FN(gate_cumsum)(const real *g, int64_t ldg, int64_t l, int suffix, double *G,
                                      double *Gl)
{
    double hi = 0, lo = 0;
    for (int64_t n = 0; n < l; n++) {
        const int64_t i = suffix ? l - 1 - n : n;
        const double x = PA_FN(gate_step)(g[i * ldg]);
        if (!suffix) PA_FN(gate_sum2)(&hi, &lo, x);
        G[i] = suffix ? -hi : hi;
        Gl[i] = suffix ? -lo : lo;
        if (suffix) PA_FN(gate_sum2)(&hi, &lo, x);
    }
}

/* dg of a block of l rows from dG (l x nc, row-major, summed in place): a step's log gate
 * enters the cumulative gate of its own row and every later one, so dg_i = dG_i + ... +
 * dG_(l-1), 0 where the step was clamped. Row by row, so both arrays stream. */
static inline void PA_FN(gate_grads_from_cumulative)(double *dG, int64_t l, int64_t nc,
                                                     const real *g, real *dg, int64_t ldg)
{
    for (int64_t i = l - 1; i >= 0; i--) {
        double *row = dG + i * nc;
        const real *gi = g + i * ldg;
        real *dgi = dg + i * ldg;
        if (i < l - 1)
            for (int64_t c = 0; c < nc; c++) row[c] += row[nc + c];
        for (int64_t c = 0; c < nc; c++) dgi[c] = gi[c] < -PA_GATE_RESET ? 0 : (real)row[c];
    }
}

/* G_i - G_j of a cumulative gate from its hi and lo parts; j < 0: G_i */
static inline double PA_FN(gate_diff)(const double *G, const double *Gl, int64_t i, int64_t j)
{
    return j < 0 ? G[i] + Gl[i] : (G[i] - G[j]) + (Gl[i] - Gl[j]);
}

/* Dm (l x l, leading dimension l): e^(G_i - G_j) on and below the diagonal (1 on it), 0
 * above; G NULL (no gate): the causal mask of ones. */
static void PA_FN(decay_mask)(const double *G, const double *Gl, int64_t l, real *Dm)
{
    for (int64_t i = 0; i < l; i++) {
        real *row = Dm + i * l;
        for (int64_t j = 0; j < i; j++) row[j] = G ? (real)PA_FN(gate_diff)(G, Gl, i, j) : 0;
        if (G) PA_FN(exp_array)(row, row, i);
        for (int64_t j = 0; !G && j < i; j++) row[j] = 1;
        row[i] = 1;
        for (int64_t j = i + 1; j < l; j++) row[j] = 0;
    }
}
