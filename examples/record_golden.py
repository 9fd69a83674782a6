"""Regenerate the stored golden traces in ``tests/golden/`` (golden set version ``GOLDEN_VERSION``).

    python examples/record_golden.py              # every case
    python examples/record_golden.py tiny-a       # some cases

Each case is a directory ``tests/golden/<case>/`` holding

* ``golden.trace``: one whole generation run recorded from **transformers** (``DiffusionGemmaForBlockDiffusion
  .generate`` observed by ``examples/trace_transformers.py``), with torch's random draws on its draw tape and
  full logits, so that a port can check its forward alone, its sampler alone, or the whole loop
  (``docs/TRACE_FORMAT.md``, "Golden traces");
* ``model/``: the transformers checkpoint it ran (``config.json`` + ``model.safetensors``) for the two tiny
  random cases; the shipped-model case names ``diffusiongemma/assets/tiny-kjv`` in its ``case.json``;
* ``case.json``: what the case is for (the code paths it reaches), the settings, and the checksum of the
  weights it was recorded with.

Before a case is written, the NumPy reference replays the trace's draws and must compare clean against it at the
default tolerances (else the script stops: the reference and transformers disagree, which is a bug to fix, not
a golden to store). Needs torch and transformers (the test extra); the checks that use the stored files do not.

The cases (together they reach every code path of the text model and the loop):

* ``tiny-a``: two rows, the second left-padded by 4 (transformers runs it with sdpa attention: its eager path
  cannot run a masked generate); a 13-token prompt and 16-token canvases over a sliding window of 8; GQA 2
  (sliding) and 4 (full); full layers without v_proj; two canvases; an EOS id chosen so that row 0 ends in
  the middle of canvas 0 (pad after it, the row ended for canvas 1); stability 0 / confidence 4 so rows stop
  at different steps (frozen rows); self-conditioning from step 1 on.
* ``tiny-b``: one row; 6 experts, top-1 routing, so some expert is hit by no token in a forward (checked);
  GQA 2 (sliding) and 3 (full) with 6 query heads; a window of 5 under a 9-token prompt and 12-token canvases;
  proportional RoPE on half the full head; default adaptive stopping; three canvases.
* ``tiny-kjv``: the shipped model on "And God said", two canvases of two steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOLDEN_DIR = os.path.join(ROOT, "tests", "golden")
GOLDEN_VERSION = 1  # bump when a case changes meaning (not when it is merely re-recorded)
SHIPPED = "tiny-kjv"


def _spec(name: str):
    from diffusiongemma.tiny import FULL, SLIDING, TinySpec

    if name == "tiny-a":
        return TinySpec()  # SPEC §14's tiny config
    return TinySpec(vocab_size=96, hidden_size=48, intermediate_size=40, moe_intermediate_size=16,
                    layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL], num_attention_heads=6,
                    num_key_value_heads=3, num_global_key_value_heads=2, head_dim=8, global_head_dim=16,
                    num_experts=6, top_k_experts=1, sliding_window=5, canvas_length=12, partial_rotary_factor=0.5)


CASES = {
    "tiny-a": dict(seed=0, torch_seed=0, rows=2, prompt_length=13, padding=4, canvases=2, steps=6,
                   stability_threshold=0, confidence_threshold=4.0, eos_mid_canvas=True),
    "tiny-b": dict(seed=1, torch_seed=3, rows=1, prompt_length=9, padding=0, canvases=3, steps=4,
                   stability_threshold=1, confidence_threshold=0.005, eos_mid_canvas=False),
    SHIPPED: dict(torch_seed=0, prompt="And God said", canvases=2, steps=2),
}


def weights_digest(directory: str) -> str:
    """sha256 of the checkpoint's model.safetensors (what the golden was recorded with)."""
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------------------------------------------ models
def tiny_checkpoint(name: str, directory: str):
    """Save the tiny random transformers model of case ``name`` into ``directory``; returns the model.

    The query/key norm weights are scaled by 0.4 (as in tests/test_trace_transformers.py): attention logits
    are less peaked, so float32 noise stays ~1e-6 over whole free runs instead of growing ~20x per step.
    """
    import torch

    from diffusiongemma.tiny import save_tiny, tiny_model

    hf = tiny_model(_spec(name), seed=CASES[name]["seed"])
    with torch.no_grad():
        for key, parameter in hf.named_parameters():
            if key.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.mul_(0.4)
    save_tiny(hf, directory)
    for extra in os.listdir(directory):  # keep the checkpoint to its two files
        if extra not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(directory, extra))
    # drop the (randomly initialised, text-unused) vision tower: most of the file's bytes
    from safetensors import safe_open
    from safetensors.numpy import save_file

    file = os.path.join(directory, "model.safetensors")
    with safe_open(file, framework="np") as f:
        text = {key: f.get_tensor(key) for key in f.keys() if "vision" not in key}
    save_file(text, file, metadata={"format": "pt"})
    return hf


