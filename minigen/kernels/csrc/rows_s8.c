/* One output row of int8 or int4 codes against one row of int8 activations (a decode step under
 * numerics/int8_act.py's scheme): integer dot products, as llama.cpp's Q8_0 / Q4_1 x Q8 rows.
 *
 * What: x is quantized once per product (prepare_s8) in blocks of 32: codes qx [k] int8, a scale dx
 * per block [k / 32], and, for int4's minimums, the quantized x's sums over each weight group xsum [k / G]
 * (dx times each block's code sum: numerics/int8_act.py says why not x's own)
 * (quantize_activations' bits: the same fp32 amax, 127 / amax, nearbyintf: round half to even). Each
 * row then sums, per block of 32, the products of its codes with qx exactly in int32, and scales the
 * block once in fp32:
 *     y[i] = sum_b (scale[i, g(b)] * dx[b]) * isum[i, b]  (+ sum_g min[i, g] * xsum[g] for int4)
 * qx stays in x's order: both weight formats meet it as 32 bytes a block (int4: the low nibbles of
 * the block's 16 bytes are weights 0..15, its high nibbles 16..31).
 * Residual blocks: a block whose largest |x| is more than twice its second largest (an outlier) is
 * quantized twice; prepare_s8 marks at most 8 a row, the largest ratios (ties: the lower block), and
 * keeps each compactly (S8Residual: the codes rx of x - dx qx, rounded once by fmaf, their scale rdx,
 * the block and its group). After its main loop a row adds, per marked block, the same block of its
 * codes (still in L1) against rx, one vpdpbusd, times scale[g] * rdx; int4's xsum holds their sums too.
 *
 * Why: the fp32-activation rows (rows.c, rows_avx512.c) widen every code to fp32 before they multiply,
 * and on this course's CPUs that widening, not memory, sets their pace. `vpdpbusd` multiplies four
 * unsigned bytes by four signed ones into an int32 in each lane: a block of 32 is one instruction
 * after the nibbles are split. One side must be unsigned: int4 codes are (0..15); int8 codes give
 * their sign to x (|q| times sign(q) qx, `vpsignb`, llama.cpp's trick; |q qx| <= 127 * 127).
 *
 * The loops, by what the compiler targets (rows_s8_variant names the one built):
 *   avx512vnni  two blocks a 512-bit vpdpbusd;
 *   avxvnni     a block a 256-bit vpdpbusd (Alder Lake, Zen 5 built without AVX-512);
 *   avx2        vpmaddubsw then vpmaddwd with ones (pairs of products <= 2 * 127 * 127: no saturation);
 *               int4 two blocks at a time (q4_pair_avx2: one load, one vpmaddwd, one convert and one
 *               multiply-add for both, x in pair order: pair_order). Measured on an AMD EPYC Zen 1
 *               (family 23 model 1, AVX2 on 128-bit units), SmolLM2's fused int4 step with int8
 *               activations, builds in turns in one process, 5 rounds of 64 tokens: one thread 23.4 ->
 *               21.7 ms a token (each round 1.06-1.10x), two threads 12.7 -> 12.5 (1.00-1.05x);
 *               -DROWS_S8_SINGLE builds the block-at-a-time loop (the VNNI builds' shape) to compare;
 *               and four rows a call (rows4_q4_s8, rows4_q8_s8; s8_rows names the loop
 *               and sets Mat.per): each lane of the fp32 sums holds one row's block, so one convert and
 *               one multiply-add serve four rows, and no row ends in a horizontal sum of its own; the
 *               rows' int16 (int4) or int32 (int8) sums are folded into those lanes by unpacks and
 *               adds (vphaddw measured no faster than one row a call). The next call's rows are
 *               prefetched: four rows read side by side ran about 0.8x the one-row loop from memory
 *               without it (the hardware prefetcher did not follow them; about 1.1x when the matrices
 *               sat in cache), 1.06-1.18x a round with it (120 matrices of SmolLM2's 30 layers' shapes,
 *               one thread, 7 rounds; int8 1.16-1.25x). Measured
 *               on the same Zen 1, fused step, builds in turns in one process, 5 rounds of 64 tokens,
 *               2 threads: int4 12.0 -> 10.4 ms a token (each round 1.10-1.17x), int8 14.1 -> 12.2
 *               (1.13-1.18x); one thread, int4 with its int8 head still one row a call in both
 *               builds, 21.7 -> 19.0 (1.13-1.15x). -DROWS_S8_ONE builds one row a call to compare;
 *   portable    scalar int32 sums (GCC vectorizes them where it can).
 * Each block's int32 sums become fp32 and meet the block's scale in a multiply-add into lanes of fp32
 * sums; several sums side by side (independent chains). A row is summed by one thread in a fixed
 * order, so the thread count does not change the bits; in the four-row loops every lane runs the
 * same operations, so neither do the rows beside it (a verify chunk's rows get a decode step's bits).
 *
 * Measured on this course's Xeon (family 6 model 167: AVX512-VNNI, AVX-VNNI; 2 vCPUs shared with
 * other jobs, so two threads gained nothing in these runs), weights per ns, G = 32, eight different
 * matrices in turn so that they come from memory, best of 5, one thread (two threads alike):
 *                      fp32 activations   int8 activations (avx512vnni / 256-bit block / avxvnni / avx2)
 *   int4 [1536, 576]        14.8              18.8 / 17.1 / 17.6 / 16.0
 *   int4 [576, 1536]        23.8              30.0 / 27.8 / 28.0 / 27.0
 *   int8 [1536, 576]        17.8              22.1 / 22.4 / 22.4 / 16.9
 *   int8 [576, 1536]        14.5              18.1 / 18.2 / 17.5 / 17.5
 *   int8 [49152, 576]        8.9              11.3 / 10.9 / 11.0 / 10.6   (SmolLM2's head)
 * With the residual blocks (measured the same way, 2 vCPUs shared with another job, runs ~15% apart;
 * avx512vnni, best of two runs; x randn, and randn with 3 channels 100x: 3 blocks marked):
 *                      fp32 activations   int8: randn x   3 marked blocks   before (no residuals)
 *   int4 [1536, 576]        17.1              20.5            17.8              21.9
 *   int4 [576, 1536]        21.3              24.8            23.5              25.7
 *   int8 [49152, 576]       16.5              20.5            17.9              17.8
 * A marked block costs a row about what a main-loop block does (3 of 18 blocks at k = 576: ~13%
 * slower, 3 of 48 at k = 1536: ~5%): at k = 576 about even with the fp32-activation rows. Their fp32
 * sums join the main loop's before its one horizontal sum.
 * The 512-bit loop (two blocks a vpdpbusd) is kept: ahead for int4, even for int8. Every block's
 * scale * dx is made once before a row's loop: a division b * 32 / G per block in the loop (~25
 * cycles) had made these rows 1.7 to 2.5x slower than the fp32-activation ones.
 */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define S8_ROWS "avx512vnni"
