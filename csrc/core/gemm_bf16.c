/* bf16 products on AVX512-BF16 and AMX-BF16 (see gemm_bf16.h). The kernels and packings are
 * compiled under target attributes and run only where pa_bf16_available found the instructions. */
#define _GNU_SOURCE /* syscall() */
#include "gemm_bf16.h"

#include "kernels.h"
#include "parallel.h"

#include <stdlib.h>
#include <string.h>

static int selected_kind = PA_BF16_NONE;

_Thread_local int pa_gemm_in_bf16 = 0;

int pa_bf16_kind(void) { return selected_kind; }

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PA_ARCH_REQ_XCOMP_PERM 0x1023
#define PA_XFEATURE_XTILEDATA 18

/* XCR0: the register state the OS saves on a context switch */
__attribute__((target("xsave"))) static uint64_t xcr0(void) { return _xgetbv(0); }

static int cpu_has(int kind)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    const uint64_t zmm = 0xe6; /* SSE, AVX and the three AVX-512 states */
    if ((xcr0() & zmm) != zmm || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned avx512 = (1u << 16) | (1u << 30) | (1u << 31); /* F, BW, VL */
    if ((b & avx512) != avx512) return 0;
    unsigned amx = d & (1u << 22) && d & (1u << 24); /* AMX-BF16, AMX-TILE */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0; /* AVX512-BF16 */
    if (kind == PA_BF16_AVX512) return 1;
    /* the tile data is saved by the OS only for processes that asked (Linux 5.16+); the
     * permission holds for the whole process and its forked children */
    return amx && (xcr0() & (3u << 17)) == (3u << 17) &&
           syscall(SYS_arch_prctl, PA_ARCH_REQ_XCOMP_PERM, PA_XFEATURE_XTILEDATA) == 0;
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#endif

/* ---- AVX512-BF16: MR rows x 32 columns of C in 2 * MR accumulators ---- */
#define BF_MR 12

static inline __attribute__((always_inline)) void avx512_tile(
    int64_t kp, const uint32_t *a, int64_t lda, const uint32_t *b0, const uint32_t *b1,
    float *C, int64_t ldc, int64_t mr, int64_t nr, float alpha, float beta, const int rows)
{
    /* every loop over the rows unrolled (rows is a constant of each caller), so that acc stays
     * in registers */
    __m512 acc[BF_MR][2];
#pragma GCC unroll 12
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        __m512bh x0 = (__m512bh)_mm512_loadu_si512(b0 + p * 16);
        __m512bh x1 = (__m512bh)_mm512_loadu_si512(b1 + p * 16);
#pragma GCC unroll 12
        for (int i = 0; i < rows; i++) {
            __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i * lda + p]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, x0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, x1);
        }
    }
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    const int64_t w0 = nr < 16 ? nr : 16, w1 = nr > 16 ? nr - 16 : 0;
    const __mmask16 mask[2] = {(__mmask16)((1u << w0) - 1), (__mmask16)((1u << w1) - 1)};
#pragma GCC unroll 12
    for (int i = 0; i < rows; i++)
#pragma GCC unroll 2
        for (int v = 0; v < 2; v++) {
            const __mmask16 m = mask[v];
            if (i >= mr || !m) continue;
            float *c = C + i * ldc + v * 16;
            __m512 r = _mm512_mul_ps(acc[i][v], va);
            if (beta != 0) r = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, c), r);
            _mm512_mask_storeu_ps(c, m, r);
        }
}

