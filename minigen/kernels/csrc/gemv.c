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
 * int8 and int4 weights (chapter 14): groups of G weights along a row share a scale (int8, as
 * GGUF's Q8_0: w = scale * q, q in [-127, 127]) or a scale and a minimum (int4, as GGUF's Q4_1:
 * w = min + scale * q, q in [0, 15]); int4 codes sit two to a byte, and in each block of 32 weights
 * byte j holds weight j in its low nibble and weight j + 16 in its high one. The codes become fp32
 * in registers and meet x there: sum over a group of q * x, times its scale, plus its minimum
 * times the sum of x over the group (worked out once per call). Scales and minimums are fp16.
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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

/* One matrix-vector product: y = W @ x, W [n, k] stored as `kind` says, x [k] fp32. */
typedef struct {
    const void *W;             /* fp32 or bf16 weights, or int8 / int4 codes */
    const uint16_t *scales;    /* int8 / int4: fp16 scale of each group [n, k / G] */
    const uint16_t *mins;      /* int4: fp16 minimum of each group [n, k / G] */
    const float *x;            /* fp32 activations [k] (bf16: reordered, see gemv_bf16) */
    const float *xsum;         /* int4: the sum of x over each group [k / G] */
    int64_t k, G;
    int64_t M, n;              /* gemm_f32: rows of x (x [M, k], y [M, n]); 0 for one vector */
    const float *xperm;        /* int4 with AVX-512 and G = 32: x reordered for row_q4_perm, or NULL */
} Mat;

/* memcpy: an unaligned vector load, which any compiler turns into one move */
static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline float sum8(f32x8 v) { float s = 0.0f; for (int l = 0; l < 8; l++) s += v[l]; return s; }
/* a += w * x in one rounding where the CPU has FMA. The 8-wide tails of the fp32 rows use it
 * rather than `a += w * x`, which the compiler fuses in one function and not in another: the
 * several-row kernels must give each row the bits row_f32 gives it. */
static inline f32x8 fma8(f32x8 w, f32x8 x, f32x8 a) {
#ifdef __FMA__
    return (f32x8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)a);
#else
    return a + w * x;
#endif
}

/* 16 bf16 numbers at p -> the 8 even ones and the 8 odd ones as fp32 (little-endian words) */
static inline void load_bf16x16(const uint16_t *p, f32x8 *even, f32x8 *odd) {
    u32x8 w; memcpy(&w, p, sizeof w);
    u32x8 e = w << 16, o = w & 0xFFFF0000u;
    memcpy(even, &e, sizeof e); memcpy(odd, &o, sizeof o);
}
static inline float bf16_to_f32(uint16_t h) { uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }

/* IEEE fp16 bits -> float, subnormals included (scales of tiny groups can be subnormal); one
 * instruction where the CPU has F16C (x86 since 2012), a few integer operations elsewhere */
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);               /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);        /* normal */
    else { float f = (float)man * (1.0f / 16777216.0f); memcpy(&bits, &f, 4); bits |= sign; }  /* 2^-24 */
    float f; memcpy(&f, &bits, 4); return f;
}

/* The end of an fp32 dot product w . x [k] whose first j weights (a multiple of 32) are in the
 * chains a, b, c, d: the 8-wide tail into a, the chains summed, the scalar tail. Every fp32 row
 * kernel ends here, so a row of a batch gets exactly the bits row_f32 gives it alone. */
static inline float finish_f32(f32x8 a, f32x8 b, f32x8 c, f32x8 d, const float *w, const float *x, int64_t j,
                               int64_t k) {
    for (; j + 8 <= k; j += 8) a = fma8(load_f32(w + j), load_f32(x + j), a);
    float s = sum8((a + b) + (c + d));
    for (; j < k; j++) s = fmaf(w[j], x[j], s);  /* k not a multiple of 8 */
    return s;
}

/* fp32: y[i] = W[i, :] @ x, 32 weights a pass into four sums (independent multiply-add chains) */
static void row_f32(const Mat *m, float *y, int64_t i) {
    const float *w = (const float *)m->W + i * m->k, *x = m->x;
    int64_t k = m->k, j = 0;
    f32x8 a = {0}, b = {0}, c = {0}, d = {0};
    for (; j + 32 <= k; j += 32) {
        a += load_f32(w + j) * load_f32(x + j);
        b += load_f32(w + j + 8) * load_f32(x + j + 8);
        c += load_f32(w + j + 16) * load_f32(x + j + 16);
        d += load_f32(w + j + 24) * load_f32(x + j + 24);
    }
    y[i] = finish_f32(a, b, c, d, w, x, j, k);
}

/* Several rows of x at once (a batch's decode step, a short prompt): y[r, i] = W[i, :] @ x[r, :].
 * Row i of W comes from memory once and meets four rows of x per pass while it sits in registers,
 * so a batch of 8 reads the weights once instead of 8 times (torch's fp32 GEMM at M = 8 read them
 * at a third of the bandwidth here). Each dot product keeps row_f32's order of sums (the same four
 * chains, the same tails), so a row of a batch gets exactly the bits it gets alone. */
#define XROWS 4
/* The weight row two rows ahead is prefetched into L2, not L1 (prefetcht1, not t0): while a row
 * meets its second four rows of x, memory keeps streaming the next ones. With t0 the requests
 * competed with the x loads for L1's few miss buffers and memory waited on arithmetic: the whole
 * of SmolLM2's matrices at M = 8, 2 threads, in turns in one process: 19.9 ms (t0), 14.5 (t1). */
