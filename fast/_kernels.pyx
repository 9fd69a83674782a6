# cython: language_level=3
"""Compiled CPU kernels of the fast path.

Everything here operates on float32 C-contiguous arrays (the last axis at least) and writes into
caller-provided outputs, so that a denoising step allocates nothing. Large matrix products are *not*
computed here: they run on NumPy's OpenBLAS, tile by tile (``gemm``); these kernels cover what surrounds
them: fused normalisations, rotary embedding, gated GELU, the masked attention softmax, the expert
dispatch bookkeeping and the per-step sampling pass. The one product of our own is the routed experts'
(``expert_ffn`` on weights packed as panels, ``fast/panel_gemm.h``): few rows per expert, where a BLAS
spends its time packing the weights.

Numerics. Each kernel computes the same float32 formula as the reference function named in its
docstring, with two kinds of deviation, both at float32 rounding level:

* sums run in a different order (interleaved lanes, then a fixed tree), and the long ones (norms,
  softmax denominators, entropies, cumulative probabilities) accumulate in float64;
* ``exp`` and ``tanh`` come from the branch-free single-precision approximations below (Cody-Waite
  range reduction and the Cephes polynomials, within ~2 ulp of the correctly rounded value) instead
  of NumPy's, so that the compiler can vectorise the loops that use them.

The inner loops are plain C written so that GCC auto-vectorises them; on x86-64 GCC they are compiled
twice (baseline SSE2 and AVX2, picked at load time by ``target_clones``). Both clones perform the
same IEEE operations in the same order (no FMA contraction: setup.py passes -ffp-contract=off, and
AVX2 does not imply FMA), so results do not depend on the machine. Parallel loops use OpenMP
``prange``; without OpenMP they run serially and compute the same numbers (work is split by rows,
and no reduction crosses rows).
"""

cimport cython
from cython.parallel import prange, threadid
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t
from libc.math cimport INFINITY, log

