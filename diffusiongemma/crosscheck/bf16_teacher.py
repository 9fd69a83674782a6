"""Teacher-forced bfloat16 calls of the reference against transformers 5.24.0's bfloat16 run on the CPU, for
``tests/test_bf16_reference.py`` and ``benchmarks/bf16_parity.py`` (the test's criterion and the benchmark's
statistics come from the same calls): tiny configurations, a checkpoint whose weights hold bfloat16 values,
the five calls (prompt encode, decoder step without and with self-conditioning, incremental encode, second
canvas) on transformers' own inputs and cache, and the ratios those tests read. Needs torch and transformers
(the test extra).
"""

from __future__ import annotations

import numpy as np
import torch

from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_denoise, hf_encode
from diffusiongemma.reference import Model
from diffusiongemma.reference.cache import KVCache
from diffusiongemma.reference.variants.router import torch_cpu_top_k
from diffusiongemma.tiny import FULL, SLIDING, TinySpec, tiny_model

CONFIGS = {  # name: (spec, why)
    "sliding+full": TinySpec(),  # SPEC §14: window 8 < prompt, head sizes 16/32, KV heads 2/1, top-2 of 4
    "sqrt(H) not bf16": TinySpec(hidden_size=48),  # the embedding scale rounds: 6.928 -> 6.9375 (B1)
    "full only, top-3 of 6": TinySpec(layer_types=[FULL, FULL], num_experts=6, top_k_experts=3),
    "peaked logits": TinySpec(final_norm_gain=6.0),
    "soft-cap, window 4, top-2 of 8": TinySpec(final_norm_gain=25.0, layer_types=[SLIDING, FULL, SLIDING, FULL],
                                               sliding_window=4, num_experts=8, top_k_experts=2),
}
SEEDS = (0, 1)