#ifndef PF_ROWS  /* prefetch the weight row this many rows ahead */
#define PF_ROWS 2
#endif
static void rows_f32(const Mat *m, float *y, int64_t i) {
    const float *w = (const float *)m->W + i * m->k;
    int64_t k = m->k, r = 0;
    for (; r + XROWS <= m->M; r += XROWS) {
        const float *x = m->x + r * k;
        f32x8 acc[XROWS][4] = {{{0}}};
        int64_t j = 0;
        for (; j + 32 <= k; j += 32) {
            f32x8 w0 = load_f32(w + j), w1 = load_f32(w + j + 8), w2 = load_f32(w + j + 16), w3 = load_f32(w + j + 24);
            if (r == 0 && i + PF_ROWS < m->n) { __builtin_prefetch(w + PF_ROWS * k + j, 0, 2); __builtin_prefetch(w + PF_ROWS * k + j + 16, 0, 2); }
            #pragma GCC unroll 8  /* unrolled, acc stays in registers: twice as fast as the rolled loop here */
            for (int q = 0; q < XROWS; q++) {
                const float *xq = x + q * k + j;
                acc[q][0] += w0 * load_f32(xq);
                acc[q][1] += w1 * load_f32(xq + 8);
                acc[q][2] += w2 * load_f32(xq + 16);
                acc[q][3] += w3 * load_f32(xq + 24);
            }
        }
        for (int q = 0; q < XROWS; q++)
            y[(r + q) * m->n + i] = finish_f32(acc[q][0], acc[q][1], acc[q][2], acc[q][3], w, x + q * k, j, k);
    }
    for (; r < m->M; r++) {  /* the rows left over: one at a time, as row_f32 does them */
        Mat one = *m;
        one.x = m->x + r * k;
        row_f32(&one, y + r * m->n, i);
    }
}

#ifdef __AVX512F__
/* With AVX-512: two rows of W a pass (pair p: rows 2p and 2p + 1), each 32-weight block of a row in
 * two 16-lane registers. Lanes 0-7 of the first register are row_f32's chain a, lanes 8-15 its
 * chain b, the second register chains c and d: the same multiply-adds on the same lanes, so the
 * same bits. Each x load now serves two rows, and the four rows of x for a 1,536-wide row stay in
 * L1 (w_down at M = 8, one thread: 21 -> 29 multiply-adds per ns). Left to itself GCC folds each
 * x load into both rows' multiply-adds, loading it twice: 20 loads for 16 multiply-adds, and the
 * loads, not the multiply-adds, set the pace. An empty asm statement keeps xab and xcd in registers
 * (12 loads for 16): one thread in L2, 18.5 -> 26.7 multiply-adds per ns; SmolLM2's matrices and
 * head at M = 8 from memory, 2 threads, 34.0 -> 30.5 ms. The same instructions, the same bits.
 * Where k is a multiple of 32 (no tails), the pass's eight dot products are summed at once
 * (sum8_x8), again with the same bits: a row of 576 weights is only 18 iterations, and eight
 * chains of dependent additions had cost a third as much as the loop (SmolLM2 at M = 8, 2
 * threads: 28.9 -> 25.9 ms; one thread in L2: 26.4 -> 29.4 multiply-adds per ns, of a peak of 57
 * measured with multiply-adds alone). */
static inline f32x8 low8(__m512 v) { __m256 h = _mm512_castps512_ps256(v); f32x8 r; memcpy(&r, &h, 32); return r; }
static inline f32x8 high8(__m512 v) { __m256 h = _mm512_extractf32x8_ps(v, 1); f32x8 r; memcpy(&r, &h, 32); return r; }

/* sum8 of eight vectors at once: lane o of the result is sum8(v[o]), the same additions in the same
 * order (0 + lane 0, + lane 1, ... + lane 7), so the same bits, after an 8 x 8 transpose: 32
 * instructions for eight sums instead of ~15 each on a chain of eight dependent additions. */
_Static_assert(2 * XROWS == 8, "rows_f32_pair hands sum8_x8 eight sums a pass");
static inline f32x8 sum8_x8(const f32x8 v[8]) {
    __m256 r[8], t[8];
    for (int o = 0; o < 8; o++) memcpy(&r[o], &v[o], 32);
    for (int o = 0; o < 8; o += 2) {  /* pairs of rows: lanes 0 1 4 5 and 2 3 6 7 interleaved */
        t[o] = _mm256_unpacklo_ps(r[o], r[o + 1]);
        t[o + 1] = _mm256_unpackhi_ps(r[o], r[o + 1]);
    }
    for (int o = 0; o < 8; o += 4)
        for (int h = 0; h < 2; h++) {
            r[o + 2 * h] = _mm256_shuffle_ps(t[o + h], t[o + 2 + h], _MM_SHUFFLE(1, 0, 1, 0));
            r[o + 2 * h + 1] = _mm256_shuffle_ps(t[o + h], t[o + 2 + h], _MM_SHUFFLE(3, 2, 3, 2));
        }
    /* now r[a] (a < 4) holds lane a of rows 0-3 in its low half and lane a + 4 in its high half, and
     * r[4 + a] the same of rows 4-7: lane l of all eight rows is two halves put together */
    __m256 s = _mm256_setzero_ps();
    for (int l = 0; l < 8; l++)
        s = _mm256_add_ps(s, _mm256_permute2f128_ps(r[l & 3], r[4 + (l & 3)], l < 4 ? 0x20 : 0x31));
    f32x8 out;
    memcpy(&out, &s, 32);
    return out;
}