#define S8_WIDE 1
static inline __m256i dot32(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVXVNNI__)
#define S8_ROWS "avxvnni"
static inline __m256i dot32(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVX2__)
#define S8_ROWS "avx2"
static inline __m256i dot32(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#ifndef ROWS_S8_SINGLE  /* -DROWS_S8_SINGLE: int4's block-at-a-time loop, as the VNNI builds (for measuring) */
#define S8_Q4_PAIRS 1
#if !defined(ROWS_S8_ONE) && defined(__F16C__) && defined(__FMA__)  /* -DROWS_S8_ONE: one row a call (for measuring) */
#define S8_FOUR 1
#endif
#endif
#else
#define S8_ROWS "portable"
#endif

/* Which loop this build runs (tests and reports): "avx512vnni", "avxvnni", "avx2" or "portable". */
const char *rows_s8_variant(void) { return S8_ROWS; }

/* max |x| over a block of 32 (max is exact: any order gives the same number) */
static inline float block_amax(const float *x) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x)), _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8)));
    __m256 b = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 16)), _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 24)));
    a = _mm256_max_ps(a, b);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) { const float a = fabsf(x[j]); amax = a > amax ? a : amax; }
    return amax;
#endif
}

/* the second largest |x| of a block of 32 (topk's: the largest again where it comes twice), given the
 * largest amax */
static inline float block_second(const float *x, float amax) {
#ifdef __AVX2__
    const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(amax);
    __m256 rest = _mm256_setzero_ps();
    int ties = 0;
    for (int j = 0; j < 32; j += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), eq = _mm256_cmp_ps(a, top, _CMP_EQ_OQ);
        ties += __builtin_popcount((unsigned)_mm256_movemask_ps(eq));
        rest = _mm256_max_ps(rest, _mm256_andnot_ps(eq, a));  /* the values below the largest */
    }
    if (ties > 1) return amax;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(rest), _mm256_extractf128_ps(rest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float second = 0.0f;
    int ties = 0;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(x[j]);
        if (a == amax) ties++;
        else second = a > second ? a : second;
    }
    return ties > 1 ? amax : second;
