/* int8 / int4 codes to fp32, rows at a time: a bf16 prompt's tiles (kernels/cpu.py: bf16_linear, which
 * rounds them to bf16 for oneDNN's GEMM) and gemm_q.c's panels (an fp32 prompt's products).
 *
 * A prompt of T rows multiplies each weight T times, so its products are bound by arithmetic, and
 * the fastest arithmetic on a CPU is a blocked GEMM. So the rows of codes become fp32 a tile or a
 * panel at a time, small enough to stay in the core's cache while the GEMM reads it:
 * the whole matrix never exists in fp32 (what torch's dequantize() builds, 4 bytes a weight written
 * to memory and read back, per product). Each weight is computed as QuantizedWeight.dequantize
 * computes it, code * scale, then + minimum for int4, each rounded to fp32: the same bits, so a
 * prompt's logits do not depend on which path dequantized (tests/test_cpu_kernel.py). */
#include <string.h>

#include "kernels.h"

/* No fused multiply-add here: code * scale + minimum rounded twice, as torch computes it. */
#pragma GCC optimize("fp-contract=off")

/* 16 codes widened to fp32 at once (two AVX-512 instructions; 8-wide ones elsewhere) */
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
/* unsigned bytes through 32-bit integers: GCC widens bytes to floats one by one otherwise */
#define TO_F32(c) __builtin_convertvector(__builtin_convertvector((c), i32x16), f32x16)

/* Row i of int8 codes into fp32, 16 weights at a time: weights j..j+15 to out + (j / 16) * step
 * (step 16: one row, as dequantize() lays it out; gemm_q.c's panels interleave rows 16 at a time) */
void widen_row_q8(const Mat *m, int64_t i, float *out, int64_t step) {
    const int64_t k = m->k, G = m->G, ng = k / G;
    const int8_t *q = (const int8_t *)m->W + i * k;
    const uint16_t *sc = m->scales + i * ng;
    for (int64_t g = 0; g < ng; g++) {
        const float s = f16_to_f32(sc[g]);
        for (int64_t j = g * G; j < (g + 1) * G; j += 16) {  /* G is a multiple of 32 */
            /* the code + 128 as an unsigned byte: GCC widens unsigned bytes at once, signed ones one by one */
            u8x16 c = *(const u8x16 *)(q + j) ^ 0x80;
            f32x16 v = __builtin_convertvector(__builtin_convertvector(c, i32x16) - 128, f32x16) * s;
            memcpy(out + j / 16 * step, &v, 64);
        }
    }
}

/* int4: in each block of 32 weights, byte j holds weight j (low nibble) and weight j + 16 (high) */
void widen_row_q4(const Mat *m, int64_t i, float *out, int64_t step) {
    const int64_t k = m->k, G = m->G, ng = k / G;
    const uint8_t *q = (const uint8_t *)m->W + i * (k / 2);
    const uint16_t *sc = m->scales + i * ng, *mn = m->mins + i * ng;
    for (int64_t g = 0; g < ng; g++) {
        const float s = f16_to_f32(sc[g]), lo = f16_to_f32(mn[g]);
        for (int64_t b = g * G; b < (g + 1) * G; b += 32) {
            u8x16 c = *(const u8x16 *)(q + b / 2);
            f32x16 low = TO_F32(c & 0xF) * s + lo;
            f32x16 high = TO_F32(c >> 4) * s + lo;
            memcpy(out + b / 16 * step, &low, 64);
            memcpy(out + (b / 16 + 1) * step, &high, 64);
        }
    }
}

static void dequant_row_q8(const Mat *m, float *out, int64_t i) { widen_row_q8(m, i, out + i * m->k, 16); }
static void dequant_row_q4(const Mat *m, float *out, int64_t i) { widen_row_q4(m, i, out + i * m->k, 16); }

/* out [n, k] fp32 = rows of int8 codes [n, k] (mins NULL) or int4 codes [n, k / 2], with their fp16
 * scales (and minimums) [n, k / G]: the caller passes the pointers of a tile's first row. */
void dequant_rows(const void *codes, const uint16_t *scales, const uint16_t *mins, float *out, int64_t n, int64_t k,
                  int64_t G, int threads) {
    Mat m = {.W = codes, .scales = scales, .mins = mins, .k = k, .G = G};
    gemv(mins ? dequant_row_q4 : dequant_row_q8, &m, out, n, threads);
}
