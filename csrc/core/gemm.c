/* Packed, register-blocked GEMM. Template body (see dtype.h).
 *
 *   C[M x N] = alpha * A[M x K] * B[K x N] + beta * C      (beta == 0: C is not read)
 *
 * A and B are addressed through row and column strides, so transposes (and the strided
 * [T, H, D] rows of attention) cost nothing extra: A(i, p) = A[i*rsa + p*csa],
 * B(p, j) = B[p*rsb + j*csb]. C is row-major with leading dimension ldc.
 * Loop nest as in BLIS/GotoBLAS: the micro-kernel accumulates an MR x NR tile in registers
 * from MR rows of A and NR columns of B over KC steps. It reads A in place where A is
 * row-major or transposed, and B in place where B is row-major (for `gemm`, with rows not a
 * multiple of 4 KiB apart: rows_in_place); what
 * it cannot read as it is (other strides, a last panel narrower than MR or NR) is packed
 * into MR x KC and KC x NR micro-panels, zero-padded at the ragged edges. The caller passes
 * `work` of gemm_work_elems(M, N, K) reals.
 */
#include "gemm.h"
#include "gemm_bf16.h"

/* gemm and gemm_packed_b multiply in bf16 on a thread where pa_gemm_in_bf16 is on (see
 * gemm_bf16.h), where beta is 0 or 1 and each operand has a unit stride one way: the float
 * instantiation of the AVX-512 build, which the amx and avx512_bf16 paths run */
#undef GEMM_BF16
#define GEMM_BF16 (!PA_DOUBLE && PA_VBYTES == 64)

static int64_t PA_FN(gemm_work_elems)(int64_t M, int64_t N, int64_t K)
{
    int64_t mc = M < MC ? (M + MR - 1) / MR * MR : MC;
    int64_t kc = K < KC ? K : KC;
    int64_t nc = N < NC ? (N + NR - 1) / NR * NR : NC;
    int64_t elems = mc * kc + kc * nc;
#if GEMM_BF16
    /* gemm_bf16's blocks: rows and columns rounded up to PA_BF16_PAD, pairs to PA_BF16_KSTEP */
    const int64_t words = (pa_bf16_round(M < MC ? M : MC, PA_BF16_PAD) +
                           pa_bf16_round(N < NC ? N : NC, PA_BF16_PAD)) * (pa_bf16_dp(kc) / 2);
    if (words > elems) elems = words;
#endif
    return elems;
}

/* The butterfly's lane indices, constants of each instantiation: at stage k (s = VL/2 >> k),
 * lo takes lane l of the first operand where bit s of l is clear and lane l - s of the
 * second where it is set; hi the mirror. Rows hold the widest vector's 16 lanes; a narrower
 * one reads its first VL, and stages past log2(VL) are never read. */
#ifndef PA_TR_ROW
#define PA_TR_LO(s, l) (((l) & (s)) ? VL + (l) - (s) : (l))
#define PA_TR_HI(s, l) (((l) & (s)) ? VL + (l) : (l) + (s))
#define PA_TR_ROW(F, s)                                                                         \
    {F(s, 0), F(s, 1), F(s, 2),  F(s, 3),  F(s, 4),  F(s, 5),  F(s, 6),  F(s, 7),              \
     F(s, 8), F(s, 9), F(s, 10), F(s, 11), F(s, 12), F(s, 13), F(s, 14), F(s, 15)}
#define PA_TR_TABLE(F) {PA_TR_ROW(F, VL / 2), PA_TR_ROW(F, VL / 4), PA_TR_ROW(F, VL / 8), PA_TR_ROW(F, VL / 16)}
#endif
static const ivec_elem PA_FN(tr_lo)[4][16] = PA_TR_TABLE(PA_TR_LO);
static const ivec_elem PA_FN(tr_hi)[4][16] = PA_TR_TABLE(PA_TR_HI);

/* r[0..VL) the rows of a VL x VL block; on return its columns. log2(VL) butterfly stages,
 * each swapping the off-diagonal s x s sub-blocks of every 2s x 2s block. */
static inline void PA_FN(vtranspose)(vreal *r)
{
#pragma GCC unroll 4
    for (int s = VL / 2, k = 0; s >= 1; s /= 2, k++) {
        vint lo, hi;
        memcpy(&lo, PA_FN(tr_lo)[k], sizeof lo);
        memcpy(&hi, PA_FN(tr_hi)[k], sizeof hi);
#pragma GCC unroll 16
        for (int i = 0; i < VL; i++) {
            if (i & s) continue;
            vreal a = r[i], b = r[i + s];
            r[i] = __builtin_shuffle(a, b, lo);
            r[i + s] = __builtin_shuffle(a, b, hi);
        }
    }
}

