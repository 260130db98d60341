/* A shared machine: a parallel region ends when its slowest thread ends. When another process
 * holds a core, one of our two threads may wait a whole scheduler time slice (milliseconds) to
 * run, and a decode step has ~120 regions: measured on a 2-core CPU next to two busy processes,
 * always-parallel decoding drops from 37 to 0.5 tokens/s while one thread keeps 3.7. So each
 * region checks whether a thread arrived late; if one did, the next calls run on one thread
 * (no one to wait for), twice as many after each late arrival, and then try two threads again.
 * One late region is not enough: on a quiet machine about 1 region in 1,500 has a thread a
 * millisecond late (an interrupt, the hypervisor), while a busy neighbour makes it happen every
 * few regions. So the kernel backs off at the second late region within 32. A region that starts
 * after a pause is not judged at all: its threads went to sleep, and waking a core takes time.
 *
 * Every product runs through gemv below, one parallel region a call; the products' entry points
 * (the library's interface, bound by kernels/build.py) follow it.
 */
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

/* rows [first, end) of y */
static void rows(row_fn row, const Mat *m, float *y, int64_t first, int64_t end) {
    for (int64_t i = first; i < end; i++) row(m, y, i);
}

static int64_t late_regions = 0;  /* read by kernels/build.py's late_regions, for reports */
int64_t gemv_late_regions(void) { return late_regions; }

#ifdef _OPENMP
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define MAX_THREADS 256
#define LATE_S 1e-3          /* a thread ending this much (and a quarter of the region) after the */
                             /* first one was not running: memory contention alone never does that */
#define MAX_BACKOFF 4096     /* calls: about 30 decode steps of a 30-layer model */
#define PAUSE_S 300e-6       /* since the last region: longer, and the threads may be asleep */
#define STRIKE_WINDOW 32     /* regions: two late ones this close mean a neighbour, not a hiccup */
static int64_t single_calls_left = 0, backoff = 0;  /* only the calling (Python) thread writes these */
static int64_t regions_since_late = STRIKE_WINDOW;
static double last_end = 0;

int backing_off(void) { return single_calls_left != 0; }
#endif

void gemv(row_fn row, const Mat *m, float *y, int64_t n, int threads) { parallel_rows(row, m, y, n, threads, 16); }

void parallel_rows(row_fn row, const Mat *m, float *y, int64_t n, int threads, int64_t min_rows) {
#ifdef _OPENMP
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && single_calls_left == 0 && n >= min_rows * threads) {
        double ended[MAX_THREADS], start = now_s();
        int team = 1;
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            if (t == 0) team = nt;
            rows(row, m, y, n * t / nt, n * (t + 1) / nt);  /* a fixed split: each thread its own rows */
            ended[t] = now_s();
        }
        double first = ended[0], last = ended[0];
        for (int t = 1; t < team; t++) {
            first = ended[t] < first ? ended[t] : first;
            last = ended[t] > last ? ended[t] : last;
        }
        double late = LATE_S > 0.25 * (first - start) ? LATE_S : 0.25 * (first - start);
        int after_pause = start - last_end > PAUSE_S;
        last_end = last;
        regions_since_late++;
        if (after_pause) {
            /* not judged (see the top of this file) */
        } else if (last - first > late) {  /* a thread was not running */
            late_regions++;
            if (regions_since_late < STRIKE_WINDOW) {  /* twice in a row: run alone for a while */
                backoff = backoff ? (2 * backoff < MAX_BACKOFF ? 2 * backoff : MAX_BACKOFF) : 64;
                single_calls_left = backoff;
            }
            regions_since_late = 0;
        } else {  /* on time: trust two threads a little more */
            backoff -= backoff / 16;
        }
        return;
    }
    if (single_calls_left > 0) single_calls_left--;
#else
    (void)threads;
    (void)min_rows;
#endif
    rows(row, m, y, 0, n);
}

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    Mat m = {.W = W, .x = x, .k = k};
    gemv(row_f32, &m, y, n, threads);
}

/* y [M, n] = x [M, k] @ W [n, k]^T, fp32 */
void gemm_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int64_t M, int threads) {
    Mat m = {.W = W, .x = x, .k = k, .M = M, .n = n};
    gemm_rows(&m, y, threads);
}

/* bf16 weights [n, k]. Returns 0, or -1 without memory for x reordered (y is then not written). */
int gemv_bf16(const uint16_t *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    float *xp = malloc((size_t)k * sizeof *xp);  /* x reordered to match load_bf16x16 */
    if (!xp) return -1;
    prepare_bf16(x, k, xp);
    Mat m = {.W = W, .x = xp, .k = k};
    gemv(row_bf16, &m, y, n, threads);
    free(xp);
    return 0;
}

/* int8 codes [n, k], fp16 scales [n, k / G]; G a multiple of 32 that divides k */
void gemv_q8(const int8_t *codes, const uint16_t *scales, const float *x, float *y, int64_t n, int64_t k,
             int64_t G, int threads) {
    Mat m = {.W = codes, .scales = scales, .x = x, .k = k, .G = G};
    gemv(q8_rows(&m), &m, y, n, threads);
}

/* int4 codes [n, k / 2], fp16 scales and minimums [n, k / G]; G a multiple of 32 that divides k.
 * Returns 0, or -1 without memory for the sums of x and x reordered (y is then not written). */
int gemv_q4(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, const float *x, float *y,
            int64_t n, int64_t k, int64_t G, int threads) {
    float *xsum = malloc((size_t)(k / G + k) * sizeof *xsum);  /* sum of x over each group, for the minimums */
    if (!xsum) return -1;
    Mat m = {.W = codes, .scales = scales, .mins = mins, .x = x, .xsum = xsum, .k = k, .G = G};
    if (prepare_q4(x, k, G, xsum, xsum + k / G)) m.xperm = xsum + k / G;
    gemv(q4_rows(&m), &m, y, n, threads);
    free(xsum);
    return 0;
}
