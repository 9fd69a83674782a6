/* Panel products of the routed experts (included by _kernels.pyx; see fast/experts.py for the layout).

   An expert's product y = x W^T has few rows (the tokens routed to that expert: 8-32 on a canvas) and a
   weight matrix W (N, K) read once per call, so a general BLAS spends most of its time packing W into its
   own layout. Here W is packed once, at load, into panels of DG_NR = 32 output columns:

       panels[p][k][j] = W[32 p + j][k]        p < ceil(N / 32), k < K, j < 32 (columns past N are 0)

   and a register tile of MR rows x 32 columns walks k from 0 to K - 1, each output one fused multiply-add
   per k, in order: out[r][n] = fma(x[r][K-1], W[n][K-1], ... fma(x[r][1], W[n][1], x[r][0] * W[n][0] + 0)).
   Every instruction set below (AVX-512, AVX2 + FMA, portable C with fmaf) performs exactly that sequence
   of roundings, so all three give the same bits, whatever the thread count (one output, one thread).

   Q8_0 weights (llama.cpp's type: blocks of 32 consecutive k of one row, int8 values and one float16
   scale) keep that layout's int8 panels, qpanels[p][k][j], and per-block scales scales[p][k / 32][j] as
   float32 (a float16 widens exactly). A chunk of DG_KC = 256 values of k of one panel is widened into a buffer
   (int8 times scale is exact in float32: at most 8 + 11 significant bits) and run through the same tile,
   which carries its accumulators across chunks through the output rows. The result is therefore bit for
   bit that of the float32 panels of the dequantized weights.

   bfloat16 weights keep the float32 layout with 16-bit entries, bpanels[p][k][j] (the top half of each
   float32's bits). A chunk is widened the same way (a shift: exact), so the result is bit for bit that of
   the float32 panels of the widened weights, at 2 bytes a weight. ``dg_widen_bf16`` also serves the tiled
   BLAS products of ``_kernels.gemm_bf16`` (a tile's rows of a bfloat16 matrix widened before its call).
*/
#ifndef DG_PANEL_GEMM_H
#define DG_PANEL_GEMM_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DG_NR 32   /* output columns of a panel */
#ifndef DG_KC
#define DG_KC 256  /* values of k per chunk (a multiple of the Q8_0 block of 32); 32 KB of float32 panel */
#endif
#define DG_QK 32   /* Q8_0 block length */
#ifndef DG_PF
#define DG_PF 64  /* prefetch distance, in values of k (64 x 128 bytes ahead): measured best of 0/16/32/64 */
#endif

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DG_NO_SIMD)
#include <immintrin.h>
#define DG_HAVE_X86 1
#else
#define DG_HAVE_X86 0
#endif

/* One tile call: rows [0, m) of x (row stride ldx) times kc values of k of one panel w (kc x 32), into
   the first nc <= 32 columns of c (row stride ldc); acc = 0 starts from zero, acc = 1 adds to c. */
typedef void (*dg_panel_fn)(int64_t m, const float *x, int64_t ldx, const float *w, int64_t kc,
                            float *c, int64_t ldc, int64_t nc, int acc);

/* ------------------------------------------------------------------------------------ portable C */
static void dg_panel_portable(int64_t m, const float *x, int64_t ldx, const float *w, int64_t kc,
                              float *c, int64_t ldc, int64_t nc, int acc) {
    for (int64_t r = 0; r < m; r++) {
        float t[DG_NR];
        for (int j = 0; j < DG_NR; j++) t[j] = (acc && j < nc) ? c[r * ldc + j] : 0.0f;
        const float *xr = x + r * ldx;
        for (int64_t k = 0; k < kc; k++) {
            const float b = xr[k];
            const float *wk = w + DG_NR * k;
            for (int j = 0; j < DG_NR; j++) t[j] = fmaf(b, wk[j], t[j]);
        }
        for (int64_t j = 0; j < nc; j++) c[r * ldc + j] = t[j];
    }
}