static void gemm_avx512(int64_t M, int64_t N, int64_t kp, float alpha, const uint32_t *a,
                        int64_t lda, const uint32_t *b, int64_t bps, float beta, float *C,
                        int64_t ldc)
{
    for (int64_t jr = 0; jr < N; jr += 32) {
        const uint32_t *b0 = b + jr / 16 * bps, *b1 = b0 + bps;
        int64_t nr = N - jr < 32 ? N - jr : 32;
        for (int64_t ir = 0; ir < M; ir += BF_MR) {
            int64_t mr = M - ir < BF_MR ? M - ir : BF_MR;
            const uint32_t *ai = a + ir * lda;
            float *c = C + ir * ldc + jr;
            if (mr > 8)
                avx512_tile(kp, ai, lda, b0, b1, c, ldc, mr, nr, alpha, beta, BF_MR);
            else if (mr > 4)
                avx512_tile(kp, ai, lda, b0, b1, c, ldc, mr, nr, alpha, beta, 8);
            else
                avx512_tile(kp, ai, lda, b0, b1, c, ldc, mr, nr, alpha, beta, 4);
        }
    }
}

/* ---- AMX: 32 x 32 blocks of C in tiles 0-3, A in tiles 4-5, B in tiles 6-7 ---- */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void gemm_amx(int64_t M, int64_t N, int64_t kp, float alpha, const uint32_t *a,
                     int64_t lda, const uint32_t *b, int64_t bps, float beta, float *C,
                     int64_t ldc)
{
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    float tmp[32 * 32];
    const int64_t sa = lda * 4;
    /* the tiles hold A B (+ C when it is loaded into them): C = R exactly where beta = alpha
     * = 1 (loaded) or beta = 0, alpha = 1; otherwise R goes through tmp */
    const int load = beta != 0 && alpha == 1;
    for (int64_t jr = 0; jr < N; jr += 32) {
        const uint32_t *b0 = b + jr / 16 * bps, *b1 = b0 + bps;
        int64_t nr = N - jr < 32 ? N - jr : 32;
        for (int64_t ir = 0; ir < M; ir += 32) {
            int64_t mr = M - ir < 32 ? M - ir : 32;
            int direct = mr == 32 && nr == 32 && alpha == 1;
            float *t = direct ? C + ir * ldc + jr : tmp;
            int64_t ldt = direct ? ldc : 32;
            if (load && !direct) {
                memset(tmp, 0, sizeof tmp);
                for (int64_t i = 0; i < mr; i++) memcpy(tmp + i * 32, C + (ir + i) * ldc + jr, sizeof(float) * nr);
            }
            if (load) {
                _tile_loadd(0, t, ldt * 4);
                _tile_loadd(1, t + 16, ldt * 4);
                _tile_loadd(2, t + 16 * ldt, ldt * 4);
                _tile_loadd(3, t + 16 * ldt + 16, ldt * 4);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            const uint32_t *a0 = a + ir * lda, *a1 = a0 + 16 * lda;
            for (int64_t p = 0; p < kp; p += PA_BF16_KSTEP) {
                _tile_loadd(4, a0 + p, sa);
                _tile_loadd(5, a1 + p, sa);
                _tile_loadd(6, b0 + p * 16, 64);
                _tile_loadd(7, b1 + p * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, t, ldt * 4);
            _tile_stored(1, t + 16, ldt * 4);
            _tile_stored(2, t + 16 * ldt, ldt * 4);
            _tile_stored(3, t + 16 * ldt + 16, ldt * 4);
            if (direct) continue;
            for (int64_t i = 0; i < mr; i++) {
                float *c = C + (ir + i) * ldc + jr;
                const float *r = tmp + i * 32;
                for (int64_t j = 0; j < nr; j++)
                    c[j] = load ? r[j] : alpha * r[j] + (beta != 0 ? beta * c[j] : 0);
            }
        }
    }
    _tile_release();
}

/* ---- packing ---- */

/* 16 float lanes of X from column c, the lanes past D zero */
static inline __m512 load_cols(const float *x, int64_t c, int64_t D)
{
    if (c >= D) return _mm512_setzero_ps();
    if (D - c >= 16) return _mm512_loadu_ps(x + c);
    return _mm512_maskz_loadu_ps((__mmask16)((1u << (D - c)) - 1), x + c);
}

/* the 32 bf16 of columns c .. c+31 of row x (zeros past D, or for x NULL) as 16 words */
static inline __m512i row_pairs(const float *x, int64_t c, int64_t D)
{
    if (!x) return _mm512_setzero_si512();
    return (__m512i)_mm512_cvtne2ps_pbh(load_cols(x, c + 16, D), load_cols(x, c, D));
}

/* word j = (lo: x[c + j], hi: y[c + j]) for j < 16: the pairs of two rows, column by column */
static inline __m512i interleave_rows(const float *x, const float *y, int64_t c, int64_t D)
{
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    __m512 lo = x ? load_cols(x, c, D) : _mm512_setzero_ps();
    __m512 hi = y ? load_cols(y, c, D) : _mm512_setzero_ps();
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* r[0..16) the rows of a 16 x 16 block of words; on return its columns */
static inline void transpose16(__m512i *r)
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* lane L of r[4g + x] is now column 4L + x of rows 4g .. 4g+3: gather the lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

void pa_bf16_rows_a(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                    uint32_t *out)
{
    const int64_t lda = pa_bf16_dp(D) / 2;
    for (int64_t r = 0; r < n_pad; r++)
        for (int64_t c = 0; c < 2 * lda; c += 32)
            _mm512_storeu_si512(out + r * lda + c / 2, row_pairs(r < n ? X + r * ldx : NULL, c, D));
}

void pa_bf16_rows_b(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                    uint32_t *out)
{
    const int64_t words = pa_bf16_dp(D) / 2, bps = words * 16;
    for (int64_t r0 = 0; r0 < n_pad; r0 += 16)
        for (int64_t c = 0; c < 2 * words; c += 32) {
            __m512i v[16];
            for (int i = 0; i < 16; i++) v[i] = row_pairs(r0 + i < n ? X + (r0 + i) * ldx : NULL, c, D);
            transpose16(v);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + r0 / 16 * bps + (c / 2 + p) * 16, v[p]);
        }
}

/* row 2p (even: 0) or 2p + 1 (1) of X, NULL past n */
static inline const float *pair_row(const float *X, int64_t ldx, int64_t n, int64_t p, int odd)
{
    return 2 * p + odd < n ? X + (2 * p + odd) * ldx : NULL;
}

void pa_bf16_pairs_b_part(int64_t p0, int64_t p1, int64_t n, int64_t D, const float *X,
                          int64_t ldx, int64_t bps, uint32_t *out)
{
    const int64_t cols = pa_bf16_round(D, PA_BF16_PAD);
    for (int64_t p = p0; p < p1; p++) {
        const float *x = pair_row(X, ldx, n, p, 0), *y = pair_row(X, ldx, n, p, 1);
        for (int64_t c = 0; c < cols; c += 16)
            _mm512_storeu_si512(out + c / 16 * bps + p * 16, interleave_rows(x, y, c, D));
    }
}

void pa_bf16_pairs_b(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                     uint32_t *out)
{
    pa_bf16_pairs_b_part(0, n_pad / 2, n, D, X, ldx, n_pad / 2 * 16, out);
}

void pa_bf16_pairs_a(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx,
                     uint32_t *out)
{
    const int64_t lda = n_pad / 2, rows = pa_bf16_round(D, PA_BF16_PAD);
    for (int64_t p0 = 0; p0 < lda; p0 += 16)
        for (int64_t c = 0; c < rows; c += 16) {
            __m512i v[16];
            for (int i = 0; i < 16; i++)
                v[i] = interleave_rows(pair_row(X, ldx, n, p0 + i, 0), pair_row(X, ldx, n, p0 + i, 1), c, D);
            transpose16(v);
            int64_t w = lda - p0 < 16 ? lda - p0 : 16;
            for (int j = 0; j < 16; j++)
                _mm512_mask_storeu_epi32(out + (c + j) * lda + p0, (__mmask16)((1u << w) - 1), v[j]);
        }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

void pa_bf16_gemm(int64_t M, int64_t N, int64_t kp, float alpha, const uint32_t *a, int64_t lda,
                  const uint32_t *b, int64_t bps, float beta, float *C, int64_t ldc)
{
    if (selected_kind == PA_BF16_AMX)
        gemm_amx(M, N, kp, alpha, a, lda, b, bps, beta, C, ldc);
    else
        gemm_avx512(M, N, kp, alpha, a, lda, b, bps, beta, C, ldc);
}

int pa_bf16_available(int kind)
{
    static int known[3] = {1, -1, -1};
    if (kind < 0 || kind > PA_BF16_AMX) return 0;
    if (known[kind] < 0) known[kind] = cpu_has(kind);
    return known[kind];
}

#else /* no x86-64 GCC/clang on Linux: the portable path only */

int pa_bf16_available(int kind) { return kind == PA_BF16_NONE; }

void pa_bf16_gemm(int64_t M, int64_t N, int64_t kp, float alpha, const uint32_t *a, int64_t lda,
                  const uint32_t *b, int64_t bps, float beta, float *C, int64_t ldc)
{
    abort(); /* unreachable: no kind is ever selected here */
}

#define PA_NO_PACKING(name)                                                                     \
    void name(int64_t n, int64_t n_pad, int64_t D, const float *X, int64_t ldx, uint32_t *out) \
    {                                                                                           \
        abort();                                                                                \
    }
PA_NO_PACKING(pa_bf16_rows_a)
PA_NO_PACKING(pa_bf16_rows_b)
PA_NO_PACKING(pa_bf16_pairs_b)
PA_NO_PACKING(pa_bf16_pairs_a)

void pa_bf16_pairs_b_part(int64_t p0, int64_t p1, int64_t n, int64_t D, const float *X,
                          int64_t ldx, int64_t bps, uint32_t *out)
{
    abort();
}

#endif

void pa_bf16_select(int kind) { selected_kind = pa_bf16_available(kind) ? kind : PA_BF16_NONE; }

void pa_bf16_block_a(int64_t mc, int64_t kc, const float *A, int64_t rsa, int64_t csa,
                     uint32_t *out)
{
    if (csa == 1)
        pa_bf16_rows_a(mc, pa_bf16_round(mc, PA_BF16_PAD), kc, A, rsa, out);
    else
        pa_bf16_pairs_a(kc, pa_bf16_dp(kc), mc, A, csa, out);
}

void pa_bf16_block_b(int64_t kc, int64_t nc, const float *B, int64_t rsb, int64_t csb,
                     uint32_t *out)
{
    if (csb == 1)
        pa_bf16_pairs_b(kc, pa_bf16_dp(kc), nc, B, rsb, out);
    else
        pa_bf16_rows_b(nc, pa_bf16_round(nc, PA_BF16_PAD), kc, B, csb, out);
}

/* ---- float32 operands multiplied in bf16 (pa_bf16_matmul) ---- */

/* tiles of C a thread computes at once, and the pairs of one pass over them: a pass's packed
 * rows and a tile's columns (96 x 256 and 64 x 256 words) stay in L2 */
enum { BF16_MB = 96, BF16_NB = 64, BF16_KB = 256 };

static inline int64_t bf16_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* Rows [i0, i0 + mb) of op(A)'s A-form over the kb pairs from p0 (one pass), kb words a row:
 * op(A) is A [M x K] (lda apart) or, with ta, A^T. Packed pass by pass because rows of all
 * kp pairs would lie kp words apart, and a tile's 12 rows would share one L1 set wherever kp
 * is a multiple of 1024 (a weight's gradient, whose pairs run over the tokens). */
static void bf16_pack_a(int64_t K, const float *A, int64_t lda, int ta, int64_t p0, int64_t kb,
                        int64_t i0, int64_t mb, uint32_t *out)
{
    const int64_t k0 = 2 * p0, k = bf16_min(K - k0, 2 * kb); /* pa_bf16_dp(k) = 2 kb */
    if (ta)
        pa_bf16_block_a(mb, k, A + k0 * lda + i0, 1, lda, out);
    else
        pa_bf16_block_a(mb, k, A + i0 * lda + k0, lda, 1, out);
}

/* Part u of op(B)'s B-form over all kp = Kp / 2 pairs (panels of 16 columns, 16 kp words
 * each), op(B) being B [K x N] (ldb apart) or, with tb, B^T: with tb the columns [32 u,
 * 32 u + 32) (rows of B), else the pairs [64 u, 64 u + 64) (rows of B too, across every
 * column: each part reads whole rows). */
static void bf16_pack_b(int64_t N, int64_t K, int64_t Kp, const float *B, int64_t ldb, int tb,
                        int64_t u, uint32_t *out)
{
    const int64_t kp = Kp / 2;
    if (tb)
        pa_bf16_block_b(K, bf16_min(N - 32 * u, 32), B + 32 * u * ldb, 1, ldb, out + 32 * u * kp);
    else
        pa_bf16_pairs_b_part(64 * u, bf16_min(64 * u + 64, kp), K, N, B, ldb, 16 * kp, out);
}

/* parts of bf16_pack_b */
static int64_t bf16_b_parts(int64_t N, int64_t Kp, int tb)
{
    return tb ? (N + 31) / 32 : (Kp / 2 + 63) / 64;
}

int pa_bf16_matmul(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                   int ta, const float *B, int64_t ldb, int tb, float beta, float *C, int64_t ldc)
{
    if (M <= 0 || N <= 0) return PA_OK;
    if (K <= 0) {
        if (beta == 0)
            for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, sizeof(float) * N);
        return PA_OK;
    }
    const int64_t Kp = pa_bf16_dp(K), kp = Kp / 2, Np = pa_bf16_round(N, PA_BF16_PAD);
    const int64_t mt = (M + BF16_MB - 1) / BF16_MB, nt = (N + BF16_NB - 1) / BF16_NB;
    const int threads = pa_threads_for((double)M * N * K, mt * nt);
    /* work items: a block of BF16_MB rows of C across a group of its column tiles; the
     * columns are split into groups only where the row blocks alone would leave threads idle
     * (each group packs its rows again) */
    const int64_t wanted = bf16_min(nt, (2 * threads + mt - 1) / mt);
    const int64_t per_group = (nt + wanted - 1) / wanted, groups = (nt + per_group - 1) / per_group;
    uint32_t *a, *b;
    void **parts[2] = {(void **)&a, (void **)&b};
    size_t bytes[2] = {sizeof(uint32_t) * threads * BF16_MB * kp, sizeof(uint32_t) * Np * kp};
    void *block = pa_alloc_parts(parts, bytes, 2);
    if (!block) return PA_ENOMEM;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < bf16_b_parts(N, Kp, tb); u++) bf16_pack_b(N, K, Kp, B, ldb, tb, u, b);
        /* each item packs its rows itself, pass after pass (the pass at p0 at BF16_MB p0 in the
         * thread's buffer), so that they come from memory while the other threads multiply */
        uint32_t *rows = a + pa_thread_id() * BF16_MB * kp;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < mt * groups; t++) {
            const int64_t i0 = t / groups * BF16_MB, mb = bf16_min(M - i0, BF16_MB);
            const int64_t j0 = t % groups * per_group * BF16_NB, j1 = bf16_min(N, j0 + per_group * BF16_NB);
            for (int64_t p0 = 0; p0 < kp; p0 += BF16_KB) {
                const int64_t kb = bf16_min(BF16_KB, kp - p0);
                bf16_pack_a(K, A, lda, ta, p0, kb, i0, mb, rows + BF16_MB * p0);
                for (int64_t j = j0; j < j1; j += BF16_NB)
                    pa_bf16_gemm(mb, bf16_min(j1 - j, BF16_NB), kb, alpha, rows + BF16_MB * p0, kb,
                                 b + j * kp + p0 * 16, 16 * kp, p0 ? 1.0f : beta, C + i0 * ldc + j, ldc);
            }
        }
    }
    free(block);
    return PA_OK;
}
