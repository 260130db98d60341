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
 * count. Built once per machine by minigen/cpu_kernel.py with `cc -O3 -march=native -fopenmp`.
 * fp32 only: for bf16 weights torch's own matrix-vector path measured as fast as a loop like this.
 */
#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));

/* memcpy: an unaligned vector load, which any compiler turns into one move */
static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline float sum8(f32x8 v) { float s = 0.0f; for (int l = 0; l < 8; l++) s += v[l]; return s; }

/* fp32: y[i..i+3] = W[i..i+3, :] @ x; rows past n (the last block) read row i again, unused. */
static void rows_f32(const float *W, const float *x, float *y, int64_t i, int rows, int64_t k) {
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

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i += 4)
        rows_f32(W, x, y, i, n - i < 4 ? (int)(n - i) : 4, k);
}