def save_bf16_valued(spec: TinySpec, seed: int, path) -> str:
    """A tiny transformers checkpoint whose weights and layer scalars hold bfloat16 values (stored float32)."""
    hf = tiny_model(spec, seed=seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(b.to(torch.bfloat16).float())
    hf.save_pretrained(path)
    return str(path)


def load_three(path):
    """(transformers bf16, transformers fp32, reference bf16 with torch's CPU top-K order)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    def hf(dtype):
        return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()

    ours = Model.from_pretrained(path, dtype="bfloat16")
    ours.router_top_k = torch_cpu_top_k  # exact bfloat16 ties are common: torch's order (SPEC B10)
    return hf(torch.bfloat16), hf(torch.float32), ours


def forced_cache(model: Model, hf_cache_obj, length: int) -> KVCache:
    """Our cache holding transformers' bfloat16 keys and values (teacher forcing of the cache)."""
    keys = [layer.keys.float().numpy().copy() for layer in hf_cache_obj.layers]
    values = [layer.values.float().numpy().copy() for layer in hf_cache_obj.layers]
    return KVCache(model.config, 1, keys, values, np.ones((1, length), dtype=bool))


class ReplayedRouting:
    """A ``router_top_k`` that returns transformers' expert choices, router call by router call."""

    def __init__(self, hf):
        self.tape, self.i = [], 0
        for module in hf.modules():
            if type(module).__name__ == "DiffusionGemmaTextRouter":
                module.register_forward_hook(lambda m, a, out: self.tape.append(out[2].numpy().copy()))

    def __call__(self, probs, k):
        self.i += 1
        return self.tape[self.i - 1]


def other_kernel(fn, *args):
    """``fn(*args)`` with oneDNN off: transformers' bfloat16 run through torch's own CPU matrix product instead
    of oneDNN's (AMX or AVX512-BF16 where the CPU has them). Same model, same inputs, same dtype: the two
    differ only in the order of the float32 sums inside each product."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's flag context warns about Intel GPUs' TF32
        with torch.backends.mkldnn.flags(enabled=False):
            return fn(*args)


def teacher_forced_ratios(spec: TinySpec, seed: int, path, ours_override=None, replay=False, other=True) -> list:
    """[(call, max|ours - hf bf16|, max|hf bf16 - hf fp32|, max|hf' bf16 - hf bf16|, max|ours - hf' bf16|)]
    for the five calls (module notes); hf' is transformers' bfloat16 run on its other CPU kernel
    (``other_kernel``), fed the same inputs and a copy of the same cache. Without ``other``, or with
    ``replay`` (whose tape takes every router call transformers makes), hf' is not run and its two columns
    are NaN."""
    import copy

    b16, f32, ours = load_three(save_bf16_valued(spec, seed, path))
    if ours_override is not None:
        ours = ours_override(ours)
    if replay:
        ours.router_top_k = ReplayedRouting(b16)
    rng = np.random.default_rng(seed)
    V, C, W = spec.vocab_size, spec.canvas_length, spec.sliding_window
    prompt = rng.integers(3, V, (1, W + 5))
    canvas, canvas2 = rng.integers(0, V, (1, C)), rng.integers(0, V, (1, C))
    cb, cf = hf_cache(b16), hf_cache(f32)
    rows = []

    def row(name, mine, theirs, fp32, alt):  # alt: transformers' run on its other kernel, or NaN
        mine, theirs, fp32, alt = (np.asarray(a, dtype=np.float64) for a in (mine, theirs, fp32, alt))
        rows.append((name, float(np.abs(mine - theirs).max()), float(np.abs(theirs - fp32).max()),
                     float(np.abs(alt - theirs).max()), float(np.abs(mine - alt).max())))

    def both(fn, *args):  # transformers on oneDNN (into cb), then on its other kernel (into a copy of cb)
        if not other or replay:
            return fn(b16, cb, *args), np.nan
        spare = copy.deepcopy(cb)
        return fn(b16, cb, *args), other_kernel(fn, b16, spare, *args)

    hb, ho = both(hf_encode, prompt)
    row("prompt encode", ours.encode(prompt, ours.new_cache(1)), hb, hf_encode(f32, cf, prompt), ho)
    L = prompt.shape[1]
    first, fo = both(hf_denoise, canvas)
    row("decoder step", ours.denoise(canvas, forced_cache(ours, cb, L)), first, hf_denoise(f32, cf, canvas), fo)
    sc = (first / np.float32(0.8)).astype(np.float32)  # generate casts it to bfloat16 (hf_denoise does too)
    with_sc, wo = both(hf_denoise, canvas, sc)
    row("self-conditioned step", ours.denoise(canvas, forced_cache(ours, cb, L), sc), with_sc,
        hf_denoise(f32, cf, canvas, sc), wo)
    committed = np.argmax(with_sc, axis=-1)
    before = forced_cache(ours, cb, L)  # transformers' cache before it encodes the canvas
    hb, ho = both(hf_encode, committed)  # transformers first: a replayed routing reads its choices
    row("incremental encode", ours.encode(committed, before), hb, hf_encode(f32, cf, committed), ho)
    hb, ho = both(hf_denoise, canvas2)
    row("second canvas", ours.denoise(canvas2, forced_cache(ours, cb, L + C)), hb, hf_denoise(f32, cf, canvas2), ho)
    return rows


def ratio(row) -> float:
    """max|ours - transformers bf16| / max|transformers bf16 - transformers fp32| of a row (call first)."""
    return row[1] / row[2] if row[2] > 0 else (0.0 if row[1] == 0 else np.inf)


def other_ratio(row) -> float:
    """The same ratio for transformers' bfloat16 run on its other CPU kernel in place of ours."""
    return row[3] / row[2] if row[2] > 0 else (0.0 if row[3] == 0 else np.inf)


def ratio_to_other(row) -> float:
    """max|ours - transformers' other-kernel bf16 run| / the same gap."""
    return row[4] / row[2] if row[2] > 0 else (0.0 if row[4] == 0 else np.inf)