static void rows_f32_pair(const Mat *m, float *y, int64_t p) {
    int64_t i = 2 * p, k = m->k, r = 0;
    if (i + 1 >= m->n) { rows_f32(m, y, i); return; }  /* an odd last row */
    const float *w0 = (const float *)m->W + i * k, *w1 = w0 + k;
    for (; r + XROWS <= m->M; r += XROWS) {
        const float *x = m->x + r * k;
        __m512 acc[XROWS][2][2];  /* [row of x][row of W][chains a|b, c|d] */
        for (int q = 0; q < XROWS; q++)
            acc[q][0][0] = acc[q][0][1] = acc[q][1][0] = acc[q][1][1] = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 32 <= k; j += 32) {
            __m512 ab0 = _mm512_loadu_ps(w0 + j), cd0 = _mm512_loadu_ps(w0 + j + 16);
            __m512 ab1 = _mm512_loadu_ps(w1 + j), cd1 = _mm512_loadu_ps(w1 + j + 16);
            if (r == 0 && i + 1 + PF_ROWS < m->n) {
                __builtin_prefetch(w0 + PF_ROWS * k + j, 0, 2); __builtin_prefetch(w0 + PF_ROWS * k + j + 16, 0, 2);
                __builtin_prefetch(w1 + PF_ROWS * k + j, 0, 2); __builtin_prefetch(w1 + PF_ROWS * k + j + 16, 0, 2);
            }
            #pragma GCC unroll 8
            for (int q = 0; q < XROWS; q++) {
                __m512 xab = _mm512_loadu_ps(x + q * k + j), xcd = _mm512_loadu_ps(x + q * k + j + 16);
                __asm__("" : "+v"(xab), "+v"(xcd));  /* in registers: see above */
                acc[q][0][0] = _mm512_fmadd_ps(ab0, xab, acc[q][0][0]);
                acc[q][0][1] = _mm512_fmadd_ps(cd0, xcd, acc[q][0][1]);
                acc[q][1][0] = _mm512_fmadd_ps(ab1, xab, acc[q][1][0]);
                acc[q][1][1] = _mm512_fmadd_ps(cd1, xcd, acc[q][1][1]);
            }
        }
        if (j == k) {  /* no tails (k a multiple of 32): the eight sums at once, see sum8_x8 */
            f32x8 v[2 * XROWS];
            for (int q = 0; q < XROWS; q++)
                for (int h = 0; h < 2; h++)
                    v[2 * q + h] = (low8(acc[q][h][0]) + high8(acc[q][h][0])) + (low8(acc[q][h][1]) + high8(acc[q][h][1]));
            f32x8 s = sum8_x8(v);
            for (int q = 0; q < XROWS; q++)
                for (int h = 0; h < 2; h++) y[(r + q) * m->n + i + h] = s[2 * q + h];
            continue;
        }
        for (int q = 0; q < XROWS; q++)
            for (int h = 0; h < 2; h++)  /* row_f32's end, on its chains a, b, c, d */
                y[(r + q) * m->n + i + h] = finish_f32(low8(acc[q][h][0]), high8(acc[q][h][0]), low8(acc[q][h][1]),
                                                       high8(acc[q][h][1]), h ? w1 : w0, x + q * k, j, k);
    }
    for (; r < m->M; r++) {  /* the rows of x left over: one at a time, as row_f32 does them */
        Mat one = *m;
        one.x = m->x + r * k;
        row_f32(&one, y + r * m->n, i);
        row_f32(&one, y + r * m->n, i + 1);
    }
}
#endif

/* bf16 weights, fp32 x and sums: 32 weights a pass. x is reordered: each block of 16 as its 8 even
 * then 8 odd elements (gemv_bf16 does it once); the tail past the last block is x itself. */
static void row_bf16(const Mat *m, float *y, int64_t i) {
    const uint16_t *w = (const uint16_t *)m->W + i * m->k;
    const float *xp = m->x;
    int64_t k = m->k, j = 0;
    f32x8 a = {0}, b = {0}, c = {0}, d = {0}, e, o;
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

/* 8 codes -> 8 fp32 numbers, through 32-bit integers (two vector instructions; a direct 8-bit to
 * float conversion compiles to eight scalar ones) */
static inline f32x8 i8_to_f32(const int8_t *p) {
#ifdef __AVX2__  /* GCC lowers the generic form below to eight inserts here: say vpmovsxbd directly */
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    f32x8 f; memcpy(&f, &v, sizeof f); return f;
#else
    i8x8 q; memcpy(&q, p, 8);
    return __builtin_convertvector(__builtin_convertvector(q, i32x8), f32x8);
#endif
}
static inline f32x8 u8_to_f32(u8x8 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x8), f32x8); }

/* int8 weights: a group of G codes, summed against x, then scaled once (G a multiple of 32) */
static void row_q8(const Mat *m, float *y, int64_t i) {
    const int8_t *q = (const int8_t *)m->W + i * m->k;
    const uint16_t *scale = m->scales + i * (m->k / m->G);
    const float *x = m->x;
    f32x8 acc = {0};
    for (int64_t g = 0, j = 0; j < m->k; g++) {
        f32x8 a = {0}, b = {0};
        for (int64_t end = j + m->G; j < end; j += 16) {
            a += i8_to_f32(q + j) * load_f32(x + j);
            b += i8_to_f32(q + j + 8) * load_f32(x + j + 8);
        }
        acc += (a + b) * f16_to_f32(scale[g]);
    }
    y[i] = sum8(acc);
}

/* A block of 32 int4 codes (16 bytes) -> 4 x 8 fp32 numbers: weights 0-7, 8-15, 16-23, 24-31 */
static inline void load_q4x32(const uint8_t *p, f32x8 *w0, f32x8 *w1, f32x8 *w2, f32x8 *w3) {
#ifdef __AVX2__  /* x86 has no byte shift: shift 16-bit lanes and mask, then widen 8 bytes at a time */
    __m128i b = _mm_loadu_si128((const __m128i *)p), nib = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    __m256 v2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), v3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    memcpy(w0, &v0, 32); memcpy(w1, &v1, 32); memcpy(w2, &v2, 32); memcpy(w3, &v3, 32);
#else
    u8x8 lo, hi;
    memcpy(&lo, p, 8); memcpy(&hi, p + 8, 8);  /* bytes 0-7 and 8-15 */
    *w0 = u8_to_f32(lo & 0xF); *w1 = u8_to_f32(hi & 0xF); *w2 = u8_to_f32(lo >> 4); *w3 = u8_to_f32(hi >> 4);
#endif
}

/* int4 weights: each block of 32 is 16 bytes, weight j in the low nibble of byte j and weight
 * j + 16 in its high one; per group, scale * sum(q * x) + min * sum(x) */
