/* bfloat16 <-> float32 conversion (bf16_convert.h). Plain integer code that the compiler
 * vectorises for whatever ISA the build targets; memory-bound, so no per-ISA versions. */
#include "bf16_convert.h"

#include <string.h>

#include "parallel.h"

/* Elements a task: a 2-thread team splits a [4096, 256] activation evenly */
#define CONVERT_BLOCK 65536
/* pa_threads_for's multiply-adds an element costs: a block of 65536 takes about as long as
 * its 1e6 (memory-bound, about a quarter ns an element), so each block may take a thread */
#define CONVERT_COST 16.0

static void widen_span(int64_t lo, int64_t hi, const void *src, void *dst)
{
    const uint16_t *s = src;
    float *d = dst;
    for (int64_t i = lo; i < hi; i++) {
        uint32_t bits = (uint32_t)s[i] << 16;
        memcpy(d + i, &bits, sizeof bits);
    }
}

static void round_span(int64_t lo, int64_t hi, const void *src, void *dst)
{
    const float *s = src;
    uint16_t *d = dst;
    for (int64_t i = lo; i < hi; i++) {
        uint32_t bits;
        memcpy(&bits, s + i, sizeof bits);
        /* adding 0x7FFF plus the kept part's lowest bit rounds half to even; a NaN's payload
         * could round into infinity, so NaNs keep their top bits with the quiet bit set */
        uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        int nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
        d[i] = (uint16_t)(nan ? (bits >> 16) | 0x0040u : rounded);
    }
}

/* span over n elements in blocks shared by the threads */
static void convert(int64_t n, void (*span)(int64_t, int64_t, const void *, void *), const void *src,
                    void *dst)
{
    int64_t blocks = (n + CONVERT_BLOCK - 1) / CONVERT_BLOCK;
    int threads = pa_threads_for(CONVERT_COST * (double)n, blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t lo = b * CONVERT_BLOCK;
        span(lo, lo + CONVERT_BLOCK < n ? lo + CONVERT_BLOCK : n, src, dst);
    }
}

void pa_f32_from_bf16(int64_t n, const uint16_t *src, float *dst) { convert(n, widen_span, src, dst); }

void pa_bf16_from_f32(int64_t n, const float *src, uint16_t *dst) { convert(n, round_span, src, dst); }
