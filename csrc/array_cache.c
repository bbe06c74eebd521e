/* See array_cache.h. */
#include "array_cache.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HDR 64       /* header bytes before the caller's block: its size; keeps 64-byte alignment */
#define SLOTS 1024   /* kept blocks at most */

static struct {
    size_t size;
    char *base;
} kept[SLOTS]; /* oldest first */
static int nkept;
static size_t kept_bytes;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static size_t block_size(const void *p) { return *(const size_t *)((const char *)p - HDR); }

/* A new block of size bytes from the system, or NULL. */
static void *fresh(size_t size)
{
    if (size > SIZE_MAX - 2 * HDR) return NULL;
    char *base = aligned_alloc(HDR, (size + 2 * HDR - 1) / HDR * HDR);
    if (!base) return NULL;
    *(size_t *)base = size;
    return base + HDR;
}

/* A kept block of exactly size bytes (the newest), or NULL. */
static void *take(size_t size)
{
    char *found = NULL;
    pthread_mutex_lock(&lock);
    for (int i = nkept - 1; i >= 0; i--)
        if (kept[i].size == size) {
            found = kept[i].base;
            kept_bytes -= size;
            memmove(kept + i, kept + i + 1, sizeof kept[0] * (size_t)(nkept - 1 - i));
            nkept--;
            break;
        }
    pthread_mutex_unlock(&lock);
    return found ? found + HDR : NULL;
}

void *pa_cache_malloc(void *ctx, size_t size)
{
    (void)ctx;
    void *p = size >= PA_CACHE_MIN ? take(size) : NULL;
    if (!p) p = fresh(size);
    if (!p && pa_cache_release()) p = fresh(size); /* the kept blocks make room */
    return p;
}

void *pa_cache_calloc(void *ctx, size_t n, size_t size)
{
    (void)ctx;
    if (size && n > SIZE_MAX / size) return NULL;
    void *p = pa_cache_malloc(NULL, n * size);
    if (p) memset(p, 0, n * size);
    return p;
}

void *pa_cache_realloc(void *ctx, void *p, size_t size)
{
    (void)ctx;
    if (!p) return pa_cache_malloc(NULL, size);
    void *q = pa_cache_malloc(NULL, size);
    if (!q) return NULL;
    size_t old = block_size(p);
    memcpy(q, p, old < size ? old : size);
    pa_cache_free(NULL, p, old);
    return q;
}

void pa_cache_free(void *ctx, void *p, size_t size_hint)
{
    (void)ctx;
    (void)size_hint; /* the header's size is the one allocated */
    if (!p) return;
    char *base = (char *)p - HDR, *drop[SLOTS];
    size_t size = block_size(p);
    int ndrop = 0;
    if (size < PA_CACHE_MIN || size > PA_CACHE_CAP) {
        free(base);
        return;
    }
    pthread_mutex_lock(&lock);
    /* the oldest make room; freed outside the lock */
    int old = 0;
    while (old < nkept && (nkept - old == SLOTS || kept_bytes + size > PA_CACHE_CAP)) {
        drop[ndrop++] = kept[old].base;
        kept_bytes -= kept[old].size;
        old++;
    }
    memmove(kept, kept + old, sizeof kept[0] * (size_t)(nkept - old));
    nkept -= old;
    kept[nkept].size = size;
    kept[nkept].base = base;
    nkept++;
    kept_bytes += size;
    pthread_mutex_unlock(&lock);
    for (int i = 0; i < ndrop; i++) free(drop[i]);
}

size_t pa_cache_release(void)
{
    pthread_mutex_lock(&lock);
    size_t bytes = kept_bytes;
    for (int i = 0; i < nkept; i++) free(kept[i].base);
    nkept = 0;
    kept_bytes = 0;
    pthread_mutex_unlock(&lock);
    return bytes;
}

size_t pa_cache_kept(void)
{
    pthread_mutex_lock(&lock);
    size_t bytes = kept_bytes;
    pthread_mutex_unlock(&lock);
    return bytes;
}

static void lock_for_fork(void) { pthread_mutex_lock(&lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&lock); }

static void register_fork_handlers(void)
{
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
}

void pa_cache_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handlers);
}
