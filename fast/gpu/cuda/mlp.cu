// Gated GELU of a fused gate/up projection (dense MLP, self-conditioning MLP and every expert).
// Upstream: DiffusionGemmaText4MLP / DiffusionGemmaTextExperts, act_fn = gelu_pytorch_tanh.

#include "common.cuh"

// gu: (rows, 2 * inner) float32, the gate projection in columns [0, inner) and the up projection in
// [inner, 2 * inner) (trap T8: gate rows first). out[r, i] = gelu(gate[r, i]) * up[r, i], (rows, inner).
// 1-D grid-stride loop over rows * inner outputs.
extern "C" __global__ void dg_gated_gelu(const float* gu, float* out, int rows, int inner) {
    const long long total = (long long)rows * inner;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / inner, i = k - r * inner;
        const float* g = gu + r * 2 * inner;
        out[k] = dg_gelu(g[i]) * g[inner + i];
    }
}
