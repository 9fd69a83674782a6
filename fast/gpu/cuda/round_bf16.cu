// Rounding to bfloat16 in place, the result kept as float32: the rounding points of a bfloat16 run computed with
// float32 kernels (reference/primitives.py round_to, SPEC §10.1). A float32 array whose values are bf16 values is
// the reference's own representation: products of two bf16 values are exact in float32, so float32 kernels fed
// such arrays differ from the reference's bf16 run only in summation order.

#include "common.cuh"
#include "bf16.cuh"

// x[i] = bf16(x[i]) widened back to float32, for i < n: nearest, ties to even, overflow to infinity, a NaN kept
// a (quiet) NaN of the same sign, infinities unchanged (dg_float_to_bf16, torch's .to(torch.bfloat16)). x: n
// float32, contiguous. Grid-stride loop, so any grid covers any n (n = 0 writes nothing).
extern "C" __global__ void dg_round_bf16(float* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        x[i] = dg_bf16_to_float(dg_float_to_bf16(x[i]));
}
