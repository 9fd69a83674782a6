// Mixture of experts: router top-K, grouping of the (token, choice) pairs by expert, a grouped GEMM that
// streams each expert's weights once per row tile, and the weighted combination.
//
// Upstream: DiffusionGemmaTextRouter and DiffusionGemmaTextExperts (SPEC §4.2 steps 10-11, traps T7, T8).
// Pipeline for N tokens (all on the device, no host synchronisation):
//   dg_router          probabilities, top-K experts and their weights
//   dg_group_experts   counting sort of the N*K choices by expert; each expert's group is padded to whole
//                      tiles of DG_GEMM_TM rows so that a row tile belongs to exactly one expert
//   dg_gather_rows     expert inputs in grouped order (padding rows are zero)
//   dg_grouped_gemm_nt gate/up projection, then (after dg_gated_gelu) the down projection
//   dg_combine_experts per token, sum of weight * expert output in ascending expert order

#include "common.cuh"
#include "bf16.cuh"

// probs: (N, E) float32 router logits z @ W_router^T, overwritten with softmax probabilities (then used
// as scratch: a chosen expert is marked -1). indices: (N, K) int64, the K most probable experts, most
// probable first, ties to the lower index (a stable descending sort). weights: (N, K) float32,
// p_k / (p_1 + ... + p_K) * per_expert_scale[e_k] (renormalised after the softmax over all E, scaled
// after the renormalisation). One warp per token: grid ceil(N / (blockDim.x / 32)).
extern "C" __global__ void dg_router(float* probs, const float* per_expert_scale, long long* indices,
                                     float* weights, int N, int E, int K) {
    const int lane = threadIdx.x & 31;
    const int token = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (token >= N) return;                          // whole warps exit together
    float* p = probs + (long long)token * E;
    float mx = -dg_inf();
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, p[e]);
    mx = dg_warp_max(mx);
    float total = 0.0f;
    for (int e = lane; e < E; e += 32) {
        const float v = expf(p[e] - mx);
        p[e] = v;
        total += v;
    }
    total = dg_warp_sum(total);
    for (int e = lane; e < E; e += 32) p[e] = p[e] / total;
    __syncwarp();
    float chosen_sum = 0.0f;
    for (int k = 0; k < K; ++k) {
        float best = -1.0f;
        int arg = E;                                 // E: none yet
        for (int e = lane; e < E; e += 32)
            if (p[e] > best) { best = p[e]; arg = e; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(DG_FULL_MASK, best, o);
            const int oa = __shfl_xor_sync(DG_FULL_MASK, arg, o);
            if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
        }
        if (arg >= E) { arg = 0; best = 0.0f; }      // only with NaN inputs: keep the index in range
        if (lane == 0) {
            indices[(long long)token * K + k] = arg;
            weights[(long long)token * K + k] = best;
            p[arg] = -1.0f;                          // taken
        }
        chosen_sum += best;
        __syncwarp();
    }
    if (lane == 0)
        for (int k = 0; k < K; ++k) {
            const long long at = (long long)token * K + k;
            weights[at] = weights[at] / chosen_sum * per_expert_scale[indices[at]];
        }
}

// Group the N*K choices by expert. One block. Writes:
//   offsets (E + 1,) int32: expert e owns grouped rows [offsets[e], offsets[e+1]), a multiple of DG_GEMM_TM;
//   row_token (max_rows,) int32: the token of each grouped row (ascending within an expert), -1 = padding;
//   choice_row (N*K,) int32: the grouped row of each choice;
//   tile_expert (max_tiles,) int32: the expert of each row tile, -1 for unused tiles.
// max_rows = max_tiles * DG_GEMM_TM >= N*K + E*(DG_GEMM_TM - 1) (checked on the host).
extern "C" __global__ void dg_group_experts(const long long* indices, int N, int K, int E, int* offsets,
                                            int* row_token, int* choice_row, int* tile_expert, int max_tiles) {
    const int NK = N * K;
    const int max_rows = max_tiles * DG_GEMM_TM;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int count = 0;
        for (int c = 0; c < NK; ++c) count += indices[c] == e;
        offsets[e + 1] = (count + DG_GEMM_TM - 1) / DG_GEMM_TM * DG_GEMM_TM;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        for (int e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    }
    __syncthreads();
    for (int row = offsets[E] + threadIdx.x; row < max_rows; row += blockDim.x) row_token[row] = -1;
    for (int t = offsets[E] / DG_GEMM_TM + threadIdx.x; t < max_tiles; t += blockDim.x) tile_expert[t] = -1;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int row = offsets[e];
        for (int c = 0; c < NK; ++c)
            if (indices[c] == e) {
                row_token[row] = c / K;
                choice_row[c] = row;
                ++row;
            }
        for (; row < offsets[e + 1]; ++row) row_token[row] = -1;
        for (int t = offsets[e] / DG_GEMM_TM; t < offsets[e + 1] / DG_GEMM_TM; ++t) tile_expert[t] = e;
    }
}

// dst[row] = src[row_token[row]] (zeros where row_token is -1). src: (N, dim); dst: (rows, dim).
// grid = rows, one block per row.
extern "C" __global__ void dg_gather_rows(const float* src, const int* row_token, float* dst, int rows, int dim) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int token = row_token[row];
    float* d = dst + (long long)row * dim;
    const float* s = src + (long long)(token < 0 ? 0 : token) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = token < 0 ? 0.0f : s[i];
}

