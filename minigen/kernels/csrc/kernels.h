/* Matrix-vector products for decoding at batch 1: y[n] = W[n, k] @ x[k].
 *
 * A decode step multiplies one activation row by every weight matrix of the model, so its time is
 * the time to stream the weights from memory. torch's fp32 matrix-vector path reaches about half
 * of this course's CPU read bandwidth; this loop reaches about 80% of it. The whole trick:
 *   - rows of W are contiguous (nn.Linear's [out, in] layout), so each thread reads its own rows
 *     one after the other: one sequential stream, which the hardware prefetcher follows best (four
 *     rows side by side, four streams of 1 to 2 KB, measured 1.3 to 1.5x slower here);
 *   - four sums of 8 lanes per row, so four multiply-add chains run side by side;
 *   - 8-wide vectors through GCC/Clang vector extensions (one AVX2 register; two NEON ones on ARM);
 *   - OpenMP splits the rows over the threads torch itself uses (same runtime, no second pool).
 * Each output is summed by one thread in a fixed order, so results do not depend on the thread
 * count. minigen/kernels/build.py builds every .c file of this folder into one library, once per
 * machine, with `cc -O3 -march=native -fopenmp` (and -mprefer-vector-width=256 on x86), or without
 * -fopenmp (single-threaded) where the compiler has no OpenMP.
 *
 * The files, one concern each:
 *   vec.h          8-wide vectors and their helpers (static inline, so they inline everywhere);
 *   kernels.h      this header: the matrix description (Mat) and what the files share;
 *   rows.c         one output row of each weight format, the portable 8-wide loops;
 *   rows_avx512.c  the int8 and int4 rows 16 lanes wide, built where the compiler targets AVX-512;
 *   rows_batch.c   fp32 rows against several rows of x at once (gemm_f32), 8 and 16 lanes wide;
 *   parallel.c     the parallel region over rows, its back-off on a busy machine, and the
 *                  products' entry points (gemv_f32, gemm_f32, gemv_bf16, gemv_q8, gemv_q4);
 *   attend.c       RMSNorm and one-query attention (rms_norm_rows, attend_decode);
 *   decode.c       a whole decode step in C (decode_layers), and a chunk of one sequence (verify_layers).
 *   dequant.c      int8 / int4 codes to fp32 rows at a time: a bf16 prompt's tiles (dequant_rows), gemm_q's panels;
 *   gemm_q.c       a prompt's products with int8 / int4 codes in one call, a panel of rows at a time (gemm_q).
 *   quantize.c     a prompt's activations as int8 codes with a scale per row, for the int8 GEMMs
 *                  (quantize_rows_s8, prefill_precision="int8");
 *   gemm_s8.c      int8 codes times int8 codes, exact int32 sums through vpdpbusd (AVX512-VNNI,
 *                  AVX-VNNI) or its exact emulation: a prompt's int8 products (gemm_s8, gemm_s8_variant).
 *   rows_s8.c      one row of int8 / int4 codes against int8 activations in blocks of 32 (a decode step
 *                  under numerics/int8_act.py: gemv_q8_s8, gemv_q4_s8, rows_s8_variant);
 *   gemm_q_s8.c    a prompt's products with int8 / int4 codes and int8 activations, a panel of codes
 *                  repacked in each thread's cache at a time (gemm_q_s8, gemm_q_s8_variant).
 * The entry points named above and gemv_late_regions are the library's interface: kernels/build.py
 * binds them by name through ctypes, kernels/cpu.py and steps/fused.py call them. Everything the
 * files share besides them is declared below as INTERNAL (hidden: not exported from the library,
 * and called directly rather than through the library's symbol table).
 */
#ifndef MINIGEN_KERNELS_H
#define MINIGEN_KERNELS_H

#include <stdint.h>

#include "vec.h"

#define INTERNAL __attribute__((visibility("hidden")))

typedef struct Mat Mat;
typedef struct S8Residual S8Residual;  /* rows_s8.c's blocks quantized twice (below) */
/* one output row of a product: y[i] = W[i, :] @ x */
typedef void (*row_fn)(const Mat *m, float *y, int64_t i);