import numpy as np

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifdef _OPENMP
    #include <omp.h>
    static int dg_max_threads(void) { return omp_get_max_threads(); }
    static int dg_openmp_compiled(void) { return 1; }
    #else
    static int dg_max_threads(void) { return 1; }
    static int dg_openmp_compiled(void) { return 0; }
    #endif

    /* Let GCC if-convert the branch-free selects below into vector blends. This changes no value:
       it only stops the compiler from preserving floating-point exception flags, which nothing reads. */
    #if defined(__GNUC__) && !defined(__clang__)
    #pragma GCC optimize ("no-trapping-math")
    #endif

    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(DG_NO_CLONES)
    #define DG_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define DG_CLONES
    #endif

    /* exp(x) in single precision, branch-free so that loops calling it vectorise.
       Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes polynomial for exp(r), then 2^n applied
       as two factors 2^(n/2) so that results in the subnormal range round like a libm expf.
       Below -103.98 (and for -inf) the result is 0, above 88.7228 it is +inf; NaN propagates. */
    static inline float dg_expf(float x) {
        const float hi = 88.72283935546875f, lo = -103.97208f;
        float xc = x > hi ? hi : x;
        xc = xc < lo ? lo : xc;
        float fx = xc * 1.44269504088896341f;
        float n = (fx + 12582912.0f) - 12582912.0f;        /* round to nearest integer */
        float r = xc - n * 0.693359375f;
        r = r - n * -2.12194440e-4f;
        float z = r * r;
        float y = 1.9875691500E-4f;
        y = y * r + 1.3981999507E-3f;
        y = y * r + 8.3334519073E-3f;
        y = y * r + 4.1665795894E-2f;
        y = y * r + 1.6666665459E-1f;
        y = y * r + 5.0000001201E-1f;
        y = y * z + r;
        y = y + 1.0f;
        int32_t ni = (int32_t)n;
        int32_t n1 = ni >> 1, n2 = ni - (ni >> 1);
        uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
        float s1, s2;
        memcpy(&s1, &b1, 4);
        memcpy(&s2, &b2, 4);
        float result = (y * s1) * s2;
        result = x < lo ? 0.0f : result;
        result = x > hi ? INFINITY : result;
        return x != x ? x : result;
    }

    /* tanh(x) in single precision, branch-free: the Cephes odd polynomial for |x| < 0.625, otherwise
       1 - 2 / (exp(2|x|) + 1) with the sign restored; |x| is clamped at 9.1 where tanh rounds to 1. */
    static inline float dg_tanhf(float x) {
        float ax = fabsf(x);
        float z = x * x;
        float p = -5.70498872745E-3f;
        p = p * z + 2.06390887954E-2f;
        p = p * z - 5.37397155531E-2f;
        p = p * z + 1.33314422036E-1f;
        p = p * z - 3.33332819422E-1f;
        float small = p * z * x + x;
        float ac = ax > 9.1f ? 9.1f : ax;
        float e = dg_expf(2.0f * ac);
        float big = 1.0f - 2.0f / (e + 1.0f);
        big = x < 0.0f ? -big : big;
        float result = ax < 0.625f ? small : big;
        return x != x ? x : result;
    }

    /* GELU, tanh approximation: 0.5*x * (1 + tanh(y)), y = sqrt(2/pi) * (x + 0.044715*x*x*x), evaluated
       as x / (1 + exp(-2y)) (the same function: 1 + tanh(y) = 2 / (1 + exp(-2y))). This form has no
       cancellation where tanh(y) is near -1, so it stays within a few ulp of the exact value there,
       where the literal form (the reference's) loses up to |x| * 2^-24 absolute. */
    static inline float dg_gelu(float x) {
        float y = 0.7978845834732056f * (x + 0.044715f * x * x * x);
        return x / (1.0f + dg_expf(-2.0f * y));
    }

    /* ---- the bfloat16 run (SPEC §10.1): rounding points inside the fused kernels
       dg_bf16(x): x rounded to the nearest bfloat16, ties to even, widened back to float32 (exact), i.e.
       reference.primitives.round_to(x, BFLOAT16) (ml_dtypes' cast, torch's .to(torch.bfloat16)): the low 16
       bits are rounded away on the integer pattern (adding 0x7fff plus the kept lsb carries into the
       exponent where needed, so the largest finite floats overflow to +-inf and subnormals round as
       numbers); infinities are unchanged, and a NaN becomes the quiet NaN of its sign (0x7fc0 / 0xffc0,
       as ml_dtypes gives; truncating a NaN whose payload sits in the low bits would make an infinity).
       Branch-free, so loops calling it vectorise. */
    static inline uint32_t dg_bf16_round_bits(float x) {
        uint32_t u;
        memcpy(&u, &x, 4);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        uint32_t nan = (u & 0x80000000u) | 0x7fc00000u;
        return (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
    }

    static inline float dg_bf16(float x) {
        uint32_t r = dg_bf16_round_bits(x);
        float y;
        memcpy(&y, &r, 4);
        return y;
    }

    /* x = bf16(x), in place */
    DG_CLONES static void dg_round_row(float *x, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) x[i] = dg_bf16(x[i]);
    }

    /* out = the bfloat16 bit patterns of bf16(x / temp) (of bf16(x) when scaled is 0) */
    DG_CLONES static void dg_bf16_bits_row(const float *x, float temp, int scaled, Py_ssize_t n, uint16_t *out) {
        if (scaled) { for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint16_t)(dg_bf16_round_bits(x[i] / temp) >> 16); }
        else        { for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint16_t)(dg_bf16_round_bits(x[i]) >> 16); }
    }

    /* bfloat16 rotate-half RoPE in place: the two products and their sum each rounded (apply_rope); the
       reference's bf16(-b * s) is -bf16(b * s), so the first half is a difference of rounded products */
    DG_CLONES static void dg_rope_row_bf16(float *x, const float *c, const float *s, Py_ssize_t half) {
        for (Py_ssize_t j = 0; j < half; j++) {
            float a = x[j], b = x[j + half];
            x[j] = dg_bf16(dg_bf16(a * c[j]) - dg_bf16(b * s[j]));
            x[j + half] = dg_bf16(dg_bf16(b * c[j]) + dg_bf16(a * s[j]));
        }
    }

    /* bfloat16 gated GELU: bf16(bf16(gelu(g)) * u) */
    DG_CLONES static void dg_gelu_gate_row_bf16(const float *g, const float *u, Py_ssize_t n, float *out) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = dg_bf16(dg_bf16(dg_gelu(g[i])) * u[i]);
    }

    /* bfloat16 residual: h = bf16(bf16(h + bf16((y * factor) * w)) * scalar) (the norm's output, the sum and
       the scaled stream each rounded); returns 1 if any new h value is NaN or infinite */
    DG_CLONES static int dg_residual_row_bf16(float *h, const float *y, float factor, const float *w, float scalar,
                                              Py_ssize_t n) {
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            float v = dg_bf16(dg_bf16(h[i] + dg_bf16((y[i] * factor) * w[i])) * scalar);
            h[i] = v;
            bad |= !(v - v == 0.0f);
        }
        return bad;
    }

    /* bfloat16 a = bf16(bf16((a * fa) * wa) + bf16((b * fb) * wb)), in place in a */
    DG_CLONES static void dg_add_normed_rows_bf16(float *a, float fa, const float *wa, const float *b, float fb,
                                                  const float *wb, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) a[i] = dg_bf16(dg_bf16((a[i] * fa) * wa[i]) + dg_bf16((b[i] * fb) * wb[i]));
    }

    /* sum of squares of x in float64 (four interleaved lanes) */
    static inline double dg_sumsq(const float *x, Py_ssize_t n) {
        double acc[4] = {0, 0, 0, 0};
        Py_ssize_t i = 0;
        for (; i + 4 <= n; i += 4)
            for (int l = 0; l < 4; l++) acc[l] += (double)x[i + l] * (double)x[i + l];
        double tail = 0.0;
        for (; i < n; i++) tail += (double)x[i] * (double)x[i];
        return ((acc[0] + acc[2]) + (acc[1] + acc[3])) + tail;
    }

    /* the reference's RMSNorm factor: float32((mean(x^2) + eps) ** -0.5) */
    static inline float dg_rms_factor(const float *x, Py_ssize_t n, float eps) {
        float mean_square = (float)(dg_sumsq(x, n) / (double)n);
        return powf(mean_square + eps, -0.5f);
    }

    /* out = x * factor (* w when w is not NULL); out may alias x */
    DG_CLONES static void dg_scale_row(const float *x, float factor, const float *w, Py_ssize_t n, float *out) {
        if (w) { for (Py_ssize_t i = 0; i < n; i++) out[i] = (x[i] * factor) * w[i]; }
        else   { for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] * factor; }
    }

    /* h = (h + (y * factor) * w) * scalar */
    DG_CLONES static void dg_residual_row(float *h, const float *y, float factor, const float *w, float scalar,
                                          Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) h[i] = (h[i] + (y[i] * factor) * w[i]) * scalar;
    }

    /* as dg_residual_row, returning 1 if any new h value is NaN or infinite (v - v is 0 only for finite v) */
    DG_CLONES static int dg_residual_row_flag(float *h, const float *y, float factor, const float *w, float scalar,
                                              Py_ssize_t n) {
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            float v = (h[i] + (y[i] * factor) * w[i]) * scalar;
            h[i] = v;
            bad |= !(v - v == 0.0f);
        }
        return bad;
    }

    /* 1 if any of the n values is NaN or infinite */
    DG_CLONES static int dg_non_finite_row(const float *x, Py_ssize_t n) {
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) bad |= !(x[i] - x[i] == 0.0f);
        return bad;
    }

    /* a = (a * fa) * wa + (b * fb) * wb, in place in a */
    DG_CLONES static void dg_add_normed_rows(float *a, float fa, const float *wa, const float *b, float fb,
                                             const float *wb, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) a[i] = (a[i] * fa) * wa[i] + (b[i] * fb) * wb[i];
    }

    /* rotate-half RoPE in place: pairs (j, j + half) */
    DG_CLONES static void dg_rope_row(float *x, const float *c, const float *s, Py_ssize_t half) {
        for (Py_ssize_t j = 0; j < half; j++) {
            float a = x[j], b = x[j + half];
            x[j] = a * c[j] - b * s[j];
            x[j + half] = b * c[j] + a * s[j];
        }
    }

    DG_CLONES static void dg_gelu_gate_row(const float *g, const float *u, Py_ssize_t n, float *out) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = dg_gelu(g[i]) * u[i];
    }

    /* soft-cap in place; returns 1 if any input was NaN or infinite (the cap would hide an infinity) */
    DG_CLONES static int dg_softcap_row(float *x, float cap, Py_ssize_t n) {
        int bad = 0;
        for (Py_ssize_t i = 0; i < n; i++) { bad |= !(x[i] - x[i] == 0.0f); x[i] = cap * dg_tanhf(x[i] / cap); }
        return bad;
    }

    /* maximum of x (NaN entries are ignored; -inf for an empty or all -inf row). Eight running maxima
       kept in one GCC vector register, selected with a compare mask (a plain scalar loop elsewhere). */
    #if defined(__GNUC__)
    typedef float dg_v8f __attribute__((vector_size(32)));
    typedef int dg_v8i __attribute__((vector_size(32)));
    DG_CLONES static float dg_max_row(const float *x, Py_ssize_t n) {
        dg_v8f m = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            dg_v8f v;
            memcpy(&v, x + i, sizeof v);
            dg_v8i greater = v > m;
            m = (dg_v8f)((greater & (dg_v8i)v) | (~greater & (dg_v8i)m));
        }
        float best = -INFINITY;
        for (int l = 0; l < 8; l++) best = m[l] > best ? m[l] : best;
        for (; i < n; i++) best = x[i] > best ? x[i] : best;
        return best;
    }
    #else
    static float dg_max_row(const float *x, Py_ssize_t n) {
        float best = -INFINITY;
        for (Py_ssize_t i = 0; i < n; i++) best = x[i] > best ? x[i] : best;
        return best;
    }
    #endif

    /* out = exp(x - shift); returns the float64 sum of out */
    DG_CLONES static double dg_exp_shift_row(const float *x, float shift, Py_ssize_t n, float *out) {
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; l++) { float e = dg_expf(x[i + l] - shift); out[i + l] = e; acc[l] += (double)e; }
        double tail = 0.0;
        for (; i < n; i++) { float e = dg_expf(x[i] - shift); out[i] = e; tail += (double)e; }
        return (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) + tail;
    }

    DG_CLONES static void dg_div_row(float *x, float d, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) x[i] = x[i] / d;
    }

    /* y += a * x */
    DG_CLONES static void dg_axpy(float *y, float a, const float *x, Py_ssize_t n) {
        for (Py_ssize_t i = 0; i < n; i++) y[i] += a * x[i];
    }

    /* ---------------------------------------------------------------------------------- attention
       Masked float32 softmax of one row of attention scores s (T keys) for a query at position qp:
       key t is visible iff kreal[t] and kpos[t] >= 0 and (not causal or kpos[t] <= qp) and
       (window <= 0 or kpos[t] > qp - window). Hidden keys get weight 0; a row with no visible key
       becomes all zeros (the reference's zero output for such a query). */
    DG_CLONES static void dg_masked_softmax_row(float *s, Py_ssize_t T, const int64_t *kpos, const uint8_t *kreal,
                                                int64_t qp, int64_t window, int causal, int bf16) {
        int nan = 0;
        if (bf16) dg_round_row(s, T);   /* bfloat16 run: the scores are rounded before the float32 softmax */
        for (Py_ssize_t t = 0; t < T; t++) {
            int vis = kreal[t] && kpos[t] >= 0 && (!causal || kpos[t] <= qp) && (window <= 0 || kpos[t] > qp - window);
            nan |= vis & (s[t] != s[t]);
            s[t] = vis ? s[t] : -INFINITY;
        }
        if (nan) {                   /* a NaN score makes the whole row NaN, as in the reference (never zeros) */
            for (Py_ssize_t t = 0; t < T; t++) s[t] = NAN;
            return;
        }
        float m = dg_max_row(s, T);
        if (m == -INFINITY) {
            for (Py_ssize_t t = 0; t < T; t++) s[t] = 0.0f;
            return;
        }
        float total = (float)dg_exp_shift_row(s, m, T, s);
        dg_div_row(s, total, T);
        if (bf16) dg_round_row(s, T);   /* and its weights before the product with V */
    }

    /* ---------------------------------------------------------------------------------- sampling
       Two passes over one row of V logits z; zh = z / temp (a float32 division) or z when unscaled.
       The row is processed in blocks of DG_BLOCK entries, small enough to stay in L1 between loops.

       Pass 1 writes e = exp(zh - m_b) into out (which may be z itself), where m_b is the running maximum
       when block b was reached (kept in mb[b]), and returns the final maximum m, its first index, and
       S = sum exp(zh - m), A = sum exp(zh - m) * (zh - m) in float64 (the sums are rescaled whenever the
       running maximum rises). Flags: 1 zh holds NaN, 2 zh holds +inf, 4 zh is all -inf, 8 z holds +inf,
       16 z is all -inf; a flagged row's outputs are meaningless. */
    #define DG_BLOCK 2048
    DG_CLONES static void dg_row_pass1(const float *z, Py_ssize_t V, float temp, int scaled, float *out, float *mb,
                                       float *m_out, int64_t *arg_out, double *S_out, double *A_out, int *flags_out) {
        float m = -INFINITY; int64_t arg = 0; double S = 0.0, A = 0.0; int flags = 0, raw_finite_seen = 0;
        for (Py_ssize_t b0 = 0, blk = 0; b0 < V; b0 += DG_BLOCK, blk++) {
            Py_ssize_t n = V - b0 < DG_BLOCK ? V - b0 : DG_BLOCK;
            const float *zb = z + b0;
            float *ob = out + b0;
            int raw = 0, bad = 0;
            for (Py_ssize_t i = 0; i < n; i++) raw |= (zb[i] == INFINITY) | (zb[i] != -INFINITY) << 1;
            if (scaled) { for (Py_ssize_t i = 0; i < n; i++) ob[i] = zb[i] / temp; }
            else if (ob != zb) { for (Py_ssize_t i = 0; i < n; i++) ob[i] = zb[i]; }
            for (Py_ssize_t i = 0; i < n; i++) bad |= (ob[i] != ob[i]) | (ob[i] == INFINITY) << 1;
            flags |= bad | (raw & 1) << 3;
            raw_finite_seen |= raw >> 1;
            mb[blk] = m;
            if (flags & 3) continue;
            float bm = dg_max_row(ob, n);
            if (bm > m) {
                Py_ssize_t first = 0;
                while (ob[first] != bm) first++;
                arg = b0 + first;
                if (S > 0.0) {
                    double shift = (double)m - (double)bm;          /* < 0 */
                    double c = exp(shift);
                    A = c * (A + S * shift);
                    S = c * S;
                }
                m = bm;
                mb[blk] = m;
            }
            if (m == -INFINITY) {                     /* nothing finite yet: every e is 0 */
                for (Py_ssize_t i = 0; i < n; i++) ob[i] = 0.0f;
                continue;
            }
            double sacc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, aacc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            Py_ssize_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int l = 0; l < 8; l++) {
                    float d = ob[i + l] - m;
                    float e = dg_expf(d);
                    float dd = e > 0.0f ? d : 0.0f;    /* -inf entries contribute 0, not 0 * -inf */
                    ob[i + l] = e;
                    sacc[l] += (double)e;
                    aacc[l] += (double)e * (double)dd;
                }
            for (; i < n; i++) {
                float d = ob[i] - m;
                float e = dg_expf(d);
                float dd = e > 0.0f ? d : 0.0f;
                ob[i] = e;
                sacc[0] += (double)e;
                aacc[0] += (double)e * (double)dd;
            }
            S += (((sacc[0] + sacc[4]) + (sacc[1] + sacc[5])) + ((sacc[2] + sacc[6]) + (sacc[3] + sacc[7])));
            A += (((aacc[0] + aacc[4]) + (aacc[1] + aacc[5])) + ((aacc[2] + aacc[6]) + (aacc[3] + aacc[7])));
        }
        if (!(flags & 3) && m == -INFINITY) flags |= 4;
        if (!raw_finite_seen) flags |= 16;
        *m_out = m; *arg_out = arg; *S_out = S; *A_out = A; *flags_out = flags;
    }

    /* Pass 2: p = e * exp(mb[b] - m) / total in place in out (the factor is exactly 1 for blocks reached
       after the maximum), returning the float64 sum of the written float32 probabilities (lanes within
       a block, blocks in order). When draw_target >= 0, also find the inverse-CDF index for that target
       (first v whose running sum exceeds it, the running sum being the block sums before v's block plus
       the entries of the block up to v, added one by one); *found = -1 if none. *below / *at receive
       the running sums just before and at the found index, so that the caller can confirm the choice
       (dg_cdf_sure) against the final total. */
    DG_CLONES static double dg_row_pass2(float *out, Py_ssize_t V, const float *mb, float m, float total,
                                         double draw_target, int64_t *found, double *below, double *at) {
        double run = 0.0;
        *found = -1;
        for (Py_ssize_t b0 = 0, blk = 0; b0 < V; b0 += DG_BLOCK, blk++) {
            Py_ssize_t n = V - b0 < DG_BLOCK ? V - b0 : DG_BLOCK;
            float *ob = out + b0;
            double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            Py_ssize_t i = 0;
            if (mb[blk] == m) {
                for (; i + 8 <= n; i += 8)
                    for (int l = 0; l < 8; l++) { float p = ob[i + l] / total; ob[i + l] = p; acc[l] += (double)p; }
                for (; i < n; i++) { float p = ob[i] / total; ob[i] = p; acc[0] += (double)p; }
            } else {
                float c = mb[blk] == -INFINITY ? 0.0f : dg_expf(mb[blk] - m);
                for (; i + 8 <= n; i += 8)
                    for (int l = 0; l < 8; l++) { float p = (ob[i + l] * c) / total; ob[i + l] = p; acc[l] += (double)p; }
                for (; i < n; i++) { float p = (ob[i] * c) / total; ob[i] = p; acc[0] += (double)p; }
            }
            double bsum = (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
            if (draw_target >= 0.0 && *found < 0 && run + bsum > draw_target) {
                double c = run;
                for (Py_ssize_t k = 0; k < n; k++) {
                    double next = c + (double)ob[k];
                    if (next > draw_target) { *found = b0 + k; *below = c; *at = next; break; }
                    c = next;
                }
            }
            run += bsum;
        }
        return run;
    }

    /* ---- exactness of the draw
       The reference (categorical_from_uniform) draws the first v with Q_v > u * Q_{V-1}, where Q_v is the
       strictly left-to-right float64 sum p_0 + ... + p_v. The passes here form other float64 sums of the
       same values: block sums of 8 lanes, then entries one by one inside the chosen block. Every such
       running value E_v is still *a* float64 summation of exactly p_0..p_v, and for any summation of
       n <= V non-negative terms |computed - exact| <= gamma_V * X (X the exact sum of all V terms,
       gamma_V = V 2^-53 / (1 - V 2^-53); Higham, Accuracy and Stability, ch. 4). Hence |E_v - Q_v| <=
       2 gamma_V X, the kernel's total T differs from Q_{V-1} by as much, and u*T from u*Q_{V-1} by
       2 gamma_V X + 2^-52 X. With delta = (V + 2) 2^-50 T, at least twice the sum of those bounds: if
       E_{v-1} + delta < u*T < E_v - delta, then Q_{v-1} < u*Q_{V-1} < Q_v, so v is the reference's id
       too (Q is non-decreasing). Otherwise, i.e. the target lies within delta of a cumulative sum (about
       1e-10 of the mass for V = 262144, so ~5e-10 of the draws), the draw is recomputed by the reference's
       own rule (dg_cdf_exact). An id of probability 0 is never returned: E_v > E_{v-1} needs p_v > 0. */
    static inline double dg_cdf_margin(Py_ssize_t V, double total) {
        return ((double)V + 2.0) * 0x1p-50 * total;
    }

    static inline int dg_cdf_sure(double below, double at, double target, double margin) {
        return target - below > margin && at - target > margin;
    }

    /* The block search over finished probabilities p (V entries): the block by its 8-lane sum, then the
       entries one by one; the id when dg_cdf_sure confirms it against target = u * total, else -1. */
    static int64_t dg_cdf_search(const float *p, Py_ssize_t V, double target, double margin) {
        double c = 0.0;
        for (Py_ssize_t b0 = 0; b0 < V; b0 += DG_BLOCK) {
            Py_ssize_t n = V - b0 < DG_BLOCK ? V - b0 : DG_BLOCK;
            double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            Py_ssize_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int l = 0; l < 8; l++) acc[l] += (double)p[b0 + i + l];
            for (; i < n; i++) acc[0] += (double)p[b0 + i];
            double bsum = (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])));
            if (c + bsum > target) {
                double cc = c;
                for (Py_ssize_t k = 0; k < n; k++) {
                    double next = cc + (double)p[b0 + k];
                    if (next > target) return dg_cdf_sure(cc, next, target, margin) ? b0 + k : -1;
                    cc = next;
                }
                return -1;                    /* the block's sum and its entries disagree: too close */
            }
            c += bsum;
        }
        return -1;                            /* the target is at the total */
    }

    /* The reference's rule itself: Q by a strictly sequential float64 sum, target = u * Q_{V-1}, the first
       v with Q_v > target, else the last v with p > 0. (No FMA contraction: -ffp-contract=off.) */
    static int64_t dg_cdf_exact(const float *p, Py_ssize_t V, double u) {
        double total = 0.0;
        for (Py_ssize_t v = 0; v < V; v++) total += (double)p[v];
        double target = u * total, c = 0.0;
        for (Py_ssize_t v = 0; v < V; v++) {
            c += (double)p[v];
            if (c > target) return v;
        }
        for (Py_ssize_t v = V - 1; v >= 0; v--) if (p[v] > 0.0f) return v;
        return V - 1;
    }

    /* The draw for uniform u on a row whose pass 2 returned psum and its guess (found, below, at). */
    static int64_t dg_draw(const float *p, Py_ssize_t V, double u, double psum, int64_t found, double below,
                           double at) {
        double target = u * psum, margin = dg_cdf_margin(V, psum);
        if (found >= 0 && dg_cdf_sure(below, at, target, margin)) return found;
        found = dg_cdf_search(p, V, target, margin);
        return found >= 0 ? found : dg_cdf_exact(p, V, u);
    }
    """
    int dg_max_threads() nogil
    int dg_openmp_compiled() nogil
    float dg_expf(float x) nogil
    float dg_tanhf(float x) nogil
    float dg_gelu(float x) nogil
    float dg_rms_factor(const float *x, Py_ssize_t n, float eps) nogil
    void dg_scale_row(const float *x, float factor, const float *w, Py_ssize_t n, float *out) nogil
    void dg_residual_row(float *h, const float *y, float factor, const float *w, float scalar, Py_ssize_t n) nogil
    int dg_residual_row_flag(float *h, const float *y, float factor, const float *w, float scalar, Py_ssize_t n) nogil
    int dg_non_finite_row(const float *x, Py_ssize_t n) nogil
    void dg_add_normed_rows(float *a, float fa, const float *wa, const float *b, float fb, const float *wb,
                            Py_ssize_t n) nogil
    void dg_rope_row(float *x, const float *c, const float *s, Py_ssize_t half) nogil
    void dg_gelu_gate_row(const float *g, const float *u, Py_ssize_t n, float *out) nogil
    int dg_softcap_row(float *x, float cap, Py_ssize_t n) nogil
    float dg_max_row(const float *x, Py_ssize_t n) nogil
    double dg_exp_shift_row(const float *x, float shift, Py_ssize_t n, float *out) nogil
    void dg_div_row(float *x, float d, Py_ssize_t n) nogil
    void dg_axpy(float *y, float a, const float *x, Py_ssize_t n) nogil
    void dg_masked_softmax_row(float *s, Py_ssize_t T, const int64_t *kpos, const uint8_t *kreal, int64_t qp,
                               int64_t window, int causal, int bf16) nogil
    float dg_bf16(float x) nogil
    void dg_round_row(float *x, Py_ssize_t n) nogil
    void dg_bf16_bits_row(const float *x, float temp, int scaled, Py_ssize_t n, uint16_t *out) nogil
    void dg_rope_row_bf16(float *x, const float *c, const float *s, Py_ssize_t half) nogil
    void dg_gelu_gate_row_bf16(const float *g, const float *u, Py_ssize_t n, float *out) nogil
    int dg_residual_row_bf16(float *h, const float *y, float factor, const float *w, float scalar, Py_ssize_t n) nogil
    void dg_add_normed_rows_bf16(float *a, float fa, const float *wa, const float *b, float fb, const float *wb,
                                 Py_ssize_t n) nogil
    int DG_BLOCK
    void dg_row_pass1(const float *z, Py_ssize_t V, float temp, int scaled, float *out, float *mb, float *m_out,
                      int64_t *arg_out, double *S_out, double *A_out, int *flags_out) nogil
    double dg_row_pass2(float *out, Py_ssize_t V, const float *mb, float m, float total, double draw_target,
                        int64_t *found, double *below, double *at) nogil
    int64_t dg_draw(const float *p, Py_ssize_t V, double u, double psum, int64_t found, double below,
                    double at) nogil

#: Entries of a row of logits the sampling pass handles as one block (kept in L1 between its loops).
SAMPLING_BLOCK = DG_BLOCK


def sampling_scratch_width(Py_ssize_t vocab_size) -> int:
    """Floats of per-thread scratch ``sample_rows`` needs for rows of ``vocab_size`` logits (one per block)."""
    return max(1, (vocab_size + DG_BLOCK - 1) // DG_BLOCK)


def max_threads() -> int:
    """Threads an OpenMP parallel loop may use now (1 when compiled without OpenMP)."""
    return dg_max_threads()


# A parallel region is opened only for at least this much work (elements touched, weighted by a rough
# per-element cost; 2^21 is about a millisecond on one core): forking and joining threads costs
# microseconds, and when the cores are shared with other processes every join can wait a scheduler time
# slice for a descheduled thread, which for small calls dwarfs the work. So only the big loops (softcap
# and sampling over the vocabulary, attention over long caches, the norms of long prompts) go parallel.
cdef double _parallel_min_work = 2097152.0


def set_parallel_threshold(double work) -> float:
    """Set the minimum work for a parallel region (0: always parallel); returns the previous value.

    Results do not depend on it (work is split by rows and no reduction crosses rows); tests use it to
    run the parallel and the serial paths on the same small inputs.
    """
    global _parallel_min_work
    previous = _parallel_min_work
    _parallel_min_work = work
    return previous


cdef inline int _threads(Py_ssize_t items, double cost_per_item) noexcept nogil:
    """Threads for a loop of ``items`` independent rows costing ``cost_per_item`` each."""
    if items <= 1 or <double>items * cost_per_item < _parallel_min_work:
        return 1
    cdef int n = dg_max_threads()
    if items < n:
        n = <int>items
    return n if n > 0 else 1


cdef inline const float *_opt(const float[::1] w) noexcept nogil:
    return &w[0] if w is not None else NULL


# ============================================================================================ matrix products
# The products of the decoder and encoder run on NumPy's own OpenBLAS, called directly through its CBLAS
# entry point (``fast.blas`` finds it and hands its address to ``set_blas``), one BLAS thread per call,
# and the parallelism is OpenMP's: the output is cut into tiles fixed by the shapes alone and the threads
# take tiles as they come (dynamic schedule). A BLAS call split statically over its own threads waits for
# the slowest one, so on a core shared with another process every product waits a scheduler time slice;
# with tiles taken dynamically, a thread that is descheduled only delays the one tile it holds. Tiles do
# not depend on the thread count and each is one single-threaded BLAS call, so results are the same with
# any number of threads.
ctypedef void (*dg_sgemm_t)(int order, int transa, int transb, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc) noexcept nogil
ctypedef void (*dg_set_threads_t)(int n) noexcept nogil
ctypedef int (*dg_get_threads_t)() noexcept nogil

cdef dg_sgemm_t _sgemm = NULL
cdef dg_set_threads_t _blas_set_threads = NULL
cdef dg_get_threads_t _blas_get_threads = NULL
cdef int _ROW_MAJOR = 101, _NO_TRANS = 111, _TRANS = 112

#: Output tile of ``gemm``: at most this many columns, and this many rows once a product has more than
#: ``2 * GEMM_TILE_ROWS`` rows.
GEMM_TILE_COLS = 256
GEMM_TILE_ROWS = 128


def set_blas(size_t sgemm, size_t set_threads, size_t get_threads) -> bool:
    """Install the CBLAS ``sgemm`` (64-bit integers) and the thread-count functions of the BLAS library
    NumPy uses (addresses, 0 to uninstall). Products go through ``gemm`` only when the kernels were built
    with OpenMP (otherwise one multi-threaded BLAS call is as good). Returns whether ``gemm`` is usable."""
    global _sgemm, _blas_set_threads, _blas_get_threads
    _sgemm = <dg_sgemm_t><void *>sgemm
    _blas_set_threads = <dg_set_threads_t><void *>set_threads
    _blas_get_threads = <dg_get_threads_t><void *>get_threads
    return has_gemm()


def set_blas_threads(int n) -> int:
    """Set the installed BLAS library's thread count to ``n`` (n > 0; 0 only reads it); returns the previous
    count, or 0 when no BLAS is installed (``set_blas``)."""
    if _blas_get_threads == NULL or _blas_set_threads == NULL:
        return 0
    cdef int previous = _blas_get_threads()
    if n > 0 and n != previous:
        _blas_set_threads(n)
    return previous


def has_gemm() -> bool:
    """Whether ``gemm`` can run (a BLAS is installed and OpenMP is available)."""
    return (_sgemm != NULL and _blas_set_threads != NULL and _blas_get_threads != NULL
            and _openmp_compiled())


cdef inline bint _openmp_compiled() noexcept:
    return dg_openmp_compiled() != 0


cdef inline int _blas_serial_begin() noexcept nogil:
    """Set the BLAS library to one thread; returns the previous count (restored by ``_blas_serial_end``)."""
    cdef int previous = _blas_get_threads()
    if previous != 1:
        _blas_set_threads(1)
    return previous


cdef inline void _blas_serial_end(int previous) noexcept nogil:
    if previous != 1:
        _blas_set_threads(previous)


cdef struct _GemmTiles:
    Py_ssize_t tm, tn      # rows and columns of a tile (the last row / column of tiles may be smaller)
    Py_ssize_t col_tiles   # tiles across the N columns
    Py_ssize_t count       # tiles in all


cdef _GemmTiles _gemm_tiles(Py_ssize_t M, Py_ssize_t N):
    """The output tiles of ``gemm`` and ``gemm_bf16`` for an (M, N) product: at most GEMM_TILE_COLS columns,
    and GEMM_TILE_ROWS rows once M exceeds 2 * GEMM_TILE_ROWS (M, N > 0)."""
    cdef _GemmTiles t
    t.tm = M if M <= 2 * GEMM_TILE_ROWS else GEMM_TILE_ROWS
    t.tn = N if N <= GEMM_TILE_COLS else GEMM_TILE_COLS
    t.col_tiles = (N + t.tn - 1) // t.tn
    t.count = ((M + t.tm - 1) // t.tm) * t.col_tiles
    return t


cdef bint _empty_product(float[:, ::1] out, Py_ssize_t K):
    """True when an (M, N) product has nothing to sum: no output (M or N is 0), or K = 0 (out set to 0)."""
    cdef Py_ssize_t i, j
    if out.shape[0] == 0 or out.shape[1] == 0:
        return True
    if K == 0:
        for i in range(out.shape[0]):
            for j in range(out.shape[1]):
                out[i, j] = 0.0
        return True
    return False


@cython.boundscheck(False)
@cython.wraparound(False)
def gemm(const float[:, ::1] a, const float[:, ::1] b, bint trans_b, float[:, ::1] out):
    """``out = a @ b`` (``trans_b`` False, b: (K, N)) or ``out = a @ b.T`` (``trans_b`` True, b: (N, K)).

    a: (M, K), out: (M, N), all float32 with a contiguous last axis (rows may be strided). out must not
    overlap a or b. Tiles of at most GEMM_TILE_ROWS x GEMM_TILE_COLS run in parallel (dynamic schedule),
    each as one single-threaded BLAS call; the BLAS library's own thread count is 1 during the call and
    restored after. Raises ValueError for mismatched shapes, RuntimeError when ``has_gemm()`` is False.
    Same function as ``numpy.matmul`` (sums in the BLAS's order).
    """
    if not has_gemm():
        raise RuntimeError("gemm: no BLAS installed (fast.blas.install) or no OpenMP")
    cdef Py_ssize_t M = a.shape[0], K = a.shape[1]
    cdef Py_ssize_t N = b.shape[0] if trans_b else b.shape[1]
    cdef Py_ssize_t Kb = b.shape[1] if trans_b else b.shape[0]
    if Kb != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError(f"gemm: shapes {(a.shape[0], a.shape[1])} @ {(b.shape[0], b.shape[1])}"
                         f"{'.T' if trans_b else ''} -> {(out.shape[0], out.shape[1])} do not match")
    if _empty_product(out, K):
        return
    cdef _GemmTiles plan = _gemm_tiles(M, N)
    cdef Py_ssize_t tm = plan.tm, tn = plan.tn, col_tiles = plan.col_tiles, tiles = plan.count
    cdef Py_ssize_t t, i0, j0, mi, nj
    cdef int64_t lda = a.strides[0] // sizeof(float), ldc = out.strides[0] // sizeof(float)
    cdef int64_t ldb = b.strides[0] // sizeof(float)
    cdef const float *A = &a[0, 0]
    cdef const float *B = &b[0, 0]
    cdef float *C = &out[0, 0]
    cdef int tb = _TRANS if trans_b else _NO_TRANS
    cdef int nt = _threads(tiles, <double>tm * tn * K / 16.0)
    cdef int previous
    with nogil:
        previous = _blas_serial_begin()
        for t in prange(tiles, schedule="dynamic", num_threads=nt):
            i0 = (t // col_tiles) * tm
            j0 = (t % col_tiles) * tn
            mi = M - i0 if M - i0 < tm else tm
            nj = N - j0 if N - j0 < tn else tn
            _sgemm(_ROW_MAJOR, _NO_TRANS, tb, mi, nj, K, 1.0, A + i0 * lda, lda,
                   (B + j0 * ldb) if trans_b else (B + j0), ldb, 0.0, C + i0 * ldc + j0, ldc)
        _blas_serial_end(previous)


cdef extern from "panel_gemm.h":
    ctypedef void (*dg_panel_fn)(int64_t m, const float *x, int64_t ldx, const float *w, int64_t kc, float *c,
                                 int64_t ldc, int64_t nc, int acc) noexcept nogil
    int DG_NR
    int DG_KC
    int dg_panel_get_isa() noexcept nogil
    int dg_panel_set_isa(int isa) noexcept nogil
    dg_panel_fn dg_panel_kernel() noexcept nogil
    void dg_panel_matmul(dg_panel_fn tile, const float *x, int64_t ldx, int64_t m, const float *panels,
                         const int8_t *qpanels, const float *scales, const uint16_t *bpanels, int64_t N,
                         int64_t K, float *c, int64_t ldc) noexcept nogil
    ctypedef struct dg_weights:
        const float *panels
        const int8_t *qpanels
        const float *scales
        const uint16_t *bpanels
        const float *frows
        const uint16_t *brows
        const uint8_t *qrows
        int64_t ldw
    void dg_weights_matmul(dg_panel_fn tile, const float *x, int64_t ldx, int64_t m, const dg_weights *w,
                           int64_t N, int64_t K, float *c, int64_t ldc) noexcept nogil
    void dg_widen_bf16(const uint16_t *src, int64_t n, float *dst) noexcept nogil
    void dg_widen_bf16_rows(const uint16_t *src, int64_t lds, int64_t rows, int64_t cols, float *dst) noexcept nogil

@cython.boundscheck(False)
@cython.wraparound(False)
def gemm_bf16(const float[:, ::1] a, w, float[:, ::1] out, scratch=None):
    """``out = a @ w.T`` for a bfloat16 matrix w (N, K) (numpy's ``ml_dtypes.bfloat16``, last axis
    contiguous), a: (M, K) and out: (M, N) float32.

    The tiles of ``gemm``, each one single-threaded BLAS call as there, on the tile's rows of w widened to
    float32 (exact) into a buffer of its thread (GEMM_TILE_COLS x K values): the weights stay bfloat16 in
    memory, and the result is ``gemm`` on the widened matrix, bit for bit (the same calls on the same
    values). ``scratch``: a float32 C-contiguous array of at least ``max_threads() * GEMM_TILE_COLS * K``
    values to hold those buffers (``fast.blas`` keeps one per thread, so that a step allocates nothing);
    None or a smaller one: allocated for the call. Raises ValueError for mismatched shapes or a w that is
    not bfloat16, RuntimeError when ``has_gemm()`` is False.
    """
    if not has_gemm():
        raise RuntimeError("gemm_bf16: no BLAS installed (fast.blas.install) or no OpenMP")
    bits = bf16_bits(w)
    if bits is None:
        raise ValueError(f"gemm_bf16: w must be bfloat16, got {getattr(w, 'dtype', type(w).__name__)}")
    cdef const uint16_t[:, ::1] b = bits
    cdef Py_ssize_t M = a.shape[0], K = a.shape[1], N = b.shape[0]
    if b.shape[1] != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError(f"gemm_bf16: shapes {(a.shape[0], a.shape[1])} @ {(b.shape[0], b.shape[1])}.T"
                         f" -> {(out.shape[0], out.shape[1])} do not match")
    if _empty_product(out, K):
        return
    cdef _GemmTiles plan = _gemm_tiles(M, N)
    cdef Py_ssize_t tm = plan.tm, tn = plan.tn, col_tiles = plan.col_tiles, tiles = plan.count
    cdef Py_ssize_t t, i0, j0, mi, nj
    cdef int64_t lda = a.strides[0] // sizeof(float), ldc = out.strides[0] // sizeof(float)
    cdef int64_t ldb = b.strides[0] // sizeof(uint16_t)
    cdef const float *A = &a[0, 0]
    cdef const uint16_t *B = &b[0, 0]
    cdef float *C = &out[0, 0]
    cdef int nt = _threads(tiles, <double>tm * tn * K / 16.0)
    if scratch is None or scratch.dtype != np.float32 or not scratch.flags.c_contiguous or scratch.size < nt * tn * K:
        scratch = np.empty(nt * tn * K, dtype=np.float32)
    cdef float[:, ::1] buffers = scratch.reshape(-1)[:nt * tn * K].reshape(nt, tn * K)  # one widened tile a thread
    cdef float *wide
    cdef int previous
    with nogil:
        previous = _blas_serial_begin()
        for t in prange(tiles, schedule="dynamic", num_threads=nt):
            i0 = (t // col_tiles) * tm
            j0 = (t % col_tiles) * tn
            mi = M - i0 if M - i0 < tm else tm
            nj = N - j0 if N - j0 < tn else tn
            wide = &buffers[threadid(), 0]
            dg_widen_bf16_rows(B + j0 * ldb, ldb, nj, K, wide)
            _sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, mi, nj, K, 1.0, A + i0 * lda, lda, wide, K, 0.0,
                   C + i0 * ldc + j0, ldc)
        _blas_serial_end(previous)


#: Output columns of one weight panel (``fast.experts``: weights packed as (..., ceil(N/PANEL), K, PANEL)).
PANEL = DG_NR
#: Values of k one tile call covers (the Q8_0 path widens that many at a time).
PANEL_CHUNK = DG_KC
PANEL_ISAS = ("portable", "avx2", "avx512")


def panel_isa() -> str:
    """The instruction set the panel products run on: "avx512", "avx2" (with FMA) or "portable" (C fmaf)."""
    return PANEL_ISAS[dg_panel_get_isa()]


def set_panel_isa(str name) -> str:
    """Run the panel products on ``name`` (one of ``PANEL_ISAS``) or the best below it that this CPU runs;
    returns the one in use. All of them give the same bits (``fast/panel_gemm.h``); for tests and benchmarks."""
    if name not in PANEL_ISAS:
        raise ValueError(f"set_panel_isa: {name!r} is not one of {PANEL_ISAS}")
    return PANEL_ISAS[dg_panel_set_isa(PANEL_ISAS.index(name))]


cdef inline int _check_panels(str what, Py_ssize_t stacked_n, Py_ssize_t stacked_k, Py_ssize_t panels,
                              Py_ssize_t K, Py_ssize_t width, Py_ssize_t N) except -1:
    if width != DG_NR or panels != (N + DG_NR - 1) // DG_NR or K != stacked_k or stacked_n != N:
        raise ValueError(f"{what}: panels of shape ({panels}, {K}, {width}) do not hold a ({N}, {stacked_k}) "
                         f"matrix (expected ({(N + DG_NR - 1) // DG_NR}, {stacked_k}, {DG_NR}))")
    return 0


def bf16_bits(array):
    """The bit patterns (uint16 view) of a bfloat16 array (ml_dtypes), or None for any other dtype. The
    kernels take bfloat16 weights as these bits (a buffer of numpy's bfloat16 cannot be typed in Cython)."""
    if array is not None and getattr(array.dtype, "name", "") == "bfloat16":
        return array.view(np.uint16)
    return None


@cython.boundscheck(False)
@cython.wraparound(False)
def panel_matmul(const float[:, ::1] x, panels, Py_ssize_t N, float[:, ::1] out, scales=None):
    """``out = x @ W.T`` for W (N, K) packed as panels (``fast.experts.pack_panels``), on the calling thread.

    x: (m, K) float32; out: (m, N). ``panels``: float32 (ceil(N/32), K, 32), bfloat16 of that shape, or int8
    Q8_0 values of that shape with ``scales`` float32 (ceil(N/32), K/32, 32). Each output is the fused
    multiply-add chain over k in order (``fast/panel_gemm.h``): the same bits on every instruction set, and
    for Q8_0 and bfloat16 the same bits as the float32 panels of the widened matrix. Raises ValueError for
    mismatched shapes.
    """
    cdef Py_ssize_t m = x.shape[0], K = x.shape[1]
    if out.shape[0] != m or out.shape[1] != N:
        raise ValueError(f"panel_matmul: out is ({out.shape[0]}, {out.shape[1]}), expected ({m}, {N})")
    cdef const float[:, :, ::1] pf
    cdef const int8_t[:, :, ::1] pq
    cdef const uint16_t[:, :, ::1] pb
    cdef const float[:, :, ::1] sq
    cdef dg_panel_fn tile = dg_panel_kernel()
    bits = bf16_bits(panels)
    if bits is not None:
        if scales is not None:
            raise ValueError("panel_matmul: bfloat16 panels take no scales")
        pb = bits
        _check_panels("panel_matmul", N, K, pb.shape[0], pb.shape[1], pb.shape[2], N)
        if m and N:
            with nogil:
                dg_panel_matmul(tile, &x[0, 0] if K else <const float *>NULL, K, m, NULL, NULL, NULL,
                                &pb[0, 0, 0] if K else <const uint16_t *>NULL, N, K, &out[0, 0], N)
        return
    if scales is None:
        pf = panels
        _check_panels("panel_matmul", N, K, pf.shape[0], pf.shape[1], pf.shape[2], N)
        if m and N:
            with nogil:
                dg_panel_matmul(tile, &x[0, 0] if K else <const float *>NULL, K, m,
                                &pf[0, 0, 0] if K else <const float *>NULL, NULL, NULL, NULL, N, K, &out[0, 0], N)
        return
    pq, sq = panels, scales
    _check_panels("panel_matmul", N, K, pq.shape[0], pq.shape[1], pq.shape[2], N)
    if K % 32 or sq.shape[0] != pq.shape[0] or sq.shape[1] != K // 32 or sq.shape[2] != DG_NR:
        raise ValueError(f"panel_matmul: Q8_0 needs K a multiple of 32 and scales ({pq.shape[0]}, {K // 32}, "
                         f"{DG_NR}); got K = {K}, scales ({sq.shape[0]}, {sq.shape[1]}, {sq.shape[2]})")
    if m and N:
        with nogil:
            dg_panel_matmul(tile, &x[0, 0] if K else <const float *>NULL, K, m, NULL,
                            &pq[0, 0, 0] if K else <const int8_t *>NULL,
                            &sq[0, 0, 0] if K else <const float *>NULL, NULL, N, K, &out[0, 0], N)


@cython.boundscheck(False)
@cython.wraparound(False)
def expert_ffn(const float[:, ::1] x, const int64_t[::1] offsets, gate_up_panels, down_panels, Py_ssize_t I,
               float[:, ::1] gate_up, float[:, ::1] act, float[:, ::1] y, gate_up_scales=None, down_scales=None,
               bint bf16=False):
    """Every expert's gated MLP on its block of rows, on packed weights, experts in parallel.

    x: (R, H) rows grouped by expert (expert e owns [offsets[e], offsets[e+1])). Weights as panels
    (``fast.experts``): gate_up_panels (E, ceil(2I/32), H, 32) of [G_e; U_e] (gate rows first),
    down_panels (E, ceil(H/32), I, 32); float32, bfloat16 (both), or int8 Q8_0 values with the two
    ``*_scales`` (E, P, K/32, 32) float32. Buffers gate_up (R, 2I), act (R, I); y (R, H) gets ``(gelu_tanh(x G^T) * (x U^T)) D^T``.
    No BLAS involved: one task per expert (dynamic schedule), each output computed by one thread in a fixed
    order, so the result does not depend on the thread count. Raises ValueError for inconsistent shapes
    or offsets that are not ascending within [0, R]. ``bf16``: the bfloat16 run (SPEC §10.1 B3, B6) rounds
    the gate/up products, the GELU, its product with up, and the down product (each expert's output is
    bfloat16); the products still accumulate in float32.
    """
    cdef Py_ssize_t R = x.shape[0], H = x.shape[1], e, r, n, a0, E
    cdef bint q8 = gate_up_scales is not None
    if q8 != (down_scales is not None):
        raise ValueError("expert_ffn: give both scales (Q8_0) or neither (float32)")
    gate_bits, down_bits = bf16_bits(gate_up_panels), bf16_bits(down_panels)
    cdef bint bf = gate_bits is not None
    if bf != (down_bits is not None) or (bf and q8):
        raise ValueError("expert_ffn: gate_up and down panels must both be bfloat16 (without scales) or neither")
    cdef const uint16_t[:, :, :, ::1] gb, db
    cdef const uint16_t *gbp = NULL
    cdef const uint16_t *dbp = NULL
    cdef const float[:, :, :, ::1] gf, df, gs, ds
    cdef const int8_t[:, :, :, ::1] gq, dq
    cdef const float *gfp = NULL
    cdef const float *dfp = NULL
    cdef const float *gsp = NULL
    cdef const float *dsp = NULL
    cdef const int8_t *gqp = NULL
    cdef const int8_t *dqp = NULL
    shape_g, shape_d = tuple(gate_up_panels.shape), tuple(down_panels.shape)
    if q8:
        gq, dq, gs, ds = gate_up_panels, down_panels, gate_up_scales, down_scales
        if (H % 32 or I % 32 or tuple(gate_up_scales.shape) != (shape_g[0], shape_g[1], H // 32, DG_NR)
                or tuple(down_scales.shape) != (shape_d[0], shape_d[1], I // 32, DG_NR)):
            raise ValueError(f"expert_ffn: Q8_0 needs H ({H}) and I ({I}) multiples of 32 and scales "
                             f"({shape_g[0]}, {shape_g[1]}, {H // 32}, {DG_NR}) / ({shape_d[0]}, {shape_d[1]}, "
                             f"{I // 32}, {DG_NR}); got {tuple(gate_up_scales.shape)} / {tuple(down_scales.shape)}")
    elif bf:
        gb, db = gate_bits, down_bits
    else:
        gf, df = gate_up_panels, down_panels
    E = shape_g[0]
    if shape_d[0] != E or offsets.shape[0] != E + 1:
        raise ValueError(f"expert_ffn: {E} experts in gate_up, {shape_d[0]} in down, "
                         f"{offsets.shape[0]} offsets (expected {E + 1})")
    _check_panels("expert_ffn (gate_up)", 2 * I, H, shape_g[1], shape_g[2], shape_g[3], 2 * I)
    _check_panels("expert_ffn (down)", H, I, shape_d[1], shape_d[2], shape_d[3], H)
    if (gate_up.shape[0] < R or gate_up.shape[1] != 2 * I or act.shape[0] < R or act.shape[1] != I
            or y.shape[0] < R or y.shape[1] != H):
        raise ValueError(f"expert_ffn: buffers must be ({R}, {2 * I}), ({R}, {I}) and ({R}, {H})")
    if offsets[0] != 0 or offsets[E] > R:
        raise ValueError(f"expert_ffn: offsets must start at 0 and end at most at {R}")
    for e in range(E):  # validated before any product: a bad offset would read or write out of bounds
        if offsets[e + 1] < offsets[e]:
            raise ValueError(f"expert_ffn: offsets decrease at expert {e}")
    if R == 0 or H == 0 or I == 0 or E == 0:
        return
    if q8:
        gqp, dqp, gsp, dsp = &gq[0, 0, 0, 0], &dq[0, 0, 0, 0], &gs[0, 0, 0, 0], &ds[0, 0, 0, 0]
    elif bf:
        gbp, dbp = &gb[0, 0, 0, 0], &db[0, 0, 0, 0]
    else:
        gfp, dfp = &gf[0, 0, 0, 0], &df[0, 0, 0, 0]
    cdef int64_t Pg = shape_g[1], Pd = shape_d[1]
    cdef int64_t gu_size = Pg * H * DG_NR, down_size = Pd * I * DG_NR
    cdef int64_t gu_scale_size = Pg * (H // 32) * DG_NR, down_scale_size = Pd * (I // 32) * DG_NR
    cdef dg_panel_fn tile = dg_panel_kernel()
    cdef int nt = _threads(E, <double>offsets[E] / E * H * 3 * I / 16.0)
    with nogil:
        for e in prange(E, schedule="dynamic", num_threads=nt):
            a0 = offsets[e]
            n = offsets[e + 1] - a0
            if n > 0:
                _expert_block(tile, &x[a0, 0], n, H, I,
                              _panels(gfp + e * gu_size if gfp != NULL else NULL, gqp + e * gu_size if q8 else NULL,
                                      gsp + e * gu_scale_size if q8 else NULL, gbp + e * gu_size if bf else NULL),
                              _panels(dfp + e * down_size if dfp != NULL else NULL,
                                      dqp + e * down_size if q8 else NULL, dsp + e * down_scale_size if q8 else NULL,
                                      dbp + e * down_size if bf else NULL),
                              &gate_up[a0, 0], &act[a0, 0], &y[a0, 0], bf16)


cdef inline dg_weights _panels(const float *panels, const int8_t *qpanels, const float *scales,
                               const uint16_t *bpanels) noexcept nogil:
    """One expert's matrix as panels of one type (``panel_gemm.h``'s ``dg_weights``)."""
    cdef dg_weights w
    w.panels, w.qpanels, w.scales, w.bpanels = panels, qpanels, scales, bpanels
    w.frows, w.brows, w.qrows, w.ldw = NULL, NULL, NULL, 0
    return w


cdef inline dg_weights _rows(const float *frows, const uint16_t *brows, const uint8_t *qrows,
                             int64_t ldw) noexcept nogil:
    """One expert's matrix row-major where it lies (row stride ``ldw``: values, or bytes for Q8_0 blocks)."""
    cdef dg_weights w
    w.panels, w.qpanels, w.scales, w.bpanels = NULL, NULL, NULL, NULL
    w.frows, w.brows, w.qrows, w.ldw = frows, brows, qrows, ldw
    return w


cdef void _expert_block(dg_panel_fn tile, const float *x, Py_ssize_t n, Py_ssize_t H, Py_ssize_t I,
                        dg_weights gate_up_w, dg_weights down_w, float *gate_up, float *act, float *y,
                        bint bf16) noexcept nogil:
    """One expert's gated MLP on its n rows x (n, H): gate_up (n, 2I) = x [G; U]^T, act (n, I) = gelu(G x) * U x,
    y (n, H) = act D^T (rows contiguous); ``bf16`` rounds as ``expert_ffn`` says."""
    cdef Py_ssize_t r
    dg_weights_matmul(tile, x, H, n, &gate_up_w, 2 * I, H, gate_up, 2 * I)
    for r in range(n):
        if bf16:
            dg_round_row(gate_up + r * 2 * I, 2 * I)
            dg_gelu_gate_row_bf16(gate_up + r * 2 * I, gate_up + r * 2 * I + I, I, act + r * I)
        else:
            dg_gelu_gate_row(gate_up + r * 2 * I, gate_up + r * 2 * I + I, I, act + r * I)
    dg_weights_matmul(tile, act, I, n, &down_w, H, I, y, H)
    if bf16:
        for r in range(n):
            dg_round_row(y + r * H, H)


@cython.boundscheck(False)
@cython.wraparound(False)
def expert_ffn_rows(const float[:, ::1] x, const int64_t[::1] offsets, gate_up, down, Py_ssize_t I,
                    float[:, ::1] gate_up_out, float[:, ::1] act, float[:, ::1] y, bint bf16=False):
    """``expert_ffn`` on weights stored row-major, read where they lie (a mapped checkpoint file): gate_up
    (E, 2I, H) and down (E, H, I) as float32 or bfloat16 arrays (C-contiguous), or as Q8_0 blocks, uint8
    (E, 2I, H/32*34) and (E, H, I/32*34) (a GGUF file's bytes: a float16 scale then 32 int8 values a block).

    Each chunk of 32 rows is gathered into the buffer the panel path widens into, and the same tile runs on
    it (``panel_gemm.h``, ``dg_weights_matmul``): the result is ``expert_ffn``'s on the packed panels of the same
    weights, bit for bit, without the packed copy. Same buffers, offsets, ``bf16`` and errors as ``expert_ffn``.
    """
    cdef Py_ssize_t R = x.shape[0], H = x.shape[1], e, r, n, a0, E
    cdef bint q8 = getattr(gate_up, "dtype", None) == np.uint8
    gate_bits, down_bits = bf16_bits(gate_up), bf16_bits(down)
    cdef bint bf = gate_bits is not None
    if bf != (down_bits is not None) or q8 != (getattr(down, "dtype", None) == np.uint8):
        raise ValueError("expert_ffn_rows: gate_up and down must be of one kind (float32, bfloat16 or Q8_0 blocks)")
    cdef const uint16_t[:, :, ::1] gb, db
    cdef const float[:, :, ::1] gf, df
    cdef const uint8_t[:, :, ::1] gq, dq
    cdef const float *gfp = NULL
    cdef const float *dfp = NULL
    cdef const uint16_t *gbp = NULL
    cdef const uint16_t *dbp = NULL
    cdef const uint8_t *gqp = NULL
    cdef const uint8_t *dqp = NULL
    cdef int64_t ldg, ldd
    if q8:
        gq, dq = gate_up, down
        if H % 32 or I % 32 or gq.shape[2] != H // 32 * 34 or dq.shape[2] != I // 32 * 34:
            raise ValueError(f"expert_ffn_rows: Q8_0 needs H ({H}) and I ({I}) multiples of 32 and rows of "
                             f"{H // 32 * 34} / {I // 32 * 34} bytes")
        shape_g, shape_d = (gq.shape[0], gq.shape[1]), (dq.shape[0], dq.shape[1])
        ldg, ldd = gq.shape[2], dq.shape[2]
    elif bf:
        gb, db = gate_bits, down_bits
        shape_g, shape_d = (gb.shape[0], gb.shape[1], gb.shape[2]), (db.shape[0], db.shape[1], db.shape[2])
        ldg, ldd = H, I
    else:
        gf, df = gate_up, down
        shape_g, shape_d = (gf.shape[0], gf.shape[1], gf.shape[2]), (df.shape[0], df.shape[1], df.shape[2])
        ldg, ldd = H, I
    E = shape_g[0]
    if (shape_d[0] != E or shape_g[1] != 2 * I or shape_d[1] != H
            or (not q8 and (shape_g[2] != H or shape_d[2] != I)) or offsets.shape[0] != E + 1):
        raise ValueError(f"expert_ffn_rows: gate_up {shape_g} and down {shape_d} do not hold {E} experts of "
                         f"({2 * I}, {H}) and ({H}, {I}), or {offsets.shape[0]} offsets are not {E + 1}")
    if (gate_up_out.shape[0] < R or gate_up_out.shape[1] != 2 * I or act.shape[0] < R or act.shape[1] != I
            or y.shape[0] < R or y.shape[1] != H):
        raise ValueError(f"expert_ffn_rows: buffers must be ({R}, {2 * I}), ({R}, {I}) and ({R}, {H})")
    if offsets[0] != 0 or offsets[E] > R:
        raise ValueError(f"expert_ffn_rows: offsets must start at 0 and end at most at {R}")
    for e in range(E):
        if offsets[e + 1] < offsets[e]:
            raise ValueError(f"expert_ffn_rows: offsets decrease at expert {e}")
    if R == 0 or H == 0 or I == 0 or E == 0:
        return
    if q8:
        gqp, dqp = &gq[0, 0, 0], &dq[0, 0, 0]
    elif bf:
        gbp, dbp = &gb[0, 0, 0], &db[0, 0, 0]
    else:
        gfp, dfp = &gf[0, 0, 0], &df[0, 0, 0]
    cdef int64_t g_size = 2 * I * ldg, d_size = H * ldd
    cdef dg_panel_fn tile = dg_panel_kernel()
    cdef int nt = _threads(E, <double>offsets[E] / E * H * 3 * I / 16.0)
    with nogil:
        for e in prange(E, schedule="dynamic", num_threads=nt):
            a0 = offsets[e]
            n = offsets[e + 1] - a0
            if n > 0:
                _expert_block(tile, &x[a0, 0], n, H, I,
                              _rows(gfp + e * g_size if gfp != NULL else NULL, gbp + e * g_size if gbp != NULL else NULL,
                                    gqp + e * g_size if gqp != NULL else NULL, ldg),
                              _rows(dfp + e * d_size if dfp != NULL else NULL, dbp + e * d_size if dbp != NULL else NULL,
                                    dqp + e * d_size if dqp != NULL else NULL, ldd),
                              &gate_up_out[a0, 0], &act[a0, 0], &y[a0, 0], bf16)


# ============================================================================================ elementwise
@cython.boundscheck(False)
@cython.wraparound(False)
def round_bf16(float[:, ::1] x):
    """Round every value of x (N, D) float32 to bfloat16 in place, kept as float32 (exact).

    ``reference.primitives.round_to(x, BFLOAT16)`` bit for bit: nearest, ties to even, overflow to +-inf,
    infinities kept, a NaN the quiet NaN of its sign (``dg_bf16``). The bfloat16 run's rounding of a
    product's float32 accumulation (SPEC §10.1 B3) and of the other results no kernel fuses.
    """
    cdef Py_ssize_t N = x.shape[0], D = x.shape[1], i
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, D)):
        dg_round_row(&x[i, 0], D)


@cython.boundscheck(False)
@cython.wraparound(False)
def bf16_bits_of(const float[:, ::1] x, float temperature, uint16_t[:, ::1] out):
    """``out`` = the bit patterns of ``bf16(x / temperature)`` (of ``bf16(x)`` when temperature is 0): the
    bfloat16 run's self-conditioning input, the processed logits cast to the embedding dtype (SPEC §10.1
    B8), kept at 2 bytes a value. x: (N, V) float32, out: (N, V) uint16 (view them as ``ml_dtypes.bfloat16``).
    """
    cdef Py_ssize_t N = x.shape[0], V = x.shape[1], i
    cdef bint scaled = temperature > 0
    if out.shape[0] != N or out.shape[1] != V:
        raise ValueError(f"bf16_bits_of: out must have shape ({N}, {V})")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 2 * V)):
        dg_bf16_bits_row(&x[i, 0], temperature, scaled, V, &out[i, 0])


@cython.boundscheck(False)
@cython.wraparound(False)
def vector_exp(const float[::1] x, float[::1] out):
    """``out = exp(x)`` with the kernels' single-precision exp (exposed for testing)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        out[i] = dg_expf(x[i])


@cython.boundscheck(False)
@cython.wraparound(False)
def vector_tanh(const float[::1] x, float[::1] out):
    """``out = tanh(x)`` with the kernels' single-precision tanh (exposed for testing)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        out[i] = dg_tanhf(x[i])


@cython.boundscheck(False)
@cython.wraparound(False)
def rms_norm(const float[:, ::1] x, const float[::1] weight, float eps, float[:, ::1] out, bint bf16=False):
    """RMSNorm of each row: ``out = x * (mean(x**2) + eps) ** -0.5 [* weight]``. out may be x.

    x, out: (N, D) float32; weight: (D,) float32 or None (weightless norm).
    Replaces ``reference.primitives.rms_norm`` (mean of squares accumulated in float64). ``bf16``: the
    output is rounded to bfloat16 (SPEC §10.1 B2).
    """
    cdef Py_ssize_t N = x.shape[0], D = x.shape[1], i
    cdef const float *w = _opt(weight)
    cdef float f
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 2 * D)):
        f = dg_rms_factor(&x[i, 0], D, eps)
        dg_scale_row(&x[i, 0], f, w, D, &out[i, 0])
        if bf16:
            dg_round_row(&out[i, 0], D)


