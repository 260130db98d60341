/* The int8 and int4 row loops 16 lanes wide, for CPUs with AVX-512 (built where -march=native or the
 * flags enable it; with -mno-avx512f this file compiles to nothing and rows.c's 8-wide loops run).
 * The 16-lane fp32 loop over several rows of x, rows_f32_pair, is in rows_batch.c. */
#include "kernels.h"

#ifdef __AVX512F__
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

/* Row i of int8 codes against nx rows of x (xs[0..nx-1], nx <= 4, a constant once inlined): each 16
 * codes widened to fp32 (or, with wf, read back already widened: wf[j] is code j as a float, exact),
 * times x, two groups of 32 a pass, then scaled. Each row of x keeps its own two chains (even, odd
 * groups) in row_q8_wide's order, so it gets the bits it gets alone; side by side, the rows' chains
 * hide each other's latency, which is what limits one row whose codes need no widening. */
static inline __attribute__((always_inline)) void dot_q8(const int8_t *q, const float *wf, const float *sc,
                                                         const float *const *xs, const int nx, int64_t k,
                                                         int64_t G, float *out) {
#define CODES8(j) (wf ? _mm512_loadu_ps(wf + (j)) : i8x16_to_f32(q + (j)))
    const int64_t ng = k / G;
    __m512 acc0[4], acc1[4];  /* per row of x, two chains: even, odd groups */
    for (int r = 0; r < nx; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t g = 0, j = 0;
    for (; G == 32 && g + 2 <= ng; g += 2, j += 64) {  /* two groups of 32 */
        const __m512 c0 = CODES8(j), c1 = CODES8(j + 16), c2 = CODES8(j + 32), c3 = CODES8(j + 48);
        const __m512 sc0 = _mm512_set1_ps(sc[g]), sc1 = _mm512_set1_ps(sc[g + 1]);
        #pragma GCC unroll 4
        for (int r = 0; r < nx; r++) {
            const float *x = xs[r];
            __m512 s0 = _mm512_mul_ps(c0, _mm512_loadu_ps(x + j));
            __m512 s1 = _mm512_mul_ps(c2, _mm512_loadu_ps(x + j + 32));
            s0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(x + j + 16), s0);
            s1 = _mm512_fmadd_ps(c3, _mm512_loadu_ps(x + j + 48), s1);
            acc0[r] = _mm512_fmadd_ps(s0, sc0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(s1, sc1, acc1[r]);
        }
    }
    for (; g < ng; g++) {  /* the rest: larger groups, or an odd last one */
        __m512 s[4];
        for (int r = 0; r < nx; r++) s[r] = _mm512_setzero_ps();
        for (int64_t end = j + G; j < end; j += 16) {
            const __m512 c = CODES8(j);
            #pragma GCC unroll 4
            for (int r = 0; r < nx; r++) s[r] = _mm512_fmadd_ps(c, _mm512_loadu_ps(xs[r] + j), s[r]);
        }
        for (int r = 0; r < nx; r++) acc0[r] = _mm512_fmadd_ps(s[r], _mm512_set1_ps(sc[g]), acc0[r]);
    }
#undef CODES8
    for (int r = 0; r < nx; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

void row_q8_wide(const Mat *m, float *y, int64_t i) {
    const int64_t ng = m->k / m->G;
    float sc[MAX_ROW_GROUPS];
    row_scales(m->scales + i * ng, sc, ng);
    dot_q8((const int8_t *)m->W + i * m->k, NULL, sc, &m->x, 1, m->k, m->G, &y[i]);
}

/* Row i against the M rows of x of m[0..M-1] (decode.c's several-row product, m[0].M = M): the codes
 * widened once into wf (exact), then the rows of x four at a time through dot_q8's multiply-adds,
 * each in its order, so each output has row_q8_wide's bits; the widening, half of what one row
 * costs, is done once for all M. k <= MAX_WIDE_K (several_rows checks). */
void rows_q8_wide(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, ng = k / m->G, M = m[0].M;
    const int8_t *q = (const int8_t *)m->W + i * k;
    float sc[MAX_ROW_GROUPS], wf[MAX_WIDE_K], out[4];
    const float *xs[DECODE_MAX_ROWS];
    row_scales(m->scales + i * ng, sc, ng);
    for (int64_t j = 0; j < k; j += 16) _mm512_storeu_ps(wf + j, i8x16_to_f32(q + j));
    for (int64_t r = 0; r < M; r++) xs[r] = m[r].x;
    for (int64_t r = 0; r < M; r += 4) {
        const int64_t nx = M - r < 4 ? M - r : 4;
        switch (nx) {
            case 4: dot_q8(q, wf, sc, xs + r, 4, k, m->G, out); break;
            case 3: dot_q8(q, wf, sc, xs + r, 3, k, m->G, out); break;
            case 2: dot_q8(q, wf, sc, xs + r, 2, k, m->G, out); break;
            default: dot_q8(q, wf, sc, xs + r, 1, k, m->G, out); break;
        }
        for (int64_t o = 0; o < nx; o++) y[(r + o) * m->n + i] = out[o];
    }
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
/* Row i of int4 codes against nx rows of x (ms[r]: its xperm, x and xsum; nx <= 4, a constant once
 * inlined), as described above; with wf, the codes are read back already made: wf[128 b + 16 t + d]
 * is block b's vector t, lane d, and the last groups' codes sit at wf[j..j + 31] as their loop
 * makes them (low nibbles, then high ones), all exact. Each row of x keeps its own chains in
 * row_q4_perm's order: the same bits as alone. */
static inline __attribute__((always_inline)) void dot_q4_perm(const uint8_t *q, const float *wf,
                                                              const Mat *const *ms, const int nx,
                                                              const uint16_t *sc, const uint16_t *mn, float *out) {
    const int64_t k = ms[0]->k, ng = k / 32, nb = k / 128;
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc0[4], acc1[4];
    for (int r = 0; r < nx; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 c[8];
        if (wf) {
            for (int t = 0; t < 8; t++) c[t] = _mm512_loadu_ps(wf + 128 * b + 16 * t);
        } else {
            _mm_prefetch((const char *)(q + 64 * b + Q4_AHEAD), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * b));
            c[0] = _mm512_permutexvar_ps(v, codes);
            for (int t = 1; t < 8; t++) c[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * t), codes);
        }
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
            _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 4 * b)))));  /* 4 scales, each to 4 lanes */
        #pragma GCC unroll 4
        for (int r = 0; r < nx; r++) {
            const float *xp = ms[r]->xperm + 128 * b;
            __m512 s0 = _mm512_mul_ps(c[0], _mm512_loadu_ps(xp));
            __m512 s1 = _mm512_mul_ps(c[1], _mm512_loadu_ps(xp + 16));
            s0 = _mm512_fmadd_ps(c[2], _mm512_loadu_ps(xp + 32), s0);
            s1 = _mm512_fmadd_ps(c[3], _mm512_loadu_ps(xp + 48), s1);
            s0 = _mm512_fmadd_ps(c[4], _mm512_loadu_ps(xp + 64), s0);
            s1 = _mm512_fmadd_ps(c[5], _mm512_loadu_ps(xp + 80), s1);
            s0 = _mm512_fmadd_ps(c[6], _mm512_loadu_ps(xp + 96), s0);
            s1 = _mm512_fmadd_ps(c[7], _mm512_loadu_ps(xp + 112), s1);
            acc0[r] = _mm512_fmadd_ps(s0, scale, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(s1, scale, acc1[r]);
        }
    }
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (int64_t g = 4 * nb, j = 128 * nb; g < ng; g++, j += 32) {  /* the last groups (k = 576: two) */
        __m512 lo, hi;
        if (wf) {
            lo = _mm512_loadu_ps(wf + j);
            hi = _mm512_loadu_ps(wf + j + 16);
        } else {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
            lo = u4x16_to_f32(_mm_and_si128(bytes, nib));
            hi = u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
        }
        const __m512 scale = _mm512_set1_ps(f16_to_f32(sc[g]));
        for (int r = 0; r < nx; r++) {
            __m512 s = _mm512_mul_ps(lo, _mm512_loadu_ps(ms[r]->x + j));
            s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(ms[r]->x + j + 16), s);
            acc0[r] = _mm512_fmadd_ps(s, scale, acc0[r]);
        }
    }
    for (int64_t g = 0; g < ng; g += 16) {  /* the minimums times the sums of x, 16 groups at a time */
        __mmask16 live = ng - g >= 16 ? 0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
        const __m512 mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + g));
        for (int r = 0; r < nx; r++) acc1[r] = _mm512_fmadd_ps(mins, _mm512_maskz_loadu_ps(live, ms[r]->xsum + g), acc1[r]);
    }
    for (int r = 0; r < nx; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

void row_q4_perm(const Mat *m, float *y, int64_t i) {
    const int64_t ng = m->k / 32;
    dot_q4_perm((const uint8_t *)m->W + i * (m->k / 2), NULL, &m, 1, m->scales + i * ng, m->mins + i * ng, &y[i]);
}

/* Row i against the M rows of x of m[0..M-1] (each with its own xperm and xsum), as rows_q8_wide:
 * the codes made once into wf, then dot_q4_perm's arithmetic for the rows of x four at a time,
 * each with row_q4_perm's bits. */
void rows_q4_perm(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, ng = k / 32, nb = k / 128, M = m[0].M;
    const uint8_t *q = (const uint8_t *)m->W + i * (k / 2);
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float wf[MAX_WIDE_K], out[4];
    const Mat *ms[DECODE_MAX_ROWS];
    for (int64_t b = 0; b < nb; b++) {
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * b));
        for (int t = 0; t < 8; t++)
            _mm512_storeu_ps(wf + 128 * b + 16 * t, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * t), codes));
    }
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (int64_t j = 128 * nb; j < k; j += 32) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
        _mm512_storeu_ps(wf + j, u4x16_to_f32(_mm_and_si128(bytes, nib)));
        _mm512_storeu_ps(wf + j + 16, u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib)));
    }
    for (int64_t r = 0; r < M; r++) ms[r] = &m[r];
    const uint16_t *sc = m->scales + i * ng, *mn = m->mins + i * ng;
    for (int64_t r = 0; r < M; r += 4) {
        const int64_t nx = M - r < 4 ? M - r : 4;
        switch (nx) {
            case 4: dot_q4_perm(q, wf, ms + r, 4, sc, mn, out); break;
            case 3: dot_q4_perm(q, wf, ms + r, 3, sc, mn, out); break;
            case 2: dot_q4_perm(q, wf, ms + r, 2, sc, mn, out); break;
            default: dot_q4_perm(q, wf, ms + r, 1, sc, mn, out); break;
        }
        for (int64_t o = 0; o < nx; o++) y[(r + o) * m->n + i] = out[o];
    }
}
#endif
