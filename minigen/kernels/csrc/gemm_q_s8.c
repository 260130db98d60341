/* A prompt's products with int4 / int8 group-wise weight codes and int8 activations (chapter 10,
 * numerics/int8_act.py, which says why): y [M, n] = int8_act.reference_linear(x, W), in one C call.
 *     y[r, i] = sum_b s[i, g(b)] (dx[r, b] isum[r, i, b] + rdx[r, b] rsum[r, i, b])  (+ sum_g m[i, g] xsum[r, g]
 *     for int4: sum_{b in g} dx sum qx + rdx sum rx),  isum = sum_{j in b} q[i, j] qx[r, j] exact int32, rsum
 *     the same with rx: the residual x - dx qx of a row's marked blocks (<= RES_MAX, int8_act.residual_blocks)
 * Why: gemm_q.c widens the codes to fp32, 16 multiply-adds an AVX-512 FMA; `vpdpbusd` does 64 (4 unsigned
 * bytes times 4 signed bytes into each int32 lane), as llama.cpp's Q4_0 x Q8_0. int4 codes are unsigned
 * (0..15); int8 codes become q + 128, each block's sum starting at -128 sum qx (exact: 255 * 127 * 32),
 * except in the AVX2 loop, where they stay signed (SIGNED_CODES, below).
 * Layout: x quantized once a call (rows shared out among the threads), packed MR rows at a time: [M / MR]
 * [k / 4][MR] int32 (4 codes of a row: what the micro-kernel broadcasts), dx, corrections and int4's group
 * sums [.][blocks or groups][MR]; each row's marked blocks apart. Each (group of rows, panel) unit repacks
 * PANEL = NV x LANES channels of codes into its thread's buffer [k / 4][PANEL][4] (one load: LANES channels'
 * next 4 codes), scales (minimums) fp32 [k / G][PANEL]; the group's rows (X_GROUP_BYTES of packed x) run on it.
 * Micro-kernel: MR x NV int32 and fp32 sums; per block 8 steps of NV loads, MR broadcasts, MR NV vpdpbusd,
 * then acc += float(isum) * (s * dx) (int4: acc += m * xsum a group); then each row's marked blocks (NV
 * loads of that block's panel codes, in L1 / L2, one broadcast, NV vpdpbusd a step). One unit sums each
 * output in a fixed order: the same bits whatever the threads, the grouping or the other rows (lanes never
 * mix rows; a row's blocks are marked from it alone). Variants: AVX512-VNNI (16 lanes), AVX-VNNI (8), AVX2
 * (vpmaddubsw, as llama.cpp: exact on these operands), portable C (GCC's vector extensions).
 * Measured on this course's Xeon (family 6 model 167, AVX512-VNNI), one thread, M = 512, SmolLM2-135M's
 * [3072, 576], [576, 1536], [960, 576], [576, 576], G = 32, before / after the residual alternately, best
 * of 11, multiply-adds per ns over the four (after's range): randn x with 3 channels x100 (3 blocks a row
 * marked): int4 233 / 184 (169-195), int8 245 / 191 (163-205); plain randn (0.1-0.3 marked): int4 242 /
 * 231 (203-248), int8 235 / 225 (208-237); gemm_q.c on the int4 codes 90. 3 marked blocks of 18 cost 27-31%
 * more time: their vpdpbusd run at about half the main loop's rate (two chains a block, no idiv: no change).
 * x's quantization, 512 rows of 576: 0.12 ms before, 0.20 after (a block's second largest |x| only where
 * one lane alone has 2|x| >= amax). A shared machine (load ~2 on 2 vCPUs): +-10% between runs.
 * Repacking costs ~4 integer operations a word of 4 codes (byte by byte: 2 ns a weight, half the product);
 * with AVX2, eight channels at a time (repack8: a 4 x 4 transpose of words in each half of a register),
 * measured on the Zen 1 above (MR = 4, same runs): int4 M = 8 1.11 -> 1.03 ms, M = 1 0.76 -> 0.70; int8
 * M = 8 1.68 -> 1.56. -DGQ_BYTE_REPACK builds the word-at-a-time repack to compare.
 * Profiling switches: -DGQ_PROFILE (with $GQ_PROFILE set: the quantization's and products' times on stderr),
 * -DGQ_NO_MINS (int4's minimums left out: wrong results), -DMR=.. -DNV=.., -DX_GROUP_BYTES=...
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef GQ_PROFILE
#include <stdio.h>
#include <time.h>
#endif

#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define Q8_VARIANT "avx512vnni"
#define LANES 16
#ifndef MR  /* measured: 4 x 3 and 6 x 2 alike (+-5%, a shared machine), 3 x 4 and 8 x 1 slower */
#define MR 4
#define NV 3
#endif
typedef __m512i vi;
static inline vi loadv(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi bcast(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi dot4(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__) || defined(__AVX2__)
#define LANES 8
#ifndef MR
#define MR 4
#define NV 2
#endif
typedef __m256i vi;
static inline vi loadv(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi bcast(int32_t x) { return _mm256_set1_epi32(x); }
#ifdef __AVXVNNI__
#define Q8_VARIANT "avxvnni"
static inline vi dot4(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define Q8_VARIANT "avx2"
/* Without vpdpbusd, llama.cpp's AVX2 products, exact here: vpmaddubsw (unsigned bytes times signed ones,
 * pairs summed into int16, saturating) never saturates on these operands. int4: a pair is at most
 * 2 * 15 * 127 = 3,810, so a block's 16 products a lane stay in int16 (30,480) and one vpmaddwd with
 * ones per block makes the int32 sums (DOT_INT16 below). int8: the codes stay signed (SIGNED_CODES: no
 * +128, no correction) and give their sign to x (vpsignb): |q| * (+-qx), a pair at most 2 * 128 * 127
 * = 32,512, into int32 at once. Measured on an AMD EPYC Zen 1 (family 23 model 1: AVX2 on 128-bit
 * units, one integer-multiply pipe), one thread, the gemm_q4_s8 / gemm_q8_s8 probes (128 rows of
 * [1536, 576] with outliers): 15.3 -> 7.2-7.9 ms (int4) and 15.2-15.5 -> 9.5-9.8 ms (int8) against the
 * exact emulation before (gemm_s8.c's two vpmaddwd), 1.12x and 0.77x the fp32-activation panels.
 * MR x NV of 6 x 2, 4 x 2, 3 x 2 and 2 x 3 ran alike there (within the VM's noise), 4 x 3 slower.
 * 4 x 2 since 2026-12-06 (AVX2 and AVX-VNNI): rows come MR at a time, so a batch's decode step of 8 rows
 * (the Engine's) ran 12 rows' tiles at MR = 6. Same Zen 1, one thread, 8 matrices [3072, 576] with
 * outliers in turn, builds in turns, best of 5, MR = 6 -> 4: int4 M = 8 1.40 -> 1.03 ms a matrix,
 * M = 16 1.92 -> 1.70, M = 512 47.9 -> 44.2; int8 M = 8 2.05 -> 1.56, M = 512 64.6 -> 62.7; the
 * Engine's batch-8 int4 decode step 194 -> 158 ms (with repack8, below). */
#define SIGNED_CODES 1
#define DOT_INT16 1
static inline vi dot4(vi acc, vi u, vi s) {  /* int4: int16 sums, summed into int32 by block_sums */
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
static inline vi dot4_signed(vi acc, vi w, vi s) {  /* int8: signed codes w */
    const vi p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline vi block_sums(vi acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif
#else
#define Q8_VARIANT "portable"
#define LANES 16
#define MR 4
#define NV 1
typedef uint32_t vi __attribute__((vector_size(64)));
static inline vi loadv(const uint8_t *p) { vi v; memcpy(&v, p, sizeof v); return v; }
static inline vi bcast(int32_t x) { return (vi){0} + (uint32_t)x; }
/* each lane's 4 unsigned bytes of u times the 4 signed bytes of s (one word, the same in every lane) */
static inline vi dot4(vi acc, vi u, vi s) {
    const int32_t x = (int32_t)s[0];
    for (int i = 0; i < 4; i++) acc += ((u >> (8 * i)) & 0xFF) * (uint32_t)(int32_t)(int8_t)(x >> (8 * i));
    return acc;  /* unsigned wrap-around: the int32 sum's bits */
}
#endif
#ifndef SIGNED_CODES  /* int8 codes as q + 128, each block's sum starting at -128 sum qx */
#define SIGNED_CODES 0
#define DOT_INT16 0
static inline vi dot4_signed(vi acc, vi u, vi s) { return dot4(acc, u, s); }
static inline vi block_sums(vi acc) { return acc; }
#endif
#define PANEL (NV * LANES)  /* output channels a panel */
#define BLOCK 32            /* activations a scale */
#define RES_RATIO 2.0f      /* int8_act.RESIDUAL_RATIO: a block whose |x|'s largest is more than 2x its second */
#define RES_MAX 8           /* int8_act.RESIDUAL_BLOCKS: such blocks a row quantized twice, at most */

typedef int32_t i32v __attribute__((vector_size(LANES * 4)));
typedef float f32v __attribute__((vector_size(LANES * 4)));
typedef float f32v_unaligned __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
static inline f32v loadf(const float *p) { return *(const f32v_unaligned *)p; }

/* Which loop this build runs (tests and reports): "avx512vnni", "avxvnni", "avx2" or "portable". */
const char *gemm_q_s8_variant(void) { return Q8_VARIANT; }

typedef struct {
    Mat m;                      /* first: parallel_rows passes a Mat pointer (m.M, m.n, m.k) */
    const uint8_t *codes;       /* int8 [n, k] or int4 [n, k / 2] */
    const uint16_t *scales, *mins;
    int64_t G, kq, nb, ng;      /* group size; k / 4, k / 32, k / G */
    int32_t *xc;                /* x's codes packed [M / MR][kq][MR] */
    float *dx;                  /* [M / MR][nb][MR] */
    int32_t *corr;              /* -128 sum of a block's codes [M / MR][nb][MR]: int8's correction */
    float *xsum;                /* int4: x summed over each group [M / MR][ng][MR] */
    int32_t *nres, *ridx, *rgi, *rcorr, *rxc;  /* a row's residual blocks: how many [M / MR][MR], which, their */
    float *rdx;                 /* groups, -128 sums, scales [.][MR][RES_MAX], codes [.][MR][RES_MAX][BLOCK / 4] */
    int64_t rows, panels;       /* rows of x a group (a multiple of MR); panels of PANEL channels */
    uint8_t *work;              /* per thread: a panel of codes, then its scales and minimums */
    int64_t work_bytes;         /* a thread's part of work */
} GemmQS8;

/* A block of 32 -> codes q (round half to even of x 127 / amax, fp32, clamped), their sum *s, its scale
 * amax / 127, *ratio: amax / second largest |x| where > RES_RATIO and second > 0, else 0 (residual_blocks').
 * AVX-512: the second only where one lane alone has 2|x| >= amax (exact); scalar, 1.4 ms for 512 x 1,536. */
static inline float quantize32(const float *xb, int8_t q[BLOCK], int32_t *s, float *ratio) {
#ifdef __AVX512F__
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const __m512 top = _mm512_set1_ps(amax);
    const uint32_t big = _mm512_cmp_ps_mask(_mm512_add_ps(a0, a0), top, _CMP_GE_OQ) |
                         (uint32_t)_mm512_cmp_ps_mask(_mm512_add_ps(a1, a1), top, _CMP_GE_OQ) << 16;
    *ratio = 0.0f;
    if (amax > 0.0f && !(big & (big - 1))) {  /* one lane: the rest < amax / 2; their largest, the second */
        const __m512 z = _mm512_setzero_ps();
        const float m2 = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(a0, (__mmask16)big, z),
                                                            _mm512_mask_mov_ps(a1, (__mmask16)(big >> 16), z)));
        *ratio = m2 > 0.0f ? amax / m2 : 0.0f;
    }
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), lim = _mm512_set1_ps(127.0f);
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 t0 = _mm512_roundscale_ps(_mm512_mul_ps(x0, inv), rnd), t1 = _mm512_roundscale_ps(_mm512_mul_ps(x1, inv), rnd);
    t0 = _mm512_max_ps(_mm512_min_ps(t0, lim), -lim), t1 = _mm512_max_ps(_mm512_min_ps(t1, lim), -lim);
    const __m512i i0 = _mm512_cvtps_epi32(t0), i1 = _mm512_cvtps_epi32(t1);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
    *s = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
    float amax = 0.0f, m2 = 0.0f;
    for (int j = 0; j < BLOCK; j++) {
        const float v = fabsf(xb[j]);
        if (v > amax) m2 = amax, amax = v; else if (v > m2) m2 = v;
    }
    *ratio = m2 > 0.0f && amax > RES_RATIO * m2 ? amax / m2 : 0.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < BLOCK; j++) {
        float t = nearbyintf(xb[j] * inv);
        t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
        q[j] = (int8_t)t;
        sum += q[j];
    }
    *s = sum;
#endif
    return amax / 127.0f;
}

/* Block b (ratio t) into a row's RES_MAX largest so far, after every ratio >= t (ties: the lower block). */
static inline int keep_block(float top[RES_MAX], int32_t idx[RES_MAX], int n, float t, int64_t b) {
    int i = n;
    while (i > 0 && top[i - 1] < t) i--;
    if (i == RES_MAX) return n;
    for (int j = n < RES_MAX ? n : RES_MAX - 1; j > i; j--) top[j] = top[j - 1], idx[j] = idx[j - 1];
    top[i] = t, idx[i] = (int32_t)b;
    return n + (n < RES_MAX);
}

/* Rows MR blk .. of x as int8_act.quantize_activations, packed (rows past M: codes 0); each row's marked
 * blocks' residual x - dx qx (fmaf: one rounding) too; int4's group sums, rdx sum(rx) after dx sum(qx). */
static void quantize_block(const GemmQS8 *g, const float *x, int64_t blk) {
    const int64_t k = g->m.k, kq = g->kq, nb = g->nb, bpg = g->G / BLOCK;
    int32_t *xc = g->xc + blk * kq * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = blk * MR + r, rr = row * RES_MAX;
        const float *xr = x + row * k;
        int32_t *idx = g->ridx + rr, s;
        int8_t q[BLOCK] = {0};
        float top[RES_MAX], d = 0.0f, t;
        int nr = 0;
        for (int64_t b = 0; b < nb; b++) {
            if (row < g->m.M) d = quantize32(xr + b * BLOCK, q, &s, &t);
            else s = 0, t = 0.0f;
            for (int p = 0; p < BLOCK / 4; p++) memcpy(xc + (b * (BLOCK / 4) + p) * MR + r, q + 4 * p, 4);
            g->dx[(blk * nb + b) * MR + r] = d;
            g->corr[(blk * nb + b) * MR + r] = -128 * s;  /* int8's correction; int4's code sum */
            if (t > 0.0f) nr = keep_block(top, idx, nr, t, b);
        }
        for (int i = 1; i < nr; i++)  /* block order */
            for (int j = i; j > 0 && idx[j - 1] > idx[j]; j--) s = idx[j], idx[j] = idx[j - 1], idx[j - 1] = s;
        g->nres[row] = nr;
        for (int m = 0; m < nr; m++) {  /* the residual's codes, scale and correction */
            const float *xb = xr + idx[m] * BLOCK;
            float rest[BLOCK];
            d = quantize32(xb, q, &s, &t);
            for (int j = 0; j < BLOCK; j++) rest[j] = fmaf(-(float)q[j], d, xb[j]);
            g->rdx[rr + m] = quantize32(rest, (int8_t *)(g->rxc + (rr + m) * (BLOCK / 4)), &s, &t);
            g->rcorr[rr + m] = -128 * s, g->rgi[rr + m] = idx[m] / (int32_t)bpg;  /* tile's scales: no division there */
        }
        if (!g->xsum) continue;
        float *xs = g->xsum + blk * g->ng * MR + r;
        for (int64_t b = 0, m = 0; b < nb; b++) {
            const int64_t at = (blk * nb + b) * MR + r;
            float sum = (b % bpg ? xs[b / bpg * MR] : 0.0f) + g->dx[at] * (float)(g->corr[at] / -128);
            if (m < nr && idx[m] == b) sum += g->rdx[rr + m] * (float)(g->rcorr[rr + m] / -128), m++;
            xs[b / bpg * MR] = sum;
        }
    }
}

/* Channels c0 .. c0 + PANEL of the codes into wp [kq][PANEL][4] unsigned bytes (int4: 0..15; int8:
 * q + 128, or q itself where SIGNED_CODES), their scales (and minimums) as fp32 into ws [ng][PANEL] (wm); channels past n: zeros.
 * 4 bytes at a time: int4's word i of a block (bytes 4i..4i+3) holds codes 4i.. in its low nibbles
 * and 16 + 4i.. in its high ones (one byte at a time, it took 2 ns a weight on the Xeon). */
#if defined(__AVX2__) && LANES == 8 && !defined(GQ_BYTE_REPACK)
/* Eight channels' codes at once (the 8-lane builds, AVX2 and AVX-VNNI: measured on the AVX2 one only;
 * the AVX-512 build keeps the copy below, unmeasured there; -DGQ_BYTE_REPACK: each channel alone): each
 * block's words (4 bytes) of the eight, transposed so that word p of channels c .. c + 7 is one 32-byte
 * store. int4: a block's 16 bytes a channel, 4 words, each split into its low and high nibbles; int8:
 * 32 bytes a channel, 8 words. */
static inline void transpose4x(__m256i r[4]) {  /* 4 x 4 dwords in each 128-bit half */
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm256_unpacklo_epi64(t0, t2), r[1] = _mm256_unpackhi_epi64(t0, t2);
    r[2] = _mm256_unpacklo_epi64(t1, t3), r[3] = _mm256_unpackhi_epi64(t1, t3);
}
static inline __m256i two(const uint8_t *lo, const uint8_t *hi) {  /* 16 bytes of channel c | of c + 4 */
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)hi), _mm_loadu_si128((const __m128i *)lo));
}
static void repack8(const GemmQS8 *g, int64_t ch, uint8_t *out) {
    const int64_t k = g->m.k, nb = g->nb;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    if (g->mins) {
        const uint8_t *src = g->codes + ch * (k / 2);
        const int64_t row = k / 2;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = src + 16 * b;
            __m256i r[4] = {two(p, p + 4 * row), two(p + row, p + 5 * row), two(p + 2 * row, p + 6 * row),
                            two(p + 3 * row, p + 7 * row)};
            transpose4x(r);  /* r[i]: word i of channels 0-3 | 4-7 */
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_si256((__m256i *)(out + (b * 8 + i) * PANEL * 4), _mm256_and_si256(r[i], nib));
                _mm256_storeu_si256((__m256i *)(out + (b * 8 + 4 + i) * PANEL * 4),
                                    _mm256_and_si256(_mm256_srli_epi16(r[i], 4), nib));
            }
        }
        return;
    }
    const uint8_t *src = g->codes + ch * k;
    const __m256i flip = _mm256_set1_epi8(SIGNED_CODES ? 0 : (char)0x80);  /* each byte + 128 */
    for (int64_t b = 0; b < nb; b++)
        for (int h = 0; h < 2; h++) {  /* words 0-3 of the block, then 4-7 */
            const uint8_t *p = src + 32 * b + 16 * h;
            __m256i r[4] = {two(p, p + 4 * k), two(p + k, p + 5 * k), two(p + 2 * k, p + 6 * k), two(p + 3 * k, p + 7 * k)};
            transpose4x(r);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_si256((__m256i *)(out + (b * 8 + 4 * h + i) * PANEL * 4), _mm256_xor_si256(r[i], flip));
        }
}
#endif

