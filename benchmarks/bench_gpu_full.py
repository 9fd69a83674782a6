"""The released DiffusionGemma 26B-A4B at its full shape on one GPU, random weights made on the device.

Run on a GPU machine through ``bash benchmarks/gpu_full.sh`` (time-boxed, under 8 minutes on one H200), or
``python benchmarks/bench_gpu_full.py --out DIR [--budget S]``. It builds the released text model's shapes
(SPEC §1/§2.1: 30 layers, ``([S]*5 + [F]) x 5``, hidden 2,816, 16 query heads, sliding layers 8 KV heads of
256, full layers 2 KV heads of 512 with K = V, dense MLP 2,112, 128 experts of 704, top 8, vocabulary
262,144, window 1,024, canvas 256, tied embeddings; 25.2 B parameters) and measures, each part time-boxed
and written to ``DIR/bench_gpu_full.json`` and ``DIR/bench_gpu_full.md`` as soon as it finishes:

* the machine: GPU, driver, CUDA, torch / CuPy / transformers / NumPy versions, commit;
* the device's copy rate (a device-to-device copy, bytes read + written per second) and its bf16 matrix
  product rate, measured in the same run; from them the floors of one denoising step: a decoder pass reads
  every weight once (256 canvas tokens x top-8 routes touch all 128 experts of every layer, and the tied
  lm_head reads the whole embedding), so ``weight bytes / copy rate``; and ``2 x multiply-adds per token x
  tokens / product rate`` (attention left out; per token: the dense weights, 8 of 128 experts, and the
  (V, H) table twice, the self-conditioning's probabilities and the lm_head), which binds at larger batches;
* **ours, bfloat16** first (``fast.gpu.Model(..., dtype="bfloat16")``, issue #30: the matrices as bfloat16
  bits on the device, multiplied on tensor cores; about 50 GB, which fits one H200): its ``Model`` takes host
  NumPy arrays, so the weights are host views that cost almost no host memory: one random draw per tensor
  kind shared by the 30 layers and one expert broadcast to all 128 (the router and the embedding are drawn
  in full, so routing spreads as with real weights), ``ml_dtypes.bfloat16`` arrays. Then, in this order (the
  steps are what the floors are about): one denoising step's model call (``denoise`` with
  self-conditioning logits, left on the device) at batch 1, 2 and 8 after a prompt of the first prompt
  length (1k), the commit of a finished canvas (an encoder call over its 256 tokens), tokens/s per user at
  16 steps per canvas: ``256 / (16 x step + commit)``; the prefill of 1k / 8k / 32k prompt tokens; device
  memory in use after each call. It leaves 90 s for the torch part (the two do not fit on the device at
  once, so ours is freed first). Where ``fast.gpu.Model`` has no ``dtype`` yet the part is skipped with a
  note saying so;
* **torch bf16 eager**: transformers' ``DiffusionGemmaForBlockDiffusion`` created inside a
  ``torch.device("cuda")`` context in bfloat16, so transformers' own initialisation (normal, std 0.02;
  norms one) draws every weight on the device and nothing of the 50 GB passes through the host (while it
  is built, the encoder's layers exist next to the decoder's until transformers ties them: about 2x the
  weights for a moment, reported as the build peak). Then: peak device memory, the same denoising steps,
  commit and tokens/s, then the prefills; the experts touched in the first decoder layer and transformers'
  experts implementation are recorded;
* **ours, float32** last, where it fits: the same host views in float32 (widened and checked for NaN on the
  host, about 101 GB on the device). When the device's free memory is below ``4 x parameters`` plus the
  step's buffers it says "does not fit" with the arithmetic instead;
* the **summary** (first in the Markdown): ours bfloat16's step against the bandwidth floor (target: within
  1.5x) and against the larger floor, and ours bfloat16 against torch bf16 eager, step by step and prefill
  by prefill (below 1: ours faster).

Each part only starts while its expected time fits in what is left of ``--budget`` (a step: 15 s; a
prefill: from the previous length's time), so the run ends in time and says what it skipped.

Without a GPU it prints "no GPU: <reason>" and exits 2. ``--dry-run`` runs every part of the same code at
tiny shapes on the CPU (torch on the CPU, ours on "cuda-sim"), which is what tests/test_bench_gpu_full.py
does; ``--scale N`` divides every width, the vocabulary, the experts, the window, the canvas and the
prompt lengths by N, ``--layers N`` keeps the released layer pattern over N layers (the last one full).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import best_of  # noqa: E402
from diffusiongemma.tiny import FULL, SLIDING, TinySpec, hf_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOMINAL_BANDWIDTH = 4.8e12  # bytes/s, the H200's HBM3e as NVIDIA states it
STEPS_PER_CANVAS = 16
PROMPTS = (1024, 8192, 32768)
BATCHES = (1, 2, 8)


def released_layer_types(n: int) -> list[str]:
    """The released pattern over ``n`` layers: full when (i + 1) % 6 == 0, and the last layer full (SPEC §1)."""
    types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    types[-1] = FULL
    return types


def model_spec(scale: int = 1, layers: int = 30) -> TinySpec:
    """The released text model's shapes (``scale`` 1, ``layers`` 30), or every size divided by ``scale``
    (floored at what keeps the model well-formed: even head sizes, top-k at most half the experts, widths
    multiples of 8 so that bf16 rows stay 16-byte aligned for torch's grouped matrix product)."""
    if scale < 1 or layers < 1:
        raise ValueError(f"--scale and --layers must be at least 1, got {scale} and {layers}")

    def d(value: int, low: int, multiple: int = 1) -> int:
        return max(low, value // scale // multiple * multiple)

    experts = d(128, 4)
    return TinySpec(vocab_size=d(262_144, 512), hidden_size=d(2816, 32, 8), intermediate_size=d(2112, 16, 8),
                    moe_intermediate_size=d(704, 8, 8), layer_types=released_layer_types(layers),
                    num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                    head_dim=d(256, 8, 2), global_head_dim=d(512, 8, 8), num_experts=experts,
                    top_k_experts=min(8, experts // 2), sliding_window=d(1024, 8), canvas_length=d(256, 8))


def our_config(spec: TinySpec):
    """The project's ``ModelConfig`` of ``spec``, read from transformers' own config (its zero-padded
    ``per_layer_config`` keys included)."""
    from diffusiongemma.reference.config import ModelConfig

    return ModelConfig.from_transformers(hf_config(spec).to_dict())


def parameter_counts(config) -> dict:
    """Parameters of the text model (tied embedding counted once), those one token's encoder pass
    multiplies (experts: top-k of E; the embedding once), and the multiply-adds of one token's decoder
    pass without attention (the embedding table twice)."""
    from diffusiongemma.reference.weights import expected_shapes

    shapes = expected_shapes(config)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    embedding = math.prod(shapes["embed_tokens"])
    active = (total - experts) * 1.0 + experts * config.top_k_experts / config.num_experts
    # a decoder pass multiplies each token by the (V, H) table twice (the self-conditioning's probabilities
    # times E, SPEC §7.1, and the tied lm_head), and gathers its embedding row (no product)
    return {"total": int(total), "experts": int(experts), "embedding": int(embedding),
            "active_per_token": int(active), "decoder_macs_per_token": int(active + embedding)}


# ------------------------------------------------------------------------------------------------ results
class Results:
    """Every measurement as it comes, in one JSON document; the JSON and its Markdown are rewritten after
    each, so a run cut short (the shell's ``timeout``) keeps what it finished."""

    def __init__(self, out: str | None, budget: float):
        self.out, self.end = out, time.monotonic() + budget
        self.data: dict = {"notes": []}
        if out:
            os.makedirs(out, exist_ok=True)

    def left(self) -> float:
        return self.end - time.monotonic()

    def put(self, path: str, value) -> None:
        node = self.data
        keys = path.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        self.write()

    def note(self, line: str) -> None:
        print(line, flush=True)
        self.data["notes"].append(line)
        self.write()

    def section(self, name: str, fn, need: float):
        """Run ``fn`` unless less than ``need`` seconds are left; a failure is recorded, the run goes on."""
        if self.left() < need:
            self.note(f"{name}: skipped ({self.left():.0f} s of the budget left, needs about {need:.0f} s)")
            return None
        print(f"{name} ...", flush=True)
        start = time.monotonic()
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001  (a part that cannot run says why; the others run)
            self.note(f"{name}: did not run: {type(error).__name__}: {str(error)[:300]}")
            return None
        print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)
        return result

    def write(self) -> None:
        self.data["summary"] = summary(self.data)  # kept current, so a run cut short has its summary too
        if not self.out:
            return
        for name, text in (("bench_gpu_full.json", json.dumps(self.data, indent=1, default=str) + "\n"),
                           ("bench_gpu_full.md", render(self.data))):
            path = os.path.join(self.out, name)
            with open(path + ".part", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".part", path)


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if isinstance(seconds, (int, float)) else "-"


def _x(value) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "-"


def render_summary(summary: dict) -> list[str]:
    """The headline table: ours bfloat16 against the floors and torch bf16 eager (``summary()``)."""
    lines = []
    if summary.get("step"):
        lines += ["### Ours bfloat16 against the floor and torch bf16 eager (targets: step within 1.5x of the "
                  "bandwidth floor; ours / torch below 1)", "",
                  "| batch | ours bf16 ms per step | bandwidth floor ms | step / bandwidth floor | within 1.5x | "
                  "step / floor | torch bf16 ms | ours / torch bf16 |", "|---|---|---|---|---|---|---|---|"]
        for b, row in summary["step"].items():
            torch_ms = f"{row['torch_bf16_ms']:.2f}" if "torch_bf16_ms" in row else "-"
            within = "yes" if row["within_1.5x_of_the_bandwidth_floor"] else "no"
            lines.append(f"| {b} | {row['ours_ms']:.2f} | {row['bandwidth_floor_ms']:.2f} | "
                         f"{_x(row['step_over_bandwidth_floor'])} | {within} | {_x(row['step_over_floor'])} | "
                         f"{torch_ms} | {_x(row.get('ours_over_torch_bf16'))} |")
        lines.append("")
    if summary.get("prefill"):
        lines += ["| prompt tokens | ours bf16 prefill ms | torch bf16 prefill ms | ours / torch bf16 |",
                  "|---|---|---|---|"]
        for n, row in summary["prefill"].items():
            torch_ms = f"{row['torch_bf16_ms']:.2f}" if "torch_bf16_ms" in row else "-"
            lines.append(f"| {n} | {row['ours_ms']:.2f} | {torch_ms} | {_x(row.get('ours_over_torch_bf16'))} |")
        lines.append("")
    return lines


def render(data: dict) -> str:
    """The Markdown report of ``data`` (whatever parts it has so far)."""
    lines = ["## DiffusionGemma 26B-A4B, full shape, random weights (benchmarks/bench_gpu_full.py)", ""]
    machine = data.get("machine", {})
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    shape, params = data.get("shape", {}), data.get("parameters", {})
    if shape:
        lines.append(f"- shape: {shape.get('label')}")
    if params:
        lines.append(f"- parameters: {params['total'] / 1e9:.3f} B (experts {params['experts'] / 1e9:.3f} B, "
                     f"embedding {params['embedding'] / 1e9:.3f} B); active per token "
                     f"{params['active_per_token'] / 1e9:.3f} B; decoder multiply-adds per token "
                     f"{params['decoder_macs_per_token'] / 1e9:.3f} G; bf16 {params['total'] * 2 / 1e9:.1f} GB, "
                     f"float32 {params['total'] * 4 / 1e9:.1f} GB")
    rates = data.get("device_rates", {})
    if rates:
        lines.append(f"- copy rate (read + write): {rates.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s; bf16 "
                     f"matrix product: {rates.get('bf16_flops_per_s', 0) / 1e12:.0f} TFLOP/s; float32: "
                     f"{rates.get('fp32_flops_per_s', 0) / 1e12:.0f} TFLOP/s")
    lines.append("")
    lines += render_summary(data.get("summary", {}))
    for key, title in (("ours_bf16", "ours, bfloat16"), ("torch_bf16", "torch bf16 eager (transformers)"),
                       ("ours_fp32", "ours, float32")):
        part = data.get(key)
        if not part:
            continue
        lines += [f"### {title}", ""]
        lines += [f"- {k}: {v}" for k, v in part.get("facts", {}).items()]
        lines.append("")
        prefill = part.get("prefill", {})
        if prefill:
            lines += ["| prompt tokens | prefill ms | tokens/s | peak device GB |", "|---|---|---|---|"]
            for n, row in prefill.items():
                lines.append(f"| {n} | {_ms(row.get('s'))} | {row.get('tokens_per_s', 0):,.0f} | "
                             f"{row.get('peak_gb', '-')} |")
            lines.append("")
        steps = part.get("step", {})
        if steps:
            lines += ["| batch | ms per step | floor ms (bandwidth / compute) | step / floor | commit ms | "
                      f"tokens/s per user ({STEPS_PER_CANVAS} steps) | tokens/s all users | peak device GB | "
                      "experts touched (layer 0) |", "|---|---|---|---|---|---|---|---|---|"]
            for b, row in steps.items():
                floor = row.get("floor_s")
                ratio = f"{row['s'] / floor:.2f}x" if floor else "-"
                lines.append(f"| {b} | {_ms(row.get('s'))} | {_ms(floor)} ({_ms(row.get('bandwidth_floor_s'))} / "
                             f"{_ms(row.get('compute_floor_s'))}) | {ratio} | {_ms(row.get('commit_s'))} | "
                             f"{row.get('tokens_per_s_per_user', 0):,.1f} | {row.get('tokens_per_s', 0):,.1f} | "
                             f"{row.get('peak_gb', '-')} | {row.get('experts_touched', '-')} |")
            lines.append("")
    if data.get("notes"):
        lines += ["### Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ machine
def machine_facts(torch_device: str) -> dict:
    facts = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    facts["commit"] = commit or os.environ.get("DG_COMMIT", "unknown (no git here; set DG_COMMIT)")
    for name in ("torch", "transformers", "cupy"):
        try:
            facts[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001
            facts[name] = f"not importable ({type(error).__name__})"
    import torch

    facts["torch_cuda"] = torch.version.cuda
    if torch_device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, " \
                       f"{props.multi_processor_count} SMs"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.memory",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
            facts["nvidia-smi: name, driver, max SM / memory clock (MHz)"] = smi.strip()
        except (OSError, subprocess.SubprocessError) as error:
            facts["driver"] = f"nvidia-smi failed: {error}"
        try:
            import cupy

            facts["cuda_runtime (cupy)"] = cupy.cuda.runtime.runtimeGetVersion()
            facts["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
        except Exception:  # noqa: BLE001
            pass
    else:
        facts["gpu"] = "none: --dry-run on the CPU (torch CPU, ours on cuda-sim)"
    facts["cpu_cores"] = os.cpu_count()
    return facts


class TorchDevice:
    """Synchronisation and memory figures of the torch device ("cuda" or, for --dry-run, "cpu")."""

    def __init__(self, name: str):
        import torch

        self.name, self.torch = name, torch
        self.cuda = name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self):
        return round(self.torch.cuda.max_memory_allocated() / 1e9, 2) if self.cuda else "n/a (CPU)"

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()



def device_rates(dev: TorchDevice, size_bytes: int, n: int) -> dict:
    """Copy rate of ``size_bytes`` device-to-device (read + written bytes per second) and the bf16 / float32
    matrix-product rates of (n x n) @ (n x n)."""
    torch = dev.torch
    src = torch.empty(size_bytes, dtype=torch.uint8, device=dev.name)
    dst = torch.empty_like(src)
    t_copy = best_of(lambda: dst.copy_(src), repeats=5, sync=dev.sync)
    del src, dst
    out = {"copy_bytes": size_bytes, "copy_s": t_copy, "copy_bytes_per_s": 2 * size_bytes / t_copy}
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        a = torch.randn(n, n, device=dev.name, dtype=dtype)
        b = torch.randn(n, n, device=dev.name, dtype=dtype)
        t = best_of(lambda: a @ b, repeats=5, sync=dev.sync)
        out[f"{key}_flops_per_s"] = 2 * n ** 3 / t
        del a, b
    dev.free()
    return out


def floors(params: dict, bytes_per_weight: int, tokens: int, rates: dict, flops_key: str) -> dict:
    """The floors of one decoder pass over ``tokens`` canvas tokens: every weight read once at the measured
    copy rate (also at the nominal 4.8 TB/s), and the matrix products at the measured product rate."""
    weight_bytes = params["total"] * bytes_per_weight
    bandwidth = weight_bytes / rates["copy_bytes_per_s"]
    compute = 2.0 * params["decoder_macs_per_token"] * tokens / rates[flops_key]
    return {"bandwidth_floor_s": bandwidth, "nominal_bandwidth_floor_s": weight_bytes / NOMINAL_BANDWIDTH,
            "compute_floor_s": compute, "floor_s": max(bandwidth, compute)}


def prompt_ids(rng, batch: int, n: int, vocab: int) -> np.ndarray:
    return rng.integers(3, vocab - 4, size=(batch, n))  # no pad/eos/bos, no image placeholders


def predicted_ok(results: Results, previous: tuple | None, n: int, reserve: float) -> float:
    """Seconds the prefill of ``n`` tokens is expected to take (from the previous length's time, scaled
    as n^1.5 between linear and quadratic), times 3 for the warm-up and a margin, plus ``reserve``."""
    if previous is None:
        return reserve
    n0, t0 = previous
    return 3 * t0 * (n / n0) ** 1.5 + reserve


# ------------------------------------------------------------------------------------------------ torch
def hf_cache_kwargs(cache) -> dict:
    """transformers >= 5.24 names the cache argument ``cache``; 5.11-5.23 ``past_key_values``."""
    import inspect

    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as m

    params = inspect.signature(m.DiffusionGemmaDecoderModel.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def torch_section(results: Results, dev: TorchDevice, model_shape: TinySpec, params: dict, prompts, batches,
                  reserve: float) -> None:
    torch = dev.torch
    from transformers import DiffusionGemmaForBlockDiffusion, DynamicCache

    key = "torch_bf16"
    dev.free()
    dev.reset_peak()
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev.name):  # every parameter created and initialised on the device
        hf = DiffusionGemmaForBlockDiffusion._from_config(hf_config(model_shape), dtype=torch.bfloat16,
                                                          attn_implementation="sdpa")
    hf.eval()
    dev.sync()
    text = [p for n, p in hf.named_parameters() if "vision" not in n]
    n_params = sum(p.numel() for p in {id(p): p for p in text}.values())
    try:
        experts_impl = hf.get_experts_implementation()
    except Exception:  # noqa: BLE001  (older transformers)
        experts_impl = getattr(hf.config.get_text_config(), "_experts_implementation", "unknown")
    results.put(f"{key}/facts", {
        "build_s": round(time.perf_counter() - start, 2), "build_peak_gb": dev.peak_gb(),
        "text parameters (tied counted once)": n_params,
        # the spec's count also holds the two layer scalars per layer, buffers in transformers
        "equals the spec's count (so encoder and decoder share their layers)":
            n_params + 2 * len(model_shape.layer_types) == params["total"],
        "experts_implementation": str(experts_impl), "attention": "sdpa",
        "weights": "transformers' initialisation on the device (normal std 0.02, norms 1), bfloat16"})
    text_model = hf.model.encoder.language_model
    C, V = model_shape.canvas_length, model_shape.vocab_size
    rng = np.random.default_rng(0)

    def encode(ids, cache=None):
        cache = DynamicCache(config=hf.config.get_text_config()) if cache is None else cache
        n0 = cache.get_seq_length()
        B, n = ids.shape
        with torch.no_grad():
            text_model(input_ids=torch.as_tensor(ids, device=dev.name),
                       position_ids=torch.arange(n0, n0 + n, device=dev.name)[None].expand(B, -1),
                       **hf_cache_kwargs(cache))
        return cache

    # ---- denoising steps
    touched = []
    routers = [m for m in hf.model.decoder.modules() if type(m).__name__.endswith("TextRouter")]

    def count_experts(module, inputs, output):  # output: (probabilities, top-k weights, top-k indices)
        try:
            touched.append(int(output[2].unique().numel()))
        except Exception:  # noqa: BLE001  (another transformers' router output: no count, the step still runs)
            pass

    hook = routers[0].register_forward_hook(count_experts) if routers else None
    try:
        for B in batches:
            def step(B=B):
                dev.free()
                dev.reset_peak()
                cache = encode(prompt_ids(rng, B, prompts[0], V))
                canvas = torch.as_tensor(rng.integers(0, V, size=(B, C)), device=dev.name)
                positions = torch.arange(prompts[0], prompts[0] + C, device=dev.name)[None].expand(B, -1)
                sc = torch.randn(B, C, V, device=dev.name, dtype=torch.bfloat16)

                def decoder_pass():
                    with torch.no_grad():
                        out = hf.model.decoder(decoder_input_ids=canvas, decoder_position_ids=positions,
                                               self_conditioning_logits=sc, **hf_cache_kwargs(cache))
                        logits = hf.lm_head(out.last_hidden_state)
                        return 30.0 * torch.tanh(logits / 30.0)

                touched.clear()
                t = best_of(decoder_pass, repeats=3, sync=dev.sync)
                experts = touched[-1] if touched else None
                commit_ids = prompt_ids(rng, B, C, V)
                encode(commit_ids, cache)  # warm-up of the incremental shape
                dev.sync()
                t0 = time.perf_counter()
                encode(commit_ids, cache)
                dev.sync()
                commit = time.perf_counter() - t0
                row = {"s": t, "commit_s": commit, "experts_touched": f"{experts} of {model_shape.num_experts}",
                       **floors(params, 2, B * C, results.data["device_rates"], "bf16_flops_per_s")}
                per_user = C / (STEPS_PER_CANVAS * t + commit)
                row.update(tokens_per_s_per_user=per_user, tokens_per_s=B * per_user, peak_gb=dev.peak_gb())
                results.put(f"{key}/step/{B}", row)
                return t

            results.section(f"torch bf16 denoising step, batch {B}", step, reserve)

        # ---- prefill (after the steps: those are what the floors are about)
        previous = None
        for n in prompts:
            need = predicted_ok(results, previous, n, reserve)

            def prefill(n=n):
                ids = prompt_ids(rng, 1, n, V)
                dev.free()
                dev.reset_peak()
                if previous is None:
                    encode(ids)  # warm-up: kernels, cuBLAS heuristics
                dev.sync()
                t0 = time.perf_counter()
                encode(ids)
                dev.sync()
                t = time.perf_counter() - t0
                results.put(f"{key}/prefill/{n}", {"s": t, "tokens_per_s": n / t, "peak_gb": dev.peak_gb()})
                return t

            t = results.section(f"torch bf16 prefill {n}", prefill, need)
            if t is None:
                break
            previous = (n, t)
    finally:
        if hook is not None:
            hook.remove()
        del hf, text, text_model
        dev.free()


# ------------------------------------------------------------------------------------------------ ours
def host_views(config, seed: int = 0, dtype=np.float32) -> dict:
    """Random host tensors of ``dtype`` (float32, or ``ml_dtypes.bfloat16``) for every name of the format, at
    almost no host memory: matrices and norms drawn once per tensor kind and shared by every layer (the same
    array object), one expert broadcast to all experts (a read-only view); the router and the embedding drawn
    in full so that tokens differ and route to different experts. Matrices have std 1/sqrt(fan-in), norms
    1 + 0.1 N, layer scalars 0.5 + U(0, 1); drawn in float32 and rounded to ``dtype``."""
    from diffusiongemma.reference.weights import expected_shapes

    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)

    def cast(array: np.ndarray) -> np.ndarray:
        return array if array.dtype == dtype else array.astype(dtype)

    kinds: dict = {}
    tensors = {}
    for name, shape in expected_shapes(config).items():
        kind = name.split(".", 2)[2] if name.startswith("layers.") else name
        kind = f"{kind}{shape}"
        if name.endswith("router.proj") or name == "embed_tokens":
            tensors[name] = cast(rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1])))
            continue
        if kind not in kinds:
            if name.endswith("layer_scalar"):
                kinds[kind] = cast(np.float32(0.5) + rng.random(shape, dtype=np.float32))
            elif len(shape) == 1:
                kinds[kind] = cast(np.float32(1) + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32))
            elif len(shape) == 3:  # (E, out, in): one expert for all
                one = rng.standard_normal((1,) + shape[1:], dtype=np.float32) / np.float32(math.sqrt(shape[-1]))
                kinds[kind] = np.broadcast_to(cast(one), shape)
            else:
                kinds[kind] = cast(rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(shape[-1])))
        tensors[name] = kinds[kind]
    return tensors


