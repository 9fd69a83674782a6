// CUDA's execution model for the host C++ compiler: the header the CPU executor ("cuda-sim") puts in front
// of the unchanged kernel sources of fast/gpu/cuda/*.cu.
//
// What it provides, and how:
//   * the qualifiers: __global__ (a plain, non-inlined extern "C" function run once per thread),
//     __device__, __forceinline__, __launch_bounds__ (checked on the host, fast/gpu/sim.py), __align__,
//     __restrict__ (the compiler's own);
//   * __shared__ = thread_local. A block-scope thread_local has static storage, one copy per OS thread, and
//     every thread of a block runs as a fiber on the executor's one OS thread, so the block's threads share
//     it: exactly CUDA's per-block shared memory, static ones and the dynamic `extern __shared__` array (the
//     executor defines that one, see codegen.py, and sizes and poisons it per launch);
//   * threadIdx, blockIdx, blockDim, gridDim, warpSize: calls into the executor, which knows which fiber is
//     running (calls rather than data so that the memory checks see only kernel memory);
//   * __syncthreads, __syncwarp, the warp shuffles (__shfl_sync, __shfl_xor_sync, __shfl_up_sync,
//     __shfl_down_sync), __ballot_sync, __any_sync, __all_sync: calls that suspend the calling fiber until
//     every thread they name has arrived (the executor checks that they all arrive at the same call);
//   * atomics (atomicAdd, atomicMax, atomicMin, atomicExch, atomicCAS): executed by the executor, which
//     checks the address (only one fiber runs at a time, so each is trivially atomic);
//   * float32 math built-ins: the C library's float functions (expf, tanhf, powf, fmaxf, ...), the
//     round-to-nearest intrinsics (__fadd_rn, __fmul_rn, ...) as plain float operations (glibc itself
//     declares __expf, __logf, __powf, __tanhf as its float functions) (the executor's
//     build disables floating-point contraction, so a*b+c is never fused), bit casts (__int_as_float, ...).
//
// Memory checks: the kernel sources are compiled with -fsanitize=thread but linked without its run-time
// library; the compiler's calls on every load and store (__tsan_read4(addr), __tsan_write8(addr), ...) are
// answered by the executor (runtime.cpp), which checks each address against the buffers of the launch and
// the block's shared memory.

#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#define __global__ __attribute__((noinline))
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local
#define __constant__ const
#define warpSize 32

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };

extern "C" {
// ---- provided by the executor (runtime.cpp)
uint3 dg_sim_thread_idx(void);
uint3 dg_sim_block_idx(void);
dim3 dg_sim_block_dim(void);
dim3 dg_sim_grid_dim(void);
void dg_sim_syncthreads(void);
// kind: 0 shfl (idx), 1 up, 2 down, 3 xor, 4 ballot, 5 any, 6 all, 7 syncwarp. Returns the exchanged bits.
uint64_t dg_sim_warp_op(int kind, unsigned mask, uint64_t bits, int size, int arg, int width);
// op: 0 add, 1 max, 2 min, 3 exch, 4 cas; type: 0 int32, 1 uint32, 2 uint64, 3 float32, 4 float64.
uint64_t dg_sim_atomic(int op, int type, void* address, uint64_t value, uint64_t compare);
}

#define threadIdx (dg_sim_thread_idx())
#define blockIdx (dg_sim_block_idx())
#define blockDim (dg_sim_block_dim())
#define gridDim (dg_sim_grid_dim())

static inline void __syncthreads(void) { dg_sim_syncthreads(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { dg_sim_warp_op(7, mask, 0, 0, 0, 32); }

template <typename T>
static inline uint64_t dg_sim_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffles carry at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
static inline T dg_sim_from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return dg_sim_from_bits<T>(dg_sim_warp_op(0, mask, dg_sim_bits(v), sizeof(T), src, width));
}
template <typename T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return dg_sim_from_bits<T>(dg_sim_warp_op(1, mask, dg_sim_bits(v), sizeof(T), (int)delta, width));
}
template <typename T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return dg_sim_from_bits<T>(dg_sim_warp_op(2, mask, dg_sim_bits(v), sizeof(T), (int)delta, width));
}
template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return dg_sim_from_bits<T>(dg_sim_warp_op(3, mask, dg_sim_bits(v), sizeof(T), lane_mask, width));
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)dg_sim_warp_op(4, mask, pred != 0, 4, 0, 32);
}
static inline int __any_sync(unsigned mask, int pred) { return (int)dg_sim_warp_op(5, mask, pred != 0, 4, 0, 32); }
static inline int __all_sync(unsigned mask, int pred) { return (int)dg_sim_warp_op(6, mask, pred != 0, 4, 0, 32); }

// ---- atomics
template <typename T> struct dg_sim_atomic_type;
template <> struct dg_sim_atomic_type<int> { static const int id = 0; };
template <> struct dg_sim_atomic_type<unsigned int> { static const int id = 1; };
template <> struct dg_sim_atomic_type<unsigned long long> { static const int id = 2; };
template <> struct dg_sim_atomic_type<float> { static const int id = 3; };
template <> struct dg_sim_atomic_type<double> { static const int id = 4; };
template <typename T>
static inline T dg_sim_atomic_call(int op, T* a, T v, T c = T()) {
    return dg_sim_from_bits<T>(dg_sim_atomic(op, dg_sim_atomic_type<T>::id, (void*)a, dg_sim_bits(v), dg_sim_bits(c)));
}
template <typename T> static inline T atomicAdd(T* a, T v) { return dg_sim_atomic_call(0, a, v); }
template <typename T> static inline T atomicMax(T* a, T v) { return dg_sim_atomic_call(1, a, v); }
template <typename T> static inline T atomicMin(T* a, T v) { return dg_sim_atomic_call(2, a, v); }
template <typename T> static inline T atomicExch(T* a, T v) { return dg_sim_atomic_call(3, a, v); }
template <typename T> static inline T atomicCAS(T* a, T c, T v) { return dg_sim_atomic_call(4, a, v, c); }

// ---- integer and float built-ins
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

static inline float __int_as_float(int i) { return dg_sim_from_bits<float>((uint32_t)i); }
static inline int __float_as_int(float f) { return (int)(uint32_t)dg_sim_bits(f); }
static inline float __uint_as_float(unsigned i) { return dg_sim_from_bits<float>(i); }
static inline unsigned __float_as_uint(float f) { return (unsigned)dg_sim_bits(f); }
static inline double __longlong_as_double(long long i) { return dg_sim_from_bits<double>((uint64_t)i); }
static inline long long __double_as_longlong(double d) { return (long long)dg_sim_bits(d); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
