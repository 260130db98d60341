/* fp32 rows against several rows of x at once (gemm_f32: a batch's decode step, a short prompt): the
 * 8-wide rows_f32 and, where the compiler targets AVX-512, rows_f32_pair, which runs in its place
 * (gemm_rows picks). rows_f32 is static: rows_f32_pair calls it for an odd last row, and in one file
 * GCC inlines it there, as it did when the kernels were one file. Called across files instead, the
 * bits and, measured, the speed were the same (M = 8: SmolLM2's 1,536 x 576 on one thread, its 30
 * layers on two, in turns in one process); the file keeps the several-row loops together. */
#include "kernels.h"

/* Several rows of x at once (a batch's decode step, a short prompt): y[r, i] = W[i, :] @ x[r, :].
 * Row i of W comes from memory once and meets four rows of x per pass while it sits in registers,
 * so a batch of 8 reads the weights once instead of 8 times (torch's fp32 GEMM at M = 8 reads them
 * at a third of the bandwidth here). Each dot product keeps row_f32's order of sums (the same four
 * chains, the same tails), so a row of a batch gets exactly the bits it gets alone. */
#define XROWS 4
/* The weight row two rows ahead is prefetched into L2, not L1 (prefetcht1, not t0): while a row
 * meets its second four rows of x, memory keeps streaming the next ones. With t0 the requests
 * compete with the x loads for L1's few miss buffers and memory waits on arithmetic: the whole
 * of SmolLM2's matrices at M = 8, 2 threads, in turns in one process: 19.9 ms (t0), 14.5 (t1). */
#ifndef PF_ROWS  /* prefetch the weight row this many rows ahead */
#define PF_ROWS 2
#endif

/* Rows r..r + nq - 1 of x (nq <= XROWS) against row i of W. Inlined with nq a constant, so that each
 * count is its own unrolled loop with its sums in registers: 4 for the passes of four rows, 1 to 3
 * for the rows left over, which take one pass together rather than one pass each (measured: a
 * leftover row cost as much as four rows in a pass). */
static inline __attribute__((always_inline)) void rows_f32_pass(const Mat *m, float *y, int64_t i, int64_t r,
                                                                 const int nq) {
    const float *w = (const float *)m->W + i * m->k, *x = m->x + r * m->k;
    int64_t k = m->k, j = 0;
    f32x8 acc[XROWS][4] = {{{0}}};
    for (; j + 32 <= k; j += 32) {
        f32x8 w0 = load_f32(w + j), w1 = load_f32(w + j + 8), w2 = load_f32(w + j + 16), w3 = load_f32(w + j + 24);
        if (r == 0 && i + PF_ROWS < m->n) { __builtin_prefetch(w + PF_ROWS * k + j, 0, 2); __builtin_prefetch(w + PF_ROWS * k + j + 16, 0, 2); }
        #pragma GCC unroll 8  /* unrolled, acc stays in registers: twice as fast as the rolled loop here */
        for (int q = 0; q < nq; q++) {
            const float *xq = x + q * k + j;
            acc[q][0] += w0 * load_f32(xq);
            acc[q][1] += w1 * load_f32(xq + 8);
            acc[q][2] += w2 * load_f32(xq + 16);
            acc[q][3] += w3 * load_f32(xq + 24);
        }
    }
    for (int q = 0; q < nq; q++)
        y[(r + q) * m->n + i] = finish_f32(acc[q][0], acc[q][1], acc[q][2], acc[q][3], w, x + q * k, j, k);
}

static void rows_f32(const Mat *m, float *y, int64_t i) {
    int64_t r = 0;
    for (; r + XROWS <= m->M; r += XROWS) rows_f32_pass(m, y, i, r, XROWS);
    switch (m->M - r) {  /* the rows left over, in one pass */
        case 3: rows_f32_pass(m, y, i, r, 3); break;
        case 2: rows_f32_pass(m, y, i, r, 2); break;
        case 1: rows_f32_pass(m, y, i, r, 1); break;
    }
}