#endif
}

/* a block of 32 -> its codes q (round half to even, from the fp32 product x * (127 / amax)) -> its scale */
static inline float quantize_block(const float *x, float amax, int8_t *q) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) {
        const float c = nearbyintf(x[j] * inv);
        q[j] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
    }
    return amax / 127.0f;
}

#ifdef S8_Q4_PAIRS
/* qx in the order row_q4_s8's AVX2 loop meets it (S8_Q4_PAIRS): each pair of blocks b, b + 1 as b's
 * x 0..15, b + 1's x 0..15, b's x 16..31, b + 1's x 16..31 (the two middle quarters swapped), which is
 * the order of one 32-byte load of their codes' low nibbles, then their high ones; an odd last block
 * stays as it is */
static void pair_order(int8_t *qx, int64_t k) {
    for (int64_t b = 0; b + 2 <= k / 32; b += 2) {
        int8_t t[16], *p = qx + 32 * b;
        memcpy(t, p + 16, 16), memcpy(p + 16, p + 32, 16), memcpy(p + 32, t, 16);
    }
}
#endif

/* x [k] -> qx [k] int8, dx [k / 32], xsum [k / G] and res [S8_RESIDUALS(k)] (see the top) -> how many
 * blocks res holds. k and G multiples of 32. */
int64_t prepare_s8(const float *x, int64_t k, int64_t G, int8_t *qx, float *dx, float *xsum, S8Residual *res, int q4) {
    const int64_t most = S8_RESIDUALS(k);
    float ratio[S8_RESIDUAL_BLOCKS];  /* the candidates so far, largest ratio first (ties: the lower block) */
    int64_t chosen[S8_RESIDUAL_BLOCKS], n = 0;
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        const float amax = block_amax(xb), second = block_second(xb, amax);
        dx[b] = quantize_block(xb, amax, qx + 32 * b);
        if (!(second > 0.0f && amax > S8_RESIDUAL_RATIO * second)) continue;
        const float r = amax / second;  /* fp32, as residual_blocks' */
        int64_t at = n;  /* after every kept ratio >= r: the earlier block wins a tie */
        while (at > 0 && ratio[at - 1] < r) at--;
        if (at >= most) continue;
        for (int64_t e = (n < most ? n : most - 1); e > at; e--) ratio[e] = ratio[e - 1], chosen[e] = chosen[e - 1];
        ratio[at] = r, chosen[at] = b;
        n += n < most;
    }
    for (int64_t e = 1; e < n; e++)  /* in block order */
        for (int64_t f = e; f > 0 && chosen[f - 1] > chosen[f]; f--) {
            const int64_t t = chosen[f]; chosen[f] = chosen[f - 1], chosen[f - 1] = t;
        }
    for (int64_t e = 0; e < n; e++) {  /* the residual x - dx qx, rounded once (the reference's fp64 difference) */
        const int64_t b = chosen[e];
        float rest[32], ramax = 0.0f;
        for (int j = 0; j < 32; j++) {
            rest[j] = fmaf(-(float)qx[32 * b + j], dx[b], x[32 * b + j]);
            ramax = fabsf(rest[j]) > ramax ? fabsf(rest[j]) : ramax;
        }
        res[e].rdx = quantize_block(rest, ramax, res[e].rx);
        res[e].b = (int32_t)b, res[e].g = (int32_t)(b / (G / 32));
    }
    for (int64_t g = 0, e = 0; g < k / G; g++) {  /* the sums of the quantized x: dx[b] times each block's code sum */
        float s = 0.0f;
        for (int64_t b = g * (G / 32); b < (g + 1) * (G / 32); b++) {
            int32_t q = 0;
            for (int j = 0; j < 32; j++) q += qx[32 * b + j];
            s += dx[b] * (float)q;
            if (e < n && res[e].b == b) {  /* then its residual's */
                q = 0;
                for (int j = 0; j < 32; j++) q += res[e].rx[j];
                s += res[e].rdx * (float)q;
                e++;
            }
        }
        xsum[g] = s;
    }
#ifdef S8_Q4_PAIRS
    if (q4) pair_order(qx, k);
#else
    (void)q4;
#endif
    return n;
}