// Grouped y = x @ W[g]^T: for row tile m (rows m*TM .. m*TM+TM-1) with g = tile_group[m] >= 0,
// y[row, col] = sum_k x[row, k] * w[g, col, k]. x: (m_tiles*TM, k_dim); w: (G, n_out, k_dim) (each
// expert's matrix row-major, (out, in) as stored); y: (m_tiles*TM, n_out). Tiles with g < 0 are skipped
// (their y rows are left as they are). grid (ceil(n_out / TN), m_tiles), block DG_GEMM_THREADS.
// Each thread computes one row of the tile and TN/16 columns (tc, tc+16, ...).
extern "C" __global__ void __launch_bounds__(DG_GEMM_THREADS)
dg_grouped_gemm_nt(const float* x, const float* w, const int* tile_group, float* y, int m_tiles, int n_out,
                   int k_dim) {
    __shared__ float xs[DG_GEMM_TM][DG_GEMM_TK + 1];
    __shared__ float ws[DG_GEMM_TN][DG_GEMM_TK + 1];
    const int m = blockIdx.y;
    if (m >= m_tiles) return;
    const int g = tile_group[m];
    if (g < 0) return;                               // uniform for the block
    const int n0 = blockIdx.x * DG_GEMM_TN;
    const int tid = threadIdx.x;
    const int cols_per_thread = DG_GEMM_TN / 16;
    const int tr = tid / 16, tc = tid - tr * 16;
    const float* wg = w + (long long)g * n_out * k_dim;
    const float* xt = x + (long long)m * DG_GEMM_TM * k_dim;
    float acc[DG_GEMM_TN / 16];
#pragma unroll
    for (int c = 0; c < cols_per_thread; ++c) acc[c] = 0.0f;
    for (int k0 = 0; k0 < k_dim; k0 += DG_GEMM_TK) {
        for (int idx = tid; idx < DG_GEMM_TM * DG_GEMM_TK; idx += DG_GEMM_THREADS) {
            const int rr = idx / DG_GEMM_TK, kk = idx - rr * DG_GEMM_TK;
            xs[rr][kk] = k0 + kk < k_dim ? xt[(long long)rr * k_dim + k0 + kk] : 0.0f;
        }
        for (int idx = tid; idx < DG_GEMM_TN * DG_GEMM_TK; idx += DG_GEMM_THREADS) {
            const int cc = idx / DG_GEMM_TK, kk = idx - cc * DG_GEMM_TK;
            const int col = n0 + cc;
            ws[cc][kk] = (col < n_out && k0 + kk < k_dim) ? wg[(long long)col * k_dim + k0 + kk] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < DG_GEMM_TK; ++kk) {
            const float xv = xs[tr][kk];
#pragma unroll
            for (int c = 0; c < cols_per_thread; ++c) acc[c] += xv * ws[tc + 16 * c][kk];
        }
        __syncthreads();
    }
#pragma unroll
    for (int c = 0; c < cols_per_thread; ++c) {
        const int col = n0 + tc + 16 * c;
        if (col < n_out) y[((long long)m * DG_GEMM_TM + tr) * n_out + col] = acc[c];
    }
}

// out[t] = sum over token t's K choices, in ascending expert order, of weights[t, k] * expert_out[row]
// (row = choice_row[t*K + k]); each product is rounded to float32 before it is added, as the reference's
// numpy.add.at does. bf16 != 0 (a bfloat16 run, SPEC §10.1 B6): expert_out holds bfloat16 values, the products
// and the sum are float32 as above, and the sum is rounded once to bfloat16 (out holds bfloat16 values), as
// transformers' grouped_mm_experts_forward and reference/layers.py experts with dtype bfloat16 do.
// expert_out: (rows, dim); indices, weights: (N, K); out: (N, dim). grid = N.
extern "C" __global__ void dg_combine_experts(const float* expert_out, const long long* indices,
                                              const int* choice_row, const float* weights, float* out,
                                              int N, int K, int dim, int bf16) {
    __shared__ int order[32];                        // K <= 32 (checked on the host)
    const int t = blockIdx.x;
    if (t >= N) return;
    if (threadIdx.x == 0) {                          // insertion sort of the K choices by expert index
        for (int k = 0; k < K; ++k) order[k] = k;
        for (int a = 1; a < K; ++a) {
            const int cur = order[a];
            int b = a - 1;
            while (b >= 0 && indices[(long long)t * K + order[b]] > indices[(long long)t * K + cur]) {
                order[b + 1] = order[b];
                --b;
            }
            order[b + 1] = cur;
        }
    }
    __syncthreads();
    float* o = out + (long long)t * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float s = 0.0f;
        for (int a = 0; a < K; ++a) {
            const int k = order[a];
            const long long row = choice_row[(long long)t * K + k];
            s = __fadd_rn(s, __fmul_rn(expert_out[row * dim + i], weights[(long long)t * K + k]));
        }
        o[i] = bf16 ? dg_bf16_to_float(dg_float_to_bf16(s)) : s;
    }
}
