// Shared definitions of the diffusiongemma CUDA kernels.
//
// Every kernel source is compiled as one translation unit together with this header (gpu.py and
// cuda_build.py inline it), by NVRTC through CuPy at run time and by nvcc in the compile checks. So
// nothing here may include a system header: only CUDA built-ins are used (expf, tanhf, powf, shuffles).
//
// Conventions of all kernels:
//   * float32 activations and weights, row-major and C-contiguous; int64 token ids ("long long");
//     int32 for counts and small index tables; uint8 for 0/1 flags.
//   * a pointer parameter whose name ends in "_opt" may be NULL (the host passes 0).
//   * the launch geometry of each kernel is computed on the host by fast/gpu_launch.py, which reads
//     the DG_* constants below from this file, so they are defined exactly once.

#pragma once

// Largest head dimension the attention kernel holds per warp in registers (26B model: 512).
#define DG_MAX_HEAD_DIM 512
// (query, head) rows one attention warp carries through the key loop.
#define DG_ATT_ROWS_PER_WARP 4
// Threads of one attention block.
#define DG_ATT_THREADS 128
// Grouped expert GEMM tile: DG_GEMM_TM rows x DG_GEMM_TN output columns, DG_GEMM_TK deep steps.
#define DG_GEMM_TM 16
#define DG_GEMM_TN 64
#define DG_GEMM_TK 32
#define DG_GEMM_THREADS 256
// bfloat16 GEMM (gemm_bf16.cu): a block computes DG_BF16_TM x DG_BF16_TN outputs with 4 warps (2 x 2, each
// 32 x 32 as 2 x 4 mma tiles of 16 x 8), stepping DG_BF16_TK deep (a multiple of the mma's 16).
#define DG_BF16_TM 64
#define DG_BF16_TN 64
#define DG_BF16_TK 32
#define DG_BF16_THREADS 128
// Grouped bfloat16 expert GEMM (moe_bf16.cu): a block computes one row tile of DG_GEMM_TM rows x DG_MOE_BF16_TN
// output columns with DG_MOE_BF16_THREADS / 32 warps side by side (each 16 x DG_MOE_BF16_TN / warps as mma tiles
// of 16 x 8), stepping DG_MOE_BF16_TK deep (a multiple of the mma's 16).
#define DG_MOE_BF16_TN 128
#define DG_MOE_BF16_TK 32
#define DG_MOE_BF16_THREADS 128
// Sampling pass: threads per row, and the vocabulary chunk whose float64 sum is kept for the CDF.
#define DG_SAMPLE_THREADS 256
#define DG_SAMPLE_CHUNK 1024
// Threads of the row-wise kernels (norms, embedding, heads): a multiple of 32, at most 1024.
#define DG_ROW_THREADS 256
// Acceptance kernel: canvas positions one block can rank (one block per batch row).
#define DG_ACCEPT_THREADS 256

#define DG_FULL_MASK 0xffffffffu

__device__ __forceinline__ float dg_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float dg_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DG_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double dg_warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DG_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float dg_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DG_FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats.
// Every thread receives the total. Contains __syncthreads: call it from all threads.
__device__ __forceinline__ float dg_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = dg_warp_sum(v);
    __syncthreads();                       // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return dg_warp_sum(v);
}

// RMSNorm factor (mean(x^2) + eps)^(-1/2) of a row of `n` values, computed by the whole block.
// The power -1/2 is taken with powf, as the reference writes it (SPEC §3), not with rsqrtf.
__device__ __forceinline__ float dg_row_rms_factor(const float* x, int n, float eps, float* scratch) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * x[i];
    s = dg_block_sum(s, scratch);
    return powf(s / (float)n + eps, -0.5f);
}

// GELU, tanh approximation, in the reference's operation order (reference/primitives.py gelu_tanh):
// 0.5*x * (1 + tanh(sqrt(2/pi) * (x + 0.044715*x*x*x))).
__device__ __forceinline__ float dg_gelu(float x) {
    const float c = 0.7978845608028654f;
    float inner = c * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

// Key `key` of an attention call (dg_attention, dg_attention_bf16) over [a cache row's n_cache slots ++ batch row
// n's n_new fresh keys], T = n_cache + n_new: returns its position and sets *real to 1 where it is a real token.
// A slot holds position slot_pos_opt[key] (-1: empty), real where cache_real_opt[crow, position] is set; a fresh
// key holds new_pos_opt[key - n_cache], real where new_real_opt[n, key - n_cache] is set; past T: -1, not real.
__device__ __forceinline__ long long dg_att_key(int key, int T, int n_cache, const long long* slot_pos_opt,
                                                const unsigned char* cache_real_opt, int crow, int real_stride,
                                                int n, int n_new, const long long* new_pos_opt,
                                                const unsigned char* new_real_opt, int* real) {
    long long pos = -1;
    *real = 0;
    if (key < n_cache) {
        pos = slot_pos_opt[key];
        *real = pos >= 0 && pos < real_stride && cache_real_opt[(long long)crow * real_stride + pos];
    } else if (key < T) {
        pos = new_pos_opt[key - n_cache];
        *real = new_real_opt[(long long)n * n_new + (key - n_cache)] != 0;
    }
    return pos;
}