@cython.boundscheck(False)
@cython.wraparound(False)
def residual_norm_add(float[:, ::1] h, const float[:, ::1] y, const float[::1] weight, float eps, float scalar,
                      bint bf16=False):
    """Fused residual update ``h = (h + rms_norm(y, weight)) * scalar``, in place.

    h, y: (N, H) float32; weight: (H,). ``scalar`` = 1 after attention (SPEC §4.1 step 8); the layer
    scalar is folded into the feed-forward residual instead (``feed_forward_residual``). ``bf16``: the
    norm's output, the sum and the scaled stream are each rounded to bfloat16 (SPEC §10.1 B2, B7).
    """
    cdef Py_ssize_t N = h.shape[0], D = h.shape[1], i
    cdef float f
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 2 * D)):
        f = dg_rms_factor(&y[i, 0], D, eps)
        if bf16:
            dg_residual_row_bf16(&h[i, 0], &y[i, 0], f, &weight[0], scalar, D)
        else:
            dg_residual_row(&h[i, 0], &y[i, 0], f, &weight[0], scalar, D)


@cython.boundscheck(False)
@cython.wraparound(False)
def feed_forward_residual(float[:, ::1] h, float[:, ::1] dense, const float[:, ::1] moe,
                          const float[::1] w_dense, const float[::1] w_moe, const float[::1] w_out,
                          float eps, float scalar, bint bf16=False):
    """End of a block: ``h = (h + norm_out(norm_dense(dense) + norm_moe(moe))) * scalar`` in place.

    h, dense, moe: (N, H) float32 (``dense`` is overwritten with the sum of the two normed branches).
    Replaces the tail of ``reference.layers.feed_forward`` plus the residual add and the layer scalar of
    ``Model._block_tail`` (SPEC §4.2 steps 9-13).
    Returns the number of rows of the new ``h`` holding a NaN or an infinity (0 normally): the block's
    output check, fused into the write so that it costs no extra pass. ``bf16``: the bfloat16 run rounds
    both branch norms, their sum, the output norm, the residual sum and the scaled stream (SPEC §10.1 B7).
    """
    cdef Py_ssize_t N = h.shape[0], D = h.shape[1], i
    cdef float fa, fb, f
    cdef Py_ssize_t bad = 0
    if dense.shape[0] != N or moe.shape[0] != N or dense.shape[1] != D or moe.shape[1] != D:
        raise ValueError("h, dense and moe must have the same shape")
    if w_dense.shape[0] != D or w_moe.shape[0] != D or w_out.shape[0] != D:
        raise ValueError(f"norm weights must have {D} entries")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 5 * D)):
        fa = dg_rms_factor(&dense[i, 0], D, eps)
        fb = dg_rms_factor(&moe[i, 0], D, eps)
        if bf16:
            dg_add_normed_rows_bf16(&dense[i, 0], fa, &w_dense[0], &moe[i, 0], fb, &w_moe[0], D)
            f = dg_rms_factor(&dense[i, 0], D, eps)
            bad += dg_residual_row_bf16(&h[i, 0], &dense[i, 0], f, &w_out[0], scalar, D)
        else:
            dg_add_normed_rows(&dense[i, 0], fa, &w_dense[0], &moe[i, 0], fb, &w_moe[0], D)
            f = dg_rms_factor(&dense[i, 0], D, eps)
            bad += dg_residual_row_flag(&h[i, 0], &dense[i, 0], f, &w_out[0], scalar, D)
    return bad


