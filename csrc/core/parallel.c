/* The process-wide thread count and a wall clock (see parallel.h). */
#include "parallel.h"

#include <time.h>

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