/* Row p of a packed panel from the m (<= VL) lanes of x at d: a whole vector where it ends
 * inside the panel (room: the reals from d to the panel's end), since the lanes past m land
 * on the next rows' first entries, which the packing writes afterwards. */
static inline void PA_FN(pack_row)(real *d, vreal x, int m, int64_t room)
{
    if (m == VL || room >= VL)
        PA_FN(vstore)(d, x);
    else
        PA_FN(vstore_part)(d, x, m);
}

static void PA_FN(pack_a)(int64_t mc, int64_t kc, const real *A, int64_t rsa, int64_t csa,
                          real *restrict Ap)
{
    for (int64_t ir = 0; ir < mc; ir += MR) {
        int64_t mr = mc - ir < MR ? mc - ir : MR;
        real *dst = Ap + ir * kc;
        if (rsa == 1) { /* A^T stored row-major: MR contiguous reals per p */
            for (int64_t p = 0; p < kc; p++) {
                const real *src = A + ir + p * csa;
                for (int i0 = 0; i0 < MR; i0 += VL) {
                    const int m = MR - i0 < VL ? MR - i0 : VL;
                    const int64_t have = mr - i0 < 0 ? 0 : mr - i0; /* rows of A, then zeros */
                    /* a whole vector where the block has its rows (the lanes past m are the
                     * next panel's), else the rows there are */
                    vreal x = ir + i0 + VL <= mc ? PA_FN(vload)(src + i0)
                                                 : PA_FN(vload_part)(src + i0, (int)(have < m ? have : m), 0);
                    PA_FN(pack_row)(dst + p * MR + i0, x, m, (kc - p) * MR - i0);
                }
            }
            continue;
        }
        if (csa == 1) { /* row-major A: VL x VL blocks transposed, zero rows past mr */
            int64_t p0 = 0;
            for (; p0 + VL <= kc; p0 += VL)
                /* blocks of VL rows from the last (maybe shorter) one down, so that row p's
                 * overflow (pack_row) is overwritten by the block at i0 = 0 or the next p0 */
                for (int i0 = (MR - 1) / VL * VL; i0 >= 0; i0 -= VL) {
                    const int m = MR - i0 < VL ? MR - i0 : VL;
                    vreal r[VL];
                    for (int i = 0; i < VL; i++)
                        r[i] = i < m && i0 + i < mr ? PA_FN(vload)(A + (ir + i0 + i) * rsa + p0)
                                                    : PA_FN(vset)(0);
                    PA_FN(vtranspose)(r);
                    for (int p = 0; p < VL; p++)
                        PA_FN(pack_row)(dst + (p0 + p) * MR + i0, r[p], m, (kc - p0 - p) * MR - i0);
                }
            for (int64_t p = p0; p < kc; p++)
                for (int64_t i = 0; i < MR; i++) dst[p * MR + i] = i < mr ? A[(ir + i) * rsa + p] : 0;
            continue;
        }
        for (int64_t i = 0; i < MR; i++) {
            if (i < mr) {
                const real *src = A + (ir + i) * rsa;
                for (int64_t p = 0; p < kc; p++) dst[p * MR + i] = src[p * csa];
            } else {
                for (int64_t p = 0; p < kc; p++) dst[p * MR + i] = 0;
            }
        }
    }
}