@cython.boundscheck(False)
@cython.wraparound(False)
def gelu_gate(const float[:, ::1] gate_up, float[:, ::1] out, bint bf16=False):
    """``out = gelu_tanh(gate) * up`` where ``gate_up = [gate | up]`` along the last axis.

    gate_up: (N, 2I) float32, out: (N, I). Replaces ``gelu_tanh(x @ G.T) * (x @ U.T)`` of
    ``reference.primitives.gated_mlp`` and the expert activation of ``reference.layers.experts``.
    ``bf16``: the GELU and the product are each rounded to bfloat16 (SPEC §10.1 B3).
    """
    cdef Py_ssize_t N = out.shape[0], I = out.shape[1], i
    if gate_up.shape[1] != 2 * I or gate_up.shape[0] != N:
        raise ValueError(f"gate_up has shape {tuple(gate_up.shape)[:2]}, expected ({N}, {2 * I})")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 20 * I)):
        if bf16:
            dg_gelu_gate_row_bf16(&gate_up[i, 0], &gate_up[i, I], I, &out[i, 0])
        else:
            dg_gelu_gate_row(&gate_up[i, 0], &gate_up[i, I], I, &out[i, 0])


@cython.boundscheck(False)
@cython.wraparound(False)
def softcap(float[:, ::1] x, float cap, bint bf16=False):
    """Final logit soft-cap in place: ``x = cap * tanh(x / cap)``. x: (N, V) float32.

    Replaces ``reference.primitives.softcap``. Returns the number of rows whose input held a NaN or an
    infinity (0 normally; the cap would turn an infinity into +-cap, so callers must look at this).
    ``bf16``: x is first rounded to bfloat16 (the bfloat16 run's output projection, SPEC §10.1 B9; the
    check then sees the rounded values, as the reference's does).
    """
    cdef Py_ssize_t N = x.shape[0], V = x.shape[1], i
    cdef Py_ssize_t bad = 0
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 20 * V)):
        if bf16:
            dg_round_row(&x[i, 0], V)
        bad += dg_softcap_row(&x[i, 0], cap, V)
    return bad


