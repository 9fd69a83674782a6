// bfloat16 matrix product with float32 accumulation, on tensor cores (sm_80 and later): the projection of a
// bfloat16 run, y = x @ W^T, as upstream's nn.Linear computes it in bfloat16 (reference/primitives.py linear
// with dtype bfloat16, SPEC §10.1: exact bf16 products, float32 sums, the output rounded once to bfloat16).

#include "common.cuh"
#include "bf16.cuh"

// c[m, n] = sum_k a[m, k] * b[n, k] in float32, for a (M, K) and b (N, K) bfloat16 (uint16 bits, row-major:
// b is a weight as stored, (out, in)). Outputs, either or both (the host passes at least one):
//   c_opt (M, N) float32: the float32 accumulator as it is;
//   c_bf16_opt (M, N) bfloat16 bits: the accumulator rounded to nearest, ties to even (dg_float_to_bf16).
// Entries past M, N or K are read as zero, so any shape works (K = 0 writes zeros). grid (ceil(N / TN),
// ceil(M / TM)), block DG_BF16_THREADS; each block stages a TM x TK slice of a and a TN x TK slice of b in
// shared memory per step, and each warp runs 2 x 4 mma tiles of 16 x 8 on it (k 16 at a time).
extern "C" __global__ void __launch_bounds__(DG_BF16_THREADS)
dg_gemm_bf16(const unsigned short* a, const unsigned short* b, float* c_opt, unsigned short* c_bf16_opt, int M,
             int N, int K) {
    // rows padded by 8 bf16 (16 bytes) so that the fragment reads of the 8 row groups spread over the banks
    __shared__ unsigned short as[DG_BF16_TM][DG_BF16_TK + 8];
    __shared__ unsigned short bs[DG_BF16_TN][DG_BF16_TK + 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * DG_BF16_TM, n0 = blockIdx.x * DG_BF16_TN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;     // the warp's 32 x 32 corner of the block tile
    float acc[2][4][4];
    for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni)
            for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += DG_BF16_TK) {
        for (int i = threadIdx.x; i < DG_BF16_TM * DG_BF16_TK; i += blockDim.x) {
            const int r = i / DG_BF16_TK, kk = i - r * DG_BF16_TK, gk = k0 + kk;
            as[r][kk] = (m0 + r < M && gk < K) ? a[(long long)(m0 + r) * K + gk] : (unsigned short)0;
        }
        for (int i = threadIdx.x; i < DG_BF16_TN * DG_BF16_TK; i += blockDim.x) {
            const int r = i / DG_BF16_TK, kk = i - r * DG_BF16_TK, gk = k0 + kk;
            bs[r][kk] = (n0 + r < N && gk < K) ? b[(long long)(n0 + r) * K + gk] : (unsigned short)0;
        }
        __syncthreads();
        for (int ks = 0; ks < DG_BF16_TK; ks += 16) {
            unsigned af[2][4], bf[4][2];
            for (int mi = 0; mi < 2; ++mi) {
                const unsigned short* top = as[wm + mi * 16 + g] + ks + 2 * t;
                const unsigned short* bottom = as[wm + mi * 16 + g + 8] + ks + 2 * t;
                af[mi][0] = dg_bf16_pair(top[0], top[1]);
                af[mi][1] = dg_bf16_pair(bottom[0], bottom[1]);
                af[mi][2] = dg_bf16_pair(top[8], top[9]);
                af[mi][3] = dg_bf16_pair(bottom[8], bottom[9]);
            }
            for (int ni = 0; ni < 4; ++ni) {
                const unsigned short* col = bs[wn + ni * 8 + g] + ks + 2 * t;
                bf[ni][0] = dg_bf16_pair(col[0], col[1]);
                bf[ni][1] = dg_bf16_pair(col[8], col[9]);
            }
            for (int mi = 0; mi < 2; ++mi)
                for (int ni = 0; ni < 4; ++ni) dg_mma_bf16_16816(acc[mi][ni], af[mi], bf[ni]);
        }
        __syncthreads();                              // the tiles are read before the next step overwrites them
    }
    for (int mi = 0; mi < 2; ++mi)
        for (int ni = 0; ni < 4; ++ni)
            for (int i = 0; i < 4; ++i) {
                const int m = m0 + wm + mi * 16 + g + (i >> 1) * 8, n = n0 + wn + ni * 8 + 2 * t + (i & 1);
                if (m >= M || n >= N) continue;
                const long long at = (long long)m * N + n;
                if (c_opt) c_opt[at] = acc[mi][ni][i];
                if (c_bf16_opt) c_bf16_opt[at] = dg_float_to_bf16(acc[mi][ni][i]);
            }
}
