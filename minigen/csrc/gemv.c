/* Matrix-vector products for decoding at batch 1: y[n] = W[n, k] @ x[k].
 *
 * A decode step multiplies one activation row by every weight matrix of the model, so its time is
 * the time to stream the weights from memory. torch's fp32 matrix-vector path reaches about half
 * of this course's CPU read bandwidth; this loop reaches about 80% of it. The whole trick:
 *   - rows of W are contiguous (nn.Linear's [out, in] layout), so each thread reads its own rows
 *     one after the other: one sequential stream, which the hardware prefetcher follows best (four
 *     rows side by side, four streams of 1 to 2 KB, measured 1.3 to 1.5x slower here);
 *   - four sums of 8 lanes per row, so four multiply-add chains run side by side;
 *   - 8-wide vectors through GCC/Clang vector extensions (one AVX2 register; two NEON ones on ARM);
 *   - OpenMP splits the rows over the threads torch itself uses (same runtime, no second pool).
 * Each output is summed by one thread in a fixed order, so results do not depend on the thread
 * count. Built once per machine by minigen/cpu_kernel.py with `cc -O3 -march=native -fopenmp`,
 * or without -fopenmp (single-threaded) where the compiler has no OpenMP.
 *
 * bf16 weights (chapter 7): the same loop reads 2 bytes a weight instead of 4 and widens each to
 * fp32 in a register (a bf16 number is the top half of an fp32 one), so the activations and every
 * sum stay fp32 while memory delivers half the bytes. 16 weights are loaded as 8 32-bit words:
 * shifting each word left by 16 gives the even weights as fp32, masking its low half gives the
 * odd ones, two instructions for 16 weights; x is reordered once per call to match (evens, odds).
 *
 * A shared machine: a parallel region ends when its slowest thread ends. When another process
 * holds a core, one of our two threads may wait a whole scheduler time slice (milliseconds) to
 * run, and a decode step has ~120 regions: measured on a 2-core CPU next to two busy processes,
 * always-parallel decoding fell from 37 to 0.5 tokens/s while one thread kept 3.7. So each
 * region checks whether a thread arrived late; if one did, the next calls run on one thread
 * (no one to wait for), twice as many after each late arrival, and then try two threads again.
 * One late region is not enough: on a quiet machine about 1 region in 1,500 has a thread a
 * millisecond late (an interrupt, the hypervisor), while a busy neighbour makes it happen every
 * few regions. So the kernel backs off at the second late region within 32. A region that starts
 * after a pause is not judged at all: its threads went to sleep, and waking a core takes time.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

/* memcpy: an unaligned vector load, which any compiler turns into one move */
static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline float sum8(f32x8 v) { float s = 0.0f; for (int l = 0; l < 8; l++) s += v[l]; return s; }

/* 16 bf16 numbers at p -> the 8 even ones and the 8 odd ones as fp32 (little-endian words) */
static inline void load_bf16x16(const uint16_t *p, f32x8 *even, f32x8 *odd) {
    u32x8 w; memcpy(&w, p, sizeof w);
    u32x8 e = w << 16, o = w & 0xFFFF0000u;
    memcpy(even, &e, sizeof e); memcpy(odd, &o, sizeof o);
}
static inline float bf16_to_f32(uint16_t h) { uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }

/* fp32: y[i] = W[i, :] @ x, 32 weights a pass into four sums (independent multiply-add chains) */
static void row_f32(const void *Wv, const float *x, float *y, int64_t i, int64_t k) {
    const float *w = (const float *)Wv + i * k;
    f32x8 a = {0}, b = {0}, c = {0}, d = {0};
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        a += load_f32(w + j) * load_f32(x + j);
        b += load_f32(w + j + 8) * load_f32(x + j + 8);
        c += load_f32(w + j + 16) * load_f32(x + j + 16);
        d += load_f32(w + j + 24) * load_f32(x + j + 24);
    }
    for (; j + 8 <= k; j += 8) a += load_f32(w + j) * load_f32(x + j);
    float s = sum8((a + b) + (c + d));
    for (; j < k; j++) s += w[j] * x[j];  /* k not a multiple of 8 */
    y[i] = s;
}

/* bf16 weights, fp32 x and sums: 32 weights a pass. xp is x with each block of 16 reordered as its
 * 8 even then 8 odd elements (gemv_bf16 does it once); the tail past the last block is x itself. */
static void row_bf16(const void *Wv, const float *xp, float *y, int64_t i, int64_t k) {
    const uint16_t *w = (const uint16_t *)Wv + i * k;
    f32x8 a = {0}, b = {0}, c = {0}, d = {0}, e, o;
    int64_t j = 0;
    for (; j + 32 <= k; j += 32) {
        load_bf16x16(w + j, &e, &o);
        a += e * load_f32(xp + j); b += o * load_f32(xp + j + 8);
        load_bf16x16(w + j + 16, &e, &o);
        c += e * load_f32(xp + j + 16); d += o * load_f32(xp + j + 24);
    }
    for (; j + 16 <= k; j += 16) {
        load_bf16x16(w + j, &e, &o);
        a += e * load_f32(xp + j); b += o * load_f32(xp + j + 8);
    }
    float s = sum8((a + b) + (c + d));
    for (; j < k; j++) s += bf16_to_f32(w[j]) * xp[j];
    y[i] = s;
}

typedef void (*row_fn)(const void *W, const float *x, float *y, int64_t i, int64_t k);

/* rows [first, end) of y */
static void rows(row_fn row, const void *W, const float *x, float *y, int64_t k, int64_t first, int64_t end) {
    for (int64_t i = first; i < end; i++) row(W, x, y, i, k);
}

static int64_t late_regions = 0;  /* read by cpu_kernel.py for its report */
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
#endif

static void gemv(row_fn row, const void *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
#ifdef _OPENMP
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && single_calls_left == 0 && n >= 16 * threads) {
        double ended[MAX_THREADS], start = now_s();
        int team = 1;
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            if (t == 0) team = nt;
            rows(row, W, x, y, k, n * t / nt, n * (t + 1) / nt);  /* a fixed split: each thread its own rows */
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
#endif
    rows(row, W, x, y, k, 0, n);
}

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    gemv(row_f32, W, x, y, n, k, threads);
}

void gemv_bf16(const uint16_t *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    float *xp = malloc((size_t)k * sizeof *xp);  /* x reordered to match load_bf16x16 */
    if (!xp) return;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int l = 0; l < 8; l++) { xp[j + l] = x[j + 2 * l]; xp[j + 8 + l] = x[j + 2 * l + 1]; }
    for (; j < k; j++) xp[j] = x[j];
    gemv(row_bf16, W, xp, y, n, k, threads);
    free(xp);
}