def gpu_model_takes_dtype() -> bool:
    """Whether ``fast.gpu.Model`` has the bfloat16 run yet (its ``dtype`` argument, issue #30)."""
    import inspect

    from diffusiongemma.fast import gpu

    return "dtype" in inspect.signature(gpu.Model.__init__).parameters


NO_BF16_YET = ("ours bfloat16: skipped: diffusiongemma.fast.gpu.Model has no dtype argument yet (the GPU "
               "bfloat16 run of issue #30 is not in this checkout); the part runs as soon as it is")


OURS = {  # dtype: (results key, title, bytes per weight, the product rate its floor uses)
    "bfloat16": ("ours_bf16", "ours, bfloat16", 2, "bf16_flops_per_s"),
    "float32": ("ours_fp32", "ours, float32", 4, "fp32_flops_per_s"),
}


def ours_section(results: Results, device_name: str, model_shape: TinySpec, params: dict, prompts, batches,
                 reserve: float, dtype: str = "float32", keep: float = 0.0) -> None:
    """``fast.gpu.Model(config, host views, device, dtype=dtype)``: its denoising steps at every batch (first:
    what the floors are about), then the prefills; each part runs only while ``reserve`` + ``keep`` seconds
    (``keep``: what the parts after this one need) are left besides its own expected time."""
    from diffusiongemma.fast import gpu
    key, title, width, flops_key = OURS[dtype]
    config = our_config(model_shape)
    C, V = config.canvas_length, config.vocab_size
    weights = params["total"] * width
    step_bytes = max(batches) * C * V * 4 * 3  # logits, self-conditioning input, probabilities
    on_gpu = device_name.startswith("cuda") and device_name != "cuda-sim"
    facts = {"dtype": dtype, "device": device_name, "weights_gb": round(weights / 1e9, 2),
             "peak device GB column": "device memory in use after the call (total - free: CuPy's pool, which "
                                      "keeps the blocks it freed, so the most the run has held so far, and "
                                      "torch's context included)"}
    if dtype == "bfloat16":
        facts["weights"] = ("bfloat16 host views (ml_dtypes.bfloat16), matrices kept as bfloat16 bits on the "
                            "device and multiplied on tensor cores (float32 accumulation)")
    if on_gpu:
        import cupy

        free, total = (int(x) for x in cupy.cuda.runtime.memGetInfo())
        need = weights + step_bytes + 4 * 2**30  # + 4 GiB of workspace, cache and activations
        facts.update(device_free_gb=round(free / 1e9, 2), device_total_gb=round(total / 1e9, 2),
                     needs_gb=round(need / 1e9, 2))
        if free < need:
            facts["fits"] = (f"does not fit: {params['total'] / 1e9:.2f} B parameters x {width} bytes = "
                             f"{weights / 1e9:.1f} GB + {step_bytes / 1e9:.1f} GB of batch-{max(batches)} step "
                             f"buffers + 4.3 GB workspace > {free / 1e9:.1f} GB free")
            results.put(f"{key}/facts", facts)
            return
        facts["fits"] = "yes"
    results.put(f"{key}/facts", facts)
    start = time.perf_counter()
    from diffusiongemma.reference.primitives import BFLOAT16  # ml_dtypes.bfloat16

    tensors = host_views(config, dtype=np.float32 if dtype == "float32" else BFLOAT16)
    if device_name == "cuda-sim":
        from diffusiongemma.fast.gpu.sim import SimDevice

        device = SimDevice(checks=False)
    else:
        device = gpu.CupyDevice(device_name)
    model = gpu.Model(config, tensors, device=device, **({} if dtype == "float32" else {"dtype": dtype}))
    del tensors
    device.synchronize()
    facts["build_s (host views checked, converted and uploaded)"] = round(time.perf_counter() - start, 1)
    facts["the model's dtype (model.dtype)"] = str(getattr(model, "dtype", "float32 (no dtype attribute)"))
    if isinstance(getattr(model, "weight_bytes", None), int):
        facts["weights on the device (model.weight_bytes), GB"] = round(model.weight_bytes / 1e9, 2)

    def used_gb():
        if not on_gpu:
            return "n/a (cuda-sim)"
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return round((total - free) / 1e9, 2)

    facts["device_used_after_build_gb"] = used_gb()
    results.put(f"{key}/facts", facts)
    rng = np.random.default_rng(1)
    sync = device.synchronize
    try:  # the steps first: they are what the bandwidth floor is about
        for B in batches:
            def step(B=B):
                cache = model.new_cache(B)
                model.encode(prompt_ids(rng, B, prompts[0], V), cache)
                canvas = rng.integers(0, V, size=(B, C))
                sc = device.zeros((B, C, V), np.float32)  # its values do not change the work; no host draw
                t = best_of(lambda: model.denoise(canvas, cache, sc, device_output=True), repeats=3, sync=sync)
                commit_ids = prompt_ids(rng, B, C, V)
                model._encode(commit_ids, cache, None, return_hidden=False)
                sync()
                t0 = time.perf_counter()
                model._encode(commit_ids, cache, None, return_hidden=False)
                sync()
                commit = time.perf_counter() - t0
                row = {"s": t, "commit_s": commit, **floors(params, width, B * C, results.data["device_rates"],
                                                           flops_key)}
                per_user = C / (STEPS_PER_CANVAS * t + commit)
                row.update(tokens_per_s_per_user=per_user, tokens_per_s=B * per_user, peak_gb=used_gb())
                results.put(f"{key}/step/{B}", row)
                return t

            results.section(f"{title} denoising step, batch {B}", step, reserve + keep)
        previous = None
        for n in prompts:
            def prefill(n=n):
                ids = prompt_ids(rng, 1, n, V)
                if previous is None:
                    model._encode(ids, model.new_cache(1), None, return_hidden=False)
                sync()
                t0 = time.perf_counter()
                model._encode(ids, model.new_cache(1), None, return_hidden=False)
                sync()
                t = time.perf_counter() - t0
                results.put(f"{key}/prefill/{n}", {"s": t, "tokens_per_s": n / t, "peak_gb": used_gb()})
                return t

            t = results.section(f"{title} prefill {n}", prefill, predicted_ok(results, previous, n, reserve) + keep)
            if t is None:
                break
            previous = (n, t)
    finally:
        del model
        gc.collect()
        if on_gpu:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()