static void repack_panel(const GemmQS8 *g, int64_t c0, uint8_t *wp, float *ws, float *wm) {
    const int64_t k = g->m.k, n = g->m.n, nb = g->nb, ng = g->ng;
    int64_t c = 0;
#if defined(__AVX2__) && LANES == 8 && !defined(GQ_BYTE_REPACK)
    for (; c + 8 <= PANEL && c0 + c + 8 <= n; c += 8) repack8(g, c0 + c, wp + c * 4);
#endif
    for (; c < PANEL; c++) {
        const int64_t ch = c0 + c;
        uint8_t *out = wp + c * 4;
        if (ch >= n) {
            for (int64_t p = 0; p < g->kq; p++) memset(out + p * PANEL * 4, 0, 4);
        } else if (g->mins) {
            const uint8_t *src = g->codes + ch * (k / 2);
            for (int64_t b = 0; b < nb; b++)
                for (int i = 0; i < 4; i++) {
                    uint32_t d, lo, hi;
                    memcpy(&d, src + b * 16 + 4 * i, 4);
                    lo = d & 0x0F0F0F0Fu, hi = (d >> 4) & 0x0F0F0F0Fu;
                    memcpy(out + (b * 8 + i) * PANEL * 4, &lo, 4);
                    memcpy(out + (b * 8 + 4 + i) * PANEL * 4, &hi, 4);
                }
        } else {
            const uint8_t *src = g->codes + ch * k;
            for (int64_t p = 0; p < g->kq; p++) {
                uint32_t d;
                memcpy(&d, src + 4 * p, 4);
                if (!SIGNED_CODES) d ^= 0x80808080u;  /* each byte + 128 */
                memcpy(out + p * PANEL * 4, &d, 4);
            }
        }
    }
    for (c = 0; c < PANEL; c++) {
        const int64_t ch = c0 + c;
        for (int64_t gi = 0; gi < ng; gi++) {
            ws[gi * PANEL + c] = ch < n ? f16_to_f32(g->scales[ch * ng + gi]) : 0.0f;
            if (wm) wm[gi * PANEL + c] = ch < n ? f16_to_f32(g->mins[ch * ng + gi]) : 0.0f;
        }
    }
}

