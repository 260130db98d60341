/* A prompt's activations as int8 codes, one scale per row (numerics/w8a8.py, prefill_precision="int8").
 *
 * The same arithmetic as w8a8.quantize_rows, in the same order, so the codes are the same bits:
 * t = x * keep (fp32: keep is 0 in the weight's outlier columns, 1 elsewhere), a = max |t| / 127,
 * q = round(t / a) (half to even, as torch.round).
 * One call instead of torch's six operations, and single-threaded: a prompt of 512 rows of 576 is
 * 1 MB, read twice from cache, while each of torch's operations is a parallel region that on a busy
 * machine waits for a time slice (chapter 8). Each row alone: the same codes whatever M. */
#include <math.h>

#include "kernels.h"

/* No fused multiply-add: each product rounded to fp32 as torch rounds it. */
#pragma GCC optimize("fp-contract=off")

void quantize_rows_s8(const float *x, const float *keep, int8_t *q, float *scales, int64_t M, int64_t k) {
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * k;
        float m = 0.0f;
        for (int64_t i = 0; i < k; i++) {
            float t = keep ? xr[i] * keep[i] : xr[i];
            m = fmaxf(m, fabsf(t));
        }
        float a = m / 127.0f;
        if (!(a > 0.0f)) a = 1.0f;  /* an all-zero row: codes 0 */
        scales[r] = a;
        for (int64_t i = 0; i < k; i++) {
            float t = keep ? xr[i] * keep[i] : xr[i];
            q[r * k + i] = (int8_t)nearbyintf(t / a);
        }
    }
}
