// bfloat16 matrix product with float32 accumulation, on tensor cores (sm_80 and later): the projection of a
// bfloat16 run, y = x @ W^T, as upstream's nn.Linear computes it in bfloat16 (reference/primitives.py linear
// with dtype bfloat16, SPEC §10.1: exact bf16 products, float32 sums, the output rounded once to bfloat16).

#include "common.cuh"
#include "bf16.cuh"

// Element `at` of the A operand as bfloat16 bits: from the bits, or a float32 rounded to nearest even.
__device__ __forceinline__ unsigned short dg_gemm_a(const unsigned short* a_opt, const float* a_f32_opt,
                                                     long long at) {
    return a_f32_opt ? dg_float_to_bf16(a_f32_opt[at]) : a_opt[at];
}

// c[m, n] = sum_k a[m, k] * b[n, k] in float32, for a (M, K) and b (N, K) bfloat16 (uint16 bits, row-major:
// b is a weight as stored, (out, in)). Operands:
//   a_opt (M, K) bfloat16 bits, or a_f32_opt (M, K) float32 (exactly one of the two): a float32 A is rounded to
//     bfloat16 as it is loaded (nearest, ties to even; exact for the bf16-valued float32 activations of a
//     bfloat16 run, and the reference's round_to for float32 probabilities);
//   b_kn = 0: b (N, K), the "nt" product a @ b^T; b_kn = 1: b (K, N), the "nn" product a @ b (the
//     self-conditioning soft embedding probs @ E with the (V, H) table as stored).
// Outputs, either or both (the host passes at least one):
//   c_opt (M, N) float32: the float32 accumulator as it is, or (round_c = 1) rounded to bfloat16 and widened
//     back to float32 (a bf16-valued float32 activation);
//   c_bf16_opt (M, N) bfloat16 bits: the accumulator rounded to nearest, ties to even (dg_float_to_bf16).
// Entries past M, N or K are read as zero, so any shape works (K = 0 writes zeros). grid (ceil(N / TN),
// ceil(M / TM)), block DG_BF16_THREADS; each block stages a TM x TK slice of a and a TN x TK slice of b in
// shared memory per step (8 bytes per load where both operands are bf16 bits, b is (N, K), K % 4 == 0 and a, b
// are 8-byte aligned; element by element otherwise), and each warp runs 2 x 4 mma tiles of 16 x 8 on it
// (k 16 at a time).
extern "C" __global__ void __launch_bounds__(DG_BF16_THREADS)
dg_gemm_bf16(const unsigned short* a_opt, const unsigned short* b, float* c_opt, unsigned short* c_bf16_opt, int M,
             int N, int K, const float* a_f32_opt, int b_kn, int round_c) {
    // bf16 pairs (k, k + 1; dg_bf16_pair), rows padded by 4 pairs (16 bytes) so that the fragment reads of the
    // 8 row groups of a warp spread over the banks
    constexpr int P = DG_BF16_TK / 2;
    __shared__ unsigned as[DG_BF16_TM][P + 4];
    __shared__ unsigned bs[DG_BF16_TN][P + 4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * DG_BF16_TM, n0 = blockIdx.x * DG_BF16_TN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;     // the warp's 32 x 32 corner of the block tile
    // 8-byte loads (4 bf16) when every row starts 8-byte aligned; element by element otherwise (the same
    // choice in every thread: it depends on the arguments only)
    const unsigned short* a = a_opt;
    const bool wide = !a_f32_opt && !b_kn && K % 4 == 0 && ((unsigned long long)a & 7) == 0 &&
                      ((unsigned long long)b & 7) == 0;
    float acc[2][4][4];
    #pragma unroll
    for (int mi = 0; mi < 2; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += DG_BF16_TK) {
        if (wide) {
            dg_bf16_stage_wide<DG_BF16_TM, P>(as, a, m0, M, K, k0);
            dg_bf16_stage_wide<DG_BF16_TN, P>(bs, b, n0, N, K, k0);
        } else {
            for (int i = threadIdx.x; i < DG_BF16_TM * P; i += blockDim.x) {
                const int r = i / P, p = i - r * P, gk = k0 + 2 * p;
                const long long at = (long long)(m0 + r) * K + gk;
                const bool in = m0 + r < M;
                as[r][p] = dg_bf16_pair(in && gk < K ? dg_gemm_a(a, a_f32_opt, at) : (unsigned short)0,
                                        in && gk + 1 < K ? dg_gemm_a(a, a_f32_opt, at + 1) : (unsigned short)0);
            }
            // b (K, N): consecutive threads take consecutive columns n (coalesced reads of a row of b)
            for (int i = threadIdx.x; b_kn && i < DG_BF16_TN * P; i += blockDim.x) {
                const int r = i % DG_BF16_TN, p = i / DG_BF16_TN, gk = k0 + 2 * p;
                const unsigned short* col = b + n0 + r;
                const bool in = n0 + r < N;
                bs[r][p] = dg_bf16_pair(in && gk < K ? col[(long long)gk * N] : (unsigned short)0,
                                        in && gk + 1 < K ? col[(long long)(gk + 1) * N] : (unsigned short)0);
            }
            if (!b_kn) dg_bf16_stage<DG_BF16_TN, P>(bs, b, n0, N, K, k0);
        }
        __syncthreads();
        #pragma unroll
        for (int ks = 0; ks < P; ks += 8) {                    // 8 pairs: the mma's 16-deep k
            unsigned af[2][4], bf[4][2];
            #pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const unsigned* top = as[wm + mi * 16 + g] + ks + t;
                const unsigned* bottom = as[wm + mi * 16 + g + 8] + ks + t;
                af[mi][0] = top[0];
                af[mi][1] = bottom[0];
                af[mi][2] = top[4];
                af[mi][3] = bottom[4];
            }
            dg_bf16_b_frags(bf, bs, wn, ks, g, t);
            #pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                #pragma unroll
                for (int ni = 0; ni < 4; ++ni) dg_mma_bf16_16816(acc[mi][ni], af[mi], bf[ni]);
        }
        __syncthreads();                              // the tiles are read before the next step overwrites them
    }
    #pragma unroll
    for (int mi = 0; mi < 2; ++mi)
        #pragma unroll
        for (int ni = 0; ni < 4; ++ni)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = m0 + wm + mi * 16 + g + (i >> 1) * 8, n = n0 + wn + ni * 8 + 2 * t + (i & 1);
                if (m >= M || n >= N) continue;
                const long long at = (long long)m * N + n;
                const float v = acc[mi][ni][i];
                if (c_opt) c_opt[at] = round_c ? dg_bf16_to_float(dg_float_to_bf16(v)) : v;
                if (c_bf16_opt) c_bf16_opt[at] = dg_float_to_bf16(v);
            }
}