static void row_q4(const Mat *m, float *y, int64_t i) {
    const uint8_t *q = (const uint8_t *)m->W + i * (m->k / 2);
    const uint16_t *scale = m->scales + i * (m->k / m->G), *mins = m->mins + i * (m->k / m->G);
    const float *x = m->x;
    f32x8 acc = {0}, w0, w1, w2, w3;
    float from_mins = 0.0f;
    for (int64_t g = 0, j = 0; j < m->k; g++) {
        f32x8 a = {0}, b = {0}, c = {0}, d = {0};  /* four multiply-add chains */
        for (int64_t end = j + m->G; j < end; j += 32) {
            load_q4x32(q + j / 2, &w0, &w1, &w2, &w3);
            a += w0 * load_f32(x + j); b += w1 * load_f32(x + j + 8);
            c += w2 * load_f32(x + j + 16); d += w3 * load_f32(x + j + 24);
        }
        acc += ((a + b) + (c + d)) * f16_to_f32(scale[g]);
        from_mins += f16_to_f32(mins[g]) * m->xsum[g];
    }
    y[i] = sum8(acc) + from_mins;
}

#ifdef __AVX512F__
/* With AVX-512 (chapter 14), int8 and int4 rows run 16 lanes wide: a block of 32 codes becomes two
 * vectors in four instructions instead of eight, and the widening, not memory, is what limits
 * these rows (measured on Zen 4, one thread: int4 10.9 -> 14.6 to 15.8 weights per ns).
 * A row's scales and minimums are widened to fp32 once, 16 at a time, into a small array. */
#define MAX_ROW_GROUPS 1024  /* k / G of the row arrays below; a longer row takes the 8-wide loop */

static inline void row_scales(const uint16_t *h, float *f, int64_t ng) {
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) _mm512_storeu_ps(f + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
    for (; g < ng; g++) f[g] = f16_to_f32(h[g]);
}
static inline __m512 i8x16_to_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 u4x16_to_f32(__m128i nibbles) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles)); }

static void row_q8_wide(const Mat *m, float *y, int64_t i) {
    const int64_t ng = m->k / m->G;
    const int8_t *q = (const int8_t *)m->W + i * m->k;
    const float *x = m->x;
    float sc[MAX_ROW_GROUPS];
    row_scales(m->scales + i * ng, sc, ng);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();  /* two chains: even, odd groups */
    int64_t g = 0, j = 0;
    for (; m->G == 32 && g + 2 <= ng; g += 2, j += 64) {  /* two groups of 32 */
        __m512 s0 = _mm512_mul_ps(i8x16_to_f32(q + j), _mm512_loadu_ps(x + j));
        __m512 s1 = _mm512_mul_ps(i8x16_to_f32(q + j + 32), _mm512_loadu_ps(x + j + 32));
        s0 = _mm512_fmadd_ps(i8x16_to_f32(q + j + 16), _mm512_loadu_ps(x + j + 16), s0);
        s1 = _mm512_fmadd_ps(i8x16_to_f32(q + j + 48), _mm512_loadu_ps(x + j + 48), s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(sc[g]), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_set1_ps(sc[g + 1]), acc1);
    }
    for (; g < ng; g++) {  /* the rest: larger groups, or an odd last one */
        __m512 s = _mm512_setzero_ps();
        for (int64_t end = j + m->G; j < end; j += 16) s = _mm512_fmadd_ps(i8x16_to_f32(q + j), _mm512_loadu_ps(x + j), s);
        acc0 = _mm512_fmadd_ps(s, _mm512_set1_ps(sc[g]), acc0);
    }
    y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

static void row_q4_wide(const Mat *m, float *y, int64_t i) {
    const int64_t ng = m->k / m->G;
    const uint8_t *q = (const uint8_t *)m->W + i * (m->k / 2);
    const float *x = m->x;
    float sc[MAX_ROW_GROUPS], mn[MAX_ROW_GROUPS];
    row_scales(m->scales + i * ng, sc, ng);
    row_scales(m->mins + i * ng, mn, ng);
    const __m128i nib = _mm_set1_epi8(0x0F);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();  /* two chains: even, odd groups */
    int64_t g = 0, j = 0;
    for (; m->G == 32 && g + 2 <= ng; g += 2, j += 64) {  /* two groups of one block each */
        __m128i b0 = _mm_loadu_si128((const __m128i *)(q + j / 2));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(q + j / 2 + 16));
        __m512 s0 = _mm512_mul_ps(u4x16_to_f32(_mm_and_si128(b0, nib)), _mm512_loadu_ps(x + j));
        __m512 s1 = _mm512_mul_ps(u4x16_to_f32(_mm_and_si128(b1, nib)), _mm512_loadu_ps(x + j + 32));
        s0 = _mm512_fmadd_ps(u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(b0, 4), nib)), _mm512_loadu_ps(x + j + 16), s0);
        s1 = _mm512_fmadd_ps(u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(b1, 4), nib)), _mm512_loadu_ps(x + j + 48), s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(sc[g]), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_set1_ps(sc[g + 1]), acc1);
    }
    for (; g < ng; g++) {  /* the rest: groups of several blocks (G = 64, 128 ...), or an odd last one */
        __m512 s = _mm512_setzero_ps();  /* weights j..j+15 in low nibbles, j+16..j+31 in high ones */
        for (int64_t end = j + m->G; j < end; j += 32) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
            s = _mm512_fmadd_ps(u4x16_to_f32(_mm_and_si128(bytes, nib)), _mm512_loadu_ps(x + j), s);
            s = _mm512_fmadd_ps(u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib)), _mm512_loadu_ps(x + j + 16), s);
        }
        acc0 = _mm512_fmadd_ps(s, _mm512_set1_ps(sc[g]), acc0);
    }
    for (g = 0; g < ng; g += 16) {  /* the minimums times the sums of x, 16 groups at a time */
        __mmask16 live = ng - g >= 16 ? 0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, mn + g), _mm512_maskz_loadu_ps(live, m->xsum + g), acc1);
    }
    y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* int4 in blocks of 128 weights (G = 32, four groups): 64 bytes of codes are loaded as 16 32-bit
 * words, and word d shifted right by 4t (t = 0..7) holds in its low 4 bits the code in byte
 * 4d + t/2 (its low nibble for even t, its high one for odd t). vpermps reads only the low 4 bits
 * of each index, so permuting the vector (0, 1, ..., 15) by the shifted words turns 16 codes into
 * 16 fp32 numbers in one instruction: no widening, masking or conversion, the work that limits
 * row_q4_wide. x is reordered once per call to match (prepare_q4); lane d of every vector belongs
 * to group 4 * block + d / 4. Measured on Zen 4, in turns in one process: one thread in
 * cache, 1.25-1.35x row_q4_wide's weights per ns; SmolLM2's 30 layers from memory, 6.6 -> 5.2-5.4
 * ms on 2 threads, 9.3-9.9 -> 7.5-8.1 ms on one. Tried and slower: making the floats with integer
 * operations instead (the code or'ed into an exponent, minus that power of two; alone or for half
 * of the codes). Prefetching the codes 2 KB ahead took 6-10% off. */
