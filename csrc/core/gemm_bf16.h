/* bfloat16 products with float32 accumulation on the CPUs that multiply bf16 in hardware:
 * AVX512-BF16 (vdpbf16ps: 16 lanes, each a dot of two bf16 pairs) and AMX-BF16 (tdpbf16ps on
 * 16 x 32 bf16 tiles). Not a template: the operands are bf16 (their 16 bits), the results
 * float32. Chosen at run time (pa_bf16_select); without them pyattn's bf16 calls compute in
 * float32 (the portable path) and nothing here runs.
 *
 * Operands are 32-bit words, each a pair of bf16 adjacent along the product's inner index
 * (lo half the even index), as both instructions take them:
 *   A(i, pair p) = a[i * lda + p]                              (rows of A, A-form)
 *   B(pair p, j) = b[(j / 16) * bps + p * 16 + j % 16]         (panels of 16 columns, B-form)
 * The kernels read past the shapes they are given, so the caller pads: A's rows and B's
 * columns are readable up to M and N rounded up to PA_BF16_PAD, the pairs up to kp rounded up
 * to PA_BF16_KSTEP, and over the padded pairs one of the operands holds zeros and the other
 * finite values. */
#ifndef PA_GEMM_BF16_H
#define PA_GEMM_BF16_H

#include <stdint.h>

enum { PA_BF16_NONE = 0, PA_BF16_AVX512 = 1, PA_BF16_AMX = 2 };
#define PA_BF16_PAD 32
#define PA_BF16_KSTEP 16

/* Whether this CPU (and OS) runs kind: AMX needs Linux to grant this process the tile state
 * (asked for here, once; it holds for forked children too). */
int pa_bf16_available(int kind);
/* The kind that runs (none where kind is not available); once, at import (csrc/dispatch.c). */
void pa_bf16_select(int kind);
int pa_bf16_kind(void);

/* Whether core/gemm.c's gemm and gemm_packed_b on this thread multiply in bf16: their float32
 * operands rounded to bf16 block by block, float32 accumulation (the float AVX-512
 * instantiation; the others ignore it). An engine turns it on in each thread of its parallel
 * region for a call whose inputs are bf16 values, and back before the region ends (the
 * threads outlive it); a product that must stay float32 turns it off around itself. */
extern _Thread_local int pa_gemm_in_bf16;

/* Sets pa_gemm_in_bf16 to on where the selected kind multiplies bf16 (off otherwise); returns
 * the value before, for pa_bf16_products_end */
static inline int pa_bf16_products_begin(int on)
{
    const int before = pa_gemm_in_bf16;
    pa_gemm_in_bf16 = on && pa_bf16_kind() != PA_BF16_NONE;
    return before;
}

static inline void pa_bf16_products_end(int before) { pa_gemm_in_bf16 = before; }

/* C[M x N] (row-major, ldc) = alpha A B + beta C over kp pairs, beta 0 (C not read) or 1;
 * the selected kind must not be none. One thread: callers split the work. */
void pa_bf16_gemm(int64_t M, int64_t N, int64_t kp, float alpha, const uint32_t *a, int64_t lda,
                  const uint32_t *b, int64_t bps, float beta, float *C, int64_t ldc);

/* Packing from float32 (rounded to the nearest bf16, ties to even; the kernels treat
 * subnormals as zero). Padding is written as zeros.
 * rows_a: rows [0, n) of X (ldx apart, D features) as A-form rows of dp = D rounded up to
 *   2 * PA_BF16_KSTEP bf16 (dp / 2 words each, lda = dp / 2), rows [n, n_pad) zero.
 * rows_b: the same rows as the columns of a B-form operand (B(p, j) = X[j] pair p): panels of
 *   16 rows, bps = dp / 2 * 16, up to n_pad rows (a multiple of 16).
 * pairs_b: rows [0, n) of X (ldx apart, D columns) paired two by two along the rows, as a
 *   B-form operand (B(p, j) = X[2p][j], X[2p+1][j]) of n_pad / 2 pairs (n_pad even) and D
 *   columns, panels of 16 columns bps = n_pad / 2 * 16 apart, up to D rounded up to PA_BF16_PAD.
 * pairs_a: the same pairs as A-form rows: A(j, p) = X[2p][j], X[2p+1][j], D rows rounded up
 *   to PA_BF16_PAD, lda = n_pad / 2. */
void pa_bf16_rows_a(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                    uint32_t *out);
void pa_bf16_rows_b(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                    uint32_t *out);
void pa_bf16_pairs_b(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                     uint32_t *out);
void pa_bf16_pairs_a(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                     uint32_t *out);
/* pairs_b's pairs [p0, p1) alone, into a B-form operand whose panels lie bps words apart */
void pa_bf16_pairs_b_part(int64_t p0, int64_t p1, int64_t n, int64_t D, const float *X,
                          int64_t ldx, int64_t bps, uint32_t *out);
/* A block of a strided float32 matrix, whichever packing its layout takes:
 * block_a: mc x kc, A(i, p) = A[i rsa + p csa] with csa = 1 (rows_a) or rsa = 1 (stored
 *   transposed: pairs_a), as an A-form operand of pa_bf16_dp(kc) / 2 words a row, its rows up to
 *   mc rounded up to PA_BF16_PAD;
 * block_b: kc x nc, B(p, j) = B[p rsb + j csb] with csb = 1 (pairs_b) or rsb = 1 (stored
 *   transposed: rows_b), as a B-form operand, panels of 16 columns pa_bf16_dp(kc) / 2 * 16
 *   words apart, its columns up to nc rounded up to PA_BF16_PAD. */
void pa_bf16_block_a(int64_t mc, int64_t kc, const float *A, int64_t rsa, int64_t csa,
                     uint32_t *out);
void pa_bf16_block_b(int64_t kc, int64_t nc, const float *B, int64_t rsb, int64_t csb,
                     uint32_t *out);

/* C[M x N] (row-major, ldc) = alpha op(A) op(B) + beta C for float32 operands, multiplied in
 * bf16: op(A) = A [M x K] (lda apart) or, with ta, A^T for A [K x M]; op(B) = B [K x N] or,
 * with tb, B^T for B [N x K]. Both are rounded to bf16 (pa_bf16_rows_a and its kin), products
 * accumulate in float32; beta 0 (C not read) or 1. Threads of its own (pa_threads_for); every
 * entry of C gets the same operations in the same order at any thread count. The selected
 * kind must not be none. PA_OK, or PA_ENOMEM when the packed operands cannot be allocated. */
int pa_bf16_matmul(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                   int ta, const float *B, int64_t ldb, int tb, float beta, float *C, int64_t ldc);

static inline int64_t pa_bf16_round(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
/* bf16 per row of an A-form operand of D features */
static inline int64_t pa_bf16_dp(int64_t D) { return pa_bf16_round(D, 2 * PA_BF16_KSTEP); }

#endif
