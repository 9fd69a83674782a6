"""Would AVX512-BF16 dot products (``vdpbf16ps``) pay for the routed experts' products? A measurement.

    python benchmarks/bench_bf16_dot.py [--repeats 7] [--shapes real medium] [--rows 16]

The fast path keeps bfloat16 experts bfloat16 and widens each 256-value chunk of k of a 32-column panel to
float32 before its float32 fused-multiply-add tile (``fast/panel_gemm.h``): exact, the float32 path's bits.
``vdpbf16ps`` instead multiplies pairs of bfloat16 values and adds both products into a float32 lane, two
k per instruction and no widening pass, but only on bfloat16 *activations*: x is rounded to bfloat16
first, and the pair's two products are summed in another order, so it is a different computation (the
bfloat16 run's numerics, not the float32 path's), bounded only against a bfloat16 reference.

This script compiles a small C program (``cc -O3``, the project's header included as it is) that runs, on
one thread, one expert-shaped product out(m, N) = x(m, K) W^T with the same register tile (8 rows x 32
columns, AVX-512) three ways:

* float32 panels (the float32 path);
* bfloat16 panels widened per chunk (the bfloat16-kept path, the float32 path's bits);
* ``vdpbf16ps`` on bfloat16 panels with k pairs interleaved (a layout of its own, the same bytes) and x
  rounded to bfloat16 once per call (timed in);

and prints GFLOP/s of each, the ratios, and the largest relative difference of the ``vdpbf16ps`` result
from the float32 one (the rounding it adds). Rows: the tokens one expert gets (``--rows``; 16 for a
256-token canvas at top 8 of 128 experts). Needs an x86-64 CPU with ``avx512_bf16`` (checked in
/proc/cpuinfo; otherwise it says so and stops). Prints the machine, load and commit first.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = {  # (N, K) of the gate/up and the down product of one expert
    "real": [(2 * 704, 2816), (2816, 704)],  # the released 26B-A4B's expert shapes
    "medium": [(2 * 512, 1024), (1024, 512)],  # bench_fast.py's "medium"
}

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "panel_gemm.h"

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

static uint16_t to_bf16(float f) {  /* round to nearest even (finite inputs) */
    union { float f; uint32_t u; } v; v.f = f;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t b) { union { uint32_t u; float f; } v; v.u = (uint32_t)b << 16; return v.f; }

/* vdpbf16ps tile: MR rows x 32 columns; wp[kp][j][2] = W[32p + j][2kp + {0,1}], xb[r][k] bf16 */
__attribute__((always_inline, target("avx512f,avx512bf16"))) static inline void
dp_tile(const int MR, const uint16_t *xb, int64_t ldx, const uint16_t *wp, int64_t kpairs, float *c, int64_t ldc) {
    __m512 c0[8], c1[8];
    for (int r = 0; r < MR; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }
    for (int64_t kp = 0; kp < kpairs; kp++) {
        _mm_prefetch((const char *)(wp + 64 * (kp + 32)), _MM_HINT_T0);
        _mm_prefetch((const char *)(wp + 64 * (kp + 32) + 32), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + 64 * kp);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 64 * kp + 32);
        for (int r = 0; r < MR; r++) {
            uint32_t pair; memcpy(&pair, xb + r * ldx + 2 * kp, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
            c0[r] = _mm512_dpbf16_ps(c0[r], b, w0);
            c1[r] = _mm512_dpbf16_ps(c1[r], b, w1);
        }
    }
    for (int r = 0; r < MR; r++) { _mm512_storeu_ps(c + r * ldc, c0[r]); _mm512_storeu_ps(c + r * ldc + 16, c1[r]); }
}
#define DP(MR) __attribute__((target("avx512f,avx512bf16"))) static void dp_##MR(const uint16_t *x, int64_t ldx, \
    const uint16_t *w, int64_t kp, float *c, int64_t ldc) { dp_tile(MR, x, ldx, w, kp, c, ldc); }
DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8)
typedef void (*dp_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t);
static const dp_fn DP_TILES[9] = {0, dp_1, dp_2, dp_3, dp_4, dp_5, dp_6, dp_7, dp_8};

/* x rounded to bf16, then every panel through the tile (N a multiple of 32, K even) */
static void dp_matmul(const float *x, int64_t m, const uint16_t *wp, int64_t N, int64_t K, uint16_t *xb, float *c) {
    for (int64_t i = 0; i < m * K; i++) xb[i] = to_bf16(x[i]);
    for (int64_t p = 0; p < N / 32; p++)
        for (int64_t r = 0; r < m; r += 8) {
            const int mr = m - r < 8 ? (int)(m - r) : 8;
            DP_TILES[mr](xb + r * K, K, wp + p * K * 32, K / 2, c + r * N + p * 32, N);
        }
}

int main(int argc, char **argv) {
    const int64_t m = atoll(argv[1]), N = atoll(argv[2]), K = atoll(argv[3]);
    const int repeats = atoi(argv[4]);
    const int64_t P = N / 32;
    float *x = aligned_alloc(64, sizeof(float) * m * K), *w = aligned_alloc(64, sizeof(float) * N * K);
    float *pf = aligned_alloc(64, sizeof(float) * N * K);
    uint16_t *pb = aligned_alloc(64, 2 * N * K), *pd = aligned_alloc(64, 2 * N * K), *xb = aligned_alloc(64, 2 * m * K);
    float *c0 = aligned_alloc(64, sizeof(float) * m * N), *c1 = aligned_alloc(64, sizeof(float) * m * N);
    float *c2 = aligned_alloc(64, sizeof(float) * m * N);
    srand(1);
    for (int64_t i = 0; i < m * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t i = 0; i < N * K; i++) w[i] = from_bf16(to_bf16(((float)rand() / RAND_MAX - 0.5f) * 0.05f));
    for (int64_t p = 0; p < P; p++)
        for (int64_t k = 0; k < K; k++)
            for (int j = 0; j < 32; j++) {
                const float v = w[(p * 32 + j) * K + k];
                pf[(p * K + k) * 32 + j] = v;
                pb[(p * K + k) * 32 + j] = to_bf16(v);
                pd[((p * K / 2 + k / 2) * 32 + j) * 2 + (k & 1)] = to_bf16(v);
            }
    dg_panel_fn tile = dg_panel_kernel();
    double best[3] = {1e30, 1e30, 1e30};
    for (int rep = 0; rep < repeats; rep++) {
        double t = now();
        dg_panel_matmul(tile, x, K, m, pf, NULL, NULL, NULL, N, K, c0, N);
        t = now() - t; if (t < best[0]) best[0] = t;
        t = now();
        dg_panel_matmul(tile, x, K, m, NULL, NULL, NULL, pb, N, K, c1, N);
        t = now() - t; if (t < best[1]) best[1] = t;
        t = now();
        dp_matmul(x, m, pd, N, K, xb, c2);
        t = now() - t; if (t < best[2]) best[2] = t;
    }
    double same = 1, rel = 0, mag = 0;
    for (int64_t i = 0; i < m * N; i++) {
        if (c0[i] != c1[i]) same = 0;
        const double d = c2[i] - c0[i];
        if (d < 0 ? -d > rel : d > rel) rel = d < 0 ? -d : d;
        if ((c0[i] < 0 ? -c0[i] : c0[i]) > mag) mag = c0[i] < 0 ? -c0[i] : c0[i];
    }
    printf("%.6e %.6e %.6e %d %.3e\n", best[0], best[1], best[2], (int)same, rel / mag);
    return 0;
}
"""


