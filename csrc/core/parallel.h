/* OpenMP helpers. Not a template. The thread count is one process-wide setting (not
 * OpenMP's per-thread ICV), so a kernel called from any Python thread uses what
 * pyattn.set_num_threads chose. */
#ifndef PA_PARALLEL_H
#define PA_PARALLEL_H

#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int pa_get_num_threads(void);
void pa_set_num_threads(int n);
/* Once per process, at import: fork handlers that keep a forked child's kernels from waiting
 * on the parent's OpenMP threads. */
void pa_parallel_init(void);
/* A failed scratch allocation's size, recorded for the MemoryError's message. */
void pa_note_failed_bytes(size_t bytes);
size_t pa_take_failed_bytes(void);
int pa_openmp_enabled(void);
double pa_wtime(void);
/* Threads worth using for `work` multiply-adds split into `items` independent pieces. */
int pa_threads_for(double work, int64_t items);

static inline int pa_thread_id(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Threads in the current team (1 outside a parallel region). */
static inline int pa_team_size(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* Subnormal floats flushed to zero, inputs and results, in the calling thread until
 * pa_subnormals_end(previous state). x86 takes a microcode assist of about a hundred cycles
 * for every operation that meets a subnormal, which strong decays produce by the thousand. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned pa_subnormals_flush(void)
{
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040); /* FTZ | DAZ */
    return old;
}
static inline void pa_subnormals_end(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned pa_subnormals_flush(void) { return 0; }
static inline void pa_subnormals_end(unsigned old) { (void)old; }
#endif

/* Inside a parallel region, after a thread's scratch allocation: ok as given, and *failed
 * set (atomically, shared by the team) when it is 0, so the kernel reports PA_ENOMEM. */
static inline int pa_scratch_ok(int ok, int *failed)
{
    if (!ok) {
#pragma omp atomic write
        *failed = 1;
    }
    return ok;
}

/* The most bytes one allocation may ask for: the machine's physical memory (set at import).
 * Where the OS overcommits (Linux's vm.overcommit_memory = 1) it grants any size and kills
 * the process when the pages are touched; a scratch buffer larger than the machine is a
 * MemoryError instead. */
extern size_t pa_alloc_limit;

/* 64-byte aligned allocation; NULL on failure (the caller reports PA_ENOMEM), its size
 * noted for the MemoryError. */
static inline void *pa_alloc(size_t bytes)
{
    void *p = bytes <= pa_alloc_limit ? aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64) : NULL;
    if (!p) pa_note_failed_bytes(bytes);
    return p;
}

/* One 64-byte aligned block carved into n parts of bytes[i] each (every part 64-byte
 * aligned): *parts[i] points to part i. Returns the block to free, or NULL on failure. */
static inline void *pa_alloc_parts(void **const *parts, const size_t *bytes, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (bytes[i] + 63) / 64 * 64;
    char *block = pa_alloc(total);
    if (!block) return NULL;
    for (size_t i = 0, at = 0; i < (size_t)n; at += (bytes[i] + 63) / 64 * 64, i++)
        *parts[i] = block + at;
    return block;
}

#endif