/* One matrix-vector product: y = W @ x, W [n, k] in the format its row function reads, x [k] fp32. */
struct Mat {
    const void *W;             /* fp32 or bf16 weights, or int8 / int4 codes */
    const uint16_t *scales;    /* int8 / int4: fp16 scale of each group [n, k / G] */
    const uint16_t *mins;      /* int4: fp16 minimum of each group [n, k / G] */
    const float *x;            /* fp32 activations [k] (bf16: reordered, see gemv_bf16) */
    const float *xsum;         /* int4: the sum of x over each group [k / G] */
    int64_t k, G;
    int64_t M, n;              /* gemm_f32: rows of x (x [M, k], y [M, n]); 0 for one vector */
    const float *xperm;        /* int4 with AVX-512 and G = 32: x reordered for row_q4_perm, or NULL */
    row_fn each;               /* decode.c's several rows of x through a one-row loop: that loop */
    float *work;               /* gemm_q: one panel of widened weights per thread */
    const int8_t *qx;          /* int8 activations (rows_s8.c): x's codes [k], blocks of 32 */
    const float *dx;           /* int8 activations: the scale of each block of 32 [k / 32] (xsum as int4's) */
    const S8Residual *res;     /* int8 activations: the blocks quantized twice, in block order [nres] */
    int64_t nres;              /* how many (0 to S8_RESIDUALS) */
    int64_t per;               /* rows of W one call of the row function writes (call p: rows per p ..; */
                               /* rows_s8.c's four-row int8-activation loops: 4); 0 or 1: one, row i */
};  /* filled by name, {.W = W, .x = x, .k = k}: a field left out is 0 or NULL */

/* the calls of m's row function that write n rows of W (m->per rows a call) */
static inline int64_t row_calls(const Mat *m, int64_t n) { return m->per > 1 ? (n + m->per - 1) / m->per : n; }

/* rows.c: the portable row loops */
INTERNAL void row_f32(const Mat *m, float *y, int64_t i);
INTERNAL void row_bf16(const Mat *m, float *y, int64_t i);
INTERNAL void prepare_bf16(const float *x, int64_t k, float *xp);
INTERNAL void row_q8(const Mat *m, float *y, int64_t i);
INTERNAL void row_q4(const Mat *m, float *y, int64_t i);
INTERNAL int prepare_q4(const float *x, int64_t k, int64_t G, float *xsum, float *xperm);
INTERNAL row_fn q8_rows(const Mat *m);
INTERNAL row_fn q4_rows(const Mat *m);

#ifdef __AVX512F__
/* rows_avx512.c: the int8 and int4 rows 16 lanes wide */
#define MAX_ROW_GROUPS 1024  /* k / G of the wide rows' arrays of scales; a longer row takes the 8-wide loop */
INTERNAL void row_q8_wide(const Mat *m, float *y, int64_t i);
INTERNAL void row_q4_wide(const Mat *m, float *y, int64_t i);
INTERNAL void row_q4_perm(const Mat *m, float *y, int64_t i);
/* the same rows against several rows of x (decode.c's several-row product), the codes widened once */
#define MAX_WIDE_K 8192  /* k of the several-row loops' widened codes on the stack; a longer row: one row at a time */
INTERNAL void rows_q8_wide(const Mat *m, float *y, int64_t p);
INTERNAL void rows_q4_perm(const Mat *m, float *y, int64_t p);
#endif
/* rows of W each call of the several-row loops takes (unit p: rows SEVERAL_W p ..): a vector of x,
 * loaded once, meets them all (rows_avx512.c says why; 2 is slower, 4 and 6 alike, 8 slower again) */
#ifndef SEVERAL_W
#define SEVERAL_W 6
#endif
/* rows.c: the several-row loop of m->each (the one-row loop of m, a row of x), or NULL for none; it
 * takes SEVERAL_W rows of W a call */
INTERNAL row_fn several_rows(const Mat *m);

/* rows_s8.c: int8 / int4 codes against int8 activations (numerics/int8_act.py): x -> its codes qx [k],
 * block scales dx [k / 32], group sums xsum [k / G] and its blocks quantized twice res [at most
 * S8_RESIDUALS(k)] (quantize_activations' bits; returns how many blocks res holds), then one row; q4: qx
 * for row_q4_s8, in the order its loop reads (the AVX2 build's pairs of blocks, rows_s8.c: pair_order) */