#ifndef Q4_AHEAD
#define Q4_AHEAD 2048  /* bytes of codes ahead */
#endif
static void row_q4_perm(const Mat *m, float *y, int64_t i) {
    const int64_t ng = m->k / 32, nb = m->k / 128;
    const uint8_t *q = (const uint8_t *)m->W + i * (m->k / 2);
    const uint16_t *sc = m->scales + i * ng, *mn = m->mins + i * ng;
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch((const char *)(q + 64 * b + Q4_AHEAD), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * b));
        const float *xp = m->xperm + 128 * b;
        __m512 s0 = _mm512_mul_ps(_mm512_permutexvar_ps(v, codes), _mm512_loadu_ps(xp));
        __m512 s1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), codes), _mm512_loadu_ps(xp + 16));
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), codes), _mm512_loadu_ps(xp + 32), s0);
        s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), codes), _mm512_loadu_ps(xp + 48), s1);
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 16), codes), _mm512_loadu_ps(xp + 64), s0);
        s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 20), codes), _mm512_loadu_ps(xp + 80), s1);
        s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 24), codes), _mm512_loadu_ps(xp + 96), s0);
        s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 28), codes), _mm512_loadu_ps(xp + 112), s1);
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
            _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 4 * b)))));  /* 4 scales, each to 4 lanes */
        acc0 = _mm512_fmadd_ps(s0, scale, acc0);
        acc1 = _mm512_fmadd_ps(s1, scale, acc1);
    }
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (int64_t g = 4 * nb, j = 128 * nb; g < ng; g++, j += 32) {  /* the last groups (k = 576: two) */
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
        __m512 s = _mm512_mul_ps(u4x16_to_f32(_mm_and_si128(bytes, nib)), _mm512_loadu_ps(m->x + j));
        s = _mm512_fmadd_ps(u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib)), _mm512_loadu_ps(m->x + j + 16), s);
        acc0 = _mm512_fmadd_ps(s, _mm512_set1_ps(f16_to_f32(sc[g])), acc0);
    }
    for (int64_t g = 0; g < ng; g += 16) {  /* the minimums times the sums of x, 16 groups at a time */
        __mmask16 live = ng - g >= 16 ? 0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + g)),
                               _mm512_maskz_loadu_ps(live, m->xsum + g), acc1);
    }
    y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

/* int4: the sum of x over each group [k / G] into xsum, and, where row_q4_perm applies, x
 * reordered for it into xperm [k / 128 * 128] (NULL: not wanted). Returns whether xperm was made. */
static int prepare_q4(const float *x, int64_t k, int64_t G, float *xsum, float *xperm) {
    for (int64_t g = 0; g < k / G; g++) {
        float s = 0.0f;
        for (int64_t j = g * G; j < (g + 1) * G; j++) s += x[j];
        xsum[g] = s;
    }
#ifdef __AVX512F__
    if (xperm && G == 32 && k >= 128) {
        for (int64_t b = 0; b < k / 128; b++)
            for (int t = 0; t < 8; t++)
                for (int d = 0; d < 16; d++) {
                    int byte = 4 * d + t / 2;  /* word d, bits 4t..4t+3 */
                    xperm[128 * b + 16 * t + d] = x[128 * b + 32 * (byte / 16) + byte % 16 + 16 * (t % 2)];
                }
        return 1;
    }
#endif
    (void)xperm;
    return 0;
}

typedef void (*row_fn)(const Mat *m, float *y, int64_t i);

static row_fn q4_rows(const Mat *m) {  /* the int4 loop for this machine and matrix */
#ifdef __AVX512F__
    if (m->xperm) return row_q4_perm;
    if (m->k / m->G <= MAX_ROW_GROUPS) return row_q4_wide;
#endif
    return row_q4;
}

/* rows [first, end) of y */
static void rows(row_fn row, const Mat *m, float *y, int64_t first, int64_t end) {
    for (int64_t i = first; i < end; i++) row(m, y, i);
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

static void gemv(row_fn row, const Mat *m, float *y, int64_t n, int threads) {
#ifdef _OPENMP
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && single_calls_left == 0 && n >= 16 * threads) {
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
#endif
    rows(row, m, y, 0, n);
}

void gemv_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    Mat m = {W, NULL, NULL, x, NULL, k, 0};
    gemv(row_f32, &m, y, n, threads);
}

/* y [M, n] = x [M, k] @ W [n, k]^T, fp32 */
void gemm_f32(const float *W, const float *x, float *y, int64_t n, int64_t k, int64_t M, int threads) {
    Mat m = {W, NULL, NULL, x, NULL, k, 0, M, n};
#ifdef __AVX512F__
    gemv(rows_f32_pair, &m, y, (n + 1) / 2, threads);  /* the threads split pairs of rows */
#else
    gemv(rows_f32, &m, y, n, threads);
#endif
}