def settings_for(name: str, config, eos: tuple[int, ...]):
    from diffusiongemma.reference.generation_config import GenerationConfig

    case = CASES[name]
    C = config.canvas_length
    return GenerationConfig(max_new_tokens=(case["canvases"] - 1) * C + 1, max_denoising_steps=case["steps"],
                            stability_threshold=case["stability_threshold"],
                            confidence_threshold=case["confidence_threshold"], eos_token_id=eos, pad_token_id=0)


# ------------------------------------------------------------------------------------------------ checks
def replay_reference(model_dir: str, trace_path: str, out_path: str, layers: bool = True, **recorder_options):
    """The NumPy reference on the prompt, settings and draws of ``trace_path``; writes ``out_path``."""
    from diffusiongemma.reference.support.replay import ReplayDraws
    from diffusiongemma.reference.generate import generate
    from diffusiongemma.reference.generation_config import GenerationConfig
    from diffusiongemma.reference.model import Model
    from diffusiongemma.trace import Trace, TraceRecorder

    with Trace(trace_path) as trace:
        draws = ReplayDraws(trace.draw_tape())
        ids = trace.get("prompt.input_ids")
        mask = trace.get("prompt.attention_mask") if "prompt.attention_mask" in trace.names else None
        settings = GenerationConfig.from_dict(trace.header["generation"])
        logits_mode, top_k = trace.header["logits"]["mode"], trace.header["logits"]["top_k"]
    recorder = TraceRecorder(layers=layers, logits=logits_mode, top_k=top_k or 32, **recorder_options)
    generate(Model.from_pretrained(model_dir), ids, mask, generation_config=settings, random=draws, trace=recorder)
    draws.check_exhausted()
    recorder.save(out_path)
    return out_path


def expert_usage(model_dir: str, trace_path: str) -> list[list[int]]:
    """Tokens routed to each expert, per MoE call, during the reference's replay of ``trace_path``."""
    from diffusiongemma.reference import layers

    counts: list[list[int]] = []
    original = layers.route

    def counting(h, w, config, *args, **kwargs):
        indices, weights = original(h, w, config, *args, **kwargs)
        counts.append(np.bincount(indices.ravel(), minlength=config.num_experts).tolist())
        return indices, weights

    layers.route = counting
    try:
        with tempfile.TemporaryDirectory() as tmp:
            replay_reference(model_dir, trace_path, os.path.join(tmp, "replay.trace"), layers=False)
    finally:
        layers.route = original
    return counts


def coverage(model_dir: str, trace_path: str) -> dict:
    """The code paths a golden trace reaches, read from its files (checked again by tests/test_golden.py)."""
    from diffusiongemma.reference.config import ModelConfig
    from diffusiongemma.trace import Trace

    config = ModelConfig.from_json_file(os.path.join(model_dir, "config.json"))
    with Trace(trace_path) as trace:
        names, header = trace.names, trace.header
        ids = trace.get("prompt.input_ids")
        mask = trace.get("prompt.attention_mask") if "prompt.attention_mask" in names else None
        committed = [trace.get(n) for n in names if n.endswith(".committed")]
        finished = [trace.get(n) for n in names if n.endswith(".finished")]
    eos = header["generation"].get("eos_token_id") or []
    pad = header["generation"].get("pad_token_id")
    C = config.canvas_length
    eos_mid = any(((row[:-1][:, None] == np.array(eos)[None]).any(axis=1)).any() and row[-1] == pad
                  for canvas in committed for row in canvas) if eos else False
    sliding = [l for l in range(config.num_hidden_layers) if config.is_sliding(l)]
    full = [l for l in range(config.num_hidden_layers) if not config.is_sliding(l)]
    usage = expert_usage(model_dir, trace_path)
    return {
        "prompt_length": int(ids.shape[1]), "canvas_length": C, "sliding_window": config.sliding_window,
        "window_shorter_than_prompt_and_canvas": bool(config.sliding_window < min(ids.shape[1], C)),
        "gqa_ratios": sorted({config.num_attention_heads // config.layer_num_key_value_heads[l]
                              for l in sliding + full}),
        "full_layers_without_v_proj": full,
        "top_k_experts": config.top_k_experts, "num_experts": config.num_experts,
        "moe_calls_with_an_unused_expert": sum(1 for c in usage if 0 in c), "moe_calls": len(usage),
        "self_conditioning_steps": sum(1 for n in names if n.endswith(".input_embedding") and ".step0." not in n),
        "canvases": len(committed),
        "eos_mid_canvas": bool(eos_mid),
        "left_padding": bool(mask is not None and (mask == 0).any()),
        "frozen_rows": bool(any(f.any() and not f.all() for f in finished)),
    }