/* One tile: MR packed rows (block blk) against the repacked panel -> out [MR][PANEL], over all of k.
 * int4 (has_mins) or int8 (its blocks' sums start at the corrections) a constant once inlined. */
static inline __attribute__((always_inline)) void tile(const GemmQS8 *g, const uint8_t *wp, const float *ws,
                                                        const float *wm, int64_t blk, const int has_mins,
                                                        float out[MR][PANEL]) {
    const int64_t nb = g->nb, bpg = g->G / BLOCK;
    const int32_t *xc = g->xc + blk * g->kq * MR;
    const float *dx = g->dx + blk * nb * MR;
    const int32_t *corr = has_mins ? NULL : g->corr + blk * nb * MR;
    const float *xsum = has_mins ? g->xsum + blk * g->ng * MR : NULL;
    f32v acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (f32v){0};
    for (int64_t gi = 0, b = 0; gi < g->ng; gi++)
    for (int64_t e = b + bpg; b < e; b++) {
        vi s[MR][NV];
        #pragma GCC unroll 16
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NV; v++) s[r][v] = has_mins || SIGNED_CODES ? bcast(0) : bcast(corr[b * MR + r]);
        #pragma GCC unroll 8
        for (int p = 0; p < BLOCK / 4; p++) {
            const uint8_t *w = wp + (b * (BLOCK / 4) + p) * PANEL * 4;
            vi wv[NV];
            for (int v = 0; v < NV; v++) wv[v] = loadv(w + v * LANES * 4);
            #pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const vi u = bcast(xc[(b * (BLOCK / 4) + p) * MR + r]);
                for (int v = 0; v < NV; v++)
                    s[r][v] = has_mins ? dot4(s[r][v], wv[v], u) : dot4_signed(s[r][v], wv[v], u);
            }
        }
        if (has_mins && DOT_INT16)
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NV; v++) s[r][v] = block_sums(s[r][v]);
        f32v sc[NV];
        for (int v = 0; v < NV; v++) sc[v] = loadf(ws + gi * PANEL + v * LANES);
        #pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const float d = dx[b * MR + r];
            for (int v = 0; v < NV; v++) {
                i32v si;
                memcpy(&si, &s[r][v], sizeof si);
                acc[r][v] += __builtin_convertvector(si, f32v) * (sc[v] * d);
            }
        }
