/* The int8 and int4 row loops 16 lanes wide, for CPUs with AVX-512 (built where -march=native or the
 * flags enable it; with -mno-avx512f this file compiles to nothing and rows.c's 8-wide loops run).
 * The 16-lane fp32 loop over several rows of x, rows_f32_pair, is in rows_batch.c. */
#include "kernels.h"

#ifdef __AVX512F__
/* With AVX-512 (chapter 10), int8 and int4 rows run 16 lanes wide: a block of 32 codes becomes two
 * vectors in four instructions instead of eight, and the widening, not memory, is what limits
 * these rows (measured on Zen 4, one thread: int4 10.9 -> 14.6 to 15.8 weights per ns).
 * A row's scales and minimums are widened to fp32 once, 16 at a time, into a small array
 * (MAX_ROW_GROUPS long, kernels.h). */

/* switch (nw) { case 1: F(1); ... }: each count of rows of W up to SEVERAL_W a constant (past it: none) */
#define W_(c) ((c) < SEVERAL_W ? (c) : SEVERAL_W)
#define SEVERAL_W_SWITCH(nw, F) switch (nw) { \
    case 1: F(W_(1)); break; case 2: F(W_(2)); break; case 3: F(W_(3)); break; case 4: F(W_(4)); break; \
    case 5: F(W_(5)); break; case 6: F(W_(6)); break; case 7: F(W_(7)); break; default: F(W_(8)); break; }
_Static_assert(SEVERAL_W >= 1 && SEVERAL_W <= 8, "SEVERAL_W_SWITCH takes 1 to 8 rows of W");

static inline void row_scales(const uint16_t *h, float *f, int64_t ng) {
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) _mm512_storeu_ps(f + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
    for (; g < ng; g++) f[g] = f16_to_f32(h[g]);
}
static inline __m512 i8x16_to_f32(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 u4x16_to_f32(__m128i nibbles) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles)); }

/* Prefetching the codes 4 KB ahead: a decode step streams each row once, and the hardware's own
 * prefetcher, which runs a short way ahead and starts over at each 4 KB page, left one thread waiting
 * on memory (the int4 loop below prefetches for the same reason). Measured on this
 * course's Xeon (family 6 model 167, 2 threads, the fused decode step, builds with 0 / 2 / 4 / 8 KB
 * ahead in turns in one process, median of 6 rounds): int8 weights 11.5 -> 7.9 / 7.4 / 7.5 ms a
 * token; int4 weights (whose int8 head is 30 of 100 MB) 6.5 -> 5.6 / 5.6 / - ms. */
#ifndef Q8_AHEAD
#define Q8_AHEAD 4096  /* bytes of codes ahead */
#endif
/* Row i of int8 codes against one row of x: each 16 codes widened to fp32, times x, two groups of 32
 * a pass, then scaled, in two chains (even, odd groups). dot_q8_w below runs the same arithmetic for
 * several rows of W, each in this order, so that a row gets the same bits in a several-row product. */