#ifdef __AVX512F__
/* With AVX-512: two rows of W a pass (pair p: rows 2p and 2p + 1), each 32-weight block of a row in
 * two 16-lane registers. Lanes 0-7 of the first register are row_f32's chain a, lanes 8-15 its
 * chain b, the second register chains c and d: the same multiply-adds on the same lanes, so the
 * same bits. Each x load serves two rows, and the four rows of x for a 1,536-wide row stay in
 * L1 (w_down at M = 8, one thread: 21 -> 29 multiply-adds per ns). Left to itself GCC folds each
 * x load into both rows' multiply-adds, loading it twice: 20 loads for 16 multiply-adds, and the
 * loads, not the multiply-adds, set the pace. An empty asm statement keeps xab and xcd in registers
 * (12 loads for 16): one thread in L2, 18.5 -> 26.7 multiply-adds per ns; SmolLM2's matrices and
 * head at M = 8 from memory, 2 threads, 34.0 -> 30.5 ms. The same instructions, the same bits.
 * Where k is a multiple of 32 (no tails), the pass's eight dot products are summed at once
 * (sum8_x8), again with the same bits: a row of 576 weights is only 18 iterations, and summed one
 * at a time, eight chains of dependent additions cost a third as much as the loop (SmolLM2 at M = 8, 2
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

/* Rows r..r + nq - 1 of x (nq <= XROWS) against rows i and i + 1 of W, inlined with nq a constant (as
 * rows_f32_pass) */
static inline __attribute__((always_inline)) void rows_f32_pair_pass(const Mat *m, float *y, int64_t i, int64_t r,
                                                                      const int nq) {
    const int64_t k = m->k;
    const float *w0 = (const float *)m->W + i * k, *w1 = w0 + k, *x = m->x + r * k;
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
        for (int q = 0; q < nq; q++) {
            __m512 xab = _mm512_loadu_ps(x + q * k + j), xcd = _mm512_loadu_ps(x + q * k + j + 16);
            __asm__("" : "+v"(xab), "+v"(xcd));  /* in registers: see above */
            acc[q][0][0] = _mm512_fmadd_ps(ab0, xab, acc[q][0][0]);
            acc[q][0][1] = _mm512_fmadd_ps(cd0, xcd, acc[q][0][1]);
            acc[q][1][0] = _mm512_fmadd_ps(ab1, xab, acc[q][1][0]);
            acc[q][1][1] = _mm512_fmadd_ps(cd1, xcd, acc[q][1][1]);
        }
    }
    if (j == k) {  /* no tails (k a multiple of 32): the eight sums at once, see sum8_x8 (rows past nq: zeros) */
        f32x8 v[2 * XROWS];
        for (int q = 0; q < XROWS; q++)
            for (int h = 0; h < 2; h++)
                v[2 * q + h] = (low8(acc[q][h][0]) + high8(acc[q][h][0])) + (low8(acc[q][h][1]) + high8(acc[q][h][1]));
        f32x8 s = sum8_x8(v);
        for (int q = 0; q < nq; q++)
            for (int h = 0; h < 2; h++) y[(r + q) * m->n + i + h] = s[2 * q + h];
        return;
    }
    for (int q = 0; q < nq; q++)
        for (int h = 0; h < 2; h++)  /* row_f32's end, on its chains a, b, c, d */
            y[(r + q) * m->n + i + h] = finish_f32(low8(acc[q][h][0]), high8(acc[q][h][0]), low8(acc[q][h][1]),
                                                   high8(acc[q][h][1]), h ? w1 : w0, x + q * k, j, k);
}

static void rows_f32_pair(const Mat *m, float *y, int64_t p) {
    int64_t i = 2 * p, r = 0;
    if (i + 1 >= m->n) { rows_f32(m, y, i); return; }  /* an odd last row */
    for (; r + XROWS <= m->M; r += XROWS) rows_f32_pair_pass(m, y, i, r, XROWS);
    switch (m->M - r) {  /* the rows of x left over, in one pass */
        case 3: rows_f32_pair_pass(m, y, i, r, 3); break;
        case 2: rows_f32_pair_pass(m, y, i, r, 2); break;
        case 1: rows_f32_pair_pass(m, y, i, r, 1); break;
    }
}
#endif

void gemm_rows(const Mat *m, float *y, int threads) {
#ifdef __AVX512F__
    gemv(rows_f32_pair, m, y, (m->n + 1) / 2, threads);  /* the threads split pairs of rows */
#else
    gemv(rows_f32, m, y, m->n, threads);
#endif
}