static void PA_FN(pack_b)(int64_t kc, int64_t nc, const real *B, int64_t rsb, int64_t csb,
                          real *restrict Bp)
{
    for (int64_t jr = 0; jr < nc; jr += NR) {
        int64_t nr = nc - jr < NR ? nc - jr : NR;
        real *dst = Bp + jr * kc;
        if (csb == 1 && nr == NR) { /* whole rows of the panel: NV vectors each */
            for (int64_t p = 0; p < kc; p++)
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++)
                    PA_FN(vstore)(dst + p * NR + v * VL, PA_FN(vload)(B + p * rsb + jr + v * VL));
        } else if (csb == 1) {
            for (int64_t p = 0; p < kc; p++) {
                const real *src = B + p * rsb + jr;
                int64_t j = 0;
                for (; j < nr; j++) dst[p * NR + j] = src[j];
                for (; j < NR; j++) dst[p * NR + j] = 0;
            }
        } else if (rsb == 1 && nr == NR) { /* B^T row-major: VL x VL blocks transposed */
            int64_t p0 = 0;
            for (; p0 + VL <= kc; p0 += VL)
                for (int v = 0; v < NV; v++) {
                    vreal r[VL];
                    for (int j = 0; j < VL; j++)
                        r[j] = PA_FN(vload)(B + (jr + v * VL + j) * csb + p0);
                    PA_FN(vtranspose)(r);
                    for (int p = 0; p < VL; p++) PA_FN(vstore)(dst + (p0 + p) * NR + v * VL, r[p]);
                }
            for (int64_t p = p0; p < kc; p++)
                for (int64_t j = 0; j < NR; j++) dst[p * NR + j] = B[p + (jr + j) * csb];
        } else {
            for (int64_t j = 0; j < NR; j++) {
                if (j < nr) {
                    const real *src = B + (jr + j) * csb;
                    for (int64_t p = 0; p < kc; p++) dst[p * NR + j] = src[p * rsb];
                } else {
                    for (int64_t p = 0; p < kc; p++) dst[p * NR + j] = 0;
                }
            }
        }
    }
}

/* C (mr x nr of ldc) = alpha t + beta C (beta == 0: C is not read), t a tile of rows of NR:
 * the micro-kernel's epilogue for ragged tiles, and gemm_few_rows'. */
static inline void PA_FN(store_tile)(const real *t, int64_t mr, int64_t nr, real alpha,
                                     real beta, real *C, int64_t ldc)
{
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            real r = alpha * t[i * NR + j];
            C[i * ldc + j] = beta != 0 ? r + beta * C[i * ldc + j] : r;
        }
}

/* C tile (mr x nr valid) = alpha * A B + beta * C, with A(i, p) = a[i * ras + p * aps]
 * (ras = 1, aps = MR for a packed panel; ras = 1, aps = ld for a transposed A read in place;
 * ras = lda, aps = 1 for rows of a row-major A read in place) and B(p, j) = b[p * bs + j]
 * (bs = NR packed, ldb in place). It multiplies `rows` rows of A (mr <= rows <= MR; the rows
 * past mr are read, as zeros of a packing or readable memory). Always inlined, so that each
 * caller's constant stride and row count give their own loop. */
static inline __attribute__((always_inline)) void PA_FN(micro_kernel)(
    int64_t kc, const real *restrict a, int64_t ras, int64_t aps, const real *restrict b,
    int64_t bs, real *C, int64_t ldc, int64_t mr, int64_t nr, real alpha, real beta,
    const int rows)
{
    vreal acc[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < rows; i++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            acc[i][v] = PA_FN(vset)(0);
            __builtin_prefetch(C + i * ldc + v * VL, 1, 3);
        }
    for (int64_t p = 0; p < kc; p++) {
        vreal bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) bv[v] = PA_FN(vload)(b + p * bs + v * VL);
#pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            vreal ai = PA_FN(vset)(a[i * ras + p * aps]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[i][v] += ai * bv[v];
        }
    }
    if (mr == rows && nr == NR) {
#pragma GCC unroll 16
        for (int i = 0; i < rows; i++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                real *c = C + i * ldc + v * VL;
                vreal r = acc[i][v] * alpha;
                if (beta != 0) r += beta * PA_FN(vload)(c);
                PA_FN(vstore)(c, r);
            }
        return;
    }
    real tile[MR * NR];
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < NV; v++) PA_FN(vstore)(tile + i * NR + v * VL, acc[i][v]);
    PA_FN(store_tile)(tile, mr, nr, alpha, beta, C, ldc);
}

/* Shapes with nothing to multiply, handled here for every entry: an empty C, or K = 0
 * (C = beta C). Returns 1 when the call is done. */
static int PA_FN(gemm_trivial)(int64_t M, int64_t N, int64_t K, real beta, real *C, int64_t ldc)
{
    if (M > 0 && N > 0 && K > 0) return 0;
    for (int64_t i = 0; i < M && K <= 0; i++)
        for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta != 0 ? beta * C[i * ldc + j] : 0;
    return 1;
}

/* Reals needed to pack an M x K matrix whole with pack_a (panels of MR rows, K each). */
static int64_t PA_FN(packed_a_elems)(int64_t M, int64_t K) { return (M + MR - 1) / MR * MR * K; }