#if DG_HAVE_X86
/* ------------------------------------------------------------------------------------- AVX-512 */
/* MR rows x 32 columns: 2 MR accumulators (16 for MR = 8), two panel loads and MR broadcasts per k. */
__attribute__((always_inline, target("avx512f"))) static inline void
dg_tile512(const int MR, const float *x, int64_t ldx, const float *w, int64_t kc, float *c, int64_t ldc,
           int64_t nc, int acc) {
    __m512 c0[8], c1[8];
    const __mmask16 m0 = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1u);
    const __mmask16 m1 = nc >= 32 ? (__mmask16)0xFFFF : nc <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nc - 16)) - 1u);
    for (int r = 0; r < MR; r++) {
        c0[r] = acc ? _mm512_maskz_loadu_ps(m0, c + r * ldc) : _mm512_setzero_ps();
        c1[r] = acc ? _mm512_maskz_loadu_ps(m1, c + r * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        /* the panel's lines DG_PF values of k ahead: the first row block of a chunk reads it from memory */
        _mm_prefetch((const char *)(w + DG_NR * (k + DG_PF)), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + DG_NR * (k + DG_PF) + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(w + DG_NR * k), w1 = _mm512_loadu_ps(w + DG_NR * k + 16);
        for (int r = 0; r < MR; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            c0[r] = _mm512_fmadd_ps(b, w0, c0[r]);
            c1[r] = _mm512_fmadd_ps(b, w1, c1[r]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_mask_storeu_ps(c + r * ldc, m0, c0[r]);
        _mm512_mask_storeu_ps(c + r * ldc + 16, m1, c1[r]);
    }
}

#define DG_TILE512(MR) \
    __attribute__((target("avx512f"))) static void dg_tile512_##MR(const float *x, int64_t ldx, const float *w, \
        int64_t kc, float *c, int64_t ldc, int64_t nc, int acc) { dg_tile512(MR, x, ldx, w, kc, c, ldc, nc, acc); }
DG_TILE512(1) DG_TILE512(2) DG_TILE512(3) DG_TILE512(4) DG_TILE512(5) DG_TILE512(6) DG_TILE512(7) DG_TILE512(8)

__attribute__((target("avx512f"))) static void
dg_panel_avx512(int64_t m, const float *x, int64_t ldx, const float *w, int64_t kc, float *c, int64_t ldc,
                int64_t nc, int acc) {
    int64_t r = 0;
    for (; r + 8 <= m; r += 8) dg_tile512_8(x + r * ldx, ldx, w, kc, c + r * ldc, ldc, nc, acc);
    const float *xr = x + r * ldx;
    float *cr = c + r * ldc;
    switch (m - r) {
        case 7: dg_tile512_7(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 6: dg_tile512_6(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 5: dg_tile512_5(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 4: dg_tile512_4(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 3: dg_tile512_3(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 2: dg_tile512_2(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        case 1: dg_tile512_1(xr, ldx, w, kc, cr, ldc, nc, acc); break;
        default: break;
    }
}

/* ---------------------------------------------------------------------------------- AVX2 + FMA */
/* MR <= 3 rows x 32 columns: 4 MR accumulators (12), the panel loads folded into the multiply-adds. A
   partial panel (nc < 32) goes through a 32-wide row buffer. */
__attribute__((always_inline, target("avx2,fma"))) static inline void
dg_tile256(const int MR, const float *x, int64_t ldx, const float *w, int64_t kc, float *c, int64_t ldc,
           int64_t nc, int acc) {
    __m256 t[3][4];
    float row[DG_NR];
    for (int r = 0; r < MR; r++) {
        for (int j = 0; j < 4; j++) t[r][j] = _mm256_setzero_ps();
        if (acc) {
            if (nc == DG_NR) {
                for (int j = 0; j < 4; j++) t[r][j] = _mm256_loadu_ps(c + r * ldc + 8 * j);
            } else {
                memset(row, 0, sizeof(row));
                memcpy(row, c + r * ldc, (size_t)nc * sizeof(float));
                for (int j = 0; j < 4; j++) t[r][j] = _mm256_loadu_ps(row + 8 * j);
            }
        }
    }
    for (int64_t k = 0; k < kc; k++) {
        const float *wk = w + DG_NR * k;
        for (int r = 0; r < MR; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
            for (int j = 0; j < 4; j++) t[r][j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(wk + 8 * j), t[r][j]);
        }
    }
    for (int r = 0; r < MR; r++) {
        if (nc == DG_NR) {
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(c + r * ldc + 8 * j, t[r][j]);
        } else {
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(row + 8 * j, t[r][j]);
            memcpy(c + r * ldc, row, (size_t)nc * sizeof(float));
        }
    }
}

#define DG_TILE256(MR) \
    __attribute__((target("avx2,fma"))) static void dg_tile256_##MR(const float *x, int64_t ldx, const float *w, \
        int64_t kc, float *c, int64_t ldc, int64_t nc, int acc) { dg_tile256(MR, x, ldx, w, kc, c, ldc, nc, acc); }
DG_TILE256(1) DG_TILE256(2) DG_TILE256(3)

__attribute__((target("avx2,fma"))) static void
dg_panel_avx2(int64_t m, const float *x, int64_t ldx, const float *w, int64_t kc, float *c, int64_t ldc,
              int64_t nc, int acc) {
    int64_t r = 0;
    for (; r + 3 <= m; r += 3) dg_tile256_3(x + r * ldx, ldx, w, kc, c + r * ldc, ldc, nc, acc);
    if (m - r == 2) dg_tile256_2(x + r * ldx, ldx, w, kc, c + r * ldc, ldc, nc, acc);
    if (m - r == 1) dg_tile256_1(x + r * ldx, ldx, w, kc, c + r * ldc, ldc, nc, acc);
}
#endif /* DG_HAVE_X86 */

/* ------------------------------------------------------------------------------ instruction set */
/* 0 portable, 1 AVX2 + FMA, 2 AVX-512F: the best this CPU runs, unless lowered by dg_panel_set_isa. */
static int dg_panel_isa_best(void) {
#if DG_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
    return 0;
}

static int dg_panel_isa = -1;

static int dg_panel_get_isa(void) {
    if (dg_panel_isa < 0) dg_panel_isa = dg_panel_isa_best();
    return dg_panel_isa;
}

/* Sets the instruction set (clamped to what the CPU runs); returns the one in use. */
static int dg_panel_set_isa(int isa) {
    const int best = dg_panel_isa_best();
    dg_panel_isa = isa < 0 ? 0 : (isa > best ? best : isa);
    return dg_panel_isa;
}

static dg_panel_fn dg_panel_kernel(void) {
#if DG_HAVE_X86
    switch (dg_panel_get_isa()) {
        case 2: return dg_panel_avx512;
        case 1: return dg_panel_avx2;
        default: break;
    }
#endif
    return dg_panel_portable;
}

/* ------------------------------------------------------------------------------------- products */
/* kc (a multiple of 32, or the tail of K, itself a multiple of 32) values of k of one Q8_0 panel, widened:
   buf[k][j] = q[k][j] * scales[k / 32][j]. */
#if (defined(__GNUC__) && !defined(__clang__)) && defined(__x86_64__) && !defined(DG_NO_SIMD)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void dg_widen_q8_0(const int8_t *q, const float *scales, int64_t kc, float *buf) {
    for (int64_t k = 0; k < kc; k++) {
        const float *s = scales + (k / DG_QK) * DG_NR;
        const int8_t *qk = q + k * DG_NR;
        float *bk = buf + k * DG_NR;
        for (int j = 0; j < DG_NR; j++) bk[j] = (float)qk[j] * s[j];
    }
}

/* n bfloat16 values (their bits) widened to float32: dst[i] = bits(src[i]) << 16, exact. */
#if (defined(__GNUC__) && !defined(__clang__)) && defined(__x86_64__) && !defined(DG_NO_SIMD)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void dg_widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) {
        union { uint32_t u; float f; } v;
        v.u = (uint32_t)src[i] << 16;
        dst[i] = v.f;
    }
}

/* rows x cols of a bfloat16 matrix (row stride lds) widened into dst (row stride cols). */
static void dg_widen_bf16_rows(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, float *dst) {
    for (int64_t r = 0; r < rows; r++) dg_widen_bf16(src + r * lds, cols, dst + r * cols);
}

/* ---- where a product's weights come from
   W (N, K) as panels (``fast.experts.pack_panels``) of one of three types: float32 ``panels`` (ceil(N/32), K,
   32); Q8_0 ``qpanels`` int8 (ceil(N/32), K, 32) with float32 ``scales`` (ceil(N/32), K/32, 32), K a multiple
   of 32; bfloat16 bits ``bpanels`` (ceil(N/32), K, 32). Or row-major, read where it lies (a mapped checkpoint
   file), with row stride ``ldw``: float32 ``frows``, bfloat16 bits ``brows``, or Q8_0 blocks ``qrows`` (each
   row K/32 blocks of a little-endian float16 scale followed by 32 int8 values, llama.cpp's block_q8_0; ``ldw``
   then counts bytes). Exactly one source is set. */
typedef struct {
    const float *panels;
    const int8_t *qpanels;
    const float *scales;
    const uint16_t *bpanels;
    const float *frows;
    const uint16_t *brows;
    const uint8_t *qrows;
    int64_t ldw;
} dg_weights;

/* An IEEE half (its bits) as float32, exact (subnormals included). */
static inline float dg_half_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) {
        v.u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        v.u = sign;
    } else {  /* subnormal half: man * 2^-24, exact in float32 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

/* Rows row0 .. row0 + nc - 1, values k0 .. k0 + kc - 1, of row-major weights gathered into ``buf`` in the panel
   layout (buf[k * 32 + j]), zeros in the columns past nc: the values a panel chunk of the same weights holds. */
static void dg_gather_rows(const dg_weights *w, int64_t row0, int64_t nc, int64_t k0, int64_t kc, float *buf) {
    for (int64_t j = 0; j < nc; j++) {
        const int64_t r = row0 + j;
        if (w->frows) {
            const float *row = w->frows + r * w->ldw + k0;
            for (int64_t k = 0; k < kc; k++) buf[k * DG_NR + j] = row[k];
        } else if (w->brows) {
            const uint16_t *row = w->brows + r * w->ldw + k0;
            for (int64_t k = 0; k < kc; k++) {
                union { uint32_t u; float f; } v;
                v.u = (uint32_t)row[k] << 16;
                buf[k * DG_NR + j] = v.f;
            }
        } else {
            const uint8_t *block = w->qrows + r * w->ldw + (k0 / DG_QK) * (2 + DG_QK);
            for (int64_t k = 0; k < kc; k += DG_QK, block += 2 + DG_QK) {
                const float s = dg_half_to_float((uint16_t)(block[0] | (block[1] << 8)));
                const int8_t *q = (const int8_t *)(block + 2);
                for (int i = 0; i < DG_QK; i++) buf[(k + i) * DG_NR + j] = (float)q[i] * s;
            }
        }
    }
    for (int64_t j = nc; j < DG_NR; j++)  /* the panel layout's zero columns past N */
        for (int64_t k = 0; k < kc; k++) buf[k * DG_NR + j] = 0.0f;
}

/* c (m, N) = x (m, K) W^T for W from any source above. Each chunk (32 outputs x DG_KC values of k) is either read
   in place (float32 panels) or widened / gathered into a buffer on the calling thread's stack (32 KB), always
   into the same values, and the same tile runs on it: every source gives the float32 panels' result on the
   widened weights, bit for bit, and row-major weights are never copied whole. */
static void dg_weights_matmul(dg_panel_fn tile, const float *x, int64_t ldx, int64_t m, const dg_weights *w,
                              int64_t N, int64_t K, float *c, int64_t ldc) {
    float buf[DG_KC * DG_NR] __attribute__((aligned(64)));
    if (m <= 0 || N <= 0) return;
    if (K == 0) {
        for (int64_t r = 0; r < m; r++) memset(c + r * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    const int64_t P = (N + DG_NR - 1) / DG_NR;
    for (int64_t p = 0; p < P; p++) {
        const int64_t nc = N - p * DG_NR < DG_NR ? N - p * DG_NR : DG_NR;
        for (int64_t k0 = 0; k0 < K; k0 += DG_KC) {
            const int64_t kc = K - k0 < DG_KC ? K - k0 : DG_KC;
            const float *chunk = buf;
            if (w->qpanels)
                dg_widen_q8_0(w->qpanels + (p * K + k0) * DG_NR, w->scales + (p * (K / DG_QK) + k0 / DG_QK) * DG_NR,
                              kc, buf);
            else if (w->bpanels)
                dg_widen_bf16(w->bpanels + (p * K + k0) * DG_NR, kc * DG_NR, buf);
            else if (w->panels)
                chunk = w->panels + (p * K + k0) * DG_NR;
            else
                dg_gather_rows(w, p * DG_NR, nc, k0, kc, buf);
            tile(m, x + k0, ldx, chunk, kc, c + p * DG_NR, ldc, nc, k0 > 0);
        }
    }
}

/* c (m, N) = x (m, K) W^T, W as panels of one of the three panel types (the others NULL). */
static void dg_panel_matmul(dg_panel_fn tile, const float *x, int64_t ldx, int64_t m, const float *panels,
                            const int8_t *qpanels, const float *scales, const uint16_t *bpanels, int64_t N,
                            int64_t K, float *c, int64_t ldc) {
    const dg_weights w = {panels, qpanels, scales, bpanels, NULL, NULL, NULL, 0};
    dg_weights_matmul(tile, x, ldx, m, &w, N, K, c, ldc);
}

#endif /* DG_PANEL_GEMM_H */
