/* The row loops 16 lanes wide, for CPUs with AVX-512 (built where -march=native or the flags enable
 * it; with -mno-avx512f this file compiles to nothing and rows.c's 8-wide loops run). */
#include "kernels.h"

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

void rows_f32_pair(const Mat *m, float *y, int64_t p) {
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

/* With AVX-512 (chapter 14), int8 and int4 rows run 16 lanes wide: a block of 32 codes becomes two
 * vectors in four instructions instead of eight, and the widening, not memory, is what limits
 * these rows (measured on Zen 4, one thread: int4 10.9 -> 14.6 to 15.8 weights per ns).
 * A row's scales and minimums are widened to fp32 once, 16 at a time, into a small array
 * (MAX_ROW_GROUPS long, kernels.h). */

static inline void row_scales(const uint16_t *h, float *f, int64_t ng) {
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) _mm512_storeu_ps(f + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
    for (; g < ng; g++) f[g] = f16_to_f32(h[g]);
}
static inline __m512 i8x16_to_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 u4x16_to_f32(__m128i nibbles) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles)); }

void row_q8_wide(const Mat *m, float *y, int64_t i) {
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

void row_q4_wide(const Mat *m, float *y, int64_t i) {
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
 * ms on 2 threads, 9.3-9.9 -> 7.5-8.1 ms on one. Slower, measured the same way: making the floats with
 * integer operations instead (the code or'ed into an exponent, minus that power of two; alone or for
 * half of the codes). Prefetching the codes 2 KB ahead (Q4_AHEAD) takes 6-10% off. */
#ifndef Q4_AHEAD
#define Q4_AHEAD 2048  /* bytes of codes ahead */
#endif
void row_q4_perm(const Mat *m, float *y, int64_t i) {
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
