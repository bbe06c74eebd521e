/* A row's vectors, loaded and stored: a full vector at p, or the last `left` (< VL) values
 * of a row (on a load, the other lanes 0). Shared by the feature maps and the linear and
 * delta-rule engines. Template body (see core/dtype.h); needs core/vmath.h before it. */

static inline vreal PA_FN(row_ld)(const real *p, int64_t left)
{
    return left >= VL ? PA_FN(vload)(p) : PA_FN(vload_part)(p, (int)left, 0);
}

static inline void PA_FN(row_st)(real *p, vreal x, int64_t left)
{
    if (left >= VL)
        PA_FN(vstore)(p, x);
    else
        PA_FN(vstore_part)(p, x, (int)left);
}