void row_q8_wide(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, G = m->G, ng = k / G;
    const int8_t *q = (const int8_t *)m->W + i * k;
    const float *x = m->x;
    float sc[MAX_ROW_GROUPS];
    row_scales(m->scales + i * ng, sc, ng);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t g = 0, j = 0;
    for (; G == 32 && g + 2 <= ng; g += 2, j += 64) {  /* two groups of 32 */
        _mm_prefetch((const char *)(q + j + Q8_AHEAD), _MM_HINT_T0);
        __m512 s0 = _mm512_mul_ps(i8x16_to_f32(q + j), _mm512_loadu_ps(x + j));
        __m512 s1 = _mm512_mul_ps(i8x16_to_f32(q + j + 32), _mm512_loadu_ps(x + j + 32));
        s0 = _mm512_fmadd_ps(i8x16_to_f32(q + j + 16), _mm512_loadu_ps(x + j + 16), s0);
        s1 = _mm512_fmadd_ps(i8x16_to_f32(q + j + 48), _mm512_loadu_ps(x + j + 48), s1);
        acc0 = _mm512_fmadd_ps(s0, _mm512_set1_ps(sc[g]), acc0);
        acc1 = _mm512_fmadd_ps(s1, _mm512_set1_ps(sc[g + 1]), acc1);
    }
    for (; g < ng; g++) {  /* the rest: larger groups, or an odd last one */
        __m512 s = _mm512_setzero_ps();
        for (int64_t end = j + G; j < end; j += 16) s = _mm512_fmadd_ps(i8x16_to_f32(q + j), _mm512_loadu_ps(x + j), s);
        acc0 = _mm512_fmadd_ps(s, _mm512_set1_ps(sc[g]), acc0);
    }
    y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* Rows i..i+nw-1 of int8 codes, widened (wf[c]: row i + c's codes as floats, sc[c] its scales), against
 * one row of x (nw <= SEVERAL_W, a constant once inlined): row_q8_wide's arithmetic with the roles turned
 * round, each row of W in its own two chains (even, odd groups) in row_q8_wide's order, so each
 * output has the bits it gets alone. Each vector of x is loaded once for the nw rows of W, and the
 * codes come from wf, in L1. */
static inline __attribute__((always_inline)) void dot_q8_w(const float *const *wf, const float *const *sc,
                                                           const float *x, const int nw, int64_t k, int64_t G,
                                                           float *out) {
    const int64_t ng = k / G;
    __m512 acc0[SEVERAL_W], acc1[SEVERAL_W];
    for (int c = 0; c < nw; c++) acc0[c] = acc1[c] = _mm512_setzero_ps();
    int64_t g = 0, j = 0;
    for (; G == 32 && g + 2 <= ng; g += 2, j += 64) {  /* two groups of 32 */
        const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
        const __m512 x2 = _mm512_loadu_ps(x + j + 32), x3 = _mm512_loadu_ps(x + j + 48);
        #pragma GCC unroll 8
        for (int c = 0; c < nw; c++) {
            const float *w = wf[c] + j;
            __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(w), x0);
            __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(w + 32), x2);
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), x1, s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 48), x3, s1);
            acc0[c] = _mm512_fmadd_ps(s0, _mm512_set1_ps(sc[c][g]), acc0[c]);
            acc1[c] = _mm512_fmadd_ps(s1, _mm512_set1_ps(sc[c][g + 1]), acc1[c]);
        }
    }
    for (; g < ng; g++) {  /* the rest: larger groups, or an odd last one */
        __m512 s[SEVERAL_W];
        for (int c = 0; c < nw; c++) s[c] = _mm512_setzero_ps();
        for (int64_t end = j + G; j < end; j += 16) {
            const __m512 xv = _mm512_loadu_ps(x + j);
            #pragma GCC unroll 8
            for (int c = 0; c < nw; c++) s[c] = _mm512_fmadd_ps(_mm512_loadu_ps(wf[c] + j), xv, s[c]);
        }
        for (int c = 0; c < nw; c++) acc0[c] = _mm512_fmadd_ps(s[c], _mm512_set1_ps(sc[c][g]), acc0[c]);
    }
    for (int c = 0; c < nw; c++) out[c] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[c], acc1[c]));
}

/* Rows SEVERAL_W p .. of W (fewer for the last unit) against the M rows of x of m[0..M-1] (decode.c's
 * several-row product, m[0].M = M): the codes widened once into wf (exact), then each row of x
 * against all of them through dot_q8_w, each output with row_q8_wide's bits. The widening, half of
 * what one row costs, is done once for all M. One row of W at a time against four rows of x (this
 * loop before), every multiply-add read a vector of x, and 16 rows of x (37 KB at k = 576, 98 KB at
 * 1,536, beside the codes) do not stay in L1: the loads of x from L2, not the arithmetic, set the
 * pace. SEVERAL_W rows of W at a time against one row of x, each vector of x serves SEVERAL_W rows,
 * and the codes come from wf, a few KB in L1. Measured on this course's Xeon (2 vCPUs, a test suite
 * running beside it), SmolLM2's 30 layers and head at 16 rows, one thread, against fp32's several-row
 * kernel, in turns: 1.14-1.17x -> 0.98-0.99x (int8), and for int4 (rows_q4_perm, the same change)
 * 1.53-1.58x -> 1.04-1.05x. k <= MAX_WIDE_K (several_rows checks): wf is SEVERAL_W k floats on the
 * stack. */
