/* A whole decode step in C (fused_decode=True).
 *
 * At batch 1 a decoder layer is four matrix-vector products and a dozen small operations: two
 * norms, RoPE, the cache write, attention over the cached tokens, SiLU, two residual adds. In
 * torch each small operation is a dispatch of several microseconds around almost no arithmetic,
 * ~150 of them a layer with their views and conversions: 6 to 9 ms of a 25 ms SmolLM2 step here,
 * which does not shrink when the weights do. `decode_layers` runs every layer of one token in C
 * (what llama.cpp does): the products through the row kernels (one parallel region each, parallel.c's gemv), the
 * small operations in between on the calling thread, attention over a head per thread once the
 * context is long enough to pay for a parallel region. Llama family only: RMSNorm, RoPE in the
 * rotate-half pairing, SwiGLU, grouped-query attention, optional q/k/v biases (Qwen2); fp32
 * activations and fp32 sums throughout, the cache in fp32 or bf16 (rounded to nearest even, as
 * torch's .to(torch.bfloat16) rounds). minigen/steps/fused.py builds the descriptions and checks
 * what applies. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int32_t kind;              /* 0 fp32, 1 bf16, 2 int8 codes, 3 int4 codes */
    int32_t pad;
    const void *W;
    const uint16_t *scales, *mins;
    int64_t n, k, G;
} Weight;

typedef struct {
    const float *attn_norm, *mlp_norm;  /* [D] fp32 */
    Weight wqkv, wo, wgu, wdown;
    const float *bqkv;                  /* [(H + 2 Hkv) Dh] or NULL */
    void *kc, *vc;                      /* this layer's cache [B, Hkv, S, Dh] */
} Layer;

typedef struct {
    int64_t D, H, Hkv, Dh, F, S;        /* S: slots allocated per head in the cache */
    int32_t cache_bf16, threads;
    float eps;
    Weight embed;                       /* the token embedding [V, D], any kind */
    int32_t embed_bf16;                 /* a quantized embedding of a bf16 model: rows rounded to bf16 */
    const float *inv_freq;              /* RoPE's inverse frequencies [Dh / 2], fp32 */
    const float *final_norm;            /* the last RMSNorm's weight [D], fp32 */
    Weight head;                        /* the output head [V, D], any kind */
    float *logits;                      /* out: [V] */
} Dims;

/* y[n] = W x for any kind above (the bf16 and int4 kernels want x prepared, done here) */
static void matvec_any(const Weight *w, const float *x, float *y, int threads, float *work) {
    Mat m = {.W = w->W, .scales = w->scales, .mins = w->mins, .x = x, .k = w->k, .G = w->G};
    if (w->kind == 0) { gemv(row_f32, &m, y, w->n, threads); return; }
    if (w->kind == 1) {  /* x reordered for row_bf16, as gemv_bf16 does */
        prepare_bf16(x, w->k, work);
        m.x = work;
        gemv(row_bf16, &m, y, w->n, threads);
        return;
    }
    if (w->kind == 2) { gemv(q8_rows(&m), &m, y, w->n, threads); return; }
    m.xsum = work;  /* int4: work holds k / G sums and k reordered activations */
    if (prepare_q4(x, w->k, w->G, work, work + w->k / w->G)) m.xperm = work + w->k / w->G;
    gemv(q4_rows(&m), &m, y, w->n, threads);
}

/* Rotate one head in place: x * cos + roll(x, Dh/2) * sin_signed (model.apply_rope) */
static void rope(float *x, const float *cos, const float *sin_signed, int64_t Dh) {
    float tmp[1024];
    int64_t half = Dh / 2;
    for (int64_t i = 0; i < Dh; i++) tmp[i] = x[i];
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin_signed[i];
    for (int64_t i = half; i < Dh; i++) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin_signed[i];
}

