/* Matrix-vector products for decoding at batch 1: y[n] = W[n, k] @ x[k].
 *
 * A decode step multiplies one activation row by every weight matrix of the model, so its time is
 * the time to stream the weights from memory. torch's fp32 matrix-vector path reaches about half
 * of this course's CPU read bandwidth; this loop reaches about 80 to 90% of it. The whole trick:
 *   - rows of W are contiguous (nn.Linear's [out, in] layout), so each thread streams its own rows;
 *   - four rows per pass, so x is loaded once for four rows and four sums run side by side;
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

/* fp32: y[i..i+3] = W[i..i+3, :] @ x; rows past n (the last block) read row i again, unused. */
static void rows_f32(const void *Wv, const float *x, float *y, int64_t i, int rows, int64_t k) {
    const float *W = Wv;
    const float *w0 = W + i * k, *w1 = rows > 1 ? w0 + k : w0,
                *w2 = rows > 2 ? w0 + 2 * k : w0, *w3 = rows > 3 ? w0 + 3 * k : w0;
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        f32x8 xv = load_f32(x + j);
        a0 += load_f32(w0 + j) * xv; a1 += load_f32(w1 + j) * xv;
        a2 += load_f32(w2 + j) * xv; a3 += load_f32(w3 + j) * xv;
    }
    float s[4] = {sum8(a0), sum8(a1), sum8(a2), sum8(a3)};
    const float *w[4] = {w0, w1, w2, w3};
    for (int r = 0; r < rows; r++) {
        for (int64_t t = j; t < k; t++) s[r] += w[r][t] * x[t];  /* k not a multiple of 8 */
        y[i + r] = s[r];
    }
}

/* bf16 weights, fp32 x and sums: the loop above, 16 weights a pass. xp is x with each block of 16
 * reordered as its 8 even then 8 odd elements (gemv_bf16 does it once); the tail is x itself. */
static void rows_bf16(const void *Wv, const float *xp, float *y, int64_t i, int rows, int64_t k) {
    const uint16_t *W = Wv;
    const uint16_t *w0 = W + i * k, *w1 = rows > 1 ? w0 + k : w0,
                   *w2 = rows > 2 ? w0 + 2 * k : w0, *w3 = rows > 3 ? w0 + 3 * k : w0;
    /* even and odd sums apart: 8 independent chains of multiply-adds keep the FMA units busy */
    f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, e, o;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        f32x8 xe = load_f32(xp + j), xo = load_f32(xp + j + 8);
        load_bf16x16(w0 + j, &e, &o); a0 += e * xe; b0 += o * xo;
        load_bf16x16(w1 + j, &e, &o); a1 += e * xe; b1 += o * xo;
        load_bf16x16(w2 + j, &e, &o); a2 += e * xe; b2 += o * xo;
        load_bf16x16(w3 + j, &e, &o); a3 += e * xe; b3 += o * xo;
    }
    float s[4] = {sum8(a0 + b0), sum8(a1 + b1), sum8(a2 + b2), sum8(a3 + b3)};
    const uint16_t *w[4] = {w0, w1, w2, w3};
    for (int r = 0; r < rows; r++) {
        for (int64_t t = j; t < k; t++) s[r] += bf16_to_f32(w[r][t]) * xp[t];
        y[i + r] = s[r];
    }
}

typedef void (*rows_fn)(const void *W, const float *x, float *y, int64_t i, int rows, int64_t k);

/* rows [4 * first_block, 4 * end_block) of y */
static void blocks(rows_fn rows, const void *W, const float *x, float *y, int64_t n, int64_t k,
                   int64_t first_block, int64_t end_block) {
    for (int64_t b = first_block; b < end_block; b++)
        rows(W, x, y, 4 * b, n - 4 * b < 4 ? (int)(n - 4 * b) : 4, k);
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

static void gemv(rows_fn rows, const void *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    int64_t n_blocks = (n + 3) / 4;
#ifdef _OPENMP
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && single_calls_left == 0 && n_blocks >= threads) {
        double ended[MAX_THREADS], start = now_s();
        int team = 1;
        #pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            if (t == 0) team = nt;
            blocks(rows, W, x, y, n, k, n_blocks * t / nt, n_blocks * (t + 1) / nt);  /* fixed split */
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
    blocks(rows, W, x, y, n, k, 0, n_blocks);
}

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    gemv(rows_f32, W, x, y, n, k, threads);
}

void gemv_bf16(const uint16_t *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    float *xp = malloc((size_t)k * sizeof *xp);  /* x reordered to match load_bf16x16 */
    if (!xp) return;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int l = 0; l < 8; l++) { xp[j + l] = x[j + 2 * l]; xp[j + 8 + l] = x[j + 2 * l + 1]; }
    for (; j < k; j++) xp[j] = x[j];
    gemv(rows_bf16, W, xp, y, n, k, threads);
    free(xp);
}
