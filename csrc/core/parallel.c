/* The process-wide thread count, fork handling, the failed-allocation record and a wall
 * clock (see parallel.h). */
#define _GNU_SOURCE /* sysconf(_SC_PHYS_PAGES) */
#include "parallel.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

size_t pa_alloc_limit = SIZE_MAX - 63;

static int pa_threads = 0; /* 0: not chosen yet, use OpenMP's default (OMP_NUM_THREADS) */

int pa_get_num_threads(void)
{
    int n;
#pragma omp atomic read
    n = pa_threads;
    if (n > 0) return n;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

void pa_set_num_threads(int n)
{
#pragma omp atomic write
    pa_threads = n;
}

/* GNU OpenMP keeps a pool of worker threads per thread that opened a parallel region, and a
 * forked child inherits the pool's bookkeeping but not its threads: its next parallel region
 * waits for them forever. So before a fork the forking thread hands its pool back
 * (omp_pause_resource_all), and the child starts a new one on its first region; the parent
 * pays one pool start-up after each fork. Should the pause fail, the child runs serially
 * until pa_set_num_threads is called. */
static int pa_pool_released = 1;

static void pa_before_fork(void)
{
#ifdef _OPENMP
    pa_pool_released = omp_pause_resource_all(omp_pause_hard) == 0;
#endif
}

static void pa_in_child(void)
{
    if (!pa_pool_released) pa_threads = 1;
}

static void pa_register_fork_handlers(void)
{
    pthread_atfork(pa_before_fork, NULL, pa_in_child);
}

void pa_parallel_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, pa_register_fork_handlers);
#ifdef _SC_PHYS_PAGES
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 && (size_t)pages <= (SIZE_MAX - 63) / (size_t)page)
        pa_alloc_limit = (size_t)pages * (size_t)page;
#endif
}

/* The size of the last scratch allocation that failed, 0 when none has since the last
 * pa_take_failed_bytes. Process-wide: with concurrent failing calls, either may read the
 * other's size. */
static size_t pa_failed = 0;

void pa_note_failed_bytes(size_t bytes)
{
#pragma omp atomic write
    pa_failed = bytes;
}

size_t pa_take_failed_bytes(void)
{
    size_t bytes;
#pragma omp atomic capture
    {
        bytes = pa_failed;
        pa_failed = 0;
    }
    return bytes;
}

int pa_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

double pa_wtime(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int pa_threads_for(double work, int64_t items)
{
    const double per_thread = 1e6; /* multiply-adds: ~10 us, well above a thread wake-up */
    double n = work / per_thread;
    int t = pa_get_num_threads();
    if (n < t) t = n < 1 ? 1 : (int)n;
    if (items < t) t = items < 1 ? 1 : (int)items;
    return t;
}
