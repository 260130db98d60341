/* Matrix-vector products for decoding at batch 1: y[n] = W[n, k] @ x[k].
 *
 * A decode step multiplies one activation row by every weight matrix of the model, so its time is
 * the time to stream the weights from memory. torch's fp32 matrix-vector path reaches about half
 * of this CPU's read bandwidth; this loop reaches about 90%. The whole trick is four things:
 *   - rows of W are contiguous (nn.Linear's [out, in] layout), so each thread streams its own rows;
 *   - four rows per pass, so x is loaded once for four rows and four sums run in parallel;
 *   - 8-wide vectors through GCC/Clang vector extensions (one AVX2 register; two NEON ones on ARM);
 *   - OpenMP splits the rows over the threads torch itself uses (same runtime, no second pool).
 * Built once per machine by minigen/cpu_kernel.py with `cc -O3 -march=native -fopenmp`.
 */
#include <stdint.h>
#include <string.h>

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }

/* bf16 is the upper half of an fp32: widen to 32 bits, shift left by 16, reinterpret. */
static inline f32x8 load_bf16(const uint16_t *p) {
    u16x8 h; memcpy(&h, p, sizeof h);
    u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    f32x8 v; memcpy(&v, &u, sizeof v); return v;
}
static inline float scalar_f32(const float *p) { return *p; }
static inline float scalar_bf16(const uint16_t *p) { uint32_t u = (uint32_t)*p << 16; float f; memcpy(&f, &u, 4); return f; }

static inline float sum8(f32x8 v) { float s = 0.0f; for (int l = 0; l < 8; l++) s += v[l]; return s; }

/* Rows [i, i + rows) of y, rows <= 4; k8 = k rounded down to a multiple of 8, the rest is scalar. */
#define DOT_ROWS(T, LOAD, SCALAR)                                                                   \
    static void dot_rows_##T(const T *W, const float *x, float *y, int64_t i, int rows, int64_t k) { \
        /* past the last row (rows < 4), read row i again and drop the result */                  \
        const T *w0 = W + i * k, *w1 = rows > 1 ? w0 + k : w0,                                     \
                *w2 = rows > 2 ? w0 + 2 * k : w0, *w3 = rows > 3 ? w0 + 3 * k : w0;                \
        f32x8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                              \
        int64_t k8 = k - k % 8, j = 0;                                                             \
        for (; j < k8; j += 8) {                                                                   \
            f32x8 xv = load_f32(x + j);                                                            \
            a0 += LOAD(w0 + j) * xv; a1 += LOAD(w1 + j) * xv;                                      \
            a2 += LOAD(w2 + j) * xv; a3 += LOAD(w3 + j) * xv;                                      \
        }                                                                                          \
        float s[4] = {sum8(a0), sum8(a1), sum8(a2), sum8(a3)};                                     \
        const T *w[4] = {w0, w1, w2, w3};                                                          \
        for (int r = 0; r < rows; r++) {                                                           \
            for (int64_t t = j; t < k; t++) s[r] += SCALAR(w[r] + t) * x[t];                       \
            y[i + r] = s[r];                                                                       \
        }                                                                                          \
    }
typedef float f32;
typedef uint16_t bf16;
DOT_ROWS(f32, load_f32, scalar_f32)
DOT_ROWS(bf16, load_bf16, scalar_bf16)

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i += 4)
        dot_rows_f32(W, x, y, i, n - i < 4 ? (int)(n - i) : 4, k);
}

void gemv_bf16(const uint16_t *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; i += 4)
        dot_rows_bf16(W, x, y, i, n - i < 4 ? (int)(n - i) : 4, k);
}