/* The loop over micro-tiles of gemm_packed_ab and gemm_macro: A(i, p) at
 * Ap[(i / MR) * ars + (i % MR) * ras + p * aps], B(p, j) at Bp[(j / NR) * bps + p * bs + j % NR]
 * (packed: bps = K * NR, bs = NR; row-major, read in place: bps = NR, bs = ldb). */
static inline __attribute__((always_inline)) void PA_FN(micro_tiles)(
    int64_t M, int64_t N, int64_t K, real alpha, const real *Ap, int64_t ars, int64_t ras,
    int64_t aps, const real *Bp, int64_t bps, int64_t bs, real beta, real *C, int64_t ldc)
{
    for (int64_t pc = 0; pc < K; pc += KC) {
        int64_t kc = K - pc < KC ? K - pc : KC;
        for (int64_t jr = 0; jr < N; jr += NR) {
            int64_t nr = N - jr < NR ? N - jr : NR;
            for (int64_t ir = 0; ir < M; ir += MR) {
                int64_t mr = M - ir < MR ? M - ir : MR;
                const real *a = Ap + ir / MR * ars + pc * aps, *b = Bp + jr / NR * bps + pc * bs;
                real *c = C + ir * ldc + jr, bt = pc == 0 ? beta : 1;
                /* a last panel of few rows (64 = 5 x 12 + 4) runs a kernel of a third or two
                 * thirds of MR rows rather than FMAs on its zero padding */
                if (mr > 2 * MR / 3)
                    PA_FN(micro_kernel)(kc, a, ras, aps, b, bs, c, ldc, mr, nr, alpha, bt, MR);
                else if (mr > MR / 3)
                    PA_FN(micro_kernel)(kc, a, ras, aps, b, bs, c, ldc, mr, nr, alpha, bt, 2 * MR / 3);
                else
                    PA_FN(micro_kernel)(kc, a, ras, aps, b, bs, c, ldc, mr, nr, alpha, bt, MR / 3);
            }
        }
    }
}

/* gemm with both operands laid out by the caller, nothing packed here: A(i, p) at
 * Ap[(i / MR) * ars + p * aps + i % MR], i.e. row panels of MR rows ars apart, p-stride aps
 * inside a panel. A pack_a(M, K, ...) packing is ars = MR * K, aps = MR (rows r.. of a larger
 * one start at Ap + r * K, r a multiple of MR); a K x M matrix with M contiguous (A^T stored
 * row-major with leading dimension ld) is ars = MR, aps = ld, and is read in place (its rows
 * past M, up to the next multiple of MR, are read too and must be readable). B as for
 * gemm_packed_b. */
static void PA_FN(gemm_packed_ab)(int64_t M, int64_t N, int64_t K, real alpha, const real *Ap,
                                  int64_t ars, int64_t aps, const real *Bp, int64_t bps,
                                  real beta, real *C, int64_t ldc)
{
    if (PA_FN(gemm_trivial)(M, N, K, beta, C, ldc)) return;
    PA_FN(micro_tiles)(M, N, K, alpha, Ap, ars, 1, aps, Bp, bps, NR, beta, C, ldc);
}

/* Whether rows rs reals apart are read in place: not where they lie a multiple of 4 KiB
 * apart, since the rows the micro-kernel reads at once would fall in one set of the L1 cache. */
static inline int PA_FN(rows_in_place)(int64_t rs) { return (rs * (int64_t)sizeof(real)) % 4096 != 0; }

/* C[M x nc] (op), B laid out as micro_tiles reads it (packed, or row-major in place), MC
 * rows of A at a time. Where A already has a layout the micro-kernel can read, packing it
 * would only copy each element once more: row-major (csa = 1) or transposed (rsa = 1) A is
 * read in place, but for a last panel of fewer than MR rows (the micro-kernel reads MR),
 * which is packed into Ap. A row-major A whose rows rows_in_place refuses is packed too.
 * Either way each C entry sees the same FMAs in the same order. */