def summary(data: dict) -> dict:
    """Ours bfloat16 against its floors and against torch bf16 eager, per batch and per prompt length
    (whatever both sides measured): step / bandwidth floor (the target: at most 1.5), step / floor (the
    larger of the bandwidth and compute floors), and ours / torch (below 1: ours faster)."""
    ours, torch_ = data.get("ours_bf16", {}), data.get("torch_bf16", {})
    out: dict = {"step": {}, "prefill": {}}
    for B, row in ours.get("step", {}).items():
        entry = {"ours_ms": row["s"] * 1e3, "bandwidth_floor_ms": row["bandwidth_floor_s"] * 1e3,
                 "step_over_bandwidth_floor": row["s"] / row["bandwidth_floor_s"],
                 "step_over_floor": row["s"] / row["floor_s"],
                 "within_1.5x_of_the_bandwidth_floor": row["s"] <= 1.5 * row["bandwidth_floor_s"]}
        theirs = torch_.get("step", {}).get(B)
        if theirs:
            entry.update(torch_bf16_ms=theirs["s"] * 1e3, ours_over_torch_bf16=row["s"] / theirs["s"])
        out["step"][B] = entry
    for n, row in ours.get("prefill", {}).items():
        entry = {"ours_ms": row["s"] * 1e3}
        theirs = torch_.get("prefill", {}).get(n)
        if theirs:
            entry.update(torch_bf16_ms=theirs["s"] * 1e3, ours_over_torch_bf16=row["s"] / theirs["s"])
        out["prefill"][n] = entry
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for bench_gpu_full.json and bench_gpu_full.md (rewritten after "
                                      "each measurement)")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run (default 400)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every part at tiny shapes on the CPU (torch CPU, ours on cuda-sim); "
                             "implies --scale 64 --layers 6 unless given")
    parser.add_argument("--scale", type=int, help="divide every size by this (default 1; 64 with --dry-run)")
    parser.add_argument("--layers", type=int, help="layers in the released pattern (default 30; 6 with --dry-run)")
    parser.add_argument("--prompts", help="comma-separated prompt lengths (default 1024,8192,32768 / scale)")
    parser.add_argument("--batches", help="comma-separated batch sizes of the steps (default 1,2,8)")
    parser.add_argument("--skip", choices=("torch", "ours", "ours-bf16", "ours-fp32"), action="append", default=[],
                        help="leave out a part (repeatable; ours: both of ours)")
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else (64 if args.dry_run else 1)
    layers = args.layers if args.layers is not None else (6 if args.dry_run else 30)
    try:
        model_shape = model_spec(scale, layers)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    if args.dry_run:
        torch_device, ours_device = "cpu", "cuda-sim"
    else:
        from diffusiongemma.fast import gpu

        ok, reason = gpu.gpu_available()
        try:
            import torch

            torch_ok = torch.cuda.is_available()
        except ImportError:
            torch_ok = False
        if not ok or not torch_ok:
            why = reason if not ok else "torch sees no CUDA device"
            print(f"no GPU: {why}. This benchmark needs an NVIDIA GPU with CuPy and CUDA torch; "
                  f"--dry-run runs it at tiny shapes on the CPU.", file=sys.stderr)
            return 2
        torch_device, ours_device = "cuda", "cuda"

    results = Results(args.out, args.budget)
    dev = TorchDevice(torch_device)
    config = our_config(model_shape)
    params = parameter_counts(config)
    try:
        prompts = tuple(int(x) for x in args.prompts.split(",")) if args.prompts else \
            tuple(max(16, n // scale) for n in PROMPTS)
        batches = tuple(int(x) for x in args.batches.split(",")) if args.batches else BATCHES
        if min(prompts + batches) < 1:
            raise ValueError("must be positive")
    except ValueError as error:
        print(f"error: --prompts / --batches take comma-separated positive integers ({error})", file=sys.stderr)
        return 2
    label = (f"{layers} layers ({''.join('F' if t == FULL else 'S' for t in model_shape.layer_types)}), hidden "
             f"{model_shape.hidden_size}, heads 16 (S: 8 KV x {model_shape.head_dim}, F: 2 KV x "
             f"{model_shape.global_head_dim}, K = V), MLP {model_shape.intermediate_size}, "
             f"{model_shape.num_experts} experts x {model_shape.moe_intermediate_size} "
             f"top {model_shape.top_k_experts}, "
             f"vocabulary {model_shape.vocab_size:,}, window {model_shape.sliding_window}, canvas "
             f"{model_shape.canvas_length}" + ("" if scale == 1 and layers == 30 else
                                               f" (scaled: --scale {scale} --layers {layers})"))
    results.put("machine", machine_facts(torch_device))
    results.put("shape", {"label": label, "spec": dataclasses.asdict(model_shape), "prompts": list(prompts),
                          "batches": list(batches), "steps_per_canvas": STEPS_PER_CANVAS,
                          "step_prompt": prompts[0]})
    results.put("parameters", params)
    big = torch_device == "cuda"
    rates = results.section("device copy and product rates",
                            lambda: device_rates(dev, 4 * 2**30 if big else 2**24, 8192 if big else 256), need=5)
    results.put("device_rates", rates or {"copy_bytes_per_s": NOMINAL_BANDWIDTH, "bf16_flops_per_s": 7.9e14,
                                          "fp32_flops_per_s": 6.7e13, "measured": False})
    reserve = 15.0 if big else 0.0
    # in order of importance: ours bf16's steps (against the floors), torch bf16 eager's, then the prefills,
    # ours float32 last (it may not fit, and its host build is the slowest); ours bf16 leaves time for torch's
    # build and its first steps (both models do not fit on the device at once)
    if "ours" not in args.skip and "ours-bf16" not in args.skip:
        if gpu_model_takes_dtype():
            results.section("ours bfloat16", lambda: ours_section(
                results, ours_device, model_shape, params, prompts, batches, reserve, dtype="bfloat16",
                keep=0 if "torch" in args.skip or not big else 90.0),
                # the host build rounds every tensor to bfloat16 and packs it (about 50 GB)
                need=150 if big else 0)
        else:
            results.note(NO_BF16_YET)
    if "torch" not in args.skip:
        results.section("torch bf16 eager", lambda: torch_section(results, dev, model_shape, params, prompts,
                                                                  batches, reserve), need=60 if big else 0)
    if "ours" not in args.skip and "ours-fp32" not in args.skip:
        results.section("ours float32", lambda: ours_section(results, ours_device, model_shape, params, prompts,
                                                             batches, reserve),
                        # its host build checks every expert tensor for NaN (about 3 GB a layer, 30 layers)
                        need=150 if big else 0)
    results.note(f"finished with {results.left():.0f} s of the {args.budget:.0f} s budget left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
