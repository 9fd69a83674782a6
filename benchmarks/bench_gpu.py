"""GPU fast path vs transformers on torch CUDA: the same random weights, the same inputs, the same steps.

Run on a GPU machine (see benchmarks/gpu_check.sh): ``python benchmarks/bench_gpu.py [--out FILE] [--quick]``.
For each config it builds a randomised transformers ``DiffusionGemmaForBlockDiffusion`` on the GPU (fp32),
copies its weights into ``fast.gpu.Model``, and times, with CUDA synchronisation around each call:

* encode: prefill of the prompt into an empty cache;
* denoise: one decoder pass over the canvas with self-conditioning logits (the steady-state step);
* generate: one canvas of ``steps`` denoising steps with adaptive stopping off (every step runs) — ours
  through ``fast.gpu.generate``, transformers through ``model.generate``;

for ours (fp32) and for transformers in fp32 and bf16 (the bf16 copy of the same weights). It also
reports the max |logit difference| of ours against transformers fp32 on the timed denoise call. Results
go to stdout and, with --out, to a Markdown file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import MEDIUM, MEDIUM_PROMPT, machine_facts  # noqa: E402
from diffusiongemma.tiny import FULL, SLIDING, TinySpec, hf_config, randomise_  # noqa: E402

# two layers (one sliding, one full) with the released 26B model's per-layer shapes (SPEC §1, §5.2)
LAYERS_26B = TinySpec(vocab_size=262_144, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
                      layer_types=[SLIDING, FULL], num_attention_heads=16, num_key_value_heads=8,
                      num_global_key_value_heads=2, head_dim=256, global_head_dim=512, num_experts=128,
                      top_k_experts=8, sliding_window=1024, canvas_length=256)


def timed(fn, sync, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_kwargs_cache(cache):
    """transformers >= 5.24 names the cache argument ``cache``; 5.11-5.23 call it ``past_key_values``."""
    import inspect

    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as m

    params = inspect.signature(m.DiffusionGemmaDecoderModel.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def build(spec: TinySpec, seed: int = 0):
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.reference.config import ModelConfig
    from diffusiongemma.reference.weights import expected_shapes
    from diffusiongemma.weights_converter.names import hf_name

    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                          attn_implementation="sdpa")
    hf.eval()
    randomise_(hf, seed=seed)
    config = ModelConfig.from_transformers(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items()}
    state.update({k: v for k, v in hf.named_buffers()})
    tensors = {}
    for name in expected_shapes(config):
        key = hf_name(name)
        tensors[name] = state[key].detach().float().cpu().numpy().reshape(expected_shapes(config)[name])
    return hf, config, tensors


def bench_config(label: str, spec: TinySpec, prompt_len: int, steps: int, device) -> list[tuple]:
    import torch
    from transformers import DynamicCache

    from diffusiongemma.fast import gpu

    hf, config, tensors = build(spec)
    ours = gpu.Model(config, tensors, device=device)
    del tensors
    sync = torch.cuda.synchronize
    rng = np.random.default_rng(0)
    B, C, V = 1, spec.canvas_length, spec.vocab_size
    prompt = rng.integers(3, min(V, 1000), size=(B, prompt_len))
    canvas = rng.integers(0, V, size=(B, C))
    rows = []

    # ---- encode
    def ours_encode():
        ours._encode(prompt, ours.new_cache(B), None, return_hidden=False)

    def hf_encode(model):
        def run():
            cache = DynamicCache(config=model.config.text_config)
            with torch.no_grad():
                model.model.encoder.language_model(input_ids=torch.tensor(prompt, device="cuda"),
                                                   position_ids=torch.arange(prompt_len, device="cuda")[None],
                                                   **hf_kwargs_cache(cache))
            return cache
        return run

    hf_bf16 = None
    results = {"ours": {}, "hf fp32": {}, "hf bf16": {}}
    results["ours"]["encode"] = timed(ours_encode, sync)
    results["hf fp32"]["encode"] = timed(hf_encode(hf), sync)

    # ---- denoise with self-conditioning
    cache = ours.new_cache(B)
    ours.encode(prompt, cache)
    hc = hf_encode(hf)()
    z_ours0 = ours.denoise(canvas, cache, device_output=True)
    sc_dev = z_ours0 / np.float32(0.8)

    def hf_denoise(model, hcache, sc):
        def run():
            with torch.no_grad():
                out = model.model.decoder(decoder_input_ids=torch.tensor(canvas, device="cuda"),
                                          decoder_position_ids=torch.arange(prompt_len, prompt_len + C,
                                                                            device="cuda")[None],
                                          self_conditioning_logits=sc, **hf_kwargs_cache(hcache))
                logits = model.lm_head(out.last_hidden_state).float()
                return 30.0 * torch.tanh(logits / 30.0)
        return run

    sc_torch = torch.as_tensor(sc_dev, device="cuda")
    results["ours"]["denoise"] = timed(lambda: ours.denoise(canvas, cache, sc_dev, device_output=True), sync)
    results["hf fp32"]["denoise"] = timed(hf_denoise(hf, hc, sc_torch), sync)
    diff = float(np.abs(ours.denoise(canvas, cache, sc_dev) - hf_denoise(hf, hc, sc_torch)().cpu().numpy()).max())

    # ---- one canvas of generation, every step executed
    gen_kwargs = dict(max_new_tokens=C, max_denoising_steps=steps, stability_threshold=None,
                      confidence_threshold=None, eos_token_id=[], pad_token_id=None)
    results["ours"]["generate"] = timed(lambda: gpu.generate(ours, prompt, random=0, **gen_kwargs),
                                        sync, repeats=3)

    def hf_generate(model):
        def run():
            with torch.no_grad():
                # a confidence threshold no mean entropy can go below: every step runs, as in ours
                model.generate(torch.tensor(prompt, device="cuda"), max_new_tokens=C, max_denoising_steps=steps,
                               stability_threshold=1, confidence_threshold=1e-30)
        return run

    try:
        results["hf fp32"]["generate"] = timed(hf_generate(hf), sync, repeats=3)
    except Exception as error:  # the generate signature differs between transformers versions
        results["hf fp32"]["generate"] = float("nan")
        print(f"  transformers generate failed: {error}")

    # ---- transformers bf16 (same weights, cast)
    hf_bf16 = hf.to(torch.bfloat16)
    results["hf bf16"]["encode"] = timed(hf_encode(hf_bf16), sync)
    hc16 = hf_encode(hf_bf16)()
    results["hf bf16"]["denoise"] = timed(hf_denoise(hf_bf16, hc16, sc_torch.to(torch.bfloat16)), sync)
    try:
        results["hf bf16"]["generate"] = timed(hf_generate(hf_bf16), sync, repeats=3)
    except Exception as error:
        results["hf bf16"]["generate"] = float("nan")
        print(f"  transformers bf16 generate failed: {error}")
    del hf, hf_bf16, ours
    torch.cuda.empty_cache()

    for op in ("encode", "denoise", "generate"):
        t = results["ours"][op]
        rows.append((label, op, t, results["hf fp32"][op], results["hf bf16"][op]))
    rows.append((label, "max |logit diff| ours vs hf fp32", diff, float("nan"), float("nan")))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write a Markdown table here")
    parser.add_argument("--quick", action="store_true", help="only the medium config")
    args = parser.parse_args(argv)

    from diffusiongemma.fast import gpu

    ok, reason = gpu.gpu_available()
    if not ok:
        print(f"no GPU: {reason}")
        return 1
    device = gpu.CupyDevice("cuda")
    configs = [("medium (hidden 1024, 4 layers, vocab 32k, canvas 128)", MEDIUM, MEDIUM_PROMPT, 8)]
    if not args.quick:
        configs.append(("26B layer shapes x2 (S+F), vocab 262k, canvas 256", LAYERS_26B, 1024, 4))
    lines = [machine_facts(), reason, "",
             "| config | operation | ours fp32 | transformers fp32 | transformers bf16 | ours / hf fp32 |",
             "|---|---|---|---|---|---|"]
    for label, spec, prompt, steps in configs:
        print(f"benchmarking {label} ...", flush=True)
        try:
            rows = bench_config(label, spec, prompt, steps, device)
        except Exception as error:
            print(f"  failed: {type(error).__name__}: {error}")
            lines.append(f"| {label} | failed: {type(error).__name__}: {error} | | | | |")
            continue
        for label_, op, ours, hf32, hf16 in rows:
            if op.startswith("max"):
                lines.append(f"| {label_} | {op} | {ours:.2e} | | | |")
            else:
                lines.append(f"| {label_} | {op} | {ours * 1e3:.2f} ms | {hf32 * 1e3:.2f} ms | {hf16 * 1e3:.2f} ms "
                             f"| {ours / hf32:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
