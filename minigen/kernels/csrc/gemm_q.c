/* A prompt's products with int8 / int4 weights in one C call (kernels/cpu.py: quantized_linear):
 * y [M, n] = x [M, k] @ W [n, k]^T, W as codes, fp32 sums.
 *
 * A prompt multiplies every weight by each of its M rows, so the work is arithmetic, and a CPU's
 * arithmetic is fastest in a register-blocked GEMM: a tile of outputs sits in registers while k
 * runs, and each value loaded feeds several multiply-adds. Here the codes never leave the cache as
 * fp32: a thread widens NR rows of W (a panel, 27 KB for k = 576) into its own buffer, as
 * dequantize() computes them (dequant.c), then runs the rows of x against that panel while it is in
 * L1 or L2. No matrix or tile of fp32 weights is written to memory, and no library repacks one (the
 * fp32 tiles of dequant_rows, each multiplied by oneDNN, did both: 64-token prompts 1.4x slower than
 * with fp32 weights).
 *
 * The micro-kernel holds NR x NV vectors of sums: NR weight rows against XB = NV vectors of rows of
 * x (32 rows with AVX-512). For each column of k it loads NV vectors of x (x is packed once per call
 * so that rows r..r+31 of a column are contiguous) and broadcasts each of the NR weights: NV + NR
 * loads for NV NR multiply-adds, which the two FMA units, not the loads, limit. With AVX-512,
 * NR = 12, NV = 2 (24 sums + 2 of x + a broadcast: 27 of 32 registers, the shape BLIS uses on
 * Skylake-X); 12 divides SmolLM2's widths (576, 960, 3,072). The 8-wide build (AVX2, NEON) holds
 * 6 x 2 vectors in its 16 registers.
 *
 * Caches: the rows of x go in groups of about 1 MB that stay in L2 while each panel sweeps them
 * (group_rows), and a panel's columns in passes that fit L1 (pass_columns). The threads share out
 * (group, panel) pairs, one parallel region a call; a short prompt is one group, so each weight is
 * widened once per call, a 512-token one in two to four.
 *
 * Each output is one chain of fused multiply-adds in the order of k, by one thread, whatever the
 * thread count or grouping; not oneDNN's order, so results agree with fp32 weights' to ~1e-6
 * relative (tests/test_weight_quant.py bounds the difference).
 */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

#ifdef __AVX512F__
#define VW 16  /* lanes of a vector */
#ifndef NR
#define NR 12  /* weight rows of a panel */
#define NV 2   /* vectors of rows of x a block */
#endif
#else
#define VW 8
#define NR 6
#define NV 2
#endif
#define XB (NV * VW)  /* rows of x a block */
#define PB 16        /* a panel's weights come in runs of 16 (widen_row_q8/q4) */

typedef float vf __attribute__((vector_size(VW * 4)));
/* an unaligned load of one vector, as one instruction: through memcpy, GCC (told to prefer 256-bit
 * vectors, see build.py) loads a 64-byte vector in two halves and joins them through the stack */
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf load_vf(const float *p) { return *(const vf_unaligned *)p; }

/* A panel of NR rows of W, fp32: for each run of PB columns, row 0's PB weights, then row 1's, ...
 * (panel[(p / PB) * NR * PB + c * PB + p % PB] is W[c, p]), what widen_row writes 16 at a time
 * with no transpose, and the micro-kernel reads with one pointer and constant offsets. */
static void widen_panel(const Mat *m, int64_t first, int64_t nr, float *panel) {
    for (int64_t c = 0; c < nr; c++) {
        if (m->mins) widen_row_q4(m, first + c, panel + c * PB, NR * PB);
        else widen_row_q8(m, first + c, panel + c * PB, NR * PB);
    }
    for (int64_t c = nr; c < NR; c++)  /* the last panel of an n that NR does not divide: zeros */
        for (int64_t j = 0; j < m->k; j += PB) memset(panel + j * NR + c * PB, 0, PB * sizeof(float));
}

/* acc += the NR x (nv VW) products of one panel with a block of x over kc columns (panel and xb at
 * the first of them), nv <= NV a constant once inlined: NV, or fewer for a last block of fewer rows */
static inline __attribute__((always_inline)) void tile(const float *panel, const float *xb, int64_t kc, const int nv,
                                                        vf acc[NR][NV]) {
    for (int64_t j = 0; j < kc; j += PB) {
        const float *w = panel + j * NR, *x = xb + j * XB;
        #pragma GCC unroll 16
        for (int p = 0; p < PB; p++) {
            vf xv[NV];
            for (int v = 0; v < nv; v++) xv[v] = load_vf(x + p * XB + v * VW);
            #pragma GCC unroll 12
            for (int c = 0; c < NR; c++) {
                const float wc = w[c * PB + p];  /* broadcast */
                for (int v = 0; v < nv; v++) acc[c][v] += xv[v] * wc;
            }
        }
    }
}