@cython.boundscheck(False)
@cython.wraparound(False)
def count_non_finite_rows(const float[:, ::1] x):
    """Rows of x (N, D) float32 holding a NaN or an infinity."""
    cdef Py_ssize_t N = x.shape[0], D = x.shape[1], i
    cdef Py_ssize_t bad = 0
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, D)):
        bad += dg_non_finite_row(&x[i, 0], D)
    return bad


@cython.boundscheck(False)
@cython.wraparound(False)
def softmax(const float[:, ::1] x, float[:, ::1] out):
    """Row softmax in float32: ``out = exp(x - max) / sum`` (sum accumulated in float64). out may be x.

    x, out: (N, V). Rows must hold no NaN/+inf (callers check). Replaces the softmax inside
    ``reference.model.Model.self_conditioning_embedding``.
    """
    cdef Py_ssize_t N = x.shape[0], V = x.shape[1], i
    cdef float m, total
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 15 * V)):
        m = dg_max_row(&x[i, 0], V)
        total = <float>dg_exp_shift_row(&x[i, 0], m, V, &out[i, 0])
        dg_div_row(&out[i, 0], total, V)


@cython.boundscheck(False)
@cython.wraparound(False)
def embed(const int64_t[::1] ids, const float[:, ::1] table, float scale, const float[:, ::1] add,
          bint normalize, float eps, float[:, ::1] out, bint bf16=False):
    """Scaled embedding lookup, optionally plus a signal and a weightless RMSNorm.

    ids: (N,) int64 in [0, V) (checked by the caller); table: (V, H); add: (N, H) or None.
    ``out = table[ids] * scale``, then ``out += add`` if given, then ``out = rms_norm(out)`` if
    ``normalize``. Replaces ``reference.primitives.embed`` (encoder input) and the canvas input
    ``rms_norm(embed(x) + signal)`` of ``Model.canvas_input`` (SPEC §7.1 step 4). ``bf16``: the product,
    the sum and the norm are each rounded to bfloat16 (SPEC §10.1 B1, B8; the caller passes the scale
    already rounded, as upstream casts it to the weight dtype).
    """
    cdef Py_ssize_t N = ids.shape[0], H = table.shape[1], V = table.shape[0], i, k
    cdef float f
    cdef bint has_add = add is not None
    if out.shape[0] != N or out.shape[1] != H or (has_add and (add.shape[0] != N or add.shape[1] != H)):
        raise ValueError(f"embed: out/add must have shape ({N}, {H})")
    for i in range(N):  # every index is validated: an id outside the table would read out of bounds
        if ids[i] < 0 or ids[i] >= V:
            raise IndexError(f"embed: token id {ids[i]} at {i} is outside [0, {V})")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 3 * H)):
        for k in range(H):
            out[i, k] = table[ids[i], k] * scale
        if bf16:
            dg_round_row(&out[i, 0], H)
        if has_add:
            for k in range(H):
                out[i, k] = out[i, k] + add[i, k]
            if bf16:
                dg_round_row(&out[i, 0], H)
        if normalize:
            f = dg_rms_factor(&out[i, 0], H, eps)
            dg_scale_row(&out[i, 0], f, NULL, H, &out[i, 0])
            if bf16:
                dg_round_row(&out[i, 0], H)


