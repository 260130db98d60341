/* RMSNorm and the attention of one new token (a decode step), in fp32: kernels/cpu.py's rms_norm
 * and attend_decode call the entry points here, and decode.c's whole step the two helpers. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

/* out = x / sqrt(mean(x^2) + eps) * weight, the sum of squares in fp32 8 lanes wide */
void rms_norm(const float *x, const float *weight, float *out, int64_t D, float eps) {
    f32x8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) { f32x8 v = load_f32(x + i); acc += v * v; }
    float ss = sum8(acc);
    for (; i < D; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (i = 0; i < D; i++) out[i] = x[i] * r * weight[i];
}

/* RMSNorm of M rows of D (model.RMSNorm on a CPU): one call instead of torch's seven operations,
 * each row alone (the same bits whatever M) */
void rms_norm_rows(const float *x, const float *weight, float *out, int64_t M, int64_t D, float eps) {
    for (int64_t r = 0; r < M; r++) rms_norm(x + r * D, weight, out + r * D, D, eps);
}

/* 8 cached numbers from element i on, as fp32 (a bf16 number is the top half of an fp32 one) */
typedef uint16_t u16x8 __attribute__((vector_size(16)));
static inline f32x8 load_cache8(const void *c, int bf16, int64_t i) {
    if (!bf16) return load_f32((const float *)c + i);
    u16x8 h; memcpy(&h, (const uint16_t *)c + i, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    f32x8 f; memcpy(&f, &w, sizeof f); return f;
}
static inline float load_cache1(const void *c, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

/* Slot s of a head's keys and values starts at element base + s Dh (a contiguous cache), or at base +
 * slot[s] where slot is given (a paged cache: the slots of a row's blocks, in table order) */
static inline int64_t slot_at(const int64_t *slot, int64_t base, int64_t s, int64_t Dh) {
    return base + (slot ? slot[s] : s * Dh);
}

/* out [Dh] = sum over slots s of scores[s] / total * v_s, each element summed over s in order. The
 * first Dh / 64 * 64 elements are summed 64 at a time in eight registers (an element kept in memory
 * waits on its own store every slot: measured 2x slower at Dh = 64), the rest in memory; the same
 * additions in the same order either way. */
#define PV_LANES 64
static void weigh_values(const float *scores, float total, const void *vc, int bf16, const int64_t *slot,
                         int64_t base, int64_t n, int64_t Dh, float *out) {
    const int64_t wide = Dh - Dh % 8, blocks = Dh / PV_LANES * PV_LANES;
    for (int64_t d0 = 0; d0 < blocks; d0 += PV_LANES) {
        f32x8 acc[PV_LANES / 8] = {{0}};
        for (int64_t s = 0; s < n; s++) {
            if (scores[s] == 0.0f) continue;
            float p = scores[s] / total;
            const int64_t row = slot_at(slot, base, s, Dh) + d0;
            for (int u = 0; u < PV_LANES / 8; u++) acc[u] = acc[u] + p * load_cache8(vc, bf16, row + 8 * u);
        }
        memcpy(out + d0, acc, sizeof acc);
    }
    for (int64_t d = blocks; d < Dh; d++) out[d] = 0.0f;
    if (blocks == Dh) return;
    for (int64_t s = 0; s < n; s++) {
        if (scores[s] == 0.0f) continue;
        float p = scores[s] / total;
        int64_t row = slot_at(slot, base, s, Dh);
        for (int64_t d = blocks; d < wide; d += 8) {
            f32x8 o = load_f32(out + d) + p * load_cache8(vc, bf16, row + d);
            memcpy(out + d, &o, sizeof o);
        }
        for (int64_t d = wide; d < Dh; d++) out[d] += p * load_cache1(vc, bf16, row + d);
    }
}

/* One query head against the first n slots of its key/value head: softmax(q k / sqrt(Dh) + mask) v,
 * fp32; mask is additive (0 or -inf per slot; NULL: none), and a -inf slot is skipped. Slot s at
 * slot_at(slot, base, s, Dh): the same additions in the same order, contiguous or paged. The dot
 * products run 8 lanes wide (a scalar sum would wait on each add: 4x slower at Dh = 64). */
void attend_head(const float *q, const void *kc, const void *vc, int bf16, const int64_t *slot, int64_t base,
                 int64_t n, int64_t Dh, const float *mask, float *scores, float *out) {
    const int64_t wide = Dh - Dh % 8;
    float scale = 1.0f / sqrtf((float)Dh), best = -INFINITY;
    for (int64_t s = 0; s < n; s++) {
        if (mask && mask[s] == -INFINITY) { scores[s] = -INFINITY; continue; }
        int64_t row = slot_at(slot, base, s, Dh);
        f32x8 acc = {0};
        for (int64_t d = 0; d < wide; d += 8) acc += load_f32(q + d) * load_cache8(kc, bf16, row + d);
        float dot = sum8(acc);
        for (int64_t d = wide; d < Dh; d++) dot += q[d] * load_cache1(kc, bf16, row + d);
        scores[s] = dot * scale + (mask ? mask[s] : 0.0f);
        best = scores[s] > best ? scores[s] : best;
    }
    float total;
    int64_t s = 0;
    f32x8 sums = {0};
    for (; s + 8 <= n; s += 8) {
        f32x8 e = exp8(load_f32(scores + s) - best);  /* -inf - best: below -87.3, 0 */
        memcpy(scores + s, &e, sizeof e);
        sums += e;
    }
    total = sum8(sums);
    for (; s < n; s++) { scores[s] = expf(scores[s] - best); total += scores[s]; }
    weigh_values(scores, total, vc, bf16, slot, base, n, Dh, out);
}

/* Attention of one new token per row (a decode step; attention.attend on a CPU): q [B, H, Dh],
 * k and v [B, Hkv, S, Dh], fp32 and contiguous; mask additive [S] for every row (mask_stride 0) or
 * [B, S]; out [B, H, Dh]. torch's SDPA spends ~40 us a call at batch 1 and ~170 at batch 8 on
 * these few thousand multiply-adds. Each (row, head) is computed alone, in the same order whatever
 * B: a row of a batch gets the bits it gets alone. Returns 0, or -1 without memory. */
int attend_decode(const float *q, const float *k, const float *v, const float *mask, int64_t mask_stride,
                  float *out, int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t Dh, int threads) {
    float *scores = malloc(sizeof(float) * (size_t)(B * H * S));
    if (!scores) return -1;
    const int64_t group = H / Hkv;
    int par = threads > 1 && B * H * S * Dh >= (1 << 16);  /* enough work to share out */
#ifdef _OPENMP
    par = par && !backing_off();  /* and no busy neighbour seen (the top of parallel.c) */
#endif
    #pragma omp parallel for num_threads(threads) if(par) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H;
        attend_head(q + bh * Dh, k, v, 0, NULL, (b * Hkv + h / group) * S * Dh, S, Dh, mask + b * mask_stride,
                    scores + bh * S, out + bh * Dh);
    }
    free(scores);
    return 0;
}