#ifdef GQ_NO_MINS
        if (0) {
#else
        if (has_mins && b + 1 == e) {
#endif
            f32v mn[NV];
            for (int v = 0; v < NV; v++) mn[v] = loadf(wm + gi * PANEL + v * LANES);
            #pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const float xs = xsum[gi * MR + r];
                for (int v = 0; v < NV; v++) acc[r][v] += mn[v] * xs;
            }
        }
    }
    /* Each row's own residual blocks, in block order: the panel's codes of the block against its codes */
    const int64_t r0 = blk * MR * RES_MAX;
    #pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
        for (int m = 0; m < g->nres[blk * MR + r]; m++) {
            const int64_t rm = r0 + r * RES_MAX + m, b = g->ridx[rm], gi = g->rgi[rm];
            const int32_t *u = g->rxc + rm * (BLOCK / 4);
            vi s[NV];
            for (int v = 0; v < NV; v++) s[v] = has_mins || SIGNED_CODES ? bcast(0) : bcast(g->rcorr[rm]);
            #pragma GCC unroll 8
            for (int p = 0; p < BLOCK / 4; p++) {
                const uint8_t *w = wp + (b * (BLOCK / 4) + p) * PANEL * 4;
                const vi ub = bcast(u[p]);
                for (int v = 0; v < NV; v++)
                    s[v] = has_mins ? dot4(s[v], loadv(w + v * LANES * 4), ub) : dot4_signed(s[v], loadv(w + v * LANES * 4), ub);
            }
            if (has_mins && DOT_INT16)
                for (int v = 0; v < NV; v++) s[v] = block_sums(s[v]);
            const float d = g->rdx[rm];
            for (int v = 0; v < NV; v++) {
                i32v si;
                memcpy(&si, &s[v], sizeof si);
                acc[r][v] += __builtin_convertvector(si, f32v) * (loadf(ws + gi * PANEL + v * LANES) * d);
            }
        }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) memcpy(out[r] + v * LANES, &acc[r][v], sizeof acc[r][v]);
}