void gemv_bf16(const uint16_t *W, const float *x, float *y, int64_t n, int64_t k, int threads) {
    float *xp = malloc((size_t)k * sizeof *xp);  /* x reordered to match load_bf16x16 */
    if (!xp) return;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int l = 0; l < 8; l++) { xp[j + l] = x[j + 2 * l]; xp[j + 8 + l] = x[j + 2 * l + 1]; }
    for (; j < k; j++) xp[j] = x[j];
    Mat m = {W, NULL, NULL, xp, NULL, k, 0};
    gemv(row_bf16, &m, y, n, threads);
    free(xp);
}

/* int8 codes [n, k], fp16 scales [n, k / G]; G a multiple of 32 that divides k */
void gemv_q8(const int8_t *codes, const uint16_t *scales, const float *x, float *y, int64_t n, int64_t k,
             int64_t G, int threads) {
    Mat m = {codes, scales, NULL, x, NULL, k, G};
#ifdef __AVX512F__
    if (k / G <= MAX_ROW_GROUPS) { gemv(row_q8_wide, &m, y, n, threads); return; }
#endif
    gemv(row_q8, &m, y, n, threads);
}

/* int4 codes [n, k / 2], fp16 scales and minimums [n, k / G]; G a multiple of 32 that divides k */
void gemv_q4(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, const float *x, float *y,
             int64_t n, int64_t k, int64_t G, int threads) {
    float *xsum = malloc((size_t)(k / G + k) * sizeof *xsum);  /* sum of x over each group, for the minimums */
    if (!xsum) return;
    Mat m = {codes, scales, mins, x, xsum, k, G, 0, 0, NULL};
    if (prepare_q4(x, k, G, xsum, xsum + k / G)) m.xperm = xsum + k / G;
    gemv(q4_rows(&m), &m, y, n, threads);
    free(xsum);
}

/* ---------------------------------------------------------------- a whole decode step (fused_decode)
 * At batch 1 a decoder layer is four matrix-vector products and a dozen small operations: two
 * norms, RoPE, the cache write, attention over the cached tokens, SiLU, two residual adds. In
 * torch each small operation is a dispatch of several microseconds around almost no arithmetic,
 * ~150 of them a layer with their views and conversions: 6 to 9 ms of a 25 ms SmolLM2 step here,
 * which does not shrink when the weights do. `decode_layers` runs every layer of one token in C
 * (what llama.cpp does): the products through the kernels above (one parallel region each), the
 * small operations in between on the calling thread, attention over a head per thread once the
 * context is long enough to pay for a parallel region. Llama family only: RMSNorm, RoPE in the
 * rotate-half pairing, SwiGLU, grouped-query attention, optional q/k/v biases (Qwen2); fp32
 * activations and fp32 sums throughout, the cache in fp32 or bf16 (rounded to nearest even, as
 * torch's .to(torch.bfloat16) rounds). minigen/fused.py builds the descriptions and checks what
 * applies. */
typedef struct {
    int32_t kind;              /* 0 fp32, 1 bf16, 2 int8 codes, 3 int4 codes */
    int32_t pad;
    const void *W;
    const uint16_t *scales, *mins;
    int64_t n, k, G;
} Weight;

typedef struct {
    const float *attn_norm, *mlp_norm;  /* [D] fp32 */
    Weight wqkv, wo, wgu, wdown;
    const float *bqkv;                  /* [(H + 2 Hkv) Dh] or NULL */
    void *kc, *vc;                      /* this layer's cache [Hkv, S, Dh] (batch row 0) */
} Layer;

typedef struct {
    int64_t D, H, Hkv, Dh, F, S;        /* S: slots allocated per head in the cache */
    int32_t cache_bf16, threads;
    float eps;
    Weight embed;                       /* the token embedding [V, D], any kind */
    int32_t embed_bf16;                 /* a quantized embedding of a bf16 model: rows rounded to bf16 */
    const float *inv_freq;              /* RoPE's inverse frequencies [Dh / 2], fp32 */
    const float *final_norm;            /* the last RMSNorm's weight [D], fp32 */
    Weight head;                        /* the output head [V, D], any kind */
    float *logits;                      /* out: [V] */
} Dims;

/* y[n] = W x for any kind above (the bf16 and int4 kernels want x prepared, done here) */
static void matvec_any(const Weight *w, const float *x, float *y, int threads, float *work) {
    Mat m = {w->W, w->scales, w->mins, x, NULL, w->k, w->G, 0, 0};
    if (w->kind == 0) { gemv(row_f32, &m, y, w->n, threads); return; }
    if (w->kind == 1) {  /* x reordered as gemv_bf16 does */
        int64_t j = 0;
        for (; j + 16 <= w->k; j += 16)
            for (int l = 0; l < 8; l++) { work[j + l] = x[j + 2 * l]; work[j + 8 + l] = x[j + 2 * l + 1]; }
        for (; j < w->k; j++) work[j] = x[j];
        m.x = work;
        gemv(row_bf16, &m, y, w->n, threads);
        return;
    }
    if (w->kind == 2) {
#ifdef __AVX512F__
        if (w->k / w->G <= MAX_ROW_GROUPS) { gemv(row_q8_wide, &m, y, w->n, threads); return; }
#endif
        gemv(row_q8, &m, y, w->n, threads);
        return;
    }
    m.xsum = work;  /* int4: work holds k / G sums and k reordered activations */
    if (prepare_q4(x, w->k, w->G, work, work + w->k / w->G)) m.xperm = work + w->k / w->G;
    gemv(q4_rows(&m), &m, y, w->n, threads);
}

/* e^x for 8 lanes (Cephes' expf: x = n ln2 + r, a degree-7 polynomial for e^r, 2^n in the exponent
 * bits): within 2 ulp of expf, 0 below -87.3. SiLU and softmax take ~90,000 exponentials a SmolLM2
 * step; one at a time through libm they cost ~0.4 ms, a tenth of an int4 step. */
