"""The routed experts' products alone, this build against an older one, in alternating processes.

    python benchmarks/bench_experts.py OLD_BUILD/fast/_kernels.cpython-*.so [--rounds 3]

OLD_BUILD is a checkout of a3d1c29 or earlier built with ``python setup.py build_ext --inplace``: its
``_kernels.expert_ffn`` makes one single-threaded OpenBLAS call per expert and product on the weights as
stored. This build runs ``fast.experts.ExpertPanels`` (panels packed once, ``fast/panel_gemm.h``). Each
shape is the benchmark configurations' (rows per expert = canvas or prompt x top-k / experts); GEMM is NumPy's
float32 2048^3 product, measured in each process. Prints GFLOP/s, the ratio and the share of the GEMM rate
at 1 and 2 threads, with the machine line and the commit.
"""
import sys, time, json, subprocess, os, statistics
import numpy as np
SHAPES = [("small", 8, 256, 128, 16), ("medium", 16, 1024, 512, 16), ("medium-enc", 16, 1024, 512, 32),
          ("bench_fast medium", 16, 1024, 512, 32), ("real", 128, 768, 192, 8), ("real-enc", 128, 768, 192, 16)]
def bench(fn, n):
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
OLD = None


def child(which, threads):
    from threadpoolctl import threadpool_limits, threadpool_info
    import importlib.util, ctypes
    rng = np.random.default_rng(0)
    out = {}
    if which == "old":
        spec = importlib.util.spec_from_file_location("_kernels", OLD)
        K = importlib.util.module_from_spec(spec); spec.loader.exec_module(K)
        path = [p["filepath"] for p in threadpool_info() if p.get("internal_api") == "openblas"][0]
        lib = ctypes.CDLL(path)
        names = ("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_")
        K.set_blas(*[ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names])
    else:
        from diffusiongemma.fast import _kernels as K
        from diffusiongemma.fast.experts import ExpertPanels
    with threadpool_limits(threads):
        a = rng.standard_normal((2048, 2048), dtype=np.float32); c = np.empty_like(a)
        out["gemm"] = 2 * 2048 ** 3 / bench(lambda: np.matmul(a, a, out=c), 5) / 1e9
        for name, E, H, I, rows in SHAPES:
            R = E * rows
            x = rng.standard_normal((R, H), dtype=np.float32)
            wgu = rng.standard_normal((E, 2 * I, H), dtype=np.float32) * 0.03
            wd = rng.standard_normal((E, H, I), dtype=np.float32) * 0.03
            off = np.arange(E + 1, dtype=np.int64) * rows
            gu = np.empty((R, 2 * I), np.float32); act = np.empty((R, I), np.float32); y = np.empty((R, H), np.float32)
            if which == "old":
                fn = lambda: K.expert_ffn(x, off, wgu, wd, gu, act, y)
            else:
                p = ExpertPanels.from_weights(wgu, wd)
                fn = lambda: p(x, off, gu, act, y)
            out[name] = 2 * R * H * 3 * I / bench(fn, 15) / 1e9
    print("RESULT " + json.dumps(out))
if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        OLD = sys.argv[4]
        child(sys.argv[2], int(sys.argv[3])); sys.exit()
    import argparse
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import machine_facts
    parser = argparse.ArgumentParser(description="expert products: this build against an older _kernels build")
    parser.add_argument("old_build")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = args.rounds
    print(machine_facts())
    res = {}
    for threads in (1, 2):
        for r in range(rounds):
            for which in ("old", "new"):
                env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                txt = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", which, str(threads),
                                      os.path.abspath(args.old_build)], capture_output=True, text=True, env=env,
                                     cwd=os.path.dirname(os.path.abspath(args.old_build))).stdout
                d = json.loads([l for l in txt.splitlines() if l.startswith("RESULT ")][0][7:])
                for k, v in d.items():
                    res.setdefault((threads, which, k), []).append(v)
        print(f"threads {threads}, load {os.getloadavg()[0]:.2f}")
        print("| shape (E, H, I, rows/expert) | old GFLOP/s | new GFLOP/s | new/old | GEMM 2048^3 (old run, new run) | new / GEMM |")
        for name, E, H, I, rows in SHAPES:
            o = statistics.median(res[(threads, "old", name)]); n = statistics.median(res[(threads, "new", name)])
            go = statistics.median(res[(threads, "old", "gemm")]); gn = statistics.median(res[(threads, "new", "gemm")])
            print(f"| {name} ({E}, {H}, {I}, {rows}) | {o:.1f} | {n:.1f} | {n/o:.2f}x | {go:.1f}, {gn:.1f} | {n/gn:.2f} |")
