/* 8-wide fp32 vectors and the helpers every kernel file uses, all `static inline`: each file that
 * includes them gets its own copy, inlined where it is called. GCC/Clang vector extensions: one AVX2
 * register on x86, two NEON ones on ARM. */
#ifndef MINIGEN_VEC_H
#define MINIGEN_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

/* memcpy: an unaligned vector load, which any compiler turns into one move */
static inline f32x8 load_f32(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
static inline float sum8(f32x8 v) { float s = 0.0f; for (int l = 0; l < 8; l++) s += v[l]; return s; }
/* a += w * x in one rounding where the CPU has FMA. The 8-wide tails of the fp32 rows use it
 * rather than `a += w * x`, which the compiler fuses in one function and not in another: the
 * several-row kernels must give each row the bits row_f32 gives it. */
static inline f32x8 fma8(f32x8 w, f32x8 x, f32x8 a) {
#ifdef __FMA__
    return (f32x8)_mm256_fmadd_ps((__m256)w, (__m256)x, (__m256)a);
#else
    return a + w * x;
#endif
}

/* 16 bf16 numbers at p -> the 8 even ones and the 8 odd ones as fp32 (little-endian words) */
static inline void load_bf16x16(const uint16_t *p, f32x8 *even, f32x8 *odd) {
    u32x8 w; memcpy(&w, p, sizeof w);
    u32x8 e = w << 16, o = w & 0xFFFF0000u;
    memcpy(even, &e, sizeof e); memcpy(odd, &o, sizeof o);
}
static inline float bf16_to_f32(uint16_t h) { uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f; }

/* IEEE fp16 bits -> float, subnormals included (scales of tiny groups can be subnormal); one
 * instruction where the CPU has F16C (x86 since 2012), a few integer operations elsewhere */
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);               /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);        /* normal */
    else { float f = (float)man * (1.0f / 16777216.0f); memcpy(&bits, &f, 4); bits |= sign; }  /* 2^-24 */
    float f; memcpy(&f, &bits, 4); return f;
}

/* The end of an fp32 dot product w . x [k] whose first j weights (a multiple of 32) are in the
 * chains a, b, c, d: the 8-wide tail into a, the chains summed, the scalar tail. Every fp32 row
 * kernel ends here, so a row of a batch gets exactly the bits row_f32 gives it alone. */
static inline float finish_f32(f32x8 a, f32x8 b, f32x8 c, f32x8 d, const float *w, const float *x, int64_t j,
                               int64_t k) {
    for (; j + 8 <= k; j += 8) a = fma8(load_f32(w + j), load_f32(x + j), a);
    float s = sum8((a + b) + (c + d));
    for (; j < k; j++) s = fmaf(w[j], x[j], s);  /* k not a multiple of 8 */
    return s;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t b; memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* e^x for 8 lanes (Cephes' expf: x = n ln2 + r, a degree-7 polynomial for e^r, 2^n in the exponent
 * bits): within 2 ulp of expf, 0 below -87.3. SiLU and softmax take ~90,000 exponentials a SmolLM2
 * step; one at a time through libm they cost ~0.4 ms, a tenth of an int4 step. */
static inline f32x8 select8(i32x8 m, f32x8 a, f32x8 b) {  /* a where m, else b */
    i32x8 ai, bi; memcpy(&ai, &a, sizeof ai); memcpy(&bi, &b, sizeof bi);
    i32x8 r = (ai & m) | (bi & ~m);
    f32x8 f; memcpy(&f, &r, sizeof f); return f;
}
static inline f32x8 exp8(f32x8 x) {
    const f32x8 hi = {88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f,
                      88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f};
    f32x8 lo = -hi + 0.0f;
    i32x8 under = x < -87.3365447505531f;
    x = select8(x > hi, hi, x);
    x = select8(x < lo, lo, x);
    f32x8 n = x * 1.44269504088896341f + 12582912.0f;  /* round to nearest: the float's last bits */
    n -= 12582912.0f;
    f32x8 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    f32x8 p = 1.9875691500E-4f * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
    f32x8 two_n; memcpy(&two_n, &bits, sizeof two_n);
    f32x8 y = p * two_n;
    i32x8 yi; memcpy(&yi, &y, sizeof yi);
    yi &= ~under;
    memcpy(&y, &yi, sizeof y);
    return y;
}

#endif