static inline f32x8 select8(i32x8 m, f32x8 a, f32x8 b) {  /* a where m, else b */
    i32x8 ai, bi; memcpy(&ai, &a, sizeof ai); memcpy(&bi, &b, sizeof bi);
    i32x8 r = (ai & m) | (bi & ~m);
    f32x8 f; memcpy(&f, &r, sizeof f); return f;
}
static inline f32x8 exp8(f32x8 x) {
    const f32x8 hi = {88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f,
                      88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f};
    f32x8 lo = -hi + 0.0f;
    i32x8 under = x < -87.3365447505531f;
    x = select8(x > hi, hi, x);
    x = select8(x < lo, lo, x);
    f32x8 n = x * 1.44269504088896341f + 12582912.0f;  /* round to nearest: the float's last bits */
    n -= 12582912.0f;
    f32x8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32x8 p = 1.9875691500E-4f * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
    f32x8 two_n; memcpy(&two_n, &bits, sizeof two_n);
    f32x8 y = p * two_n;
    i32x8 yi; memcpy(&yi, &y, sizeof yi);
    yi &= ~under;
    memcpy(&y, &yi, sizeof y);
    return y;
}

/* out = x / sqrt(mean(x^2) + eps) * weight, the sum of squares in fp32 8 lanes wide */
static void rms_norm(const float *x, const float *weight, float *out, int64_t D, float eps) {
    f32x8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) { f32x8 v = load_f32(x + i); acc += v * v; }
    float ss = sum8(acc);
    for (; i < D; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (i = 0; i < D; i++) out[i] = x[i] * r * weight[i];
}

/* RMSNorm of M rows of D (model.RMSNorm on a CPU): one call instead of torch's seven operations,
 * each row alone (the same bits whatever M) */
void rms_norm_rows(const float *x, const float *weight, float *out, int64_t M, int64_t D, float eps) {
    for (int64_t r = 0; r < M; r++) rms_norm(x + r * D, weight, out + r * D, D, eps);
}

/* Rotate one head in place: x * cos + roll(x, Dh/2) * sin_signed (model.apply_rope) */
static void rope(float *x, const float *cos, const float *sin_signed, int64_t Dh) {
    float tmp[1024];
    int64_t half = Dh / 2;
    for (int64_t i = 0; i < Dh; i++) tmp[i] = x[i];
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin_signed[i];
    for (int64_t i = half; i < Dh; i++) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin_signed[i];
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t b; memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* 8 cached numbers from element i on, as fp32 (a bf16 number is the top half of an fp32 one) */
typedef uint16_t u16x8 __attribute__((vector_size(16)));
static inline f32x8 load_cache8(const void *c, int bf16, int64_t i) {
    if (!bf16) return load_f32((const float *)c + i);
    u16x8 h; memcpy(&h, (const uint16_t *)c + i, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    f32x8 f; memcpy(&f, &w, sizeof f); return f;
}
static inline float load_cache1(const void *c, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

/* One query head against the first n slots of its key/value head: softmax(q k / sqrt(Dh) + mask) v,
 * fp32; mask is additive (0 or -inf per slot; NULL: none), and a -inf slot is skipped. The dot
 * products run 8 lanes wide (a scalar sum would wait on each add: 4x slower at Dh = 64). */
static void attend_head(const float *q, const void *kc, const void *vc, int bf16, int64_t base, int64_t n,
                        int64_t Dh, const float *mask, float *scores, float *out) {
    const int64_t wide = Dh - Dh % 8;
    float scale = 1.0f / sqrtf((float)Dh), best = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        if (mask && mask[s] == -INFINITY) { scores[s] = -INFINITY; continue; }
        int64_t row = base + s * Dh;
        f32x8 acc = {0};
        for (int64_t d = 0; d < wide; d += 8) acc += load_f32(q + d) * load_cache8(kc, bf16, row + d);
        float dot = sum8(acc);
        for (int64_t d = wide; d < Dh; d++) dot += q[d] * load_cache1(kc, bf16, row + d);
        scores[s] = dot * scale + (mask ? mask[s] : 0.0f);
        best = scores[s] > best ? scores[s] : best;
    }
    float total;
    int64_t s = 0;
    f32x8 sums = {0};
    for (; s + 8 <= n; s += 8) {
        f32x8 e = exp8(load_f32(scores + s) - best);  /* -inf - best: below -87.3, 0 */
        memcpy(scores + s, &e, sizeof e);
        sums += e;
    }
    total = sum8(sums);
    for (; s < n; s++) { scores[s] = expf(scores[s] - best); total += scores[s]; }
    for (int64_t d = 0; d < Dh; d++) out[d] = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        if (scores[s] == 0.0f) continue;
        float p = scores[s] / total;
        int64_t row = base + s * Dh;
        for (int64_t d = 0; d < wide; d += 8) {
            f32x8 o = load_f32(out + d) + p * load_cache8(vc, bf16, row + d);
            memcpy(out + d, &o, sizeof o);
        }
        for (int64_t d = wide; d < Dh; d++) out[d] += p * load_cache1(vc, bf16, row + d);
    }
}

/* Attention of one new token per row (a decode step; attention.attend on a CPU): q [B, H, Dh],
 * k and v [B, Hkv, S, Dh], fp32 and contiguous; mask additive [S] for every row (mask_stride 0) or
 * [B, S]; out [B, H, Dh]. torch's SDPA spends ~40 us a call at batch 1 and ~170 at batch 8 on
 * these few thousand multiply-adds. Each (row, head) is computed alone, in the same order whatever
 * B: a row of a batch gets the bits it gets alone. Returns 0, or -1 without memory. */
int attend_decode(const float *q, const float *k, const float *v, const float *mask, int64_t mask_stride,
                  float *out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t Dh, int threads) {
    float *scores = malloc(sizeof(float) * (size_t)(B * H * S));
    if (!scores) return -1;
    const int64_t group = H / Hkv;
    int par = threads > 1 && B * H * S * Dh >= (1 << 16);  /* enough work to share out */
#ifdef _OPENMP
    par = par && single_calls_left == 0;  /* and no busy neighbour seen (the top of this file) */
#endif
    #pragma omp parallel for num_threads(threads) if(par) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        attend_head(q + bh * Dh, k, v, 0, (b * Hkv + h / group) * S * Dh, S, Dh, mask + b * mask_stride,
                    scores + bh * S, out + bh * Dh);
    }
    free(scores);
    return 0;
}