void rows_q8_wide(const Mat *m, float *y, int64_t p) {
    const int64_t k = m->k, ng = k / m->G, M = m[0].M, i = p * SEVERAL_W;
    const int nw = m->n - i < SEVERAL_W ? (int)(m->n - i) : SEVERAL_W;
    float wf[SEVERAL_W * k], sc[SEVERAL_W * ng], out[SEVERAL_W];  /* k <= MAX_WIDE_K: a few KB */
    const float *wfs[SEVERAL_W], *scs[SEVERAL_W];
    for (int c = 0; c < nw; c++) {
        const int8_t *q = (const int8_t *)m->W + (i + c) * k;
        wfs[c] = wf + c * k;
        scs[c] = sc + c * ng;
        row_scales(m->scales + (i + c) * ng, sc + c * ng, ng);
        for (int64_t j = 0; j < k; j += 16) _mm512_storeu_ps(wf + c * k + j, i8x16_to_f32(q + j));
    }
    for (int64_t r = 0; r < M; r++) {
#define DOT(n) dot_q8_w(wfs, scs, m[r].x, n, k, m->G, out)
        SEVERAL_W_SWITCH(nw, DOT);  /* each count its own unrolled loop */
#undef DOT
        for (int c = 0; c < nw; c++) y[r * m->n + i + c] = out[c];
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
/* Row i of int4 codes against one row of x (its xperm, x and xsum), as described above, in
 * two chains; dot_q4_perm_w below runs the same arithmetic for several rows of W, each in this
 * order: the same bits as alone. */
void row_q4_perm(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, ng = k / 32, nb = k / 128;
    const uint8_t *q = (const uint8_t *)m->W + i * (k / 2);
    const uint16_t *sc = m->scales + i * ng, *mn = m->mins + i * ng;
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 c[8];
        _mm_prefetch((const char *)(q + 64 * b + Q4_AHEAD), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * b));
        c[0] = _mm512_permutexvar_ps(v, codes);
        for (int t = 1; t < 8; t++) c[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * t), codes);
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
            _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 4 * b)))));  /* 4 scales, each to 4 lanes */
        const float *xp = m->xperm + 128 * b;
        __m512 s0 = _mm512_mul_ps(c[0], _mm512_loadu_ps(xp));
        __m512 s1 = _mm512_mul_ps(c[1], _mm512_loadu_ps(xp + 16));
        s0 = _mm512_fmadd_ps(c[2], _mm512_loadu_ps(xp + 32), s0);
        s1 = _mm512_fmadd_ps(c[3], _mm512_loadu_ps(xp + 48), s1);
        s0 = _mm512_fmadd_ps(c[4], _mm512_loadu_ps(xp + 64), s0);
        s1 = _mm512_fmadd_ps(c[5], _mm512_loadu_ps(xp + 80), s1);
        s0 = _mm512_fmadd_ps(c[6], _mm512_loadu_ps(xp + 96), s0);
        s1 = _mm512_fmadd_ps(c[7], _mm512_loadu_ps(xp + 112), s1);
        acc0 = _mm512_fmadd_ps(s0, scale, acc0);
        acc1 = _mm512_fmadd_ps(s1, scale, acc1);
    }
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (int64_t g = 4 * nb, j = 128 * nb; g < ng; g++, j += 32) {  /* the last groups (k = 576: two) */
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
        const __m512 lo = u4x16_to_f32(_mm_and_si128(bytes, nib));
        const __m512 hi = u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
        __m512 s = _mm512_mul_ps(lo, _mm512_loadu_ps(m->x + j));
        s = _mm512_fmadd_ps(hi, _mm512_loadu_ps(m->x + j + 16), s);
        acc0 = _mm512_fmadd_ps(s, _mm512_set1_ps(f16_to_f32(sc[g])), acc0);
    }
    for (int64_t g = 0; g < ng; g += 16) {  /* the minimums times the sums of x, 16 groups at a time */
        __mmask16 live = ng - g >= 16 ? 0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
        const __m512 mins = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + g));
        acc1 = _mm512_fmadd_ps(mins, _mm512_maskz_loadu_ps(live, m->xsum + g), acc1);
    }
    y[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* Rows i..i+nw-1 of int4 codes, made once (wf[c]: row i + c's codes as floats, laid out as
 * row_q4_perm's order of codes; sv[c][b]: block b's four scales each on four lanes; st[c][g]: the scale of group
 * g as a float; mn[c][g]: its minimum), against one row of x (ms: its xperm, x and xsum), nw <=
 * SEVERAL_W a constant once inlined: row_q4_perm's arithmetic with the roles turned round, each row
 * of W in its own chains in row_q4_perm's order (the same bits), each vector of x loaded once for
 * the nw rows of W. */
static inline __attribute__((always_inline)) void dot_q4_perm_w(const float *const *wf, const __m512 *const *sv,
                                                                const float *const *st, const float *const *mn,
                                                                const Mat *ms, const int nw, float *out) {
    const int64_t k = ms->k, ng = k / 32, nb = k / 128;
    __m512 acc0[SEVERAL_W], acc1[SEVERAL_W];
    for (int c = 0; c < nw; c++) acc0[c] = acc1[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const float *xp = ms->xperm + 128 * b;
        __m512 s0[SEVERAL_W], s1[SEVERAL_W];
        const __m512 x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16);
        #pragma GCC unroll 8
        for (int c = 0; c < nw; c++) {
            s0[c] = _mm512_mul_ps(_mm512_loadu_ps(wf[c] + 128 * b), x0);
            s1[c] = _mm512_mul_ps(_mm512_loadu_ps(wf[c] + 128 * b + 16), x1);
        }
        #pragma GCC unroll 3
        for (int t = 2; t < 8; t += 2) {
            const __m512 xe = _mm512_loadu_ps(xp + 16 * t), xo = _mm512_loadu_ps(xp + 16 * t + 16);
            #pragma GCC unroll 8
            for (int c = 0; c < nw; c++) {
                s0[c] = _mm512_fmadd_ps(_mm512_loadu_ps(wf[c] + 128 * b + 16 * t), xe, s0[c]);
                s1[c] = _mm512_fmadd_ps(_mm512_loadu_ps(wf[c] + 128 * b + 16 * t + 16), xo, s1[c]);
            }
        }
        #pragma GCC unroll 8
        for (int c = 0; c < nw; c++) {
            acc0[c] = _mm512_fmadd_ps(s0[c], sv[c][b], acc0[c]);
            acc1[c] = _mm512_fmadd_ps(s1[c], sv[c][b], acc1[c]);
        }
    }
    for (int64_t g = 4 * nb, j = 128 * nb; g < ng; g++, j += 32) {  /* the last groups (k = 576: two) */
        const __m512 xl = _mm512_loadu_ps(ms->x + j), xh = _mm512_loadu_ps(ms->x + j + 16);
        #pragma GCC unroll 8
        for (int c = 0; c < nw; c++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(wf[c] + j), xl);
            s = _mm512_fmadd_ps(_mm512_loadu_ps(wf[c] + j + 16), xh, s);
            acc0[c] = _mm512_fmadd_ps(s, _mm512_set1_ps(st[c][g]), acc0[c]);
        }
    }
    for (int64_t g = 0; g < ng; g += 16) {  /* the minimums times the sums of x, 16 groups at a time */
        __mmask16 live = ng - g >= 16 ? 0xFFFF : (__mmask16)((1u << (ng - g)) - 1);
        const __m512 xs = _mm512_maskz_loadu_ps(live, ms->xsum + g);
        #pragma GCC unroll 8
        for (int c = 0; c < nw; c++) acc1[c] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, mn[c] + g), xs, acc1[c]);
    }
    for (int c = 0; c < nw; c++) out[c] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[c], acc1[c]));
}