#ifdef ROWS_S8_NARROW  /* -DROWS_S8_NARROW: AVX512-VNNI's block a 256-bit vpdpbusd (for measuring) */
#undef S8_WIDE
#endif

#if defined(__AVX2__)
/* one block of 32 int4 codes (16 bytes) as 32 unsigned bytes, weights 0..31 in order */
static inline __m256i q4_block(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}
/* one block of int8 codes against qx: |q| and qx with q's sign */
static inline __m256i q8_dot(const int8_t *q, const int8_t *x) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)q), s = _mm256_loadu_si256((const __m256i *)x);
    return dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w));
}
static inline __m256 blk(__m256i isum, float scale, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(scale), acc);
}
static inline float sum_f32x8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#ifdef S8_Q4_PAIRS
/* blocks b, b + 1 of int4 codes (32 bytes at p) against their x in pair order (pair_order) with their
 * two scales s[0], s[1]: one load, the low nibbles (b's and b + 1's weights 0..15) and the high ones
 * (16..31) each one vpmaddubsw, their int16 sums added (a lane: 4 products, <= 4 * 15 * 127 = 7,620,
 * no saturation), one vpmaddwd with ones to int32 (lanes 0-3 block b, 4-7 block b + 1), one convert,
 * one multiply-add with [s0 x4, s1 x4]: half the block loop's splitting, summing and scaling */
static inline __m256 q4_pair_avx2(const uint8_t *p, const int8_t *xp, const float *s, __m256 acc) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p), nib = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 32))));
    const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(s + 1), _mm_broadcast_ss(s));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1))), scale, acc);
}
#endif

#ifdef S8_WIDE
/* two blocks of int4 codes (32 bytes) as 64 unsigned bytes: block 0's weights 0..31, then block 1's */
static inline __m512i q4_pair(const uint8_t *p) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p), nib = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
    const __m512i order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  /* lo0 hi0 lo1 hi1 */
    return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
}
static inline __m512i dot64(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }
/* blocks b, b + 1 (half 0) or b + 2, b + 3 (half 1) of four scales, each on its 8 lanes */
static inline __m512 pair_scale(__m512 four, int half) {
    const __m512i idx = half ? _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                             : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, four);
}
#endif

/* bs[b] = scale[g(b)] * dx[b] (fp32) for a row's nb blocks, bpg = G / 32 blocks a group: made once per
 * row before its loop (a division b * 32 / G in the loop, ~25 cycles each, halved the speed) */
static inline void block_scales(const uint16_t *sc, const float *dx, int64_t nb, int64_t bpg, float *bs) {
    int64_t b = 0;
#ifdef __F16C__
    for (; bpg == 1 && b + 8 <= nb; b += 8)
        _mm256_storeu_ps(bs + b, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b))),
                                               _mm256_loadu_ps(dx + b)));
#endif
    for (; b < nb; b++) bs[b] = f16_to_f32(sc[b / bpg]) * dx[b];
}

/* sum_g min[g] * xsum[g], int4's minimums against the sums of x */
static inline float from_mins(const uint16_t *mn, const float *xsum, int64_t ng) {
    int64_t g = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    __m256 a = _mm256_setzero_ps();
    for (; g + 8 <= ng; g += 8)
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))), _mm256_loadu_ps(xsum + g), a);
    s = sum_f32x8(a);
#endif
    for (; g < ng; g++) s += f16_to_f32(mn[g]) * xsum[g];
    return s;
}

/* The marked blocks' residuals against row q (int4: 16 bytes a block, else int8: 32), after the main
 * loop: sum_e scale[g(e)] * rdx[e] * sum_j q[j] rx[e, j], in fp32 sums of their own (at most 8 blocks,
 * the weights already in L1) that the vector loops add to theirs before the one horizontal sum */