static void PA_FN(gemm_macro)(int64_t M, int64_t nc, int64_t kc, real alpha, const real *A,
                              int64_t rsa, int64_t csa, const real *Bp, int64_t bps, int64_t bs,
                              real beta, real *C, int64_t ldc, real *Ap)
{
    int rowmajor = csa == 1 && PA_FN(rows_in_place)(rsa);
    int transposed = !rowmajor && rsa == 1;
    for (int64_t ic = 0; ic < M; ic += MC) {
        int64_t mc = M - ic < MC ? M - ic : MC;
        int64_t inplace = rowmajor || transposed ? mc / MR * MR : 0;
        if (rowmajor)
            PA_FN(micro_tiles)(inplace, nc, kc, alpha, A + ic * rsa, MR * rsa, rsa, 1, Bp, bps,
                               bs, beta, C + ic * ldc, ldc);
        else if (transposed)
            PA_FN(micro_tiles)(inplace, nc, kc, alpha, A + ic, MR, 1, csa, Bp, bps, bs, beta,
                               C + ic * ldc, ldc);
        if (inplace < mc) {
            PA_FN(pack_a)(mc - inplace, kc, A + (ic + inplace) * rsa, rsa, csa, Ap);
            PA_FN(micro_tiles)(mc - inplace, nc, kc, alpha, Ap, MR * kc, 1, MR, Bp, bps, bs,
                               beta, C + (ic + inplace) * ldc, ldc);
        }
    }
}

/* gemm_macro over a row-major B (csb = 1, rows rsb apart) read in place: its full NR-column
 * panels as they are, a narrower last panel packed into Bp (kc x NR). */
static void PA_FN(gemm_macro_b_rows)(int64_t M, int64_t nc, int64_t kc, real alpha, const real *A,
                                     int64_t rsa, int64_t csa, const real *B, int64_t rsb,
                                     real beta, real *C, int64_t ldc, real *Ap, real *Bp)
{
    const int64_t full = nc / NR * NR;
    if (full > 0)
        PA_FN(gemm_macro)(M, full, kc, alpha, A, rsa, csa, B, NR, rsb, beta, C, ldc, Ap);
    if (full < nc) {
        PA_FN(pack_b)(kc, nc - full, B + full, rsb, 1, Bp);
        PA_FN(gemm_macro)(M, nc - full, kc, alpha, A, rsa, csa, Bp, kc * NR, NR, beta, C + full,
                          ldc, Ap);
    }
}

#if GEMM_BF16
/* ---- products in bf16 (gemm_bf16.h), for gemm and gemm_packed_b where pa_gemm_in_bf16 ---- */

/* B block (kc x nc) as a B-form operand (pa_bf16_block_b): strided, or, where fbps > 0, from a
 * pack_b packing (B(p, j) at B[(j / NR) fbps + p NR + j % NR]), one NR-column panel at a time */
static void PA_FN(bf16_block_b)(int64_t kc, int64_t nc, const real *B, int64_t rsb, int64_t csb,
                                int64_t fbps, uint32_t *out)
{
    if (fbps <= 0) {
        pa_bf16_block_b(kc, nc, B, rsb, csb, out);
        return;
    }
    const int64_t bps = pa_bf16_dp(kc) / 2 * 16;
    for (int64_t j = 0; j < nc; j += NR)
        pa_bf16_block_b(kc, nc - j < NR ? nc - j : NR, B + j / NR * fbps, NR, 1, out + j / 16 * bps);
}

/* gemm's C = alpha A B + beta C, beta 0 or 1 (as pa_bf16_gemm takes it), with both operands
 * rounded to bf16 block by block (MC x KC of A, KC x NC of B) and multiplied by pa_bf16_gemm,
 * float32 accumulation. B as bf16_block_b takes it. work: gemm_work_elems(M, N, K) reals. */
static void PA_FN(gemm_bf16)(int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                             int64_t rsa, int64_t csa, const real *B, int64_t rsb, int64_t csb,
                             int64_t fbps, real beta, real *C, int64_t ldc, real *work)
{
    uint32_t *a = (uint32_t *)work;
    uint32_t *b = a + pa_bf16_round(M < MC ? M : MC, PA_BF16_PAD) * (pa_bf16_dp(K < KC ? K : KC) / 2);
    for (int64_t jc = 0; jc < N; jc += NC) {
        const int64_t nc = N - jc < NC ? N - jc : NC;
        for (int64_t pc = 0; pc < K; pc += KC) {
            const int64_t kc = K - pc < KC ? K - pc : KC, words = pa_bf16_dp(kc) / 2;
            const real *Bb = fbps > 0 ? B + jc / NR * fbps + pc * NR : B + pc * rsb + jc * csb;
            PA_FN(bf16_block_b)(kc, nc, Bb, rsb, csb, fbps, b);
            for (int64_t ic = 0; ic < M; ic += MC) {
                const int64_t mc = M - ic < MC ? M - ic : MC;
                pa_bf16_block_a(mc, kc, A + ic * rsa + pc * csa, rsa, csa, a);
                pa_bf16_gemm(mc, nc, words, alpha, a, words, b, words * 16, pc == 0 ? beta : 1,
                             C + ic * ldc + jc, ldc);
            }
        }
    }
}
#endif

