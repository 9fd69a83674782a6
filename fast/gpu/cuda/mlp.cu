// Gated GELU of a fused gate/up projection (dense MLP, self-conditioning MLP and every expert).
// Upstream: DiffusionGemmaText4MLP / DiffusionGemmaTextExperts, act_fn = gelu_pytorch_tanh.

#include "common.cuh"
#include "bf16.cuh"

// gu: (rows, 2 * inner) float32, the gate projection in columns [0, inner) and the up projection in
// [inner, 2 * inner) (trap T8: gate rows first). out[r, i] = gelu(gate[r, i]) * up[r, i], (rows, inner).
// bf16 != 0: a bfloat16 run's (reference/primitives.py gated_mlp and layers.experts with dtype bfloat16): the
// GELU, computed in float32, is rounded to bfloat16, and so is its product with the up value (gu then holds
// bfloat16 values, and out receives bfloat16 values widened to float32). 1-D grid-stride loop over rows * inner
// outputs.
extern "C" __global__ void dg_gated_gelu(const float* gu, float* out, int rows, int inner, int bf16) {
    const long long total = (long long)rows * inner;
    for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < total;
         k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / inner, i = k - r * inner;
        const float* g = gu + r * 2 * inner;
        if (bf16) {
            const float gelu = dg_bf16_to_float(dg_float_to_bf16(dg_gelu(g[i])));
            out[k] = dg_bf16_to_float(dg_float_to_bf16(gelu * g[inner + i]));
        } else {
            out[k] = dg_gelu(g[i]) * g[inner + i];
        }
    }
}