/* Unit i: panel i % panels repacked into this thread's buffer, then every block of rows of group
 * i / panels against it. */
static void unit(const Mat *m, float *y, int64_t i) {
    const GemmQS8 *g = (const GemmQS8 *)m;
    const int64_t n = m->n, c0 = i % g->panels * PANEL;
    const int64_t start = i / g->panels * g->rows, end = start + g->rows < m->M ? start + g->rows : m->M;
#ifdef _OPENMP
    uint8_t *wp = g->work + (int64_t)omp_get_thread_num() * g->work_bytes;
#else
    uint8_t *wp = g->work;
#endif
    float *ws = (float *)(wp + g->kq * PANEL * 4), *wm = g->mins ? ws + g->ng * PANEL : NULL;
    repack_panel(g, c0, wp, ws, wm);
    const int64_t nl = n - c0 < PANEL ? n - c0 : PANEL;
    for (int64_t r0 = start; r0 < end; r0 += MR) {
        float out[MR][PANEL];
        if (g->mins) tile(g, wp, ws, wm, r0 / MR, 1, out);
        else tile(g, wp, ws, wm, r0 / MR, 0, out);
        for (int64_t r = 0; r < MR && r0 + r < end; r++) memcpy(y + (r0 + r) * n + c0, out[r], nl * sizeof(float));
    }
}

