/* A prompt's products under prefill_precision="int8" (kernels/int8.py, numerics/w8a8.py):
 *     y[r, j] = a[r] * b[j] * sum_k qx[r, k] qw[j, k]     int8 codes, exact int32 sums, fp32 y [M, n]
 * with qx [M, k] a prompt's rows (a scale a[r] each) and qw [n, k] a weight's (a scale b[j] per
 * output channel).
 *
 * Why our own: oneDNN's int8 linear ran a reference loop on an AMD Zen 5 (10 s for 512 x 576 x 1,536,
 * where its fp32 GEMM took 12 ms), and torch._int_mm was slower than fp32 there. The instruction
 * that makes int8 fast is `vpdpbusd`: in each 32-bit lane, four unsigned bytes times four signed
 * bytes, summed into an int32 (64 multiply-adds a 512-bit instruction, 4x an fp32 FMA's 16). Every
 * x86 with VNNI has it: AVX512-VNNI (Intel since Cascade Lake, AMD Zen 4 and 5) 512 bits wide, and
 * AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5) 256 bits wide. One side must be unsigned, so the
 * activations become u = qx + 128 (a flip of the sign bit) and the sum loses what that added:
 *     sum_k qx qw = sum_k u qw - 128 sum_k qw[j, k]
 * the second term fixed per weight row (w8a8.Int8Weight.code_sums, made once per weight). The sums are
 * exact (|u qw| <= 255 * 127: k up to 66,000 fits int32), so each output is
 * (float)(sum) * a[r] * b[j], in that order: w8a8.reference_linear's bits wherever its fp32 sums
 * are exact too, and the same bits whatever the thread count, blocking or variant.
 *
 * Layout: the weight's codes come blocked (w8a8.Int8Weight.blocked) as 16 output channels
 * x 4 bytes of k, [n / 16][k / 4][16][4], k padded with zeros to a multiple of 4 and n to a multiple
 * of 64 (so a panel never reads past them): one 64-byte load is one vpdpbusd's signed operand, 16
 * channels' next 4 codes. Each call packs the rows of x the same way, MR rows x 4 bytes, [M / MR][k
 * / 4][MR] int32 (u, the sign bits flipped), so the micro-kernel broadcasts each row's 4 bytes from
 * one pointer at constant offsets; given the rows in fp32, it quantizes them there too.
 *
 * The micro-kernel holds MR x NV vectors of int32 sums (MR rows of x against NV vectors of output
 * channels); for each 4 bytes of k it loads NV vectors of codes and broadcasts MR times: NV + MR loads
 * for MR NV vpdpbusd, which the vector units limit, not the loads:
 *   AVX512-VNNI  MR 12, NV 2 (32 channels): 24 sums + 2 codes + a broadcast of 32 registers;
 *   AVX-VNNI     MR 6, NV 2 (16 channels): 12 sums + 2 + 1 of 16;
 *   AVX2         the same shape, vpdpbusd emulated exactly: the bytes widened to int16 pairs, two
 *                vpmaddwd (not vpmaddubsw, whose int16 sums saturate at 2 * 255 * 127): ~5 instructions
 *                where VNNI has one, 0.8x of oneDNN's fp32 GEMM on the Xeon (an AVX2-only Zen 3 has
 *                more integer ports; not measured there);
 *   portable C   MR 4, 16 channels, int32 vectors of GCC's extensions (no x86, or no AVX2).
 * Measured on this course's Xeon, one core, 512 rows of SmolLM2's products (the GEMM alone, rows
 * given as codes): 323-335 multiply-adds per ns with AVX512-VNNI (two vpdpbusd a cycle: about its
 * peak), ~190 with AVX-VNNI, ~58 with AVX2, 7 portable; oneDNN's fp32 GEMM 70.
 * The threads share groups of rows through parallel_rows (parallel.c: its back-off on a busy
 * machine); a group of rows of packed x stays in L2 while each panel of codes (NV vectors x k,
 * 18 KB for k = 576) sweeps it from L1.
 */
#include <stdlib.h>

