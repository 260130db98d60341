/* One output row of a product, for each weight format: fp32, bf16, int8 and int4, in portable
 * 8-wide loops (the AVX-512 ones are in rows_avx512.c, the fp32 ones for several rows of x in
 * rows_batch.c). parallel.c shares the rows out over the threads; a row is always summed by one
 * thread, in the order written here.
 *
 * bf16 weights (chapter 9): the same loop reads 2 bytes a weight instead of 4 and widens each to
 * fp32 in a register (a bf16 number is the top half of an fp32 one), so the activations and every
 * sum stay fp32 while memory delivers half the bytes. 16 weights are loaded as 8 32-bit words:
 * shifting each word left by 16 gives the even weights as fp32, masking its low half gives the
 * odd ones, two instructions for 16 weights; x is reordered once per call to match (evens, odds).
 *
 * int8 and int4 weights (chapter 10): groups of G weights along a row share a scale (int8, as
 * GGUF's Q8_0: w = scale * q, q in [-127, 127]) or a scale and a minimum (int4, as GGUF's Q4_1:
 * w = min + scale * q, q in [0, 15]); int4 codes sit two to a byte, and in each block of 32 weights
 * byte j holds weight j in its low nibble and weight j + 16 in its high one. The codes become fp32
 * in registers and meet x there: sum over a group of q * x, times its scale, plus its minimum
 * times the sum of x over the group (worked out once per call). Scales and minimums are fp16.
 */
#include "kernels.h"

/* fp32: y[i] = W[i, :] @ x, 32 weights a pass into four sums (independent multiply-add chains) */
void row_f32(const Mat *m, float *y, int64_t i) {
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

/* bf16 weights, fp32 x and sums: 32 weights a pass. x is reordered: each block of 16 as its 8 even
 * then 8 odd elements (prepare_bf16, once per product); the tail past the last block is x itself. */
void row_bf16(const Mat *m, float *y, int64_t i) {
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

/* x [k] -> xp [k] in row_bf16's order (see there) */
void prepare_bf16(const float *x, int64_t k, float *xp) {
    int64_t j = 0;
    for (; j + 16 <= k; j += 16)
        for (int l = 0; l < 8; l++) { xp[j + l] = x[j + 2 * l]; xp[j + 8 + l] = x[j + 2 * l + 1]; }
    for (; j < k; j++) xp[j] = x[j];
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
void row_q8(const Mat *m, float *y, int64_t i) {
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
void row_q4(const Mat *m, float *y, int64_t i) {
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

/* int4: the sum of x over each group [k / G] into xsum, and, where row_q4_perm applies, x
 * reordered for it into xperm [k / 128 * 128] (NULL: not wanted). Returns whether xperm was made. */
int prepare_q4(const float *x, int64_t k, int64_t G, float *xsum, float *xperm) {
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

row_fn q8_rows(const Mat *m) {  /* the int8 loop for this machine and matrix */
#ifdef __AVX512F__
    if (m->k / m->G <= MAX_ROW_GROUPS) return row_q8_wide;
#endif
    (void)m;
    return row_q8;
}

row_fn q4_rows(const Mat *m) {  /* the int4 loop for this machine and matrix */
#ifdef __AVX512F__
    if (m->xperm) return row_q4_perm;
    if (m->k / m->G <= MAX_ROW_GROUPS) return row_q4_wide;
#endif
    (void)m;
    return row_q4;
}

row_fn several_rows(const Mat *m) {  /* several rows of x, the codes widened once (rows_avx512.c) */
#ifdef __AVX512F__
    if (m->k <= MAX_WIDE_K && m->each == row_q8_wide) return rows_q8_wide;
    if (m->k <= MAX_WIDE_K && m->each == row_q4_perm) return rows_q4_perm;
#endif
    (void)m;
    return NULL;
}
