"""Benchmark of the fast CPU path against the reference and transformers (torch CPU, fp32, eager).

    python benchmarks/bench_fast.py [--threads 1 2] [--configs small medium] [--repeats 3]
                                    [--phases quiet contended] [--no-stages] [--no-sampling]
    python benchmarks/bench_fast.py --sampler-ab OTHER_BUILD.so [--threads 1 2] [--repeats 9]
    python benchmarks/bench_fast.py --bf16 [--configs medium real] [--threads 2] [--repeats 3]

Two phases: "quiet" (whatever else the machine runs) and "contended", during which the benchmark keeps one
busy background process of its own (a Python loop) and stops it after. In each phase and at each thread
count (threadpoolctl limits BLAS and OpenMP; torch.set_num_threads for torch; OMP_NUM_THREADS is set to the
largest count before anything is imported):

* generate on the same weights with the same fixed number of steps (adaptive stopping off, no EOS):
  fast vs transformers (small and medium) and fast vs reference (small);
* the decoder forward (one ``denoise`` with self-conditioning) on medium in GFLOP/s, next to NumPy's
  float32 GEMM rate on a 2048^3 product;
* (quiet phase) one sampling step over a (256, 262144) logits tensor: fast vs reference.

Entries compared with each other run in alternation (fast, transformers, reference, fast, ...) and each
is the median of ``--repeats`` runs after a warm-up round, so that a change of the machine's load hits all
of them alike; every line carries the load average when it was printed. At the end, a per-stage breakdown
of one fast generate per configuration at one thread (``StageProfile``: share of the time and GFLOP/s of
attention, dense MLP, the experts' routing and their products, output projection, self-conditioning product and
MLP, sampling, encoder).
``--bf16`` instead compares one checkpoint that stores bfloat16 (the configuration's random weights
rounded to bfloat16, written as a converted directory in a temporary folder) loaded two ways, each in a
process of its own so that its memory is its own: widened to float32 at load (``keep_bf16=False``) and kept
bfloat16 (the default): weights held (``Model.weight_nbytes``), resident memory after the load and its peak
(``VmHWM``, load and generate), load time, generate time, wall and CPU (two rounds in alternation, each the
median of ``--repeats`` after a warm-up; the ratio compares the best rounds), and whether the generated
tokens are the same.
The machine line, thread pools and the git commit are printed first. Weights are random
(``tests.random_weights.random_tensors``); timings do not depend on their values except through adaptive
stopping, which is off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

_MAX_THREADS = os.environ.get("BENCH_MAX_THREADS", "2")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _MAX_THREADS)

import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from diffusiongemma import fast  # noqa: E402
import diffusiongemma.fast.model  # noqa: E402,F401  (fast.model.CPU_ARRAYS)
from diffusiongemma.tiny import make_config, random_tensors  # noqa: E402
from diffusiongemma.reference.draws import SeededDraws  # noqa: E402
from diffusiongemma.reference.generate import generate as reference_generate  # noqa: E402
from diffusiongemma.reference.model import Model as ReferenceModel  # noqa: E402
from diffusiongemma.reference.sampling import (argmax_tokens, entropy_bound_accept, renoise, scale_logits,
                                               softmax_and_entropy)
from diffusiongemma.reference.support.logits import check_logits

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Setup:
    name: str
    config_kwargs: dict
    prompt: int  # prompt length
    batch: int
    steps: int  # denoising steps per canvas (all executed)
    canvases: int


SETUPS = {
    "small": Setup("small", dict(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                 layer_types="SFSF", num_attention_heads=4, sliding_head_dim=64, sliding_kv_heads=2,
                                 full_head_dim=128, full_kv_heads=1, sliding_window=128, num_experts=8,
                                 top_k_experts=2, canvas_length=64), prompt=128, batch=1, steps=16, canvases=2),
    "medium": Setup("medium", dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048,
                                   moe_intermediate_size=512, layer_types="SSSF", num_attention_heads=8,
                                   sliding_head_dim=128, sliding_kv_heads=4, full_head_dim=256, full_kv_heads=2,
                                   sliding_window=512, num_experts=16, top_k_experts=4, canvas_length=128),
                    prompt=256, batch=1, steps=4, canvases=1),
    # the released model's ratios (128 experts top 8, head sizes 256 / 512), scaled down: bench_peers.py's "real"
    "real": Setup("real", dict(vocab_size=32768, hidden_size=768, intermediate_size=576, moe_intermediate_size=192,
                               layer_types="SSSF", num_attention_heads=4, sliding_head_dim=256, sliding_kv_heads=2,
                               full_head_dim=512, full_kv_heads=1, sliding_window=512, num_experts=128,
                               top_k_experts=8, canvas_length=128), prompt=256, batch=1, steps=4, canvases=1),
}


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        load = " load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = ""
    return f"{cpu}, {os.cpu_count()} logical CPUs,{load}, Python {platform.python_version()}, NumPy {np.__version__}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fast"], cwd=HERE, capture_output=True, text=True)
        return out.stdout.strip() + (" (fast/ modified)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------------------ transformers
def transformers_model(config, tensors):
    """A transformers DiffusionGemmaForBlockDiffusion (fp32, eager) holding exactly ``tensors``."""
    import torch
    from diffusiongemma.tiny import SLIDING, TinySpec, hf_config
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.weights_converter.names import hf_name

    sliding = [i for i, t in enumerate(config.layer_types) if t == SLIDING]
    full = [i for i, t in enumerate(config.layer_types) if t != SLIDING]
    spec = TinySpec(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                    intermediate_size=config.intermediate_size, moe_intermediate_size=config.moe_intermediate_size,
                    layer_types=list(config.layer_types), num_attention_heads=config.num_attention_heads,
                    num_key_value_heads=config.layer_num_key_value_heads[sliding[0]] if sliding else 1,
                    num_global_key_value_heads=config.layer_num_key_value_heads[full[0]],
                    head_dim=config.layer_head_dim[sliding[0]] if sliding else config.layer_head_dim[full[0]],
                    global_head_dim=config.layer_head_dim[full[0]], num_experts=config.num_experts,
                    top_k_experts=config.top_k_experts, sliding_window=config.sliding_window,
                    canvas_length=config.canvas_length,
                    partial_rotary_factor=config.rope_parameters["full_attention"].partial_rotary_factor)
    model = DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                         attn_implementation="eager")
    model.eval()
    state = model.state_dict(keep_vars=True)  # tied tensors appear under every name
    with torch.no_grad():
        for name, value in tensors.items():
            target = state[hf_name(name)]
            target.copy_(torch.from_numpy(np.asarray(value).reshape(target.shape)))
    model.generation_config.eos_token_id = None  # no EOS: every run does the same amount of work
    model.generation_config.pad_token_id = None
    model.generation_config.stability_threshold = None  # no adaptive stopping: all steps run
    return model


def hf_generate(model, prompt, setup: Setup):
    import torch

    with torch.no_grad():
        return model.generate(torch.from_numpy(prompt), max_new_tokens=setup.canvases * model.config.canvas_length,
                              max_denoising_steps=setup.steps)


# ------------------------------------------------------------------------------------------ stage profile
STAGES = ("attention", "dense MLP", "experts: router, dispatch, combine", "experts: products", "output projection",
          "self-conditioning product", "self-conditioning MLP", "sampling", "encoder", "other decoder", "loop and other")


class _TimedXp:
    """Array module for ``StageProfile``: the model's own (``fast.blas.CpuArrays``), with the products that
    read the embedding charged to the output projection or the self-conditioning product."""

    def __init__(self, profile, inner):
        self._profile, self._inner = profile, inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def matmul(self, a, b, out=None):
        stage = self._profile.product_stage(b)
        if stage is None:
            return self._inner.matmul(a, b, out=out)
        with self._profile.stage(stage, 2.0 * a.size * b.shape[-1]):
            return self._inner.matmul(a, b, out=out)


class _TimedOps:
    """Kernels for ``StageProfile``: ``_kernels``, with the soft-cap charged to the output projection."""

    def __init__(self, profile, ops):
        self._profile, self._ops = profile, ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def softcap(self, x, cap, bf16=False):
        with self._profile.stage("output projection"):
            return self._ops.softcap(x, cap, bf16)


class StageProfile:
    """Per-stage wall time and FLOPs of a fast model's generate, by wrapping its stages (``with`` block).

    Times are exclusive (a stage's time excludes the stages it calls): "attention" is a decoder block's own
    work (norms, q/k/v and output projections, RoPE, the attention itself, residuals), "other decoder" the
    canvas embedding and final norm, "loop and other" whatever the step spends outside the model.
    """

    def __init__(self, model):
        from diffusiongemma.fast import model as model_module
        from diffusiongemma.fast.sampling import FusedSampler

        from diffusiongemma.fast.experts import ExpertPanels

        self.model, self._module, self._sampler_class = model, model_module, FusedSampler
        self._panels, self._panels_call = ExpertPanels, ExpertPanels.__call__
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.flops = dict.fromkeys(STAGES, 0.0)
        self._stack: list[list] = []
        self._encoding = False

    # ---------------------------------------------------------------- timing
    def stage(self, name: str, flops: float = 0.0):
        profile = self

        class _Stage:
            def __enter__(self):
                profile._stack.append([name, time.perf_counter(), 0.0])
                return self

            def __exit__(self, *exc):
                stage, start, children = profile._stack.pop()
                elapsed = time.perf_counter() - start
                charged = "encoder" if profile._encoding else stage
                profile.seconds[charged] += elapsed - children
                profile.flops[charged] += flops
                if profile._stack:
                    profile._stack[-1][2] += elapsed
                return False

        return _Stage()

    def product_stage(self, b):
        E = self.model.embed_tokens  # (V, H); compared by address: a loaded embedding is itself a view
        if b.ctypes.data == E.ctypes.data and b.size == E.size:
            return "self-conditioning product" if b.shape == E.shape else "output projection"  # p @ E, h @ E.T
        return None  # the other products are timed by the stage that makes them

    # ---------------------------------------------------------------- wrapping
    def __enter__(self):
        m, cfg = self.model, self.model.config
        originals = {name: getattr(m, name) for name in ("_block", "_gated_mlp", "_experts", "encode",
                                                          "decode_rows")}
        self._originals = originals
        self._xp, self._ops, self._attend = m.xp, m.ops, self._module.attend
        self._call = self._sampler_class.__call__
        m.xp, m.ops = _TimedXp(self, m.xp), _TimedOps(self, m.ops)
        profile = self

        def encode(*args, **kwargs):
            profile._encoding = True
            try:
                with profile.stage("encoder"):
                    return originals["encode"](*args, **kwargs)
            finally:
                profile._encoding = False

        def decode_rows(*args, **kwargs):
            with profile.stage("other decoder"):
                return originals["decode_rows"](*args, **kwargs)

        def block(l, w, h, N, S, positions, cache, rows, new_real, decoder):
            M, H, n_h, d, g = N * S, cfg.hidden_size, cfg.num_attention_heads, w.head_dim, w.num_kv_heads
            keys = cache.cached_slots(l) + S
            flops = 2.0 * M * H * (w.qkv.shape[0] + n_h * d) + 4.0 * M * n_h * d * keys
            with profile.stage("attention", flops):
                return originals["_block"](l, w, h, N, S, positions, cache, rows, new_real, decoder)

        def gated_mlp(x, gate_up, down, out):
            name = "self-conditioning MLP" if gate_up is m.sc_gate_up else "dense MLP"
            with profile.stage(name, 2.0 * x.shape[0] * x.shape[1] * (gate_up.shape[0] + down.shape[1])):
                return originals["_gated_mlp"](x, gate_up, down, out)

        def experts(w, h):  # the products themselves: "experts: products"
            M, H = h.shape
            with profile.stage("experts: router, dispatch, combine", 2.0 * M * H * cfg.num_experts):
                return originals["_experts"](w, h)

        def expert_products(panels, grouped, offsets, *buffers):
            flops = 2.0 * float(offsets[-1]) * panels.hidden_size * 3 * panels.moe_intermediate_size
            with profile.stage("experts: products", flops):
                return profile._panels_call(panels, grouped, offsets, *buffers)

        def sampler_call(sampler, *args, **kwargs):
            with profile.stage("sampling"):
                return profile._call(sampler, *args, **kwargs)

        m._block, m._gated_mlp, m._experts, m.encode, m.decode_rows = block, gated_mlp, experts, encode, decode_rows
        self._sampler_class.__call__ = sampler_call
        self._panels.__call__ = expert_products
        return self

    def __exit__(self, *exc):
        m = self.model
        for name in self._originals:
            delattr(m, name)
        m.xp, m.ops = self._xp, self._ops
        self._sampler_class.__call__ = self._call
        self._panels.__call__ = self._panels_call
        return False

    def lines(self, total: float) -> list[str]:
        """Table rows: stage, seconds, share of ``total``, GFLOP/s (matrix-product and attention FLOPs)."""
        self.seconds["loop and other"] = max(0.0, total - sum(v for k, v in self.seconds.items()
                                                               if k != "loop and other"))
        out = ["| stage | time (s) | share | GFLOP/s |", "|---|---|---|---|"]
        for name in STAGES:
            t, f = self.seconds[name], self.flops[name]
            rate = f"{f / t / 1e9:.1f}" if f and t else "-"
            out.append(f"| {name} | {t:.3f} | {100 * t / total:.1f} % | {rate} |")
        return out


# ------------------------------------------------------------------------------------------ measurements
def ours_generate(model, prompt, setup: Setup):
    C = model.config.canvas_length
    generate = fast.generate if isinstance(model, fast.Model) else reference_generate
    return generate(model, prompt, random=0, max_new_tokens=setup.canvases * C,
                    max_denoising_steps=setup.steps, stability_threshold=None, eos_token_id=())


def decoder_flops(config, batch: int, cached: int) -> float:
    """Multiply-adds x 2 of one decoder pass with self-conditioning (matrix products and attention)."""
    C, H, V = config.canvas_length, config.hidden_size, config.vocab_size
    M = batch * C
    flops = 2 * M * V * H * 2  # self-conditioning soft embedding + output projection
    flops += 2 * M * H * config.intermediate_size * 3  # self-conditioning MLP
    for l in range(config.num_hidden_layers):
        d, g, n_h = config.layer_head_dim[l], config.layer_num_key_value_heads[l], config.num_attention_heads
        qkv = n_h * d + g * d * (2 if config.is_sliding(l) else 1)
        flops += 2 * M * H * (qkv + n_h * d)  # projections
        keys = (min(cached, config.sliding_window - 1) if config.is_sliding(l) else cached) + C
        flops += 2 * 2 * M * n_h * d * keys  # scores and weighted sum
        flops += 2 * M * H * config.intermediate_size * 3  # dense MLP
        flops += 2 * M * config.top_k_experts * H * config.moe_intermediate_size * 3 + 2 * M * H * config.num_experts
    return float(flops)


def reference_sampling_step(z, temp, draws, bound):
    processed = scale_logits(z, temp)
    check_logits(z, "denoiser logits")
    check_logits(processed, "processed")
    probs, entropies = softmax_and_entropy(processed)
    sampled = draws.categorical(probs)
    draft = argmax_tokens(processed)
    accepted = entropy_bound_accept(entropies, bound)
    return draft, renoise(sampled, accepted, draws.renoise_ids(*z.shape))


def fast_sampling_step(z, temp, draws, bound, sampler):
    from diffusiongemma.fast.sampling import sampling_step

    u = draws.generator.random(size=z.shape[:2], dtype=np.float64)
    return sampling_step(z, temp, u, draws.renoise_ids(*z.shape), bound, sampler)


def interleaved(fns: dict, repeats: int) -> dict:
    """Median wall time of each callable in ``fns``, run in alternation (round robin) ``repeats`` times after
    one untimed warm-up round, so that a change of machine load hits every entry alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def load_now() -> str:
    return "load %.2f" % os.getloadavg()[0]


class BusyProcess:
    """One busy background process (a Python loop) for the contention phase, stopped on exit."""

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()
        return False


def run(args) -> list[str]:
    lines = [f"machine: {machine_line()}", f"commit: {git_commit()}",
             "thread pools: " + ", ".join(f"{p['internal_api']} ({p['num_threads']})" for p in threadpool_info()),
             f"kernels compiled with OpenMP threads available: {fast._kernels.max_threads()}; "
             f"tiled products: {fast.model.CPU_ARRAYS.tiled}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
             f"affinity: {sorted(os.sched_getaffinity(0))}"]
    print("\n".join(lines), flush=True)

    def report(line):
        print(line, flush=True)
        lines.append(line)

    import torch

    built = {}
    for name in args.configs:
        setup = SETUPS[name]
        config = make_config(**setup.config_kwargs)
        tensors = random_tensors(config, 0)
        prompt = np.random.default_rng(0).integers(3, config.vocab_size, (setup.batch, setup.prompt))
        built[name] = (setup, config, tensors, prompt, fast.Model(config, tensors),
                       ReferenceModel(config, tensors) if name == "small" else None,
                       transformers_model(config, tensors) if not args.no_transformers else None)

    for phase in args.phases:
        scope = BusyProcess() if phase == "contended" else contextlib.nullcontext()
        with scope:
            report(f"\n# {phase}" + (" (one busy background process started by the benchmark)"
                                      if phase == "contended" else ""))
            for threads in args.threads:
                torch.set_num_threads(threads)
                with threadpool_limits(limits=threads):
                    report(f"\n## {phase}, {threads} thread(s)")
                    for name, (setup, config, tensors, prompt, fst, ref, hf) in built.items():
                        fns = {"fast": lambda: ours_generate(fst, prompt, setup)}
                        if hf is not None:
                            fns["transformers"] = lambda: hf_generate(hf, prompt, setup)
                        if ref is not None:
                            fns["reference"] = lambda: ours_generate(ref, prompt, setup)
                        t = interleaved(fns, args.repeats)
                        work = (f"{setup.canvases} canvas(es) x {setup.steps} steps, batch {setup.batch}, "
                                f"prompt {setup.prompt}")
                        report(f"{name} generate ({work}), median of {args.repeats} interleaved, {load_now()}: "
                               f"fast {t['fast']:.3f} s")
                        for other in ("transformers", "reference"):
                            if other in t:
                                report(f"  {other:12s} {t[other]:.3f} s -> fast is {t[other] / t['fast']:.2f}x faster")
                        if name == "medium":
                            decoder_line(fst, config, setup, prompt, args.repeats, report)
                    if args.sampling and phase == "quiet":
                        sampling_line(args.repeats, report)
    if args.stages:
        for name, (setup, config, tensors, prompt, fst, ref, hf) in built.items():
            with threadpool_limits(limits=1):
                ours_generate(fst, prompt, setup)
                with StageProfile(fst) as profile:
                    start = time.perf_counter()
                    ours_generate(fst, prompt, setup)
                    total = time.perf_counter() - start
            report(f"\n### stages of one {name} generate, 1 thread, quiet phase conditions, {load_now()}: "
                   f"{total:.3f} s")
            for line in profile.lines(total):
                report(line)
    return lines


def decoder_line(fst, config, setup, prompt, repeats, report):
    """The medium decoder's GFLOP/s next to NumPy's float32 GEMM rate, timed in alternation."""
    cache = fst.new_cache(setup.batch)
    fst.encode(prompt, cache)
    canvas = np.random.default_rng(1).integers(0, config.vocab_size, (setup.batch, config.canvas_length))
    out = fst.denoise(canvas, cache)
    sc = out / np.float32(0.8)
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    b, c = a.copy(), np.empty_like(a)
    t = interleaved({"decoder": lambda: fst.denoise(canvas, cache, sc, out=out),
                     "gemm": lambda: np.matmul(a, b, out=c)}, max(3, repeats))
    rate = decoder_flops(config, setup.batch, cache.length) / t["decoder"] / 1e9
    gemm = 2 * 2048 ** 3 / t["gemm"] / 1e9
    report(f"  medium decoder forward (denoise with SC, {cache.length} cached): {t['decoder']:.3f} s, "
           f"{rate:.1f} GFLOP/s; NumPy float32 GEMM 2048^3: {gemm:.1f} GFLOP/s -> {rate / gemm:.2f} of GEMM rate "
           f"({load_now()})")


def sampling_line(repeats, report):
    from diffusiongemma.fast.sampling import FusedSampler

    B, C, V = 1, 256, 262144
    logits = (4.0 * np.random.default_rng(0).standard_normal((B, C, V))).astype(np.float32)
    temp, bound = np.float32(0.8), 0.1
    t_ref = best_of(lambda: reference_sampling_step(logits, temp, SeededDraws(0), bound), 1)
    sampler, work = FusedSampler(), np.empty_like(logits)

    def fast_step():
        np.copyto(work, logits)  # the fast step overwrites its input; copying is not timed below
        start = time.perf_counter()
        fast_sampling_step(work, temp, SeededDraws(0), bound, sampler)
        return time.perf_counter() - start

    t_fast = min(fast_step() for _ in range(repeats))
    same = np.array_equal(fast_sampling_step(logits.copy(), temp, SeededDraws(0), bound, sampler)[4],
                          reference_sampling_step(logits, temp, SeededDraws(0), bound)[1])
    report(f"sampling step over ({B}, {C}, {V}) logits (canvas of 256, vocabulary 262144): "
           f"reference {t_ref:.3f} s, fast {t_fast:.3f} s -> {t_ref / t_fast:.1f}x faster "
           f"(same next canvas: {same}; {load_now()})")


def load_kernels(path: str):
    """Another build of ``fast/_kernels.pyx`` (e.g. of an older commit, compiled under another module name such
    as ``_kernels_before``) loaded from ``path``; its module name is the file name up to the first dot."""
    import importlib.machinery
    import importlib.util

    name = os.path.basename(path).split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def sampler_ab_line(other_path: str, repeats: int, report, threads: int):
    """The fused sampling pass of this build against another build's, in alternation (A B A B ...): the same
    (1, 256, 262144) logits, temperature and uniforms. Reports the median time of each and their ratio."""
    from diffusiongemma.fast import sampling as fast_sampling
    from diffusiongemma.fast.sampling import FusedSampler

    builds = {"this build": fast._kernels, "other build": load_kernels(other_path)}
    B, C, V = 1, 256, 262144
    logits = (4.0 * np.random.default_rng(0).standard_normal((B, C, V))).astype(np.float32)
    u = np.random.default_rng(1).random((B, C))
    u_random = u.copy()
    temp = np.float32(0.8)
    probs = np.empty_like(logits)
    sampler = FusedSampler()
    rows = np.arange(B, dtype=np.int64)

    def step(module):
        def run_once():
            fast_sampling._kernels = module
            try:
                return sampler(logits, rows, temp, u, probs)
            finally:
                fast_sampling._kernels = builds["this build"]
        return run_once

    for case, uniforms in (("random u", u_random), ("u = 0, every draw in the rounding margin", np.zeros_like(u))):
        u[...] = uniforms
        with threadpool_limits(limits=threads):
            same = np.array_equal(step(builds["this build"])().sampled, step(builds["other build"])().sampled)
            t = interleaved({name: step(module) for name, module in builds.items()}, repeats)
        report(f"sampler A/B over ({B}, {C}, {V}) logits, {case}, {threads} thread(s), median of {repeats} "
               f"interleaved: this build {t['this build'] * 1e3:.1f} ms, other build {t['other build'] * 1e3:.1f} ms "
               f"-> this / other = {t['this build'] / t['other build']:.3f} (same draws: {same}; {load_now()})")


# ------------------------------------------------------------------------------------------ bf16 storage
def _rss_bytes(field: str = "VmRSS") -> int:
    """Resident memory of this process now (VmRSS), or its peak (VmHWM: since exec, unlike ``ru_maxrss``,
    which keeps the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def bf16_child(name: str, path: str, keep: bool, repeats: int, threads: int) -> None:
    """One side of ``--bf16``: load ``path`` (widened or kept bfloat16), time generate, print one JSON line."""
    import hashlib
    import json

    setup = SETUPS[name]
    start = time.perf_counter()
    model = fast.Model.from_pretrained(path, keep_bf16=keep)
    load = time.perf_counter() - start
    rss = _rss_bytes()
    prompt = np.random.default_rng(0).integers(3, model.config.vocab_size, (setup.batch, setup.prompt))
    times, cpu = [], []
    with threadpool_limits(limits=threads):
        result = ours_generate(model, prompt, setup)  # warm-up
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            ours_generate(model, prompt, setup)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    kinds = sorted({w.experts.kind for w in model.layers})
    print("BF16CHILD " + json.dumps({
        "weights": model.weight_nbytes, "rss": rss, "peak": _rss_bytes("VmHWM"),
        "load": load, "generate": statistics.median(times), "cpu": statistics.median(cpu), "experts": kinds,
        "qkv": str(model.layers[0].qkv.dtype), "tokens": hashlib.sha256(result.sequences.tobytes()).hexdigest()[:16]}),
        flush=True)


def bf16_lines(args) -> None:
    """``--bf16``: float32-widened against bfloat16-kept, on a bfloat16 checkpoint of each configuration."""
    import json
    import tempfile

    from safetensors.numpy import save_file

    from diffusiongemma.reference.support.quantized import BFLOAT16

    print(f"machine: {machine_line()}\ncommit: {git_commit()}\nkernels: panel ISA {fast._kernels.panel_isa()}, "
          f"tiled products {fast.model.CPU_ARRAYS.tiled}, OpenMP threads available "
          f"{fast._kernels.max_threads()}", flush=True)
    gib = 2.0 ** 30
    for name in args.configs:
        setup = SETUPS[name]
        config = make_config(**setup.config_kwargs)
        with tempfile.TemporaryDirectory(prefix="bench-bf16-") as folder:
            tensors = {k: v.astype(BFLOAT16) for k, v in random_tensors(config, 0).items()}
            save_file(tensors, os.path.join(folder, "weights-00001.safetensors"))
            with open(os.path.join(folder, "diffusiongemma.json"), "w") as f:
                json.dump({"format": "diffusiongemma", "format_version": 1, "dtype": "bfloat16",
                           "model_config": config.to_dict(),
                           "weight_map": {k: "weights-00001.safetensors" for k in tensors}}, f)
            n_params = sum(int(v.size) for v in tensors.values())
            del tensors
            for threads in args.threads:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(2):  # two rounds, in alternation
                    for keep in (False, True):
                        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--bf16-child", name, folder,
                                              str(int(keep)), str(args.repeats), str(threads)],
                                             capture_output=True, text=True, env=dict(os.environ))
                        line = next((l for l in out.stdout.splitlines() if l.startswith("BF16CHILD ")), None)
                        if line is None:
                            raise SystemExit(f"--bf16 child failed:\n{out.stdout}\n{out.stderr}")
                        runs[keep].append(json.loads(line[len("BF16CHILD "):]))
                print(f"\n{name} ({n_params / 1e6:.1f} M parameters; generate {setup.canvases} canvas(es) x "
                      f"{setup.steps} steps, batch {setup.batch}, prompt {setup.prompt}), {threads} thread(s), "
                      f"{load_now()}:", flush=True)
                for keep, label in ((False, "float32 (keep_bf16=False)"), (True, "bfloat16 kept")):
                    r = runs[keep]
                    print(f"  {label:26s} weights {r[0]['weights'] / gib:.3f} GiB, RSS after load "
                          f"{min(x['rss'] for x in r) / gib:.3f} GiB, peak RSS {min(x['peak'] for x in r) / gib:.3f} GiB, "
                          f"load {min(x['load'] for x in r):.2f} s, generate {' / '.join('%.3f' % x['generate'] for x in r)} s "
                          f"(CPU time {' / '.join('%.3f' % x['cpu'] for x in r)} s) "
                          f"(experts {r[0]['experts']}, qkv {r[0]['qkv']})", flush=True)
                f32, b16 = runs[False], runs[True]
                same = len({x["tokens"] for x in f32 + b16}) == 1
                ratio = min(x["generate"] for x in b16) / min(x["generate"] for x in f32)
                cpu_ratio = min(x["cpu"] for x in b16) / min(x["cpu"] for x in f32)
                print(f"  bfloat16 / float32: weights {b16[0]['weights'] / f32[0]['weights']:.3f}, peak RSS "
                      f"{min(x['peak'] for x in b16) / min(x['peak'] for x in f32):.3f}, generate time (best round) "
                      f"{ratio:.3f}, CPU time {cpu_ratio:.3f}; "
                      f"generated tokens {'identical' if same else 'DIFFER'}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=["small", "medium"], choices=sorted(SETUPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", nargs="*", default=["quiet", "contended"], choices=["quiet", "contended"])
    parser.add_argument("--no-stages", dest="stages", action="store_false")
    parser.add_argument("--no-sampling", dest="sampling", action="store_false")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--sampler-ab", metavar="SO", help="only time the sampling pass of this build against the "
                                                           "_kernels build in SO, in alternation, and exit")
    parser.add_argument("--bf16", action="store_true", help="only compare a bfloat16 checkpoint widened to float32 "
                                                            "at load against kept bfloat16, and exit")
    parser.add_argument("--bf16-child", nargs=5, metavar=("CONFIG", "PATH", "KEEP", "REPEATS", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bf16_child:
        name, path, keep, repeats, threads = args.bf16_child
        bf16_child(name, path, keep == "1", int(repeats), int(threads))
        return
    if args.bf16:
        bf16_lines(args)
        return
    if args.sampler_ab:
        print(f"machine: {machine_line()}\ncommit: {git_commit()}", flush=True)
        for threads in args.threads:
            sampler_ab_line(args.sampler_ab, max(args.repeats, 5), lambda line: print(line, flush=True), threads)
        return
    run(args)


if __name__ == "__main__":
    main()
