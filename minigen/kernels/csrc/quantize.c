/* A prompt's activations as int8 codes, one scale per row (numerics/w8a8.py, prefill_precision="int8").
 *
 * The same arithmetic as w8a8.quantize_rows, in the same order, so the codes are the same bits:
 * t = x * keep (fp32: keep is 0 in the weight's outlier columns, 1 elsewhere), a = max |t| / 127,
 * q = round(t / a) (half to even, as torch.round).
 * One call instead of torch's six operations, and single-threaded: a prompt of 512 rows of 576 is
 * 1 MB, read twice from cache, while each of torch's operations is a parallel region that on a busy
 * machine waits for a time slice (chapter 11). Each row alone: the same codes whatever M. gemm_s8
 * calls the same row function inside its own parallel region (the rows shared out, no region more).
 * 8 lanes at a time (vec.h): one number at a time, 512 rows of 576 took 0.4 ms on the Xeon, a
 * quarter of gemm_s8's product after it on one core, and half of it on two.
 */
#include <math.h>

#include "kernels.h"

/* No fused multiply-add: each product rounded to fp32 as torch rounds it. */
#pragma GCC optimize("fp-contract=off")

/* 1.5 2^23: t + it, for |t| < 2^22, is rounded to an integer n (half to even, as nearbyintf) and its
 * bits are 0x4B400000 + n, so their low byte is n's int8 code (no float-to-int conversion, which
 * GCC does one lane at a time here) */
#define ROUNDER 12582912.0f

/* one row: t = x * keep, a = max |t| / 127, q = round(t / a) -> a */
float quantize_row(const float *xr, const float *keep, int8_t *qr, int64_t k) {
    const f32x8 zero = {0};
    f32x8 m8 = zero;  /* max is exact: any order gives the same scale */
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        f32x8 t = keep ? load_f32(xr + i) * load_f32(keep + i) : load_f32(xr + i);
        t = select8(t < zero, -t, t);
        m8 = select8(t > m8, t, m8);  /* a NaN is passed over, as fmaxf does */
    }
    float m = 0.0f;
    for (int l = 0; l < 8; l++) m = fmaxf(m, m8[l]);
    for (; i < k; i++) m = fmaxf(m, fabsf(keep ? xr[i] * keep[i] : xr[i]));
    float a = m / 127.0f;
    if (!(a > 0.0f)) a = 1.0f;  /* an all-zero row: codes 0 */
    i = 0;
    for (; i + 8 <= k; i += 8) {
        f32x8 t = keep ? load_f32(xr + i) * load_f32(keep + i) : load_f32(xr + i);
        t = t / a + ROUNDER;  /* |t / a| <= 127: the rounder's range */
        i32x8 bits;
        memcpy(&bits, &t, sizeof bits);
#ifdef __AVX2__  /* n = bits - 0x4B400000, narrowed by two packs (no saturation in [-127, 127]) */
        const __m256i n = _mm256_sub_epi32((__m256i)bits, _mm256_set1_epi32(0x4B400000));
        const __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        _mm_storel_epi64((__m128i *)(qr + i), _mm_packs_epi16(n16, n16));
#else
        const i8x8 c = __builtin_convertvector(bits, i8x8);  /* the low bytes */
        memcpy(qr + i, &c, sizeof c);
#endif
    }
    for (; i < k; i++) qr[i] = (int8_t)nearbyintf((keep ? xr[i] * keep[i] : xr[i]) / a);
    return a;
}

void quantize_rows_s8(const float *x, const float *keep, int8_t *q, float *scales, int64_t M, int64_t k) {
    for (int64_t r = 0; r < M; r++) scales[r] = quantize_row(x + r * k, keep, q + r * k, k);
}