# ------------------------------------------------------------------------------------------------ recording
def record_case(name: str, out_dir: str) -> dict:
    """Record case ``name`` into ``out_dir`` (model/, golden.trace, case.json); returns case.json's content."""
    import torch

    sys.path.insert(0, HERE)
    from trace_transformers import record_transformers_trace  # noqa: E402 (examples/ is not a package)

    from diffusiongemma.checkpoint import default_model_dir, load_text_side
    from diffusiongemma.reference.config import ModelConfig
    from diffusiongemma.reference.generation_config import GenerationConfig
    from diffusiongemma.trace import Trace, compare_traces, format_report

    case = CASES[name]
    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, "golden.trace")
    if name == SHIPPED:
        from transformers import DiffusionGemmaForBlockDiffusion

        model_dir = default_model_dir()
        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
        config = ModelConfig.from_transformers(hf.config.to_dict())
        ids = np.array([load_text_side(model_dir).encode(case["prompt"])], dtype=np.int64)
        mask = None
        settings = GenerationConfig.from_pretrained(model_dir).replace(
            max_new_tokens=(case["canvases"] - 1) * config.canvas_length + 1, max_denoising_steps=case["steps"])
    else:
        model_dir = os.path.join(out_dir, "model")
        if os.path.isdir(model_dir):
            shutil.rmtree(model_dir)
        hf = tiny_checkpoint(name, model_dir)
        config = ModelConfig.from_transformers(hf.config.to_dict())
        rng = np.random.default_rng(100 + case["seed"])
        ids = rng.integers(5, config.vocab_size, size=(case["rows"], case["prompt_length"])).astype(np.int64)
        mask = None
        if case["padding"]:
            mask = np.ones_like(ids)
            ids[-1, :case["padding"]], mask[-1, :case["padding"]] = 0, 0
        settings = settings_for(name, config, ())
        if case["eos_mid_canvas"]:  # pick an id that row 0 drafts mid-canvas 0 and nowhere before it
            probe = record_transformers_trace(_attention(hf, mask), ids, settings, seed=case["torch_seed"],
                                              attention_mask=mask)
            row0 = probe.tensors["canvas0.committed"][0]
            C = config.canvas_length
            for p in range(C // 2, C - 1):
                token = int(row0[p])
                if token not in row0[:p] and token not in (0,) and token not in probe.tensors["canvas0.committed"][1:]:
                    break
            else:
                raise RuntimeError(f"{name}: no token of row 0 can serve as a mid-canvas EOS")
            settings = settings_for(name, config, (token,))
    recorder = record_transformers_trace(_attention(hf, mask), ids, settings, seed=case["torch_seed"],
                                         attention_mask=mask, layers=True, logits="full")
    recorder.header["golden"] = {"case": name, "version": GOLDEN_VERSION}
    recorder.save(trace_path)
    with tempfile.TemporaryDirectory() as tmp:  # the reference must agree before anything is kept
        ours = replay_reference(model_dir, trace_path, os.path.join(tmp, "ours.trace"))
        with Trace(trace_path) as a, Trace(ours) as b:
            comparison = compare_traces(a, b)
        if not comparison.ok or comparison.skipped:
            raise RuntimeError(f"{name}: the reference does not reproduce transformers' run:\n"
                               + format_report(comparison, table=False))
        worst = max(row.max_abs for row in comparison.rows if row.max_abs is not None)
    info = {
        "case": name, "golden_version": GOLDEN_VERSION, "trace_format_version": recorder.header["version"],
        "producer": recorder.header["producer"],
        "model": "model" if name != SHIPPED else "diffusiongemma/assets/tiny-kjv",
        "weights": weights_digest(model_dir), "torch_seed": case["torch_seed"],
        "attention": "sdpa" if mask is not None else "eager",
        "reference_max_abs_diff": worst, "tensors": len(recorder.entries),
        "coverage": coverage(model_dir, trace_path),
    }
    with open(os.path.join(out_dir, "case.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    return info


def _attention(hf, mask):
    """transformers 5.24.0's eager attention cannot run a masked generate; sdpa can (same math)."""
    hf.set_attn_implementation("sdpa" if mask is not None else "eager")
    return hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"cases to record, of {list(CASES)} (default: all)")
    parser.add_argument("--out", default=GOLDEN_DIR, help="golden directory (default: tests/golden)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    for name in args.cases or list(CASES):
        info = record_case(name, os.path.join(args.out, name))
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(args.out, name))
                   for f in fs)
        print(f"{name}: {info['tensors']} tensors, {size / 2**20:.2f} MiB, reference max |diff| "
              f"{info['reference_max_abs_diff']:.2e}; coverage {json.dumps(info['coverage'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