static void PA_FN(gemm)(int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                        int64_t rsa, int64_t csa, const real *B, int64_t rsb, int64_t csb,
                        real beta, real *C, int64_t ldc, real *work)
{
    if (PA_FN(gemm_trivial)(M, N, K, beta, C, ldc)) return;
#if GEMM_BF16
    if (pa_gemm_in_bf16 && (beta == 0 || beta == 1) && (csa == 1 || rsa == 1) &&
        (csb == 1 || rsb == 1)) {
        PA_FN(gemm_bf16)(M, N, K, alpha, A, rsa, csa, B, rsb, csb, 0, beta, C, ldc, work);
        return;
    }
#endif
    int64_t mcmax = M < MC ? (M + MR - 1) / MR * MR : MC;
    int64_t kcmax = K < KC ? K : KC;
    real *Ap = work, *Bp = work + mcmax * kcmax;
    const int inplace = csb == 1 && PA_FN(rows_in_place)(rsb);
    for (int64_t jc = 0; jc < N; jc += NC) {
        int64_t nc = N - jc < NC ? N - jc : NC;
        for (int64_t pc = 0; pc < K; pc += KC) {
            int64_t kc = K - pc < KC ? K - pc : KC;
            const real bb = pc == 0 ? beta : 1;
            const real *Bb = B + pc * rsb + jc * csb;
            if (inplace) {
                PA_FN(gemm_macro_b_rows)(M, nc, kc, alpha, A + pc * csa, rsa, csa, Bb, rsb, bb,
                                         C + jc, ldc, Ap, Bp);
                continue;
            }
            PA_FN(pack_b)(kc, nc, Bb, rsb, csb, Bp);
            PA_FN(gemm_macro)(M, nc, kc, alpha, A + pc * csa, rsa, csa, Bp, kc * NR, NR, bb,
                              C + jc, ldc, Ap);
        }
    }
}

/* Reals needed to pack a K x N matrix whole with pack_b: panels of NR columns, K rows each. */
static int64_t PA_FN(packed_b_elems)(int64_t K, int64_t N) { return (N + NR - 1) / NR * NR * K; }

/* gemm with B packed once by the caller: pack_b(K, N, ...) into Bp, so panel j starts at
 * Bp + j * bps with bps = K * NR (or a row offset into such a packing: rows r.. of a packing
 * of more rows are at Bp + r * NR with the same bps). work: gemm_work_elems reals. */
static void PA_FN(gemm_packed_b)(int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                                 int64_t rsa, int64_t csa, const real *Bp, int64_t bps,
                                 real beta, real *C, int64_t ldc, real *work)
{
    if (PA_FN(gemm_trivial)(M, N, K, beta, C, ldc)) return;
#if GEMM_BF16
    if (pa_gemm_in_bf16 && (beta == 0 || beta == 1) && (csa == 1 || rsa == 1)) {
        PA_FN(gemm_bf16)(M, N, K, alpha, A, rsa, csa, Bp, 0, 0, bps, beta, C, ldc, work);
        return;
    }
#endif
    for (int64_t pc = 0; pc < K; pc += KC) {
        int64_t kc = K - pc < KC ? K - pc : KC;
        PA_FN(gemm_macro)(M, N, kc, alpha, A + pc * csa, rsa, csa, Bp + pc * NR, bps, NR,
                          pc == 0 ? beta : 1, C, ldc, work);
    }
}

/* gemm for fewer rows of C than a micro-panel (decoding's matrix-vector products): the
 * micro-kernel's arithmetic for one row at a time, over one packed panel of B on the stack
 * and A read in place. Packing all of B to multiply it by M < MR rows in the micro-kernel
 * would waste MR / M of its FMAs and need a buffer the size of B. Each C entry is computed
 * as the micro-kernel computes it (per KC block a running vector FMA sum over p from zero,
 * then store_tile: alpha times it plus beta C, or plus C after the first block). Where alpha
 * and beta scale exactly (alpha = 1 and beta 0 or 1, as in every matmul of pyattn.nn), a row
 * of C then has the same bits as when the packed path computes it among many rows, whichever
 * of the micro-kernel's epilogues (vector, or store_tile for ragged tiles) it goes through:
 * one decoded token gets the bits of the whole sequence's forward. Threads split the
 * NR-column panels. */