#ifdef __AVX512F__
/* r[i] (16 floats each) -> r[j] = (r[0][j], r[1][j], ... r[15][j]): pairs of rows interleaved, then
 * quads within each 128-bit lane, then the lanes gathered (64 shuffles for 256 numbers) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* lane L of r[i + c]: column 4 L + c of rows i..i+3 */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        __m512 u = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), v = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(u, u2, 0x88);       /* column c */
        t[4 + c] = _mm512_shuffle_f32x4(v, v2, 0x88);   /* column 4 + c */
        t[8 + c] = _mm512_shuffle_f32x4(u, u2, 0xDD);   /* column 8 + c */
        t[12 + c] = _mm512_shuffle_f32x4(v, v2, 0xDD);  /* column 12 + c */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
#endif

/* The sums of a tile into y (rows of y `stride` apart): acc[c][v] lane l is row v VW + l of the
 * block against weight row c, for mr rows and nr columns. With AVX-512 each vector of 16 rows is
 * transposed in registers into 16 row pieces of NR numbers, one masked store each (stored one
 * number at a time, a tile's 384 numbers cost ~7% of its multiply-adds at k = 576). */
static inline void store_tile(vf acc[NR][NV], float *y, int64_t stride, int64_t mr, int64_t nr) {
#if defined(__AVX512F__) && NR <= 16
    const __mmask16 cols = (__mmask16)((1u << nr) - 1);
    for (int64_t v = 0; v * VW < mr; v++) {
        __m512 r[16];
        for (int c = 0; c < 16; c++) r[c] = c < NR ? (__m512)acc[c][v] : _mm512_setzero_ps();
        transpose16(r);  /* r[l]: row v VW + l, its NR columns */
        for (int64_t l = 0; l < VW && v * VW + l < mr; l++) _mm512_mask_storeu_ps(y + (v * VW + l) * stride, cols, r[l]);
    }
#else
    float out[NR][XB];
    memcpy(out, acc, sizeof out);  /* out[c][r]: row r of the block against weight row c */
    for (int64_t r = 0; r < mr; r++)
        for (int64_t c = 0; c < nr; c++) y[r * stride + c] = out[c][r];
#endif
}

/* Columns a pass of the micro-kernel: the panel's part, NR x KC fp32, stays in L1 (48 KB on this
 * course's Xeon, 32 KB on Zen 4) beside the lines of x streaming past. k = 576 (27 KB) is one pass;
 * k = 1,536 three of 512, each block's sums kept between passes (the same chain of sums: same bits). */
#define L1_PANEL_BYTES (28 * 1024)

static int64_t pass_columns(int64_t k) {
    const int64_t passes = (k * NR * (int64_t)sizeof(float) + L1_PANEL_BYTES - 1) / L1_PANEL_BYTES;
    return ((k + passes - 1) / passes + PB - 1) / PB * PB;  /* a multiple of PB */
}

/* Rows of x a group: every panel sweeps its group's rows of packed x, which should stay in L2
 * (1 MB on Zen 4, 2 MB on the Xeon): 512 rows of k = 1,536 are 3 MB, and swept from L3 by each panel
 * they ran at 70% of the speed of k = 576. So a long prompt's rows go in groups of at most ~1 MB,
 * of equal size in whole blocks, and the threads share out (group, panel) pairs. */
#define X_GROUP_BYTES (1024 * 1024)

static int64_t group_rows(int64_t M, int64_t k) {
    int64_t most = X_GROUP_BYTES / ((int64_t)sizeof(float) * k) / XB * XB;
    if (most < XB) most = XB;
    const int64_t groups = (M + most - 1) / most;
    return ((M + groups - 1) / groups + XB - 1) / XB * XB;
}

/* Unit i: panel i % panels (rows NR (i % panels) .. of W) widened into this thread's buffer, then
 * every block of x of group i / panels against it, KC columns a pass. */
static void panel_rows(const Mat *m, float *y, int64_t i) {
    const int64_t k = m->k, rows = group_rows(m->M, k), panels = (m->n + NR - 1) / NR;
    const int64_t first = i % panels * NR, nr = m->n - first < NR ? m->n - first : NR, KC = pass_columns(k);
    const int64_t start = i / panels * rows, end = start + rows < m->M ? start + rows : m->M;
#ifdef _OPENMP
    float *panel = m->work + (int64_t)omp_get_thread_num() * (NR * k + rows * NR);
#else
    float *panel = m->work;
#endif
    vf *sums = (vf *)(panel + NR * k);  /* the group's blocks' NR x NV sums between passes */
    widen_panel(m, first, nr, panel);
    for (int64_t j = 0; j < k; j += KC) {
        const int64_t kc = k - j < KC ? k - j : KC;
        for (int64_t r0 = start; r0 < end; r0 += XB) {
            const int64_t mr = end - r0 < XB ? end - r0 : XB;
            const float *xb = m->x + r0 * k + j * XB;  /* block r0 / XB of the packed x, from column j */
            vf acc[NR][NV], *saved = sums + (r0 - start) / XB * NR * NV;
            if (j == 0) memset(acc, 0, sizeof acc);
            else memcpy(acc, saved, sizeof acc);
            switch ((mr + VW - 1) / VW) {  /* vectors this block fills */
#if NV > 3
                case 4: tile(panel + j * NR, xb, kc, 4, acc); break;
#endif
#if NV > 2
                case 3: tile(panel + j * NR, xb, kc, 3, acc); break;
#endif
                case 2: tile(panel + j * NR, xb, kc, 2, acc); break;
                default: tile(panel + j * NR, xb, kc, 1, acc); break;
            }
            if (j + kc < k) memcpy(saved, acc, sizeof acc);
            else store_tile(acc, y + r0 * m->n + first, m->n, mr, nr);
        }
    }
}