/* Row `token` of the embedding -> x [D] in fp32 (a quantized row dequantized as weight_quant.py does) */
static void embed_row(const Weight *e, int64_t token, int round_bf16, float *x) {
    const int64_t D = e->k, row = token * D;
    for (int64_t j = 0; j < D; j++) {
        float v;
        if (e->kind == 0) v = ((const float *)e->W)[row + j];
        else if (e->kind == 1) v = bf16_to_f32(((const uint16_t *)e->W)[row + j]);
        else if (e->kind == 2) v = (float)((const int8_t *)e->W)[row + j] * f16_to_f32(e->scales[(row + j) / e->G]);
        else {  /* int4: block of 32, code j in the low nibble of byte j, code j + 16 in the high one */
            uint8_t byte = ((const uint8_t *)e->W)[(row + j) / 32 * 16 + (j % 32) % 16];
            int code = (j % 32) < 16 ? byte & 0xF : byte >> 4;
            float q = (float)code * f16_to_f32(e->scales[(row + j) / e->G]);
            v = q + f16_to_f32(e->mins[(row + j) / e->G]);
        }
        x[j] = round_bf16 && e->kind >= 2 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
}

/* One decode token, embedding to logits: x [D] gets the token's embedding, then each layer's output
 * in turn; RoPE's angles for position pos are worked out here (fp32 pos * inv_freq, as
 * Model.forward), and pos's slot is written in every layer's cache; then the final norm and the
 * head write d->logits. Returns 0, or -1 when memory for the work buffers was not there.
 * The norm and the head are here, not in torch, for what surrounds them: after a step has streamed
 * the weights through the caches, torch's first small operations run cold (~0.2 ms for a norm that
 * takes 8 us in a loop), a few percent of an int4 step. */
int decode_layers(const Layer *layers, int64_t n_layers, const Dims *d, int64_t token, float *x, int64_t pos) {
    const int64_t D = d->D, H = d->H, Hkv = d->Hkv, Dh = d->Dh, F = d->F, S = d->S;
    const int64_t qkv_n = (H + 2 * Hkv) * Dh, widest = D > F ? D : F;
    float *buf = malloc(sizeof(float) * (size_t)(D + qkv_n + H * Dh + D + 2 * F + 2 * widest + H * (pos + 1)));
    if (!buf || Dh > 1024) { free(buf); return -1; }
    float cos[1024], sin_signed[1024];
    for (int64_t i = 0; i < Dh / 2; i++) {
        float angle = (float)pos * d->inv_freq[i];
        cos[i] = cos[i + Dh / 2] = cosf(angle);
        sin_signed[i] = -sinf(angle);
        sin_signed[i + Dh / 2] = sinf(angle);
    }
    embed_row(&d->embed, token, d->embed_bf16, x);
    float *h = buf, *qkv = h + D, *att = qkv + qkv_n, *o = att + H * Dh, *gu = o + D, *work = gu + 2 * F,
          *scores = work + 2 * widest;
    const int group = (int)(H / Hkv), bf16 = d->cache_bf16;
    for (int64_t l = 0; l < n_layers; l++) {
        const Layer *L = &layers[l];
        rms_norm(x, L->attn_norm, h, D, d->eps);
        matvec_any(&L->wqkv, h, qkv, d->threads, work);
        if (L->bqkv) for (int64_t i = 0; i < qkv_n; i++) qkv[i] += L->bqkv[i];
        for (int64_t hd = 0; hd < H + Hkv; hd++) rope(qkv + hd * Dh, cos, sin_signed, Dh);  /* q and k heads */
        const float *k_new = qkv + H * Dh, *v_new = k_new + Hkv * Dh;
        for (int64_t j = 0; j < Hkv; j++) {  /* write this position's slot */
            int64_t at = (j * S + pos) * Dh;
            for (int64_t i = 0; i < Dh; i++) {
                if (bf16) {
                    ((uint16_t *)L->kc)[at + i] = f32_to_bf16(k_new[j * Dh + i]);
                    ((uint16_t *)L->vc)[at + i] = f32_to_bf16(v_new[j * Dh + i]);
                } else {
                    ((float *)L->kc)[at + i] = k_new[j * Dh + i];
                    ((float *)L->vc)[at + i] = v_new[j * Dh + i];
                }
            }
        }
        /* long enough to share out, and the products' regions have not backed off to one thread (a busy
         * neighbour: see the top of this file) */
        int par = d->threads > 1 && (pos + 1) * H * Dh >= (1 << 16);
#ifdef _OPENMP
        par = par && single_calls_left == 0;
#endif
        #pragma omp parallel for num_threads(d->threads) if(par) schedule(static)
        for (int64_t hd = 0; hd < H; hd++)
            attend_head(qkv + hd * Dh, L->kc, L->vc, bf16, (hd / group) * S * Dh, pos + 1, Dh, NULL,
                        scores + hd * (pos + 1), att + hd * Dh);
        matvec_any(&L->wo, att, o, d->threads, work);
        for (int64_t i = 0; i < D; i++) x[i] += o[i];
        rms_norm(x, L->mlp_norm, h, D, d->eps);
        matvec_any(&L->wgu, h, gu, d->threads, work);
        int64_t i = 0;
        for (; i + 8 <= F; i += 8) {  /* silu(gate) * up, into the first half */
            f32x8 g = load_f32(gu + i), a = g / (1.0f + exp8(-g)) * load_f32(gu + F + i);
            memcpy(gu + i, &a, sizeof a);
        }
        for (; i < F; i++) gu[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[F + i];
        matvec_any(&L->wdown, gu, o, d->threads, work);
        for (int64_t i = 0; i < D; i++) x[i] += o[i];
    }
    rms_norm(x, d->final_norm, h, D, d->eps);
    matvec_any(&d->head, h, d->logits, d->threads, work);
    free(buf);
    return 0;
}