#if defined(__AVX2__)
static inline __m256 residuals(const Mat *m, const void *row, const uint16_t *sc, int q4) {
    __m256 r = _mm256_setzero_ps();
    for (int64_t e = 0; e < m->nres; e++) {
        const S8Residual *v = m->res + e;
        const __m256i rx = _mm256_loadu_si256((const __m256i *)v->rx);
        const __m256i isum = q4 ? dot32(q4_block((const uint8_t *)row + 16 * v->b), rx)
                                : q8_dot((const int8_t *)row + 32 * v->b, v->rx);
        r = blk(isum, f16_to_f32(sc[v->g]) * v->rdx, r);
    }
    return r;
}
#else
static inline float residuals(const Mat *m, const void *row, const uint16_t *sc, int q4) {
    float r = 0.0f;
    for (int64_t e = 0; e < m->nres; e++) {
        const S8Residual *v = m->res + e;
        int32_t isum = 0;
        if (q4) {
            const uint8_t *p = (const uint8_t *)row + 16 * v->b;
            for (int j = 0; j < 16; j++) isum += (int32_t)(p[j] & 0xF) * v->rx[j] + (int32_t)(p[j] >> 4) * v->rx[j + 16];
        } else {
            const int8_t *w = (const int8_t *)row + 32 * v->b;
            for (int j = 0; j < 32; j++) isum += (int32_t)w[j] * v->rx[j];
        }
        r += f16_to_f32(sc[v->g]) * v->rdx * (float)isum;
    }
    return r;
}
#endif

#define BSCALE(b) bs[b]

void row_q4_s8(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, G = m->G, ng = k / G, nb = k / 32;
    const uint8_t *q = (const uint8_t *)m->W + i * (k / 2);
    const uint16_t *sc = m->scales + i * ng, *mn = m->mins + i * ng;
    const int8_t *qx = m->qx;
    float s = 0.0f, bs[nb];
    block_scales(sc, m->dx, nb, G / 32, bs);
    int64_t b = 0;
#if defined(S8_WIDE)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; b + 4 <= nb; b += 4) {
        const __m512i p0 = dot64(q4_pair(q + 16 * b), _mm512_loadu_si512((const void *)(qx + 32 * b)));
        const __m512i p1 = dot64(q4_pair(q + 16 * b + 32), _mm512_loadu_si512((const void *)(qx + 32 * b + 64)));
        const __m512 four = _mm512_castps128_ps512(_mm_loadu_ps(bs + b));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), pair_scale(four, 0), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), pair_scale(four, 1), a1);
    }
    __m256 c = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 d = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    for (; b < nb; b++) c = blk(dot32(q4_block(q + 16 * b), _mm256_loadu_si256((const __m256i *)(qx + 32 * b))), BSCALE(b), c);
    if (m->nres) d = _mm256_add_ps(d, residuals(m, q, sc, 1));
    s = sum_f32x8(_mm256_add_ps(c, d));
#elif defined(S8_Q4_PAIRS)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; b + 8 <= nb; b += 8) {
        a0 = q4_pair_avx2(q + 16 * b, qx + 32 * b, bs + b, a0);
        a1 = q4_pair_avx2(q + 16 * b + 32, qx + 32 * b + 64, bs + b + 2, a1);
        a2 = q4_pair_avx2(q + 16 * b + 64, qx + 32 * b + 128, bs + b + 4, a2);
        a3 = q4_pair_avx2(q + 16 * b + 96, qx + 32 * b + 192, bs + b + 6, a3);
    }
    for (; b + 2 <= nb; b += 2) a0 = q4_pair_avx2(q + 16 * b, qx + 32 * b, bs + b, a0);
    if (b < nb) a1 = blk(dot32(q4_block(q + 16 * b), _mm256_loadu_si256((const __m256i *)(qx + 32 * b))), BSCALE(b), a1);
    if (m->nres) a3 = _mm256_add_ps(a3, residuals(m, q, sc, 1));
    s = sum_f32x8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#elif defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; b + 4 <= nb; b += 4) {
        a0 = blk(dot32(q4_block(q + 16 * b), _mm256_loadu_si256((const __m256i *)(qx + 32 * b))), BSCALE(b), a0);
        a1 = blk(dot32(q4_block(q + 16 * b + 16), _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 32))), BSCALE(b + 1), a1);
        a2 = blk(dot32(q4_block(q + 16 * b + 32), _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 64))), BSCALE(b + 2), a2);
        a3 = blk(dot32(q4_block(q + 16 * b + 48), _mm256_loadu_si256((const __m256i *)(qx + 32 * b + 96))), BSCALE(b + 3), a3);
    }
    for (; b < nb; b++) a0 = blk(dot32(q4_block(q + 16 * b), _mm256_loadu_si256((const __m256i *)(qx + 32 * b))), BSCALE(b), a0);
    if (m->nres) a3 = _mm256_add_ps(a3, residuals(m, q, sc, 1));
    s = sum_f32x8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    for (; b < nb; b++) {
        const uint8_t *p = q + 16 * b;
        const int8_t *xb = qx + 32 * b;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) isum += (int32_t)(p[j] & 0xF) * xb[j] + (int32_t)(p[j] >> 4) * xb[j + 16];
        s += BSCALE(b) * (float)isum;
    }
    if (m->nres) s += residuals(m, q, sc, 1);