#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define S8_VARIANT "avx512vnni"
#define LANES 16
#define MR 12
#define NV 2
#define SIMD 1
typedef __m512i vi;
static inline vi loadv(const int8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi bcast(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi dot4(vi acc, vi u, vi w) { return _mm512_dpbusd_epi32(acc, u, w); }
#elif defined(__AVXVNNI__) || defined(__AVX2__)
#define LANES 8
#define MR 6  /* AVX2 too: its widened halves of the codes and a row spill 4 sums, and 4 rows measured slower */
#define NV 2
#define SIMD 1
typedef __m256i vi;
static inline vi loadv(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi bcast(int32_t x) { return _mm256_set1_epi32(x); }
#ifdef __AVXVNNI__
#define S8_VARIANT "avxvnni"
static inline vi dot4(vi acc, vi u, vi w) { return _mm256_dpbusd_avx_epi32(acc, u, w); }
#else
#define S8_VARIANT "avx2"
/* vpdpbusd's sums exactly: the even and the odd bytes of each 16-bit pair widened (u: zero-extended,
 * w: sign-extended), then vpmaddwd adds each pair of products into the 32-bit lane (inlined into the
 * tile, the widenings of u and w are made once per broadcast and per load, not per product) */
static inline vi dot4(vi acc, vi u, vi w) {
    const vi low = _mm256_set1_epi16(0x00FF);
    const vi ue = _mm256_and_si256(u, low), uo = _mm256_srli_epi16(u, 8);
    const vi we = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), wo = _mm256_srai_epi16(w, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, we), _mm256_madd_epi16(uo, wo)));
}
#endif
#else
#define S8_VARIANT "portable"
#define LANES 16
#define MR 4
#define NV 1
#endif
#define PANEL (NV * LANES)  /* output channels a panel: 32 or 16, within the 64 that n is padded to */

/* Which loop this build runs (tests and reports): "avx512vnni", "avxvnni", "avx2" or "portable". */
const char *gemm_s8_variant(void) { return S8_VARIANT; }

typedef struct {
    Mat m;                  /* first, so that parallel_rows' Mat pointer is this struct's (m.M, m.n, m.k) */
    const int8_t *w;        /* the blocked codes [n / 16][kq][16][4] */
    const int32_t *wsum;    /* 128 sum_k qw[j, k], [n] */
    float *a;               /* the rows' scales [M] (written with x) */
    const float *b;         /* the channels' [n] */
    const float *x, *keep;  /* the rows in fp32 [M, k] and the columns they keep [k] (NULL: codes given) */
    int8_t *qx;             /* the rows' codes [M, k] (written with x) */
    int32_t *xp;            /* x packed, [M / MR][kq][MR] */
    int64_t kq, rows;       /* groups of 4 bytes of k; rows of x a group (a multiple of MR) */
} GemmS8;

/* y[r, c0 + l] for l < nl of one row's sums s[l] (LANES of them): (float)(s - wsum) * a * b, in that
 * order (the reference's); the last vector of an n that LANES does not divide one number at a time */
static inline void store_row(const int32_t *s, const GemmS8 *g, float *y, float a, int64_t c0, int64_t nl) {
    for (int64_t l = 0; l < nl; l++) y[c0 + l] = (float)(s[l] - g->wsum[c0 + l]) * a * g->b[c0 + l];
}

#ifdef SIMD
/* out = the MR x PANEL sums of one block of packed x (xb) against one panel of codes (wp), over all of
 * k. Vector v of the panel is 16-channel block v LANES / 16 (wstride bytes apart), its bytes from
 * (v LANES % 16) * 4 on: 512-bit vectors are whole blocks, 256-bit ones halves. The sums are locals
 * of this function, written out once at the end: an array of them that the caller zeroed or that
 * escaped to the store lived on the stack, a load and a store around every vpdpbusd (measured 60
 * multiply-adds per ns on one core of the Xeon, where oneDNN's ran 214). */
static inline __attribute__((always_inline)) void tile(const int8_t *wp, int64_t wstride, const int32_t *xb,
                                                        int64_t kq, int32_t out[MR][PANEL]) {
    vi acc[MR][NV];
    #pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = bcast(0);
    for (int64_t p = 0; p < kq; p++) {
        vi w[NV];
        for (int v = 0; v < NV; v++) w[v] = loadv(wp + (v * LANES / 16) * wstride + p * 64 + (v * LANES % 16) * 4);
        #pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            const vi u = bcast(xb[p * MR + r]);
            for (int v = 0; v < NV; v++) acc[r][v] = dot4(acc[r][v], u, w[v]);
        }
    }
    #pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) memcpy(out[r] + v * LANES, &acc[r][v], sizeof acc[r][v]);
}