/* Rows SEVERAL_W p .. of W (fewer for the last unit) against the M rows of x of m[0..M-1] (each with
 * its own xperm and xsum), as rows_q8_wide: the codes made once into wf, the scales and minimums
 * widened once, then each row of x against all of them through dot_q4_perm_w, each output with
 * row_q4_perm's bits. */
void rows_q4_perm(const Mat *m, float *y, int64_t p) {
    const int64_t k = m->k, ng = k / 32, nb = k / 128, M = m[0].M, i = p * SEVERAL_W;
    const int nw = m->n - i < SEVERAL_W ? (int)(m->n - i) : SEVERAL_W;
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128i nib = _mm_set1_epi8(0x0F);
    float wf[SEVERAL_W * k], st[SEVERAL_W * ng], mn[SEVERAL_W * ng], out[SEVERAL_W];  /* k <= MAX_WIDE_K */
    __m512 sv[SEVERAL_W * nb + 1];
    const float *wfs[SEVERAL_W], *sts[SEVERAL_W], *mns[SEVERAL_W];
    const __m512 *svs[SEVERAL_W];
    for (int c = 0; c < nw; c++) {
        const uint8_t *q = (const uint8_t *)m->W + (i + c) * (k / 2);
        const uint16_t *sc = m->scales + (i + c) * ng;
        float *w = wf + c * k;
        wfs[c] = w, sts[c] = st + c * ng, mns[c] = mn + c * ng, svs[c] = sv + c * nb;
        for (int64_t b = 0; b < nb; b++) {
            const __m512i v = _mm512_loadu_si512((const void *)(q + 64 * b));
            for (int t = 0; t < 8; t++)
                _mm512_storeu_ps(w + 128 * b + 16 * t, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * t), codes));
            sv[c * nb + b] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(
                _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + 4 * b)))));  /* 4 scales, each to 4 lanes */
        }
        for (int64_t j = 128 * nb; j < k; j += 32) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(q + j / 2));
            _mm512_storeu_ps(w + j, u4x16_to_f32(_mm_and_si128(bytes, nib)));
            _mm512_storeu_ps(w + j + 16, u4x16_to_f32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nib)));
        }
        row_scales(sc, st + c * ng, ng);
        row_scales(m->mins + (i + c) * ng, mn + c * ng, ng);
    }
    for (int64_t r = 0; r < M; r++) {
#define DOT(n) dot_q4_perm_w(wfs, svs, sts, mns, &m[r], n, out)
        SEVERAL_W_SWITCH(nw, DOT);
#undef DOT
        for (int c = 0; c < nw; c++) y[r * m->n + i + c] = out[c];
    }
}
#endif
