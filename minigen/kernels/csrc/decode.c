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
 * activations and fp32 sums throughout (except into the products of Weight kinds 4 and 5, int8 / int4
 * codes that quantize their input rows to int8 per block of 32: numerics/int8_act.py, rows_s8.c),
 * the cache in fp32 or bf16 (rounded to nearest even, as
 * torch's .to(torch.bfloat16) rounds). One body (run_layers) runs M rows, each at its own position in
 * its own cache row or sequence; its entry points say which: decode_layers, a tensor
 * batch (B rows, one shared position), and verify_layers, a chunk of one sequence (T consecutive
 * positions, speculative decoding's verify); a third, decode_paged, runs the serving engine's rows,
 * each at its own position, in its paged pool read through block tables, and prefill_paged its
 * prompt chunks (any number of tokens, each a row). minigen/steps/fused.py builds the descriptions
 * and checks what applies. */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

typedef struct {
    int32_t kind;              /* 0 fp32, 1 bf16, 2 int8 codes, 3 int4 codes (fp32 activations); 4 int8 codes, */
                               /* 5 int4 codes, with int8 activations (numerics/int8_act.py: rows_s8.c) */
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
    float *logits;                      /* out: [rows, V] */
} Dims;

/* The description of W x for one row x of the activations, with x prepared as its kind's row loop
 * wants it (bf16: reordered; int4: the sums of x over each group and x reordered; kinds 4 and 5: x's
 * sums over each group, its block scales, its blocks quantized twice and its int8 codes, k / G + k / 32
 * + 11 min(8, k / 32) floats and k bytes: at most 21 k / 32 floats) in
 * `work`, which holds WORK_PER_ROW(k) floats; returns that row loop. */
#define WORK_PER_ROW(k) (2 * (k))
/* Attention shares its heads out among the threads from this many attended multiply-adds (slots times
 * H * Dh: SmolLM2 from 29 cached positions). Below it the other thread waits at the next product's
 * region while the calling thread attends alone. Measured on this course's Xeon (family 6 model 167,
 * 2 threads, int4 SmolLM2, positions 5 to 104, builds in turns in one process, median of 6 rounds):
 * 2^16 5.05 / 5.10 ms a token, 2^15 4.89, 2^14 4.85 / 4.93, 2^13 4.94, 2^12 5.01. */
#ifndef ATTEND_PAR_MIN
#define ATTEND_PAR_MIN (1 << 14)
#endif
static row_fn describe(const Weight *w, const float *x, float *work, Mat *m) {
    *m = (Mat){.W = w->W, .scales = w->scales, .mins = w->mins, .x = x, .k = w->k, .G = w->G, .n = w->n};
    if (w->kind == 0) return row_f32;
    if (w->kind == 1) {  /* x reordered for row_bf16, as gemv_bf16 does */
        prepare_bf16(x, w->k, work);
        m->x = work;
        return row_bf16;
    }
    if (w->kind == 2) return q8_rows(m);
    if (w->kind == 4 || w->kind == 5) {  /* int8 activations: x's codes, made once per product and row */
        float *dx = work + w->k / w->G;
        S8Residual *res = (S8Residual *)(dx + w->k / 32);
        int8_t *qx = (int8_t *)(dx + w->k / 32 + S8_RESIDUALS(w->k) * S8_RESIDUAL_FLOATS);
        m->nres = prepare_s8(x, w->k, w->G, qx, dx, work, res, w->kind == 5);
        m->xsum = work, m->dx = dx, m->qx = qx, m->res = res;
        return s8_rows(m, w->kind == 5);
    }
    m->xsum = work;  /* int4: work holds k / G sums and k reordered activations */
    if (prepare_q4(x, w->k, w->G, work, work + w->k / w->G)) m->xperm = work + w->k / w->G;
    return q4_rows(m);
}

/* Row i of W (rows m->per i .. where that loop takes several a call) against each of the M rows of x
 * that m[0..M-1] describe (m[0].M = M), through their row loop m->each: the row comes from memory
 * once and meets every row of x while it sits in L1, so a chunk of M tokens streams the weights once
 * rather than M times. Each output is that loop's own, so every row gets the bits it gets alone. The
 * dequantizing is done M times, so where that, not memory, sets the pace (int4 on Zen 4, measured in
 * an earlier session) this buys nothing; where memory does, it is most of the step (chapter 13's
 * verify cost). */
static void rows_each(const Mat *m, float *y, int64_t i) {
    for (int64_t r = 0; r < m[0].M; r++) m[r].each(&m[r], y + r * m[r].n, i);
}

/* RoPE's table for position pos: cos [Dh] and sin_signed [Dh], the angles fp32 pos * inv_freq (as
 * Model.forward), each half of the head sharing them (rotate-half pairing) */
static void rope_angles(const float *inv_freq, int64_t pos, int64_t Dh, float *cos, float *sin_signed) {
    for (int64_t i = 0; i < Dh / 2; i++) {
        float angle = (float)pos * inv_freq[i];
        cos[i] = cos[i + Dh / 2] = cosf(angle);
        sin_signed[i] = -sinf(angle);
        sin_signed[i + Dh / 2] = sinf(angle);
    }
}

/* Rotate one head in place: x * cos + roll(x, Dh/2) * sin_signed (model.apply_rope) */
static void rope(float *x, const float *cos, const float *sin_signed, int64_t Dh) {
    float tmp[1024];
    int64_t half = Dh / 2;
    for (int64_t i = 0; i < Dh; i++) tmp[i] = x[i];
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin_signed[i];
    for (int64_t i = half; i < Dh; i++) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin_signed[i];
}

/* Row `token` of the embedding -> x [D] in fp32 (a quantized row dequantized as numerics/weight_quant.py
 * does; kinds 4 and 5 are the codes of 2 and 3: a lookup has no activations to quantize) */
static void embed_row(const Weight *e, int64_t token, int round_bf16, float *x) {
    const int64_t D = e->k, row = token * D;
    for (int64_t j = 0; j < D; j++) {
        float v;
        if (e->kind == 0) v = ((const float *)e->W)[row + j];
        else if (e->kind == 1) v = bf16_to_f32(((const uint16_t *)e->W)[row + j]);
        else if (e->kind == 2 || e->kind == 4) v = (float)((const int8_t *)e->W)[row + j] * f16_to_f32(e->scales[(row + j) / e->G]);
        else {  /* int4: block of 32, code j in the low nibble of byte j, code j + 16 in the high one */
            uint8_t byte = ((const uint8_t *)e->W)[(row + j) / 32 * 16 + (j % 32) % 16];
            int code = (j % 32) < 16 ? byte & 0xF : byte >> 4;
            float q = (float)code * f16_to_f32(e->scales[(row + j) / e->G]);
            v = q + f16_to_f32(e->mins[(row + j) / e->G]);
        }
        x[j] = round_bf16 && e->kind >= 2 ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
}

/* y [B, n] = x [B, k] @ W^T, the weights streamed from memory once for all B rows: fp32 through the
 * several-row kernel (rows_batch.c); int8 and int4 in groups of 32 through their several-row loops
 * (rows_avx512.c: each row of codes widened once, then every row of x in the one-row loop's order);
 * the rest (int8 activations among them: kinds 4, 5) each row of W through its one-row loop B times
 * (rows_each; kinds 4 and 5 four rows of W a call in the AVX2 build, rows_s8.c), each row of x
 * quantized once by describe. Every kind gives each row of
 * x the bits it gets alone. An int8 or int4 row is paced by widening its codes and the multiply-adds,
 * not by memory (an fp32 row is paced by memory), so the several-row loops widen each row of codes
 * once for all B rows: a 5-token verify of SmolLM2 on 2 threads of a Xeon costs about 2.8 decode
 * steps in int8 and 3.3 in int4, fp32's about 1.0. work: B * WORK_PER_ROW(k) floats.
 * gemm (rows that are separate sequences: the serving engine's, decode_paged): B > 1 rows of int8 /
 * int4 codes run the GEMMs the eager step runs for them (kernels/cpu.py: gemm_q_s8.c with int8
 * activations, gemm_q.c without), which tile rows and channels rather than widening or quantizing a row
 * of codes per row of x: each row's bits are then the eager batch's, not a lone row's. Returns 0, or -1
 * where a GEMM found no memory for its buffers. */
static int product(const Weight *w, const float *x, float *y, int64_t B, int threads, float *work, int gemm) {
    if (B > 1 && w->kind == 0) {
        Mat m = {.W = w->W, .x = x, .k = w->k, .M = B, .n = w->n};
        gemm_rows(&m, y, threads);
        return 0;
    }
    if (gemm && B > 1 && (w->kind == 4 || w->kind == 5))
        return gemm_q_s8(w->W, w->scales, w->mins, w->kind == 5 ? 4 : 8, x, y, B, w->n, w->k, w->G, threads);
    if (gemm && B > 1 && (w->kind == 2 || w->kind == 3))
        return gemm_q(w->W, w->scales, w->mins, x, y, B, w->n, w->k, w->G, threads);
    if (B > DECODE_MAX_ROWS) {  /* a prompt's rows through the row loops: DECODE_MAX_ROWS at a time */
        int failed = 0;
        for (int64_t r = 0; r < B; r += DECODE_MAX_ROWS)
            failed |= product(w, x + r * w->k, y + r * w->n, B - r < DECODE_MAX_ROWS ? B - r : DECODE_MAX_ROWS,
                              threads, work, gemm);
        return failed;
    }
    Mat m[DECODE_MAX_ROWS];
    for (int64_t b = 0; b < B; b++) m[b].each = describe(w, x + b * w->k, work + b * WORK_PER_ROW(w->k), &m[b]);
    const int64_t calls = row_calls(&m[0], w->n);
    if (B == 1) { gemv(m[0].each, &m[0], y, calls, threads); return 0; }
    m[0].M = B;
    row_fn several = several_rows(&m[0]);
    if (several) gemv(several, m, y, (w->n + SEVERAL_W - 1) / SEVERAL_W, threads);  /* SEVERAL_W rows of W a call */
    else gemv(rows_each, m, y, calls, threads);
    return 0;
}

/* Where each row's keys and values sit in a layer's cache: a contiguous cache [B, Hkv, S, Dh], row r in
 * cache row row_of[r] (tables NULL), or the paged pool [N, bs, Hkv, Dh] read through block tables, row
 * r's logical block j (positions j bs .. j bs + bs - 1) in physical block tables[t * stride + j], t its
 * sequence's table: seq_of[r] (a prompt's tokens, several rows of one sequence), or r where seq_of is NULL */
typedef struct {
    const int64_t *row_of;
    const int64_t *tables, *seq_of;
    int64_t stride, block_size;
} Where;

/* The table row r reads its slots through: its sequence's (paged) or its cache row's (contiguous) */
static inline int64_t owner(const Where *w, int paged, int64_t r) {
    return paged ? (w->seq_of ? w->seq_of[r] : r) : w->row_of[r];
}

/* M rows through every layer, embedding to logits. Row r is token tokens[r] at position pos_of[r],
 * its keys and values where `where` says: x [M, D] gets the tokens' embeddings, then each layer's output in turn;
 * RoPE's angles of each row's position are worked out here (fp32 pos * inv_freq, as Model.forward);
 * every row's keys and values are written at its slot before any row attends, so a row sees the
 * rows before it in the same call (a chunk of one sequence is causal), and attends to slots
 * 0..its own position; then the final norm and the head write d->logits [n_out, V], the rows out_rows
 * lists in its order (NULL: every row, n_out = M). Each row's slots are
 * worked out once a call (slot: the element where slot s of its first key/value head starts; head j
 * at j times head_stride after it), the same for every layer. Returns 0, or -1 without memory for the
 * work buffers (or for Dh past 1024).
 * The norm and the head are here, not in torch, for what surrounds them: after a step has streamed
 * the weights through the caches, torch's first small operations run cold (~0.2 ms for a norm that
 * takes 8 us in a loop), a few percent of an int4 step. */
static int run_layers(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t M,
                      float *x, const int64_t *pos_of, const Where *where, const int64_t *out_rows, int64_t n_out) {
    const int64_t D = d->D, H = d->H, Hkv = d->Hkv, Dh = d->Dh, F = d->F, S = d->S;
    const int64_t qkv_n = (H + 2 * Hkv) * Dh, widest = D > F ? D : F, row_cache = Hkv * S * Dh;
    const int paged = where->tables != NULL;
    const int64_t head_stride = paged ? Dh : S * Dh, bs = where->block_size;
    if (M < 1 || Dh > 1024 || n_out < 1 || n_out > M) return -1;
    int64_t last = 0, attended = 0;  /* the furthest position, and the slots all rows attend to */
    for (int64_t r = 0; r < M; r++) {
        last = pos_of[r] > last ? pos_of[r] : last;
        attended += pos_of[r] + 1;
    }
    const int64_t span = last + 1;  /* room for the longest row's slots */
    /* each row's slots come from its table (paged: its sequence's; contiguous: its cache row's), worked
     * out once per table for every slot up to span (a shorter sequence's table is padded with block 0,
     * whose slots it never reads) */
    int64_t owners = 1;
    for (int64_t r = 0; r < M; r++) {
        const int64_t t = owner(where, paged, r);
        owners = t + 1 > owners ? t + 1 : owners;
    }
    const int64_t nt = d->threads > 1 ? d->threads : 1, wrows = M < DECODE_MAX_ROWS ? M : DECODE_MAX_ROWS;
    float *buf = malloc(sizeof(float) * (size_t)(M * (D + qkv_n + H * Dh + D + 2 * F + 2 * Dh) + nt * span
                                                 + wrows * WORK_PER_ROW(widest)));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)(owners * span));
    if (!buf || !slots) { free(buf), free(slots); return -1; }
    for (int64_t t = 0; t < owners; t++)
        for (int64_t s = 0; s < span; s++)
            slots[t * span + s] = paged ? (where->tables[t * where->stride + s / bs] * bs + s % bs) * Hkv * Dh
                                        : t * row_cache + s * Dh;
    int failed = 0;
    float *h = buf, *qkv = h + M * D, *att = qkv + M * qkv_n, *o = att + M * H * Dh, *gu = o + M * D,
          *cos = gu + M * 2 * F, *sin_signed = cos + M * Dh, *scores = sin_signed + M * Dh,  /* a thread's: span */
          *work = scores + nt * span;
    for (int64_t r = 0; r < M; r++) rope_angles(d->inv_freq, pos_of[r], Dh, cos + r * Dh, sin_signed + r * Dh);
    for (int64_t r = 0; r < M; r++) embed_row(&d->embed, tokens[r], d->embed_bf16, x + r * D);
    const int group = (int)(H / Hkv), bf16 = d->cache_bf16;
    for (int64_t l = 0; l < n_layers; l++) {
        const Layer *L = &layers[l];
        for (int64_t r = 0; r < M; r++) rms_norm(x + r * D, L->attn_norm, h + r * D, D, d->eps);
        failed |= product(&L->wqkv, h, qkv, M, d->threads, work, paged);
        for (int64_t r = 0; r < M; r++) {
            float *q = qkv + r * qkv_n;
            if (L->bqkv) for (int64_t i = 0; i < qkv_n; i++) q[i] += L->bqkv[i];
            for (int64_t hd = 0; hd < H + Hkv; hd++)  /* q and k heads */
                rope(q + hd * Dh, cos + r * Dh, sin_signed + r * Dh, Dh);
            const float *k_new = q + H * Dh, *v_new = k_new + Hkv * Dh;
            for (int64_t j = 0; j < Hkv; j++) {  /* write row r's slot: its position, in its cache row or block */
                int64_t at = slots[owner(where, paged, r) * span + pos_of[r]] + j * head_stride;
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
        int par = d->threads > 1 && attended * H * Dh >= ATTEND_PAR_MIN;
#ifdef _OPENMP
        par = par && !backing_off();
#endif
        #pragma omp parallel for num_threads(d->threads) if(par) schedule(static)
        for (int64_t rh = 0; rh < M * H; rh++) {  /* row rh / H, query head rh % H */
            const int64_t r = rh / H, hd = rh % H;
#ifdef _OPENMP
            float *mine = scores + (par ? omp_get_thread_num() : 0) * span;
#else
            float *mine = scores;
#endif
            attend_head(qkv + r * qkv_n + hd * Dh, L->kc, L->vc, bf16, slots + owner(where, paged, r) * span,
                        (hd / group) * head_stride, pos_of[r] + 1, Dh, NULL, mine, att + rh * Dh);
        }
        failed |= product(&L->wo, att, o, M, d->threads, work, paged);
        for (int64_t i = 0; i < M * D; i++) x[i] += o[i];
        for (int64_t r = 0; r < M; r++) rms_norm(x + r * D, L->mlp_norm, h + r * D, D, d->eps);
        failed |= product(&L->wgu, h, gu, M, d->threads, work, paged);
        for (int64_t r = 0; r < M; r++) {  /* silu(gate) * up, into the first half of the row's [2F] */
            float *g_row = gu + r * 2 * F;
            int64_t i = 0;
            for (; i + 8 <= F; i += 8) {
                f32x8 g = load_f32(g_row + i), a = g / (1.0f + exp8(-g)) * load_f32(g_row + F + i);
                memcpy(g_row + i, &a, sizeof a);
            }
            for (; i < F; i++) g_row[i] = g_row[i] / (1.0f + expf(-g_row[i])) * g_row[F + i];
            /* pack the rows as [M, F]: row r moves down to r * F, over nothing a later row still holds */
            if (r > 0) memmove(gu + r * F, g_row, sizeof(float) * (size_t)F);
        }
        failed |= product(&L->wdown, gu, o, M, d->threads, work, paged);
        for (int64_t i = 0; i < M * D; i++) x[i] += o[i];
    }
    for (int64_t o = 0; o < n_out; o++) rms_norm(x + (out_rows ? out_rows[o] : o) * D, d->final_norm, h + o * D, D, d->eps);
    failed |= product(&d->head, h, d->logits, n_out, d->threads, work, paged);
    free(buf), free(slots);
    return failed ? -1 : 0;
}

/* A decode token for each of B rows of a tensor batch, all at position pos: row b is cache row b.
 * x [B, D] is the residual stream's room; logits to d->logits [B, V]. */
int decode_layers(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t B,
                  float *x, int64_t pos) {
    int64_t pos_of[DECODE_MAX_ROWS], cache_row[DECODE_MAX_ROWS];
    if (B < 1 || B > DECODE_MAX_ROWS) return -1;
    for (int64_t b = 0; b < B; b++) { pos_of[b] = pos; cache_row[b] = b; }
    const Where where = {.row_of = cache_row};
    return run_layers(layers, n_layers, d, tokens, B, x, pos_of, &where, NULL, B);
}

/* T tokens of one sequence (cache row 0) at positions pos..pos + T - 1: speculative decoding's
 * check of T - 1 proposals after the last accepted token, one forward whose products read each
 * weight once for all T (see product). Token t attends to slots 0..pos + t, the
 * chunk's earlier tokens included. x [T, D]; logits to d->logits [T, V], one row per position. */
int verify_layers(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t T,
                  float *x, int64_t pos) {
    int64_t pos_of[DECODE_MAX_ROWS], cache_row[DECODE_MAX_ROWS];
    if (T < 1 || T > DECODE_MAX_ROWS) return -1;
    for (int64_t t = 0; t < T; t++) { pos_of[t] = pos + t; cache_row[t] = 0; }
    const Where where = {.row_of = cache_row};
    return run_layers(layers, n_layers, d, tokens, T, x, pos_of, &where, NULL, T);
}

/* A decode token for each of B sequences of the serving engine's paged cache, each at its own position
 * pos_of[b]: every layer's kc / vc is its pool [N, bs, Hkv, Dh] (d->S unused), and row b's logical
 * block j is physical block tables[b * stride + j], which the engine's scheduler gave it before the
 * call (positions 0..pos_of[b] each in a block: steps/fused.py checks). The rows are separate sequences,
 * so B > 1 rows of codes run the batch GEMMs (product). x [B, D]; logits to d->logits [B, V]. */
int decode_paged(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t B,
                 float *x, const int64_t *pos_of, const int64_t *tables, int64_t stride, int64_t block_size) {
    if (B < 1 || B > DECODE_MAX_ROWS || block_size < 1) return -1;
    const Where where = {.tables = tables, .stride = stride, .block_size = block_size};
    return run_layers(layers, n_layers, d, tokens, B, x, pos_of, &where, NULL, B);
}

/* The serving engine's prompt chunks in one call: M tokens of several sequences, token r of sequence
 * seq_of[r] (its table: tables[seq_of[r] * stride ..]) at position pos_of[r], a sequence's tokens at
 * consecutive positions in order (every row's keys and values are written before any row attends, so a
 * chunk is causal, as verify_layers'). No padding: the rows are the tokens. Only the rows out_rows lists
 * (each chunk's last token) go through the final norm and the head: d->logits [n_out, V]. x [M, D]. */
int prefill_paged(const Layer *layers, int64_t n_layers, const Dims *d, const int64_t *tokens, int64_t M,
                  float *x, const int64_t *pos_of, const int64_t *seq_of, const int64_t *tables, int64_t stride,
                  int64_t block_size, const int64_t *out_rows, int64_t n_out) {
    if (block_size < 1) return -1;
    const Where where = {.tables = tables, .seq_of = seq_of, .stride = stride, .block_size = block_size};
    return run_layers(layers, n_layers, d, tokens, M, x, pos_of, &where, out_rows, n_out);
}