#endif
    y[i] = s + from_mins(mn, m->xsum, ng);
}

#ifdef S8_FOUR
/* Four rows a call (rows 4p .. 4p + 3; past n, the last row again, not written): each lane of the
 * sums is one row's block. A pair of blocks of each row gives 16 int16 sums (q4_pair16: 8 a block,
 * each of 4 products, <= 7,620); unpacks and int16 adds fold each row's 8 into 2 (<= 30,480: no
 * wrap; two rounds of vphaddw did the same and measured no faster than one row a call on Zen 1), and
 * one vpmaddwd with ones into one int32: [rows 0-3 of block b | rows 0-3 of block b + 1]. One
 * convert and one multiply-add with the four rows' scales then serve four rows and two blocks, where
 * the one-row loop spends a vpmaddwd, a convert, a multiply-add and a broadcast pair per row, and a
 * horizontal sum per row at its end. Every lane runs the same operations in the same order, so a
 * row's bits do not depend on the rows beside it. */
static inline __m256i q4_pair16(const uint8_t *p, const int8_t *xp) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)p), nib = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 32))));
}
static inline __m256 four_pair(const uint8_t *const q[4], int64_t b, const int8_t *qx, const float *bs, __m256 acc) {
    const __m256i v0 = q4_pair16(q[0] + 16 * b, qx + 32 * b), v1 = q4_pair16(q[1] + 16 * b, qx + 32 * b);
    const __m256i v2 = q4_pair16(q[2] + 16 * b, qx + 32 * b), v3 = q4_pair16(q[3] + 16 * b, qx + 32 * b);
    /* 32-bit lanes (two int16 sums each) of rows 0, 1 interleaved and their halves added, the same for
     * rows 2, 3, then 64-bit lanes: [row 0's, row 1's, row 2's, row 3's pair] per block (<= 30,480) */
    const __m256i s01 = _mm256_add_epi16(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
    const __m256i s23 = _mm256_add_epi16(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
    const __m256i isum = _mm256_madd_epi16(_mm256_add_epi16(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23)),
                                           _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(bs + 4 * b), acc);
}

/* bs[4 b + r] = scale[r, g(b)] * dx[b]: the four rows' block scales, block by block */
static inline void four_scales(const uint16_t *const sc[4], const float *dx, int64_t nb, int64_t bpg, float *bs) {
    int64_t b = 0;
    for (; bpg == 1 && b + 8 <= nb; b += 8) {
        const __m256 d = _mm256_loadu_ps(dx + b);
        __m256 r[4];
        for (int j = 0; j < 4; j++) r[j] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc[j] + b))), d);
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);  /* blocks 0 | 4, 1 | 5 */
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);  /* blocks 2 | 6, 3 | 7 */
        _mm256_storeu_ps(bs + 4 * b, _mm256_permute2f128_ps(u0, u1, 0x20));
        _mm256_storeu_ps(bs + 4 * b + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
        _mm256_storeu_ps(bs + 4 * b + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
        _mm256_storeu_ps(bs + 4 * b + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
    }
    for (; b < nb; b++)
        for (int j = 0; j < 4; j++) bs[4 * b + j] = f16_to_f32(sc[j][b / bpg]) * dx[b];
}

void rows4_q4_s8(const Mat *m, float *y, int64_t p) {
    const int64_t k = m->k, G = m->G, ng = k / G, nb = k / 32;
    const uint8_t *q[4];
    const uint16_t *sc[4];
    for (int j = 0; j < 4; j++) {
        const int64_t i = 4 * p + j < m->n ? 4 * p + j : m->n - 1;
        q[j] = (const uint8_t *)m->W + i * (k / 2), sc[j] = m->scales + i * ng;
    }
    const int8_t *qx = m->qx;
    float bs[4 * nb];
    four_scales(sc, m->dx, nb, G / 32, bs);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t b = 0;
    const char *next = (const char *)m->W + (4 * p + 4) * (k / 2);  /* the next call's rows: nb lines of 64 bytes */
    for (; b + 4 <= nb; b += 4) {
        for (int j = 0; j < 4; j++) _mm_prefetch(next + 64 * (b + j), _MM_HINT_T0);
        a0 = four_pair(q, b, qx, bs, a0);
        a1 = four_pair(q, b + 2, qx, bs, a1);
    }
    if (b + 2 <= nb) a0 = four_pair(q, b, qx, bs, a0), b += 2;
    if (b < nb) {  /* an odd last block (x in its own order): eight int32 sums a row, folded by vphaddd */
        __m256i v[4];
        for (int j = 0; j < 4; j++) v[j] = dot32(q4_block(q[j] + 16 * b), _mm256_loadu_si256((const __m256i *)(qx + 32 * b)));
        const __m256i isum = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ps((const __m128 *)(bs + 4 * b)), a1);
    }
    const __m256 a = _mm256_add_ps(a0, a1);
    float s[4];
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
    for (int j = 0; j < 4 && 4 * p + j < m->n; j++) {
        const int64_t i = 4 * p + j;
        if (m->nres) s[j] += sum_f32x8(residuals(m, q[j], sc[j], 1));
        y[i] = s[j] + from_mins(m->mins + i * ng, m->xsum, ng);
    }
}
#endif

