// The routed experts' two projections in a bfloat16 run, on tensor cores: the grouped GEMM of moe.cu with the
// expert matrices as bfloat16 bits and a bfloat16 output (reference/layers.py experts with dtype bfloat16: each
// expert's nn.Linear-like product with exact bf16 products, float32 sums, the output rounded once; SPEC §10.1 B6).
// The tokens are grouped by expert into row tiles of DG_GEMM_TM rows by dg_group_experts / dg_gather_rows
// (moe.cu), exactly as for the float32 dg_grouped_gemm_nt.

#include "common.cuh"
#include "bf16.cuh"

// Grouped y = x @ W[g]^T in bfloat16: for row tile m (rows m*TM .. m*TM+TM-1, TM = DG_GEMM_TM = the mma's 16)
// with g = tile_group[m] >= 0, acc[row, col] = sum_k x[row, k] * w[g, col, k] in float32, and
//   y[row, col] = bf16(acc) widened to float32 (nearest, ties to even: dg_float_to_bf16);
//   y_acc_opt[row, col] = acc as it is (float32; may be NULL).
// x: (m_tiles*TM, k_dim) float32 holding bfloat16 values (converted to bf16 bits on staging: exact for such
// values, a rounding to nearest otherwise); w: (G, n_out, k_dim) bfloat16 bits, each expert's matrix row-major
// (out, in) as the checkpoint stores it; y, y_acc_opt: (m_tiles*TM, n_out). Tiles with g < 0 are skipped (their
// rows are left as they are). Entries past n_out or k_dim are read as zero, so any n_out, k_dim work (k_dim = 0
// writes zeros). grid (ceil(n_out / DG_MOE_BF16_TN), m_tiles), block DG_MOE_BF16_THREADS: warp w computes columns
// [w*32, w*32 + 32) of the block's DG_MOE_BF16_TN as 4 mma tiles of 16 x 8, 16 deep at a time.
extern "C" __global__ void __launch_bounds__(DG_MOE_BF16_THREADS)
dg_grouped_gemm_bf16(const float* x, const unsigned short* w, const int* tile_group, float* y, float* y_acc_opt,
                     int m_tiles, int n_out, int k_dim) {
    constexpr int TM = DG_GEMM_TM, TN = DG_MOE_BF16_TN, P = DG_MOE_BF16_TK / 2;   // P: bf16 pairs per row step
    static_assert(TM == 16, "a row tile is one mma's 16 rows");
    static_assert(TN == (DG_MOE_BF16_THREADS / 32) * 32, "each warp computes 32 columns");
    static_assert(P % 8 == 0, "the step is a multiple of the mma's 16-deep k");
    // bf16 pairs (k, k + 1), rows padded by 4 pairs so that a warp's fragment reads (8 rows x 4 pairs) hit 32 banks
    __shared__ unsigned xs[TM][P + 4];
    __shared__ unsigned ws[TN][P + 4];
    const int m = blockIdx.y;
    if (m >= m_tiles) return;
    const int grp = tile_group[m];
    if (grp < 0) return;                                     // uniform for the block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * TN, wn = warp * 32;
    const float* xt = x + (long long)m * TM * k_dim;
    const unsigned short* wg = w + (long long)grp * n_out * k_dim;
    // 8-byte loads (2 values of x, 4 of w) when every row starts 8-byte aligned; value by value otherwise (the
    // same choice in every thread: it depends on the arguments only)
    const bool wide = k_dim % 4 == 0 && ((unsigned long long)x & 7) == 0 && ((unsigned long long)w & 7) == 0;
    float acc[4][4];
    #pragma unroll
    for (int ni = 0; ni < 4; ++ni)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc[ni][i] = 0.0f;
    for (int k0 = 0; k0 < k_dim; k0 += DG_MOE_BF16_TK) {
        if (wide) {
            for (int i = threadIdx.x; i < TM * P; i += blockDim.x) {
                const int r = i / P, p = i - r * P, gk = k0 + 2 * p;          // gk < k_dim: both inside
                const unsigned long long v = gk < k_dim
                    ? *(const unsigned long long*)(xt + (long long)r * k_dim + gk) : 0ull;
                xs[r][p] = dg_bf16_pair(dg_float_to_bf16(__uint_as_float((unsigned)v)),
                                        dg_float_to_bf16(__uint_as_float((unsigned)(v >> 32))));
            }
            dg_bf16_stage_wide<TN, P>(ws, wg, n0, n_out, k_dim, k0);
        } else {
            for (int i = threadIdx.x; i < TM * P; i += blockDim.x) {
                const int r = i / P, p = i - r * P, gk = k0 + 2 * p;
                const float* row = xt + (long long)r * k_dim;
                xs[r][p] = dg_bf16_pair(gk < k_dim ? dg_float_to_bf16(row[gk]) : (unsigned short)0,
                                        gk + 1 < k_dim ? dg_float_to_bf16(row[gk + 1]) : (unsigned short)0);
            }
            dg_bf16_stage<TN, P>(ws, wg, n0, n_out, k_dim, k0);
        }
        __syncthreads();
        #pragma unroll
        for (int ks = 0; ks < P; ks += 8) {                  // 8 pairs: the mma's 16-deep k
            unsigned af[4], bf[4][2];
            af[0] = xs[g][ks + t];
            af[1] = xs[g + 8][ks + t];
            af[2] = xs[g][ks + t + 4];
            af[3] = xs[g + 8][ks + t + 4];
            dg_bf16_b_frags(bf, ws, wn, ks, g, t);
            #pragma unroll
            for (int ni = 0; ni < 4; ++ni) dg_mma_bf16_16816(acc[ni], af, bf[ni]);
        }
        __syncthreads();                                     // the tiles are read before the next step overwrites them
    }
    #pragma unroll
    for (int ni = 0; ni < 4; ++ni)
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = m * TM + g + (i >> 1) * 8, col = n0 + wn + ni * 8 + 2 * t + (i & 1);
            if (col >= n_out) continue;
            const long long at = (long long)row * n_out + col;
            y[at] = dg_bf16_to_float(dg_float_to_bf16(acc[ni][i]));
            if (y_acc_opt) y_acc_opt[at] = acc[ni][i];
        }
}