static void PA_FN(gemm_few_rows)(int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                                 int64_t rsa, int64_t csa, const real *B, int64_t rsb,
                                 int64_t csb, real beta, real *C, int64_t ldc)
{
    int64_t panels = (N + NR - 1) / NR;
    int threads = pa_threads_for((double)M * N * K, panels);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t jp = 0; jp < panels; jp++) {
        int64_t j0 = jp * NR, nr = N - j0 < NR ? N - j0 : NR;
        real bp[KC * NR], row[NR];
        for (int64_t pc = 0; pc < K; pc += KC) {
            int64_t kc = K - pc < KC ? K - pc : KC;
            real bb = pc == 0 ? beta : 1;
            PA_FN(pack_b)(kc, nr, B + pc * rsb + j0 * csb, rsb, csb, bp);
            for (int64_t i = 0; i < M; i++) {
                const real *a = A + i * rsa + pc * csa;
                vreal acc[NV];
                for (int v = 0; v < NV; v++) acc[v] = PA_FN(vset)(0);
                for (int64_t p = 0; p < kc; p++) {
                    vreal ai = PA_FN(vset)(a[p * csa]);
#pragma GCC unroll 4
                    for (int v = 0; v < NV; v++) acc[v] += ai * PA_FN(vload)(bp + p * NR + v * VL);
                }
                for (int v = 0; v < NV; v++) PA_FN(vstore)(row + v * VL, acc[v]);
                PA_FN(store_tile)(row, 1, nr, alpha, bb, C + i * ldc + j0, ldc);
            }
        }
    }
}

/* gemm on the threads pa_threads_for grants (the binding's entry; the attention kernels call
 * gemm inside their own parallel regions). Each thread owns a contiguous share of A's MR-row
 * panels (the shares differ by one panel at most) and runs gemm_macro on them (MC rows at a
 * time), so it keeps the same rows of C, in its own cache, through every pc block. A
 * row-major B (csb = 1) is read in place, but for a last panel of fewer than NR columns,
 * which each thread packs into a buffer of its own: no barrier inside the region.
 * Any other B is packed by the team into one shared buffer per (jc, pc) block. Panels start
 * at multiples of MR whatever the thread count, so every C entry sees the same FMAs in the
 * same order. */
static int PA_FN(gemm_threaded)(int64_t M, int64_t N, int64_t K, real alpha, const real *A,
                                int64_t rsa, int64_t csa, const real *B, int64_t rsb,
                                int64_t csb, real beta, real *C, int64_t ldc)
{
    if (PA_FN(gemm_trivial)(M, N, K, beta, C, ldc)) return PA_OK;
    if (M < MR) {
        PA_FN(gemm_few_rows)(M, N, K, alpha, A, rsa, csa, B, rsb, csb, beta, C, ldc);
        return PA_OK;
    }
    int64_t panels = (M + MR - 1) / MR;
    int threads = pa_threads_for((double)M * N * K, panels);
    int b_in_place = csb == 1;
    int64_t mcmax = M < MC ? panels * MR : MC;
    int64_t kcmax = K < KC ? K : KC;
    int64_t ncmax = N < NC ? (N + NR - 1) / NR * NR : NC;
    real *Ap, *Bp;
    void **parts[2] = {(void **)&Ap, (void **)&Bp};
    size_t bytes[2] = {sizeof(real) * threads * mcmax * kcmax,
                       sizeof(real) * kcmax * (b_in_place ? threads * NR : ncmax)};
    void *block = pa_alloc_parts(parts, bytes, 2);
    if (!block) return PA_ENOMEM;
#pragma omp parallel num_threads(threads)
    {
        int tid = pa_thread_id(), team = pa_team_size();
        real *myAp = Ap + tid * mcmax * kcmax;
        int64_t r0 = panels * tid / team * MR, r1 = panels * (tid + 1) / team * MR;
        if (r1 > M) r1 = M;
        const real *Ar = A + r0 * rsa;
        real *Cr = C + r0 * ldc;
        for (int64_t jc = 0; jc < N; jc += NC) {
            int64_t nc = N - jc < NC ? N - jc : NC;
            for (int64_t pc = 0; pc < K; pc += KC) {
                int64_t kc = K - pc < KC ? K - pc : KC;
                real bb = pc == 0 ? beta : 1;
                if (b_in_place) {
                    if (r1 > r0)
                        PA_FN(gemm_macro_b_rows)(r1 - r0, nc, kc, alpha, Ar + pc * csa, rsa, csa,
                                                 B + pc * rsb + jc, rsb, bb, Cr + jc, ldc, myAp,
                                                 Bp + tid * kcmax * NR);
                    continue;
                }
#pragma omp for schedule(static)
                for (int64_t jr = 0; jr < nc; jr += NR)
                    PA_FN(pack_b)(kc, nc - jr < NR ? nc - jr : NR, B + pc * rsb + (jc + jr) * csb,
                                  rsb, csb, Bp + jr * kc);
                if (r1 > r0)
                    PA_FN(gemm_macro)(r1 - r0, nc, kc, alpha, Ar + pc * csa, rsa, csa, Bp,
                                      kc * NR, NR, bb, Cr + jc, ldc, myAp);
#pragma omp barrier /* Bp is packed again next */
            }
        }
    }
    free(block);
    return PA_OK;
}