void row_q8_s8(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, G = m->G, nb = k / 32;
    const int8_t *q = (const int8_t *)m->W + i * k;
    const uint16_t *sc = m->scales + i * (k / G);
    const int8_t *qx = m->qx;
    float s = 0.0f, bs[nb];
    block_scales(sc, m->dx, nb, G / 32, bs);
    int64_t b = 0;
#if defined(S8_WIDE)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; b + 4 <= nb; b += 4) {
        const __m512i w0 = _mm512_loadu_si512((const void *)(q + 32 * b)), w1 = _mm512_loadu_si512((const void *)(q + 32 * b + 64));
        const __m512i x0 = _mm512_loadu_si512((const void *)(qx + 32 * b)), x1 = _mm512_loadu_si512((const void *)(qx + 32 * b + 64));
        /* |w| and x with w's sign: x negated where w < 0, zeroed where w == 0 (w == 0 adds nothing anyway) */
        const __m512i p0 = dot64(_mm512_abs_epi8(w0), _mm512_mask_sub_epi8(x0, _mm512_movepi8_mask(w0), _mm512_setzero_si512(), x0));
        const __m512i p1 = dot64(_mm512_abs_epi8(w1), _mm512_mask_sub_epi8(x1, _mm512_movepi8_mask(w1), _mm512_setzero_si512(), x1));
        const __m512 four = _mm512_castps128_ps512(_mm_loadu_ps(bs + b));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), pair_scale(four, 0), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), pair_scale(four, 1), a1);
    }
    __m256 c = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 d = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    for (; b < nb; b++) c = blk(q8_dot(q + 32 * b, qx + 32 * b), BSCALE(b), c);
    if (m->nres) d = _mm256_add_ps(d, residuals(m, q, sc, 0));
    s = sum_f32x8(_mm256_add_ps(c, d));
#elif defined(__AVX2__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; b + 4 <= nb; b += 4) {
        a0 = blk(q8_dot(q + 32 * b, qx + 32 * b), BSCALE(b), a0);
        a1 = blk(q8_dot(q + 32 * b + 32, qx + 32 * b + 32), BSCALE(b + 1), a1);
        a2 = blk(q8_dot(q + 32 * b + 64, qx + 32 * b + 64), BSCALE(b + 2), a2);
        a3 = blk(q8_dot(q + 32 * b + 96, qx + 32 * b + 96), BSCALE(b + 3), a3);
    }
    for (; b < nb; b++) a0 = blk(q8_dot(q + 32 * b, qx + 32 * b), BSCALE(b), a0);
    if (m->nres) a3 = _mm256_add_ps(a3, residuals(m, q, sc, 0));
    s = sum_f32x8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    for (; b < nb; b++) {
        const int8_t *w = q + 32 * b, *xb = qx + 32 * b;
        int32_t isum = 0;
        for (int j = 0; j < 32; j++) isum += (int32_t)w[j] * xb[j];
        s += BSCALE(b) * (float)isum;
    }
    if (m->nres) s += residuals(m, q, sc, 0);
#endif
    y[i] = s;
}

#ifdef S8_FOUR
/* int8 codes four rows a call (as rows4_q4_s8): a block of each row gives eight int32 sums (q8_dot), folded
 * into [rows 0-3 | rows 0-3] (each half a part of the block's sums), one convert, one multiply-add
 * with the four rows' scales in both halves */