# ============================================================================================ attention
@cython.boundscheck(False)
@cython.wraparound(False)
def heads(const float[:, :, ::1] proj, Py_ssize_t n_heads, Py_ssize_t n_kv, Py_ssize_t d, bint has_v,
          const float[::1] q_norm, const float[::1] k_norm, float eps,
          const float[:, ::1] cos, const float[:, ::1] sin,
          float[:, :, :, ::1] q_out, float[:, :, :, :] k_out, float[:, :, :, :] v_out, bint bf16=False):
    """Split a fused q/k/v projection into normalised, rotated heads.

    proj: (N, S, n_h*d + g*d [+ g*d]) float32: ``x @ [Wq; Wk; Wv].T`` (the Wv block only when has_v).
    cos, sin: (S, d/2) float32 RoPE tables of the S positions (the reference's angle table, one half).
    Writes q_out (N, S, n_h, d) = RoPE(q_norm(q)); k_out (N, g, S, d) = RoPE(k_norm(k_raw));
    v_out (N, g, S, d) = weightless norm of v_raw, or of the *raw* keys k_raw when there is no v
    projection (full-attention layers; trap T3). k_out / v_out may be strided views (e.g. cache slots)
    with a contiguous last axis.
    Replaces ``reference.layers.project_qkv`` after its matrix products. ``bf16``: the bfloat16 run
    (SPEC §10.1 B2, B4): every norm's output is rounded, and each rotation's two products and their sum
    are rounded; cos and sin must then be the rounded tables.
    """
    cdef Py_ssize_t N = proj.shape[0], S = proj.shape[1], half = d // 2
    cdef Py_ssize_t qw = n_heads * d, kw = n_kv * d
    cdef Py_ssize_t need = qw + kw + (kw if has_v else 0)
    if proj.shape[2] != need:
        raise ValueError(f"projection width {proj.shape[2]} != {need}")
    if k_out.strides[3] != sizeof(float) or v_out.strides[3] != sizeof(float):
        raise ValueError("k_out / v_out need a contiguous last axis")
    if cos.shape[0] != S or cos.shape[1] != half or sin.shape[0] != S or sin.shape[1] != half:
        raise ValueError(f"RoPE table has shape {tuple(cos.shape)[:2]}, expected ({S}, {half})")
    if tuple(q_out.shape)[:4] != (N, S, n_heads, d) or q_norm.shape[0] != d or k_norm.shape[0] != d:
        raise ValueError(f"q_out must have shape {(N, S, n_heads, d)} and q_norm/k_norm {d} entries")
    if tuple(k_out.shape)[:4] != (N, n_kv, S, d) or tuple(v_out.shape)[:4] != (N, n_kv, S, d):
        raise ValueError(f"k_out / v_out must have shape {(N, n_kv, S, d)}")
    cdef Py_ssize_t item, n, s, h
    cdef float f
    cdef const float *src
    cdef float *dst
    for item in prange(N * S, nogil=True, schedule="guided", num_threads=_threads(N * S, 8 * (n_heads + 2 * n_kv) * d)):
        n = item // S
        s = item % S
        for h in range(n_heads):
            src = &proj[n, s, h * d]
            dst = &q_out[n, s, h, 0]
            f = dg_rms_factor(src, d, eps)
            dg_scale_row(src, f, &q_norm[0], d, dst)
            if bf16:
                dg_round_row(dst, d)
                dg_rope_row_bf16(dst, &cos[s, 0], &sin[s, 0], half)
            else:
                dg_rope_row(dst, &cos[s, 0], &sin[s, 0], half)
        for h in range(n_kv):
            # values first: on full layers they are the raw keys, before k_norm and RoPE
            src = &proj[n, s, qw + kw + h * d] if has_v else &proj[n, s, qw + h * d]
            f = dg_rms_factor(src, d, eps)
            dg_scale_row(src, f, NULL, d, &v_out[n, h, s, 0])
            if bf16:
                dg_round_row(&v_out[n, h, s, 0], d)
            src = &proj[n, s, qw + h * d]
            dst = &k_out[n, h, s, 0]
            f = dg_rms_factor(src, d, eps)
            dg_scale_row(src, f, &k_norm[0], d, dst)
            if bf16:
                dg_round_row(dst, d)
                dg_rope_row_bf16(dst, &cos[s, 0], &sin[s, 0], half)
            else:
                dg_rope_row(dst, &cos[s, 0], &sin[s, 0], half)