#define S8_RESIDUAL_RATIO 2.0f  /* int8_act.RESIDUAL_RATIO: a block's largest |x| over its second largest */
#define S8_RESIDUAL_BLOCKS 8    /* int8_act.RESIDUAL_BLOCKS: at most this many blocks a row */
#define S8_RESIDUALS(k) ((k) / 32 < S8_RESIDUAL_BLOCKS ? (k) / 32 : S8_RESIDUAL_BLOCKS)
/* one block quantized twice: what its codes miss, x - dx qx, as codes of its own (44 bytes, 4-aligned:
 * it lives in float buffers) */
struct S8Residual {
    int8_t rx[32];   /* the residual's codes */
    float rdx;       /* their scale */
    int32_t b, g;    /* the block, and its weight group b / (G / 32): no division in the rows' loops */
};
#define S8_RESIDUAL_FLOATS (sizeof(S8Residual) / sizeof(float))
INTERNAL int64_t prepare_s8(const float *x, int64_t k, int64_t G, int8_t *qx, float *dx, float *xsum, S8Residual *res,
                            int q4);
INTERNAL void row_q8_s8(const Mat *m, float *y, int64_t i);
INTERNAL void row_q4_s8(const Mat *m, float *y, int64_t i);
/* this build's loop for int4 (q4) or int8 codes: row_q4_s8 / row_q8_s8, or four rows a call (m->per = 4)
 * where AVX2 has no VNNI */
INTERNAL row_fn s8_rows(Mat *m, int q4);

/* rows_batch.c: y [M, n] = x [M, k] @ W [n, k]^T, fp32, through gemv (gemm_f32) */
INTERNAL void gemm_rows(const Mat *m, float *y, int threads);

/* dequant.c: row i of int8 / int4 codes as fp32, weights j..j+15 to out + (j / 16) * step */
INTERNAL void widen_row_q8(const Mat *m, int64_t i, float *out, int64_t step);
INTERNAL void widen_row_q4(const Mat *m, int64_t i, float *out, int64_t step);

/* gemm_q.c and gemm_q_s8.c: a batch's products with int8 / int4 codes (entry points; decode.c's paged
 * step calls them for the serving engine's rows) */
int gemm_q(const void *codes, const uint16_t *scales, const uint16_t *mins, const float *x, float *y, int64_t M,
           int64_t n, int64_t k, int64_t G, int threads);
int gemm_q_s8(const void *codes, const uint16_t *scales, const uint16_t *mins, int bits, const float *x, float *y,
              int64_t M, int64_t n, int64_t k, int64_t G, int threads);

/* decode.c: the rows one fused decode step or verify chunk takes (cpu.MAX_ROWS: where the several-row
 * kernel stops paying; steps/fused.py refuses more) */
#define DECODE_MAX_ROWS 16

/* parallel.c: y [n] = row(m, y, i) for i < n, on `threads` threads or, backing off, on one */
INTERNAL void gemv(row_fn row, const Mat *m, float *y, int64_t n, int threads);
/* the same with min_rows a thread (gemv: 16 rows), for row functions that do much more than a row */
INTERNAL void parallel_rows(row_fn row, const Mat *m, float *y, int64_t n, int threads, int64_t min_rows);
#ifdef _OPENMP
/* whether the products' regions are backing off to one thread (a busy neighbour: see the top of
 * parallel.c); attention's parallel loops follow them */
INTERNAL int backing_off(void);
#endif

/* quantize.c: one row of x [k] (times keep [k], or NULL) as int8 codes q [k] -> its scale (quantize_rows_s8's) */
INTERNAL float quantize_row(const float *x, const float *keep, int8_t *q, int64_t k);

/* attend.c: one RMSNorm row, and one query head against its cached keys and values */
INTERNAL void rms_norm(const float *x, const float *weight, float *out, int64_t D, float eps);
INTERNAL void attend_head(const float *q, const void *kc, const void *vc, int bf16, const int64_t *slot,
                          int64_t base, int64_t n, int64_t Dh, const float *mask, float *scores, float *out);

#endif