/* the tile's sums into y: each vector to fp32 through the correction and the scales */
static void store_tile(int32_t out[MR][PANEL], const GemmS8 *g, float *y, int64_t r0, int64_t c0) {
    const int64_t n = g->m.n;
    for (int r = 0; r < MR && r0 + r < g->m.M; r++) {
        float *yr = y + (r0 + r) * n;
        const float a = g->a[r0 + r];
        for (int v = 0; v < NV; v++) {
            const int64_t c = c0 + v * LANES, nl = n - c < LANES ? n - c : LANES;
            const int32_t *s = out[r] + v * LANES;
            if (nl <= 0) break;
#if LANES == 16
            if (nl == LANES) {  /* the same operations as store_row, 16 at once */
                __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(s), _mm512_loadu_si512(g->wsum + c)));
                f = _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(a)), _mm512_loadu_ps(g->b + c));
                _mm512_storeu_ps(yr + c, f);
                continue;
            }
#else
            if (nl == LANES) {
                __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)s),
                                                               _mm256_loadu_si256((const __m256i *)(g->wsum + c))));
                f = _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(a)), _mm256_loadu_ps(g->b + c));
                _mm256_storeu_ps(yr + c, f);
                continue;
            }
#endif
            store_row(s, g, yr, a, c, nl);
        }
    }
}
#endif

/* Block blk of qx [M, k] (rows MR blk ..) -> xp's block: [kq][MR] int32 of 4 bytes of a row each, the
 * sign bits flipped (u = q + 128). Past k (128 there) and past M (0) any value would do: the codes
 * there are zeros, and those rows are not stored. With x, the block's rows are quantized first
 * (quantize_row: quantize_rows_s8's bits) into qx and a. */
static void pack_block(const float *x, const float *keep, int8_t *qx, float *a, int64_t M, int64_t k, int64_t kq,
                       int32_t *xp, int64_t blk) {
    int32_t *out = xp + blk * kq * MR;
    for (int r = 0; r < MR; r++) {
        const int64_t row = blk * MR + r;
        const int8_t *q = qx + row * k;
        if (x && row < M) a[row] = quantize_row(x + row * k, keep, qx + row * k, k);
        for (int64_t p = 0; p < kq; p++) {
            uint32_t word = 0;
            if (row < M) {
                if (4 * p + 4 <= k) memcpy(&word, q + 4 * p, 4);
                else for (int64_t i = 4 * p; i < k; i++) word |= (uint32_t)(uint8_t)q[i] << (8 * (i - 4 * p));
                word ^= 0x80808080u;  /* each byte + 128 */
            }
            out[p * MR + r] = (int32_t)word;
        }
    }
}

/* Channels c0 .. c0 + PANEL against the packed rows start .. end (whole blocks from start). */
static void panel_rows(const GemmS8 *g, float *y, int64_t c0, int64_t start, int64_t end) {
    const int64_t kq = g->kq, wstride = kq * 64;  /* bytes of a 16-channel block */
    const int8_t *wp = g->w + c0 / 16 * wstride;
    for (int64_t r0 = start; r0 < end; r0 += MR) {
        const int32_t *xb = g->xp + r0 / MR * kq * MR;
#ifdef SIMD
        int32_t out[MR][PANEL];
        tile(wp, wstride, xb, kq, out);
        store_tile(out, g, y, r0, c0);
#else
        /* 16 channels as one vector of int32 sums a row (GCC's vector extensions: NEON or SSE): each 4
         * bytes of k, the block's 64 codes as 16 int32 lanes (a channel's 4 codes each), byte i of
         * every lane sign-extended by two shifts, then 4 multiply-adds a row (one byte at a time, the
         * strided loop ran 2 multiply-adds per ns on the Xeon; a shuffle per byte, 3) */
        typedef int32_t i32x16 __attribute__((vector_size(64)));
        i32x16 acc[MR] = {{0}};
        for (int64_t p = 0; p < kq; p++) {
            i32x16 w;
            memcpy(&w, wp + p * 64, sizeof w);
            const i32x16 wi[4] = {(w << 24) >> 24, (w << 16) >> 24, (w << 8) >> 24, w >> 24};  /* little-endian */
            for (int r = 0; r < MR; r++) {
                uint8_t u[4];
                memcpy(u, xb + p * MR + r, 4);
                acc[r] += (int32_t)u[0] * wi[0] + (int32_t)u[1] * wi[1] + (int32_t)u[2] * wi[2] + (int32_t)u[3] * wi[3];
            }
        }
        const int64_t n = g->m.n, nl = n - c0 < 16 ? n - c0 : 16;
        for (int r = 0; r < MR && r0 + r < g->m.M; r++) {
            int32_t sums[16];
            memcpy(sums, &acc[r], sizeof sums);
            store_row(sums, g, y + (r0 + r) * n, g->a[r0 + r], c0, nl);
        }
#endif
    }
}