/* Rows of x a group: packed x (k bytes a row) that every panel of the group sweeps stays in L2. */
#ifndef X_GROUP_BYTES
#define X_GROUP_BYTES (1024 * 1024)  /* 512 KB: two groups of k = 1,536, 10-20% slower */
#endif

static int64_t group_rows(int64_t M, int64_t k) {
    int64_t most = X_GROUP_BYTES / k / MR * MR;
    if (most < MR) most = MR;
    const int64_t groups = (M + most - 1) / most;
    return ((M + groups - 1) / groups + MR - 1) / MR * MR;
}

/* y [M, n] = reference_linear(x [M, k], W): int8 codes [n, k] (mins NULL, bits 8) or int4 codes
 * [n, k / 2] (bits 4) with fp16 scales (and minimums) [n, k / G]; k and G multiples of 32, G divides
 * k. Returns 0, or -1 without memory for x's codes and a panel a thread (y is then not written). */
int gemm_q_s8(const void *codes, const uint16_t *scales, const uint16_t *mins, int bits, const float *x, float *y,
              int64_t M, int64_t n, int64_t k, int64_t G, int threads) {
    if (M <= 0 || n <= 0) return 0;
    if ((bits == 4) != (mins != NULL)) return -1;
    const int64_t blocks = (M + MR - 1) / MR, nt = threads > 1 ? threads : 1, kq = k / 4, nb = k / BLOCK, ng = k / G;
    const int64_t work_bytes = (kq * PANEL * 4 + 2 * ng * PANEL * 4 + 63) / 64 * 64;
    int32_t *xc = malloc((size_t)(blocks * kq * MR) * sizeof *xc);
    float *dx = malloc((size_t)(blocks * nb * MR) * sizeof *dx);
    int32_t *corr = malloc((size_t)(blocks * nb * MR) * sizeof *corr);
    float *xsum = mins ? malloc((size_t)(blocks * ng * MR) * sizeof *xsum) : NULL;
    uint8_t *work = aligned_alloc(64, (size_t)(nt * work_bytes));
    const int64_t rows = blocks * MR;  /* the residual blocks: per row a count, then RES_MAX of each */
    int32_t *res = malloc((size_t)(rows * (1 + RES_MAX * (4 + BLOCK / 4))) * sizeof *res);
    if (!xc || !dx || !corr || (mins && !xsum) || !work || !res) {
        free(xc), free(dx), free(corr), free(xsum), free(work), free(res);
        return -1;
    }
    GemmQS8 g = {.m = {.M = M, .n = n, .k = k}, .codes = codes, .scales = scales, .mins = mins, .G = G, .kq = kq,
                 .nb = nb, .ng = ng, .xc = xc, .dx = dx, .corr = corr, .xsum = xsum, .nres = res,
                 .ridx = res + rows, .rcorr = res + rows * (1 + RES_MAX), .rdx = (float *)(res + rows * (1 + 2 * RES_MAX)),
                 .rgi = res + rows * (1 + 3 * RES_MAX), .rxc = res + rows * (1 + 4 * RES_MAX), .rows = group_rows(M, k),
                 .panels = (n + PANEL - 1) / PANEL, .work = work, .work_bytes = work_bytes};
    /* x quantized and packed, its blocks shared out (as gemm_q.c's pack_x: after the products' back-off) */
    int par = threads > 1 && blocks >= 2 * threads;
#ifdef _OPENMP
    par = par && !backing_off();
#endif
#ifdef GQ_PROFILE
    struct timespec t0, t1, t2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
#endif
    #pragma omp parallel for num_threads(threads) if(par) schedule(static)
    for (int64_t b = 0; b < blocks; b++) quantize_block(&g, x, b);
#ifdef GQ_PROFILE
    clock_gettime(CLOCK_MONOTONIC, &t1);
#endif
    const int64_t units = (M + g.rows - 1) / g.rows * g.panels;
    parallel_rows(unit, &g.m, y, units, threads, 2);
#ifdef GQ_PROFILE
    clock_gettime(CLOCK_MONOTONIC, &t2);
    if (getenv("GQ_PROFILE")) {
        double tq = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) * 1e-6;
        double tp = (t2.tv_sec - t1.tv_sec) * 1e3 + (t2.tv_nsec - t1.tv_nsec) * 1e-6;
        fprintf(stderr, "M %ld n %ld k %ld: quantize %.3f ms, products %.3f ms\n", (long)M, (long)n, (long)k, tq, tp);
    }
#endif
    free(xc), free(dx), free(corr), free(xsum), free(work), free(res);
    return 0;
}