/* Block b of x [M, k] (rows XB b ..) -> XB rows packed, k columns of XB (rows past M: zeros), from
 * m->x to m->work. With AVX-512, 16 x 16 squares at a time through registers: read row by row and
 * written column by column, one number at a time, packing cost ~1 ns a number. The blocks are
 * shared out among the threads (pack_x): packed on the calling thread alone, they took a tenth of
 * a 512-row product's time on two threads. Measured on this course's Xeon (2 vCPUs), SmolLM2's four
 * products at 512 rows, 2 threads, in turns in one process against the serial packing: 1.12-1.20x
 * -> 1.06-1.14x of oneDNN's fp32 GEMM (int8), 1.11-1.22x -> 1.06-1.14x (int4). */
static void pack_block(const Mat *m, float *unused, int64_t blk) {
    (void)unused;
    const int64_t M = m->M, k = m->k, r0 = blk * XB, mr = M - r0 < XB ? M - r0 : XB;
    float *b = m->work + r0 * k;
    const float *xr = m->x + r0 * k;
#ifdef __AVX512F__
    for (int64_t h = 0; h < XB; h += 16)  /* the two halves of the block */
        for (int64_t p = 0; p < k; p += 16) {
            __m512 r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = h + i < mr ? _mm512_loadu_ps(xr + (h + i) * k + p) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < 16; j++) _mm512_storeu_ps(b + (p + j) * XB + h, r[j]);
        }
#else
    for (int64_t p = 0; p < k; p++)
        for (int64_t r = 0; r < XB; r++) b[p * XB + r] = r < mr ? xr[r * k + p] : 0.0f;
#endif
}

/* x [M, k] -> xp, its blocks of XB rows packed (pack_block), two blocks or more a thread. Not through
 * parallel_rows: its check for late threads, judging this short region, which follows the Python
 * caller's pause, tripped on a quiet machine and sent the products to one thread; this region only
 * follows the products' back-off (as attention's loops do, decode.c). */
static void pack_x(const float *x, int64_t M, int64_t k, float *xp, int threads) {
    const Mat m = {.x = x, .M = M, .k = k, .work = xp};
    const int64_t blocks = (M + XB - 1) / XB;
    int par = threads > 1 && blocks >= 2 * threads;
#ifdef _OPENMP
    par = par && !backing_off();
#endif
    #pragma omp parallel for num_threads(threads) if(par) schedule(static)
    for (int64_t b = 0; b < blocks; b++) pack_block(&m, NULL, b);
}

/* y [M, n] = x [M, k] @ W^T for int8 codes [n, k] (mins NULL) or int4 codes [n, k / 2], fp16 scales
 * (and minimums) [n, k / G]; G a multiple of 32 that divides k. Returns 0, or -1 without memory for
 * x packed and, per thread, one panel and its blocks' sums (y is then not written). */
int gemm_q(const void *codes, const uint16_t *scales, const uint16_t *mins, const float *x, float *y, int64_t M,
           int64_t n, int64_t k, int64_t G, int threads) {
    const int64_t blocks = (M + XB - 1) / XB, nt = threads > 1 ? threads : 1, rows = group_rows(M, k);
    float *xp = aligned_alloc(64, (size_t)(blocks * XB * k) * sizeof(float));
    float *panels = aligned_alloc(64, (size_t)(nt * (NR * k + rows * NR)) * sizeof(float));
    if (!xp || !panels) {
        free(xp);
        free(panels);
        return -1;
    }
    pack_x(x, M, k, xp, threads);
    Mat m = {.W = codes, .scales = scales, .mins = mins, .x = xp, .k = k, .G = G, .M = M, .n = n, .work = panels};
    /* the threads split the (group, panel) pairs, two or more each (a panel is hundreds of rows' work:
     * gemv's 16 rows a thread would keep SmolLM2's 576-row matrices on one thread of four) */
    const int64_t units = (M + rows - 1) / rows * ((n + NR - 1) / NR);  /* (group, panel) pairs */
    parallel_rows(panel_rows, &m, y, units, threads, 2);
    free(xp);
    free(panels);
    return 0;
}