/* Row `token` of the embedding -> x [D] in fp32 (a quantized row dequantized as numerics/weight_quant.py does) */
static void embed_row(const Weight *e, int64_t token, int round_bf16, float *x) {
    const int64_t D = e->k, row = token * D;
    for (int64_t j = 0; j < D; j++) {
        float v;
        if (e->kind == 0) v = ((const float *)e->W)[row + j];
        else if (e->kind == 1) v = bf16_to_f32(((const uint16_t *)e->W)[row + j]);
        else if (e->kind == 2) v = (float)((const int8_t *)e->W)[row + j] * f16_to_f32(e->scales[(row + j) / e->G]);
        else {  /* int4: block of 32, code j in the low nibble of byte j, code j + 16 in the high one */
            uint8_t byte = ((const uint8_t *)e->W)[(row + j) / 32 * 16 + (j % 32) % 16];
            int code = (j % 32) < 16 ? byte & 0xF : byte >> 4;
            float q = (float)code * f16_to_f32(e->scales[(row + j) / e->G]);
            v = q + f16_to_f32(e->mins[(row + j) / e->G]);
        }
        x[j] = round_bf16 && e->kind >= 2 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
}

/* y [B, n] = x [B, k] @ W^T: fp32 weights meet every row in one pass (the several-row kernel, so
 * the weights stream from memory once for the batch), the other kinds one row at a time */
static void product(const Weight *w, const float *x, float *y, int64_t B, int threads, float *work) {
    if (B > 1 && w->kind == 0) {
        Mat m = {.W = w->W, .x = x, .k = w->k, .M = B, .n = w->n};
        gemm_rows(&m, y, threads);
        return;
    }
    for (int64_t b = 0; b < B; b++) matvec_any(w, x + b * w->k, y + b * w->n, threads, work);
}

/* One decode token for each of B rows at the same position pos, embedding to logits: x [B, D] gets
 * the tokens' embeddings, then each layer's output in turn; RoPE's angles for pos are worked out
 * here (fp32 pos * inv_freq, as Model.forward), and pos's slot is written in every layer's cache
 * (row b at b * Hkv * S * Dh); then the final norm and the head write d->logits [B, V]. Returns 0,
 * or -1 without memory for the work buffers (or for B past DECODE_MAX_ROWS or Dh past 1024).
 * The norm and the head are here, not in torch, for what surrounds them: after a step has streamed
 * the weights through the caches, torch's first small operations run cold (~0.2 ms for a norm that
 * takes 8 us in a loop), a few percent of an int4 step. */
int decode_layers(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t B,
                  float *x, int64_t pos) {
    const int64_t D = d->D, H = d->H, Hkv = d->Hkv, Dh = d->Dh, F = d->F, S = d->S;
    const int64_t qkv_n = (H + 2 * Hkv) * Dh, widest = D > F ? D : F, row_cache = Hkv * S * Dh;
    if (B < 1 || B > DECODE_MAX_ROWS || Dh > 1024) return -1;
    float *buf = malloc(sizeof(float) * (size_t)(B * (D + qkv_n + H * Dh + D + 2 * F + H * (pos + 1)) + 2 * widest));
    if (!buf) return -1;
    float cos[1024], sin_signed[1024];
    for (int64_t i = 0; i < Dh / 2; i++) {
        float angle = (float)pos * d->inv_freq[i];
        cos[i] = cos[i + Dh / 2] = cosf(angle);
        sin_signed[i] = -sinf(angle);
        sin_signed[i + Dh / 2] = sinf(angle);
    }
    for (int64_t b = 0; b < B; b++) embed_row(&d->embed, tokens[b], d->embed_bf16, x + b * D);
    float *h = buf, *qkv = h + B * D, *att = qkv + B * qkv_n, *o = att + B * H * Dh, *gu = o + B * D,
          *scores = gu + B * 2 * F, *work = scores + B * H * (pos + 1);
    const int group = (int)(H / Hkv), bf16 = d->cache_bf16;
    for (int64_t l = 0; l < n_layers; l++) {
        const Layer *L = &layers[l];
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, L->attn_norm, h + b * D, D, d->eps);
        product(&L->wqkv, h, qkv, B, d->threads, work);
        for (int64_t b = 0; b < B; b++) {
            float *q = qkv + b * qkv_n;
            if (L->bqkv) for (int64_t i = 0; i < qkv_n; i++) q[i] += L->bqkv[i];
            for (int64_t hd = 0; hd < H + Hkv; hd++) rope(q + hd * Dh, cos, sin_signed, Dh);  /* q and k heads */
            const float *k_new = q + H * Dh, *v_new = k_new + Hkv * Dh;
            for (int64_t j = 0; j < Hkv; j++) {  /* write this position's slot of row b */
                int64_t at = b * row_cache + (j * S + pos) * Dh;
                for (int64_t i = 0; i < Dh; i++) {
                    if (bf16) {
                        ((uint16_t *)L->kc)[at + i] = f32_to_bf16(k_new[j * Dh + i]);
                        ((uint16_t *)L->vc)[at + i] = f32_to_bf16(v_new[j * Dh + i]);
                    } else {
                        ((float *)L->kc)[at + i] = k_new[j * Dh + i];
                        ((float *)L->vc)[at + i] = v_new[j * Dh + i];
                    }
                }
            }
        }
        /* long enough to share out, and the products' regions have not backed off to one thread (a busy
         * neighbour: see the top of parallel.c) */
        int par = d->threads > 1 && B * (pos + 1) * H * Dh >= (1 << 16);
#ifdef _OPENMP
        par = par && !backing_off();
#endif
        #pragma omp parallel for num_threads(d->threads) if(par) schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {  /* row bh / H, query head bh % H */
            const int64_t b = bh / H, hd = bh % H;
            attend_head(qkv + b * qkv_n + hd * Dh, L->kc, L->vc, bf16, b * row_cache + (hd / group) * S * Dh,
                        pos + 1, Dh, NULL, scores + bh * (pos + 1), att + bh * Dh);
        }
        product(&L->wo, att, o, B, d->threads, work);
        for (int64_t i = 0; i < B * D; i++) x[i] += o[i];
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, L->mlp_norm, h + b * D, D, d->eps);
        product(&L->wgu, h, gu, B, d->threads, work);
        for (int64_t b = 0; b < B; b++) {  /* silu(gate) * up, into the first half of the row's [2F] */
            float *g_row = gu + b * 2 * F;
            int64_t i = 0;
            for (; i + 8 <= F; i += 8) {
                f32x8 g = load_f32(g_row + i), a = g / (1.0f + exp8(-g)) * load_f32(g_row + F + i);
                memcpy(g_row + i, &a, sizeof a);
            }
            for (; i < F; i++) g_row[i] = g_row[i] / (1.0f + expf(-g_row[i])) * g_row[F + i];
            /* pack the rows as [B, F]: row b moves down to b * F, over nothing a later row still holds */
            if (b > 0) memmove(gu + b * F, g_row, sizeof(float) * (size_t)F);
        }
        product(&L->wdown, gu, o, B, d->threads, work);
        for (int64_t i = 0; i < B * D; i++) x[i] += o[i];
    }
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * D, d->final_norm, h + b * D, D, d->eps);
    product(&d->head, h, d->logits, B, d->threads, work);
    free(buf);
    return 0;
}