static inline __m256 four_block(const int8_t *const q[4], int64_t b, const int8_t *qx, const float *bs, __m256 acc) {
    const __m256i v0 = q8_dot(q[0] + 32 * b, qx + 32 * b), v1 = q8_dot(q[1] + 32 * b, qx + 32 * b);
    const __m256i v2 = q8_dot(q[2] + 32 * b, qx + 32 * b), v3 = q8_dot(q[3] + 32 * b, qx + 32 * b);
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
    const __m256i isum = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcast_ps((const __m128 *)(bs + 4 * b)), acc);
}

void rows4_q8_s8(const Mat *m, float *y, int64_t p) {
    const int64_t k = m->k, G = m->G, nb = k / 32;
    const int8_t *q[4];
    const uint16_t *sc[4];
    for (int j = 0; j < 4; j++) {
        const int64_t i = 4 * p + j < m->n ? 4 * p + j : m->n - 1;
        q[j] = (const int8_t *)m->W + i * k, sc[j] = m->scales + i * (k / G);
    }
    const int8_t *qx = m->qx;
    float bs[4 * nb];
    four_scales(sc, m->dx, nb, G / 32, bs);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t b = 0;
    const char *next = (const char *)m->W + (4 * p + 4) * k;  /* the next call's rows: 2 nb lines of 64 bytes */
    for (; b + 2 <= nb; b += 2) {
        for (int j = 0; j < 4; j++) _mm_prefetch(next + 64 * (2 * b + j), _MM_HINT_T0);
        a0 = four_block(q, b, qx, bs, a0);
        a1 = four_block(q, b + 1, qx, bs, a1);
    }
    if (b < nb) a0 = four_block(q, b, qx, bs, a0);
    const __m256 a = _mm256_add_ps(a0, a1);
    float s[4];
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
    for (int j = 0; j < 4 && 4 * p + j < m->n; j++) {
        if (m->nres) s[j] += sum_f32x8(residuals(m, q[j], sc[j], 0));
        y[4 * p + j] = s[j];
    }
}
#endif

/* This build's row loop for int4 (q4) or int8 codes: four rows a call (m->per = 4) with S8_FOUR, else one */
row_fn s8_rows(Mat *m, int q4) {
#ifdef S8_FOUR
    m->per = 4;
    return q4 ? rows4_q4_s8 : rows4_q8_s8;
#else
    m->per = 1;
    return q4 ? row_q4_s8 : row_q8_s8;
#endif
}

/* The products' entry points: x prepared once (k + 4 (k / 32 + k / G) + 44 min(8, k / 32) bytes), then every row.
 * Return 0, or -1 without memory for the prepared x (y is then not written). */
static int gemv_s8(int q4, Mat *m, const float *x, float *y, int64_t n, int threads) {
    const int64_t k = m->k, G = m->G;
    float *buf = malloc((size_t)(k / 32 + k / G + S8_RESIDUALS(k) * S8_RESIDUAL_FLOATS) * sizeof(float) + (size_t)k);
    if (!buf) return -1;
    float *dx = buf, *xsum = buf + k / 32;
    S8Residual *res = (S8Residual *)(xsum + k / G);
    int8_t *qx = (int8_t *)(xsum + k / G + S8_RESIDUALS(k) * S8_RESIDUAL_FLOATS);
    m->nres = prepare_s8(x, k, G, qx, dx, xsum, res, q4);
    m->qx = qx, m->dx = dx, m->xsum = xsum, m->res = res;
    const row_fn row = s8_rows(m, q4);
    gemv(row, m, y, row_calls(m, n), threads);
    free(buf);
    return 0;
}

/* int8 codes [n, k], fp16 scales [n, k / G]; k and G multiples of 32, G divides k */
int gemv_q8_s8(const int8_t *codes, const uint16_t *scales, const float *x, float *y, int64_t n, int64_t k,
               int64_t G, int threads) {
    Mat m = {.W = codes, .scales = scales, .k = k, .G = G, .n = n};
    return gemv_s8(0, &m, x, y, n, threads);
}

/* int4 codes [n, k / 2], fp16 scales and minimums [n, k / G]; the same k and G */
int gemv_q4_s8(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, const float *x, float *y,
               int64_t n, int64_t k, int64_t G, int threads) {
    Mat m = {.W = codes, .scales = scales, .mins = mins, .k = k, .G = G, .n = n};
    return gemv_s8(1, &m, x, y, n, threads);
}