/* GFLOP/s of independent FMA chains on each of `threads` threads for about `seconds`: the
 * machine's FMA peak for this dtype and ISA, the yardstick of the benchmarks. */
static double PA_FN(fma_peak)(double seconds, int threads)
{
    enum { CHAINS = 12 };
    const int64_t iters = 1 << 20;
    double total_flops = 0, elapsed = 0;
    int64_t reps = 1;
    volatile real sink = 0;
    for (;;) {
        double t0 = pa_wtime();
#pragma omp parallel num_threads(threads)
        {
            vreal acc[CHAINS];
            for (int c = 0; c < CHAINS; c++) acc[c] = PA_FN(vset)((real)c * (real)1e-3);
            vreal x = PA_FN(vset)((real)0.999999), y = PA_FN(vset)((real)1e-7);
            for (int64_t r = 0; r < reps; r++)
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
                    for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * x + y;
                }
            real s = 0;
            for (int c = 0; c < CHAINS; c++) s += PA_FN(hsum)(acc[c]);
            sink = s;
        }
        elapsed = pa_wtime() - t0;
        total_flops = 2.0 * CHAINS * VL * (double)iters * (double)reps * threads;
        if (elapsed >= seconds || reps > (1 << 20)) break;
        reps *= 2;
    }
    (void)sink;
    return total_flops / elapsed * 1e-9;
}

/* GB/s of reading a `bytes` buffer (split evenly over `threads` threads, each touching its own
 * part first) with vector loads, the best of repeated passes over about `seconds`: the
 * machine's read bandwidth, the yardstick of the memory-bound benchmarks (a decode step).
 * Returns -1 when the buffer cannot be allocated. */
static double PA_FN(read_bandwidth)(double seconds, int threads, int64_t bytes)
{
    const int64_t n = bytes / (int64_t)sizeof(vreal) / threads * threads, per = n / threads;
    vreal *buf = pa_alloc(sizeof(vreal) * (size_t)(n ? n : 1));
    if (!buf) return -1;
    volatile real sink = 0;
#pragma omp parallel num_threads(threads)
    for (int64_t i = pa_thread_id() * per, e = i + per; i < e; i++) buf[i] = PA_FN(vset)((real)1e-3);
    double best = 0, start = pa_wtime();
    do {
        double t0 = pa_wtime();
#pragma omp parallel num_threads(threads)
        {
            vreal a0 = PA_FN(vset)(0), a1 = a0, a2 = a0, a3 = a0;
            const vreal *p = buf + pa_thread_id() * per;
            for (int64_t i = 0; i + 4 <= per; i += 4) {
                a0 += p[i];
                a1 += p[i + 1];
                a2 += p[i + 2];
                a3 += p[i + 3];
            }
            sink = PA_FN(hsum)(a0 + a1 + a2 + a3);
        }
        double t = pa_wtime() - t0, gbs = (double)(per / 4 * 4) * threads * sizeof(vreal) / t * 1e-9;
        if (gbs > best) best = gbs;
    } while (pa_wtime() - start < seconds);
    (void)sink;
    free(buf);
    return best;
}
