// bfloat16 on the device without cuda_bf16.h (NVRTC has no system headers here, and cuda-sim compiles the same
// text on the host): a bf16 value is its 16 bits in an `unsigned short` (the top half of the float32 with the
// same sign, exponent and first 7 mantissa bits), and a pair of bf16 is one 32-bit register, the lower
// column (or k) index in the low half, as the `mma` instructions take their .bf16x2 operands.
//
// Conversions follow the reference (reference/primitives.py round_to: ml_dtypes' float32 -> bfloat16, i.e.
// torch's .to(torch.bfloat16)): widening is exact; narrowing rounds to nearest, ties to even, overflows to
// infinity, and keeps a NaN a (quiet) NaN of the same sign.

#pragma once

#include "common.cuh"

__device__ __forceinline__ float dg_bf16_to_float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

__device__ __forceinline__ unsigned short dg_float_to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);  // NaN: set the quiet bit
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   // nearest, ties to even
}

// x rounded to bfloat16 (nearest, ties to even) and widened back: the reference's round_to on one float32, the
// rounding point of a bfloat16 run whose activations stay float32 arrays holding bfloat16 values.
__device__ __forceinline__ float dg_bf16_round(float x) { return dg_bf16_to_float(dg_float_to_bf16(x)); }

// Two bf16 (low: the first) as the 32-bit register of a .bf16x2 operand.
__device__ __forceinline__ unsigned dg_bf16_pair(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

// One block step of a row-major (n_rows, K) bfloat16 matrix m staged in shared memory as bf16 pairs (the tiles of
// dg_gemm_bf16 and dg_grouped_gemm_bf16): dst[r][p] = (m[r0 + r][k0 + 2p], m[r0 + r][k0 + 2p + 1]) for r < ROWS,
// p < P, zero past n_rows or K; the block's threads share the work. dg_bf16_stage_wide loads 8 bytes (two pairs)
// at a time and needs K % 4 == 0 and m 8-byte aligned (then k0 + 4q < K puts all four inside); dg_bf16_stage
// loads value by value and takes any K and alignment.
template <int ROWS, int P>
__device__ __forceinline__ void dg_bf16_stage_wide(unsigned (*dst)[P + 4], const unsigned short* m, int r0,
                                                   int n_rows, int K, int k0) {
    for (int i = threadIdx.x; i < ROWS * (P / 2); i += blockDim.x) {
        const int r = i / (P / 2), q = i - r * (P / 2), gk = k0 + 4 * q;
        const unsigned long long v = (r0 + r < n_rows && gk < K)
            ? *(const unsigned long long*)(m + (long long)(r0 + r) * K + gk) : 0ull;
        dst[r][2 * q] = (unsigned)v;
        dst[r][2 * q + 1] = (unsigned)(v >> 32);
    }
}

template <int ROWS, int P>
__device__ __forceinline__ void dg_bf16_stage(unsigned (*dst)[P + 4], const unsigned short* m, int r0, int n_rows,
                                              int K, int k0) {
    for (int i = threadIdx.x; i < ROWS * P; i += blockDim.x) {
        const int r = i / P, p = i - r * P, gk = k0 + 2 * p;
        const unsigned short* row = m + (long long)(r0 + r) * K;
        const bool in = r0 + r < n_rows;
        dst[r][p] = dg_bf16_pair(in && gk < K ? row[gk] : (unsigned short)0,
                                 in && gk + 1 < K ? row[gk + 1] : (unsigned short)0);
    }
}

// The B fragments (dg_mma_bf16_16816's b) of four mma tiles side by side, columns n0 + 8 ni .. n0 + 8 ni + 7 for
// ni < 4, at pair column ks (16 deep) of a tile staged as above (a row of bs per column of B); g, t: the lane's.
template <int LD>
__device__ __forceinline__ void dg_bf16_b_frags(unsigned bf[4][2], unsigned (*bs)[LD], int n0, int ks, int g, int t) {
    #pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
        const unsigned* col = bs[n0 + ni * 8 + g] + ks + t;
        bf[ni][0] = col[0];
        bf[ni][1] = col[4];
    }
}

// d += A (16 x 16) * B (16 x 8) for one warp, all 32 lanes calling together (lane = threadIdx.x & 31, so a
// 1-D block of whole warps). The fragments are those of PTX `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
// (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"); with g = lane / 4, t = lane % 4:
//   a[0]: A[g][2t, 2t+1]   a[1]: A[g+8][2t, 2t+1]   a[2]: A[g][2t+8, 2t+9]   a[3]: A[g+8][2t+8, 2t+9]
//   b[0]: B[2t, 2t+1][g]   b[1]: B[2t+8, 2t+9][g]
//   d[0], d[1]: D[g][2t, 2t+1]                      d[2], d[3]: D[g+8][2t, 2t+1]
// On sm_80 and later it is the tensor-core instruction. Elsewhere (cuda-sim, which defines no __CUDA_ARCH__,
// and older GPUs) the same fragments are exchanged with shuffles and each output is accumulated on the CUDA
// cores: d + A[r][0]*B[0][c] + ... + A[r][15]*B[15][c], left to right in float32 (each product of two bf16
// is exact in float32). The tensor cores add the same exact products in an order and with an internal
// rounding of their own (not documented; measured studies find truncation rather than rounding to nearest),
// so the two agree to within the accumulation bound tests/test_gpu_bf16.py states, not bit for bit.
__device__ __forceinline__ void dg_mma_bf16_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float arow[2][16], bcol[2][16];                  // A rows g, g+8 and B columns 2t, 2t+1, all 16 k
    for (int s = 0; s < 4; ++s) {
        for (int half = 0; half < 2; ++half) {       // k in [0, 8) from a[0], a[1]; [8, 16) from a[2], a[3]
            const unsigned top = __shfl_sync(DG_FULL_MASK, a[2 * half], g * 4 + s);
            const unsigned bottom = __shfl_sync(DG_FULL_MASK, a[2 * half + 1], g * 4 + s);
            const int k = 8 * half + 2 * s;
            arow[0][k] = __uint_as_float(top << 16);
            arow[0][k + 1] = __uint_as_float(top & 0xffff0000u);
            arow[1][k] = __uint_as_float(bottom << 16);
            arow[1][k + 1] = __uint_as_float(bottom & 0xffff0000u);
        }
        for (int j = 0; j < 2; ++j)
            for (int half = 0; half < 2; ++half) {
                const unsigned v = __shfl_sync(DG_FULL_MASK, b[half], (2 * t + j) * 4 + s);
                const int k = 8 * half + 2 * s;
                bcol[j][k] = __uint_as_float(v << 16);
                bcol[j][k + 1] = __uint_as_float(v & 0xffff0000u);
            }
    }
    for (int r = 0; r < 2; ++r)
        for (int j = 0; j < 2; ++j) {
            float acc = d[2 * r + j];
            for (int k = 0; k < 16; ++k) acc = acc + arow[r][k] * bcol[j][k];
            d[2 * r + j] = acc;
        }
#endif
}
