/* What the delta-rule engine (ops/delta_rule.c) takes from the gated linear engine
 * (ops/linear_attn.c): the scan of a block for its non-finite rows, and the layout of the
 * states a chunk forward keeps. Template body (see core/dtype.h); needs core/vmath.h and
 * ops/rows.h before it. */

/* The rows of U (L x D) holding a NaN or an infinity, in order, into rows; returns their count */
static int64_t PA_FN(la_nonfinite_rows)(const real *U, int64_t ldu, int64_t L, int64_t D,
                                        int64_t *rows)
{
    int64_t n = 0;
    for (int64_t i = 0; i < L; i++) {
        vreal z = PA_FN(vset)(0); /* x * 0 is NaN exactly when x is not finite */
        for (int64_t d = 0; d < D; d += VL) z += PA_FN(row_ld)(U + i * ldu + d, D - d) * 0;
        const real t = PA_FN(hsum)(z);
        if (t != t) rows[n++] = i;
    }
    return n;
}

/* The kept-states layout (pa_linear_kept_states): first[u] is unit u's first slot, a slot per
 * block of L rows and one for the final state; NULL when out of memory. */
static int64_t *PA_FN(la_slots)(const pa_linear_desc *d, int64_t L)
{
    const int64_t units = d->nseq * d->H;
    int64_t *first = malloc(sizeof(int64_t) * (units + 1));
    if (!first) return NULL;
    first[0] = 0;
    for (int64_t u = 0; u < units; u++)
        first[u + 1] = first[u] + pa_linear_unit_states(d, u / d->H, L);
    return first;
}
