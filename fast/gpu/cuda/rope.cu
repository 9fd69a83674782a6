// Query/key/value heads of a fused projection: per-head RMSNorm (q_norm, k_norm, weightless value norm)
// and rotary embedding, rotate-half convention (pairs (j, j + d/2); SPEC §3, trap T4).
// Upstream: DiffusionGemmaTextAttention.forward up to the attention itself.

#include "common.cuh"
#include "bf16.cuh"

// proj: (tokens, n_heads*d + n_kv*d [+ n_kv*d]) float32, x @ [Wq; Wk; (Wv)]^T for tokens = batch * S,
//   token t = b * S + s. has_v = 0 on full-attention layers: V is then the *raw* key projection, taken
//   before k_norm and before RoPE (trap T3).
// cos_t, sin_t: (S, d/2) float32 tables of the S positions (the angle vector is [a, a], so one half).
// q_out: (tokens, n_heads, d) = RoPE(q_norm(q)); k_out, v_out: (batch, n_kv, S, d):
//   k = RoPE(k_norm(k_raw)), v = rms(v_raw) with no weight.
// grid = (tokens, n_heads + n_kv): one block per (token, head); block y >= n_heads does KV head
// y - n_heads, writing both its key and its value. blockDim.x = a multiple of 32 (<= DG_ROW_THREADS).
// bf16 (layers.project_qkv and primitives.apply_rope with dtype bfloat16, SPEC B4): proj and the tables hold
// bfloat16 values (the host rounds cos and sin); each norm is rounded, and the rotation is three rounded
// tensor operations, round(round(x * cos) + round(rotate_half(x) * sin)).
extern "C" __global__ void dg_qkv_heads(const float* proj, int tokens, int S, int n_heads, int n_kv, int d,
                                        int has_v, const float* q_norm, const float* k_norm,
                                        const float* cos_t, const float* sin_t, float* q_out, float* k_out,
                                        float* v_out, float eps, int bf16) {
    __shared__ float scratch[32];
    __shared__ float vec[DG_MAX_HEAD_DIM];
    const int t = blockIdx.x, head = blockIdx.y;
    if (t >= tokens) return;
    const int b = t / S, s = t - b * S, half = d / 2;
    const long long width = (long long)(n_heads + (has_v ? 2 : 1) * n_kv) * d;
    const float* row = proj + (long long)t * width;
    const float* c = cos_t + (long long)s * half;
    const float* sn = sin_t + (long long)s * half;

    const float* src;
    const float* w;
    float* dst;
    if (head < n_heads) {
        src = row + (long long)head * d;
        w = q_norm;
        dst = q_out + ((long long)t * n_heads + head) * d;
    } else {
        const int j = head - n_heads;
        const float* k_raw = row + (long long)(n_heads + j) * d;
        // value first: on full layers it is the raw key projection, before k_norm and RoPE
        const float* v_raw = has_v ? row + (long long)(n_heads + n_kv + j) * d : k_raw;
        float* vdst = v_out + (((long long)b * n_kv + j) * S + s) * d;
        const float fv = dg_row_rms_factor(v_raw, d, eps, scratch);
        for (int i = threadIdx.x; i < d; i += blockDim.x) vdst[i] = bf16 ? dg_bf16_round(v_raw[i] * fv) : v_raw[i] * fv;
        src = k_raw;
        w = k_norm;
        dst = k_out + (((long long)b * n_kv + j) * S + s) * d;
    }
    const float f = dg_row_rms_factor(src, d, eps, scratch);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = (src[i] * f) * w[i];
        vec[i] = bf16 ? dg_bf16_round(v) : v;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const float a = vec[j], bb = vec[j + half];
        if (bf16) {  // round(-y) = -round(y): x1 c - x2 s is the reference's x1 c + (-x2) s, rounded alike
            dst[j] = dg_bf16_round(dg_bf16_round(a * c[j]) - dg_bf16_round(bb * sn[j]));
            dst[j + half] = dg_bf16_round(dg_bf16_round(bb * c[j]) + dg_bf16_round(a * sn[j]));
        } else {
            dst[j] = a * c[j] - bb * sn[j];
            dst[j + half] = bb * c[j] + a * sn[j];
        }
    }
}