@cython.boundscheck(False)
@cython.wraparound(False)
def masked_softmax(float[:, ::1] scores, const int64_t[::1] q_pos, const int64_t[::1] key_pos,
                   const uint8_t[::1] key_real, Py_ssize_t window, bint causal, bint bf16=False):
    """Attention weights in place: a masked float32 softmax of every row of ``scores``.

    scores: (R, T) float32 raw scores q.k (scale 1); row i belongs to the query at position
    ``q_pos[i % len(q_pos)]`` (rows of several heads of the same queries follow each other).
    key_pos: (T,) int64 absolute position of each key (-1: an empty cache slot); key_real: (T,) uint8.
    Key t is visible from query position p iff it is real, ``(not causal or pos <= p)`` and
    ``(window <= 0 or pos > p - window)``. Hidden keys get weight exactly 0 and a row with no visible
    key is all zeros. Replaces the masking and softmax of ``reference.layers.attend`` with the visibility
    rules of ``reference.masks``. ``bf16``: the bfloat16 run (SPEC §10.1 B5): the scores are rounded to
    bfloat16 first and the float32 weights are rounded after the division.
    """
    cdef Py_ssize_t R = scores.shape[0], T = scores.shape[1], S = q_pos.shape[0], i
    if key_pos.shape[0] != T or key_real.shape[0] != T:
        raise ValueError(f"key_pos / key_real must have {T} entries")
    if S == 0 or R % S:
        raise ValueError(f"{R} score rows are not a whole number of {S}-query groups")
    if T == 0:
        return
    for i in prange(R, nogil=True, schedule="guided", num_threads=_threads(R, 12 * T)):
        dg_masked_softmax_row(&scores[i, 0], T, &key_pos[0], &key_real[0], q_pos[i % S], window, causal, bf16)


