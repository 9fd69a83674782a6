// Row-wise normalisation kernels: RMSNorm (optionally weighted and post-scaled), the fused residual
// updates of a transformer block, the scaled embedding lookup, and the final-logit soft-cap.
//
// One block per row (grid.x = rows), blockDim.x = DG_ROW_THREADS. Upstream modules reproduced
// (transformers 5.24.0, modeling_diffusion_gemma.py): DiffusionGemmaRMSNorm (x * w, never x * (1 + w)),
// the residual adds of DiffusionGemmaTextDecoderLayer including the layer scalar, and
// DiffusionGemmaTextScaledWordEmbedding.

#include "common.cuh"
#include "bf16.cuh"

// bf16 != 0 (every kernel here): a bfloat16 run (reference/primitives.py and layers.py with dtype bfloat16,
// SPEC §10.1). The inputs hold bfloat16 values in float32; every float32 result upstream stores as a bfloat16
// tensor is rounded to nearest even (dg_bf16_round), and nothing else: the norm's factor and its products stay
// float32. bf16 = 0 is the float32 run, operation for operation as before.

// out[r] = ((x[r] * f) * w) * post, f = (mean(x[r]^2) + eps)^(-1/2); w_opt NULL: no weight.
// x, out: (rows, dim) float32 and may be the same array. post = 1 leaves the value unchanged; the router
// uses post = hidden_size^(-1/2) after its vector scale (SPEC §4.2 step 10).
// bf16 = 1: round((x * f) * w), then round(that * post) (post = 1: the norm rounded once). bf16 = 2, the
// router's input (layers.route, SPEC B6): the weightless norm, its product with the scale w and the product
// with post are three rounded tensors: round(round(round(x * f) * w) * post).
extern "C" __global__ void dg_rms_norm(const float* x, const float* w_opt, float post, float* out,
                                       int rows, int dim, float eps, int bf16) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * dim;
    float* orow = out + (long long)r * dim;
    const float f = dg_row_rms_factor(xr, dim, eps, scratch);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * f;
        if (bf16 == 2) v = dg_bf16_round(v);
        if (w_opt) v = v * w_opt[i];
        if (bf16) v = dg_bf16_round(v);
        v = v * post;
        orow[i] = bf16 ? dg_bf16_round(v) : v;
    }
}

// h[r] = (h[r] + rms_norm(y[r]) * w) * scalar: the residual add after attention (scalar = 1).
// h, y: (rows, dim) float32; w: (dim,). bf16: the norm, the sum and the scaled sum each rounded
// (reference Model._block_tail: round(h + rms_norm(o_proj(attn)))).
extern "C" __global__ void dg_residual_norm(float* h, const float* y, const float* w, float scalar,
                                            int rows, int dim, float eps, int bf16) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* hr = h + (long long)r * dim;
    const float* yr = y + (long long)r * dim;
    const float f = dg_row_rms_factor(yr, dim, eps, scratch);
    if (bf16) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            hr[i] = dg_bf16_round(dg_bf16_round(hr[i] + dg_bf16_round((yr[i] * f) * w[i])) * scalar);
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) hr[i] = (hr[i] + (yr[i] * f) * w[i]) * scalar;
}

// End of a block (SPEC §4.2 steps 9-13):
//   a = rms(dense) * w_dense + rms(moe) * w_moe          (written into `dense`)
//   h = (h + rms(a) * w_out) * scalar                     (scalar: the layer scalar of this stack)
// h, dense, moe: (rows, dim) float32; the weights: (dim,). bf16 (layers.feed_forward and Model._block_tail,
// SPEC B7): both branch norms, their sum, the outer norm, the residual sum and the scaled residual rounded.
extern "C" __global__ void dg_ffn_tail(float* h, float* dense, const float* moe, const float* w_dense,
                                       const float* w_moe, const float* w_out, float scalar,
                                       int rows, int dim, float eps, int bf16) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* hr = h + (long long)r * dim;
    float* dr = dense + (long long)r * dim;
    const float* mr = moe + (long long)r * dim;
    const float fa = dg_row_rms_factor(dr, dim, eps, scratch);
    const float fb = dg_row_rms_factor(mr, dim, eps, scratch);
    if (bf16) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            dr[i] = dg_bf16_round(dg_bf16_round((dr[i] * fa) * w_dense[i]) + dg_bf16_round((mr[i] * fb) * w_moe[i]));
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dr[i] = (dr[i] * fa) * w_dense[i] + (mr[i] * fb) * w_moe[i];
    }
    __syncthreads();                                  // every thread's part of a is written
    const float fo = dg_row_rms_factor(dr, dim, eps, scratch);
    if (bf16) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            hr[i] = dg_bf16_round(dg_bf16_round(hr[i] + dg_bf16_round((dr[i] * fo) * w_out[i])) * scalar);
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) hr[i] = (hr[i] + (dr[i] * fo) * w_out[i]) * scalar;
}

// out[r] = table[ids[r]] * scale (+ add_opt[r]); then, if normalize, a weightless RMSNorm of the row.
// ids: (rows,) int64, already checked to lie in [0, vocab) on the host. table_opt: (vocab, dim) float32, or
// table_bf16_opt: (vocab, dim) bfloat16 bits (exactly one of the two).
// Encoder input: normalize = 0, no add. Canvas input: normalize = 1 and add = self-conditioning signal
// (or none on the first step), i.e. rms(emb(x) + g) (SPEC §7.1, trap T10).
// bf16 (primitives.embed, Model.canvas_input; SPEC B1): the scale is first rounded to bfloat16 (upstream casts
// embed_scale to the table's dtype: sqrt(2816) = 53.066 becomes 53.0), the product is rounded, the sum with
// the signal is rounded, and the norm is rounded.
extern "C" __global__ void dg_embed(const long long* ids, const float* table_opt, float scale, const float* add_opt,
                                    int normalize, float* out, int rows, int dim, float eps,
                                    const unsigned short* table_bf16_opt, int bf16) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const long long base = ids[r] * (long long)dim;
    float* orow = out + (long long)r * dim;
    const float s = bf16 ? dg_bf16_round(scale) : scale;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float e = table_opt ? table_opt[base + i] : dg_bf16_to_float(table_bf16_opt[base + i]);
        float v = e * s;
        if (bf16) v = dg_bf16_round(v);
        if (add_opt) v = v + add_opt[(long long)r * dim + i];
        orow[i] = bf16 ? dg_bf16_round(v) : v;
    }
    if (!normalize) return;
    __syncthreads();
    const float f = dg_row_rms_factor(orow, dim, eps, scratch);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = bf16 ? dg_bf16_round(orow[i] * f) : orow[i] * f;
}

// x = cap * tanh(x / cap) in place over n values (final logit soft-cap, SPEC §3). Grid-stride loop.
extern "C" __global__ void dg_softcap(float* x, long long n, float cap) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}