def machine_line() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = "load average %.2f %.2f %.2f" % os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return f"{cpu}, {os.cpu_count()} logical CPUs, {load}, commit {commit.strip()}, 1 thread"


def has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", default=["real", "medium"], choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    if not has_avx512_bf16():
        print("this CPU has no avx512_bf16 (/proc/cpuinfo): nothing to measure")
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-bf16-dot-") as folder:
        src, exe = os.path.join(folder, "dot.c"), os.path.join(folder, "dot")
        with open(src, "w") as f:
            f.write(SOURCE)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O3", "-ffp-contract=off", "-I", os.path.join(ROOT, "fast"), src, "-o", exe, "-lm"],
                       check=True)
        for shape in args.shapes:
            for N, K in SHAPES[shape]:
                for m in args.rows:
                    out = subprocess.run([exe, str(m), str(N), str(K), str(args.repeats)], capture_output=True,
                                         text=True, check=True).stdout.split()
                    f32, b16, dp = (float(v) for v in out[:3])
                    flops = 2.0 * m * N * K / 1e9
                    print(f"{shape:6s} N={N:5d} K={K:5d} rows={m:3d}: float32 panels {flops / f32:6.1f} GFLOP/s, "
                          f"bf16 widened per chunk {flops / b16:6.1f} ({f32 / b16:.2f}x float32; same bits: "
                          f"{'yes' if out[3] == '1' else 'NO'}), vdpbf16ps {flops / dp:6.1f} ({f32 / dp:.2f}x float32, "
                          f"{b16 / dp:.2f}x widened; max |diff| / max |out| {float(out[4]):.1e}), "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