# ============================================================================================ experts
@cython.boundscheck(False)
@cython.wraparound(False)
def route(float[:, ::1] logits, const float[::1] per_expert_scale, int64_t[:, ::1] indices, float[:, ::1] weights):
    """Top-K routing from router logits; ``logits`` is overwritten with the router probabilities.

    logits: (N, E) float32 = ``z @ W_router.T``. p = float32 softmax over all E experts (written back
    into ``logits``). Writes indices (N, K) int64 (largest probability first, ties to the lower expert
    index, as a stable descending sort) and weights (N, K) float32 = ``p_top / sum(p_top) *
    per_expert_scale[index]`` (the sum of the K values accumulated left to right in float32).
    SPEC §4.2 step 10, trap T7. Replaces the part of ``reference.layers.route`` after its matrix product.

    Every index written is in [0, E), whatever the logits hold: a NaN probability ranks below every
    number (as NumPy's stable ``argsort`` of ``-p`` puts NaN last), so a row of NaN (router input or
    weights not finite) picks experts 0..K-1 like the reference, and its NaN weights carry the NaN on
    to the block output, where the caller's finiteness check reports it.
    """
    cdef Py_ssize_t N = logits.shape[0], E = logits.shape[1], K = indices.shape[1], i, k, e, best
    cdef float m, total, bp, p, key, psum
    if K > E or indices.shape[0] != N or weights.shape[0] != N or weights.shape[1] != K:
        raise ValueError(f"route: indices/weights must have shape ({N}, K <= {E})")
    if per_expert_scale.shape[0] != E:
        raise ValueError(f"route: per_expert_scale has {per_expert_scale.shape[0]} entries, expected {E}")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, (K + 15) * E)):
        m = dg_max_row(&logits[i, 0], E)
        total = <float>dg_exp_shift_row(&logits[i, 0], m, E, &logits[i, 0])
        dg_div_row(&logits[i, 0], total, E)
        for k in range(K):
            best = -1
            bp = -2.0
            p = 0.0
            for e in range(E):
                key = logits[i, e]
                if key != key:
                    key = -1.0      # NaN: below every probability, above "nothing chosen yet"
                if key > bp and not _taken(&indices[i, 0], k, e):
                    best = e
                    bp = key
                    p = logits[i, e]
            indices[i, k] = best    # always set: K <= E leaves an expert not taken
            weights[i, k] = p
        psum = 0.0
        for k in range(K):
            psum = psum + weights[i, k]
        for k in range(K):
            weights[i, k] = weights[i, k] / psum * per_expert_scale[indices[i, k]]


cdef inline bint _taken(const int64_t *chosen, Py_ssize_t k, Py_ssize_t e) noexcept nogil:
    cdef Py_ssize_t t
    for t in range(k):
        if chosen[t] == e:
            return True
    return False


@cython.boundscheck(False)
@cython.wraparound(False)
def group_by_expert(const int64_t[:, ::1] indices, int64_t[::1] offsets, int64_t[::1] order,
                    int64_t[:, ::1] position):
    """Counting sort of the (token, slot) choices by expert.

    indices: (N, K) expert of each token's k-th choice. Writes offsets (E + 1,) (expert e owns rows
    [offsets[e], offsets[e+1]) of the grouped buffers), order (N*K,) the token of each grouped row
    (ascending within an expert) and position (N, K) the grouped row of each choice.
    """
    cdef Py_ssize_t N = indices.shape[0], K = indices.shape[1], E = offsets.shape[0] - 1, i, k, e
    if order.shape[0] != N * K or position.shape[0] != N or position.shape[1] != K:
        raise ValueError(f"group_by_expert: order must have {N * K} entries and position shape ({N}, {K})")
    for i in range(N):  # validated before any write: an index outside [0, E) would write out of bounds
        for k in range(K):
            if indices[i, k] < 0 or indices[i, k] >= E:
                raise IndexError(f"group_by_expert: expert index {indices[i, k]} of token {i}, slot {k} "
                                 f"is outside [0, {E})")
    offsets[:] = 0
    for i in range(N):
        for k in range(K):
            offsets[indices[i, k] + 1] += 1
    for e in range(E):
        offsets[e + 1] += offsets[e]
    cdef int64_t[::1] fill = np.array(offsets[:E], dtype=np.int64)
    for i in range(N):
        for k in range(K):
            e = indices[i, k]
            order[fill[e]] = i
            position[i, k] = fill[e]
            fill[e] += 1


@cython.boundscheck(False)
@cython.wraparound(False)
def gather_rows(const float[:, ::1] src, const int64_t[::1] rows, float[:, ::1] out):
    """``out[i] = src[rows[i]]``: (N, H), (M,) -> (M, H). Raises ``IndexError`` for a row outside [0, N)."""
    cdef Py_ssize_t M = rows.shape[0], H = src.shape[1], i, k
    if out.shape[0] != M or out.shape[1] != H:
        raise ValueError(f"gather_rows: out must have shape ({M}, {H})")
    for i in range(M):
        if rows[i] < 0 or rows[i] >= src.shape[0]:
            raise IndexError(f"gather_rows: row {rows[i]} at {i} is outside [0, {src.shape[0]})")
    for i in prange(M, nogil=True, schedule="guided", num_threads=_threads(M, H)):
        for k in range(H):
            out[i, k] = src[rows[i], k]


@cython.boundscheck(False)
@cython.wraparound(False)
def combine_experts(const float[:, ::1] expert_out, const int64_t[:, ::1] indices,
                    const int64_t[:, ::1] position, const float[:, ::1] weights, float[:, ::1] out,
                    bint bf16=False):
    """Weighted sum of each token's expert outputs, in ascending expert order.

    expert_out: (M, H) grouped expert outputs; indices, position, weights: (N, K); out: (N, H).
    ``out[i] = sum over the token's experts e (ascending) of expert_out[row] * weight``, each product
    rounded to float32 before it is added, as ``numpy.add.at`` does in ``reference.layers.experts``.
    ``bf16``: the float32 sum is rounded once to bfloat16 (SPEC §10.1 B6, transformers' default
    ``grouped_mm`` experts).
    """
    cdef Py_ssize_t N = out.shape[0], H = out.shape[1], K = indices.shape[1], i, k, t, j, c
    cdef int64_t prev, e_t, e_j
    if (indices.shape[0] != N or position.shape[0] != N or weights.shape[0] != N or position.shape[1] != K
            or weights.shape[1] != K or expert_out.shape[1] != H):
        raise ValueError("combine_experts: indices/position/weights must be (N, K) and expert_out (M, H)")
    for i in range(N):  # every grouped row read must exist
        for k in range(K):
            if position[i, k] < 0 or position[i, k] >= expert_out.shape[0] or indices[i, k] < 0:
                raise IndexError(f"combine_experts: token {i}, slot {k} points at grouped row {position[i, k]} "
                                 f"(expert {indices[i, k]}) outside [0, {expert_out.shape[0]})")
    for i in prange(N, nogil=True, schedule="guided", num_threads=_threads(N, 2 * K * H)):
        for c in range(H):
            out[i, c] = 0.0
        prev = -1
        for t in range(K):          # the token's experts, smallest index first (they are distinct)
            e_t = -1
            k = 0
            for j in range(K):
                e_j = indices[i, j]
                if e_j > prev and (e_t < 0 or e_j < e_t):
                    e_t = e_j
                    k = j
            prev = e_t
            dg_axpy(&out[i, 0], weights[i, k], &expert_out[position[i, k], 0], H)
        if bf16:
            dg_round_row(&out[i, 0], H)


# ============================================================================================ sampling
@cython.boundscheck(False)
@cython.wraparound(False)
def sample_rows(const float[:, ::1] logits, float[:, ::1] probs, const int64_t[::1] rows, float temperature,
                const double[::1] uniforms, float[:, ::1] scratch, int64_t[::1] argmax, float[::1] entropy,
                int64_t[::1] sampled, int[::1] flags):
    """The fused per-step sampling pass over rows of soft-capped logits.

    logits: (R_all, V) float32, read; probs: (R_all, V) float32, written (it may be ``logits`` itself:
    each row is consumed before it is overwritten). Only rows ``rows`` (R,) are touched.
    temperature: T > 0, or 0 for none.
    For each processed row, with ẑ = logits / T (a float32 division, as ``sampling.scale_logits``):
      argmax[i]  first index of the maximum of ẑ (``sampling.argmax_tokens``),
      entropy[i] float32 entropy of softmax(ẑ) in nats (``sampling.softmax_and_entropy``), computed as
                 log S - A / S with S = sum e^(ẑ-m), A = sum e^(ẑ-m) (ẑ-m) accumulated in float64,
      probs[row] p = exp(ẑ - m) / float32(S) (the probabilities, for sampling and for the next step's
                 self-conditioning input; exp is taken against the running maximum of the row and
                 rescaled, so p is within a few ulp of the reference's value),
      sampled[i] (only if uniforms is not None) the inverse-CDF draw for uniforms[i] in [0, 1):
                 exactly the id of ``sampling.categorical_from_uniform`` on the written row p (the first
                 id whose left-to-right float64 cumulative sum exceeds u * total, else the last id of
                 nonzero probability), for every u. The pass finds it from block sums; a target within
                 the proven rounding bound of a cumulative sum (see dg_cdf_margin) is redone by the
                 reference's sequential rule, so no id of probability 0 is ever drawn,
      flags[i]   1 ẑ holds NaN, 2 ẑ holds +inf, 4 ẑ is all -inf, 8 the logits hold +inf, 16 the logits
                 are all -inf; a flagged row's other outputs (and its probs row) are meaningless (the
                 caller raises).
    Each row is read once and written twice (pass 1: statistics and exponentials; pass 2: normalisation
    and the draw), whatever V is.
    scratch: (threads, sampling_scratch_width(V)) float32.
    """
    cdef Py_ssize_t R = rows.shape[0], V = logits.shape[1], i, row, tid
    if probs.shape[0] != logits.shape[0] or probs.shape[1] != V:
        raise ValueError("probs must have the shape of logits")
    if argmax.shape[0] < R or entropy.shape[0] < R or flags.shape[0] < R or (sampled is not None and sampled.shape[0] < R):
        raise ValueError(f"sample_rows: outputs need {R} entries")
    for i in range(R):
        if rows[i] < 0 or rows[i] >= logits.shape[0]:
            raise IndexError(f"sample_rows: row {rows[i]} at {i} is outside [0, {logits.shape[0]})")
    cdef bint scaled = temperature > 0
    cdef bint draw = uniforms is not None
    if draw and uniforms.shape[0] != R:
        raise ValueError(f"{uniforms.shape[0]} uniforms for {R} rows")
    if scratch.shape[1] < sampling_scratch_width(V):
        raise ValueError("sampling scratch too small")
    cdef int nt = _threads(R, 12.0 * V)
    if nt > scratch.shape[0]:
        nt = <int>scratch.shape[0]
    cdef float m, total
    cdef int64_t arg, found
    cdef double S, A, psum, below, at, target
    cdef int fl
    for i in prange(R, nogil=True, schedule="dynamic", num_threads=nt):
        tid = threadid()
        row = rows[i]
        m = 0.0      # assigned here so that prange makes these per-thread (the kernels write them
        arg = 0      # through pointers, which Cython's privatisation analysis does not see)
        S = 0.0
        A = 0.0
        fl = 0
        found = -1
        below = 0.0
        at = 0.0
        dg_row_pass1(&logits[row, 0], V, temperature, scaled, &probs[row, 0], &scratch[tid, 0], &m, &arg, &S, &A,
                     &fl)
        flags[i] = fl
        if fl != 0:
            continue
        argmax[i] = arg
        entropy[i] = <float>(log(S) - A / S)
        total = <float>S
        target = -1.0
        if draw:
            target = uniforms[i] * (S / <double>total)   # estimate of u * sum(p); confirmed below
        psum = dg_row_pass2(&probs[row, 0], V, &scratch[tid, 0], m, total, target, &found, &below, &at)
        if draw:
            sampled[i] = dg_draw(&probs[row, 0], V, uniforms[i], psum, found, below, at)
