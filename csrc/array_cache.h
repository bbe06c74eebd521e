/* A cache of large freed blocks behind NumPy's data-memory handler (its PyDataMem_Handler
 * functions; module.c wraps them for NumPy). Not a template, no Python.
 *
 * A training step allocates and frees the same activation sizes every step. Through the C
 * library, large freed blocks go back to the system (the heap is trimmed, big blocks are
 * unmapped), so the next step's arrays are fresh pages that the kernel zeroes on first touch.
 * Here a freed block of PA_CACHE_MIN bytes or more is kept, up to PA_CACHE_CAP bytes in all
 * (the oldest dropped first), and handed out again for a request of exactly its size. Every
 * block starts with a header holding its size, so free and realloc never depend on the size
 * NumPy passes. Blocks are 64-byte aligned. When the system has no memory for a new block,
 * the kept ones are freed and the request tried again. Thread-safe; safe across fork. */
#ifndef PA_ARRAY_CACHE_H
#define PA_ARRAY_CACHE_H

#include <stddef.h>

#define PA_CACHE_MIN ((size_t)1 << 20)
#define PA_CACHE_CAP ((size_t)1 << 31)

void *pa_cache_malloc(void *ctx, size_t size);
void *pa_cache_calloc(void *ctx, size_t n, size_t size);
void *pa_cache_realloc(void *ctx, void *p, size_t size);
void pa_cache_free(void *ctx, void *p, size_t size);
/* Frees every kept block; returns their bytes. */
size_t pa_cache_release(void);
/* Bytes kept now. */
size_t pa_cache_kept(void);
/* Once per process, at import: fork handlers for the cache's lock. */
void pa_cache_init(void);

#endif