/* Unit i: group i of rows (rows i g->rows ..) quantized where x is given and packed, then multiplied
 * by every panel of codes (PANEL channels), each panel against all of the group's blocks. */
static void group_unit(const Mat *m, float *y, int64_t i) {
    const GemmS8 *g = (const GemmS8 *)m;
    const int64_t start = i * g->rows, end = start + g->rows < m->M ? start + g->rows : m->M;
    for (int64_t blk = start / MR; blk * MR < end; blk++)
        pack_block(g->x, g->keep, g->qx, g->a, m->M, m->k, g->kq, g->xp, blk);
    for (int64_t c0 = 0; c0 < m->n; c0 += PANEL)
        panel_rows(g, y, c0, start, end);
}

/* Rows of x a group: every panel sweeps its group's packed rows, which should stay in L2 (1 MB on
 * Zen 4 and 5, 2 MB on the Xeon): at most 512 KB a group, and at least one group a thread (each
 * thread quantizes and packs its own groups: one parallel region a call, no hand-over between
 * threads), in equal groups of whole blocks. */
#define X_GROUP_BYTES (512 * 1024)

static int64_t group_rows(int64_t M, int64_t kq, int threads) {
    int64_t most = X_GROUP_BYTES / (4 * kq) / MR * MR;
    if (most < MR) most = MR;
    int64_t groups = (M + most - 1) / most;
    if (threads > 1) groups = (groups + threads - 1) / threads * threads;  /* as many a thread */
    return ((M + groups - 1) / groups + MR - 1) / MR * MR;
}

/* y [M, n] fp32 = a[r] b[j] sum_k qx[r, k] qw[j, k]: qx [M, k] int8 codes with scales a [M], the weight
 * as w8a8.block_codes blocks it (w [n64 / 16][k4 / 4][16][4], n64 and k4 n and k rounded up to 64
 * and 4, zeros there), wsum [n] = 128 sum_k qw[j, k], b [n]. With x [M, k] fp32 (else NULL), qx and a
 * are outputs: x's rows quantized (times keep [k], or NULL) as quantize_rows_s8 does, by the thread
 * that multiplies them (quantize_rows_s8 before the call ran on one thread: a quarter of a 512-row
 * product's time on two). Returns 0, or -1 without memory for x packed (y, and qx and a, then not
 * written).
 * One parallel region a call, through parallel_rows (its back-off on a busy machine): each of its
 * units a group of rows. A first version packed x in a region of its own: next to two busy
 * processes, every region waits for a time slice, and its products took twice fp32's (24 ms
 * against 12, 2 threads). */
int gemm_s8(const float *x, const float *keep, int8_t *qx, float *a, const int8_t *w, const int32_t *wsum,
            const float *b, float *y, int64_t M, int64_t n, int64_t k, int threads) {
    const int64_t kq = (k + 3) / 4, blocks = (M + MR - 1) / MR;
    if (M <= 0 || n <= 0) return 0;  /* nothing to write (and malloc(0) may return NULL) */
    int32_t *xp = malloc((size_t)(blocks * kq * MR) * sizeof *xp);
    if (!xp) return -1;
    GemmS8 g = {.m = {.M = M, .n = n, .k = k}, .w = w, .wsum = wsum, .a = a, .b = b, .x = x, .keep = keep, .qx = qx,
                .xp = xp, .kq = kq, .rows = group_rows(M, kq, threads)};
    parallel_rows(group_unit, &g.m, y, (M + g.rows - 1) / g.rows, threads, 1);
    free(xp);
    return 0;
}
