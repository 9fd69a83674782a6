"""The SPEC's figures, computed by the reference itself and drawn with matplotlib.

    python -m diffusiongemma.figures                   # write <name>.json and <name>.png in the current folder
    python -m diffusiongemma.figures --out /tmp/figs --only visibility temperature_schedule
    python -m diffusiongemma.figures --docs            # from inside the clone: rewrite docs/figures
    python -m diffusiongemma.figures --docs --check    # exit 1 when a committed figure's data is stale

Every figure has two halves: ``figure_data(name)`` computes what the picture shows by calling the
reference's own functions (``reference/masks.py``, ``reference/cache.py``, ``reference/generate.py`` with
``SeededDraws``, ``reference/sampling.py``, the shipped model's config) and returns a small JSON-ready
dict; ``draw(name, data)`` turns that dict into a ``matplotlib`` figure and computes nothing about the
model. The JSON lies next to the PNG in ``docs/figures/``, so a change of the reference that changes a
figure's content shows up as stale data (``tests/test_figures.py`` regenerates the data, never the pixels).

Figures (``FIGURES``):

* ``architecture``: encoder, KV cache, decoder, self-conditioning path and one block's MoE, with the shipped
  model's sizes (``diffusiongemma/assets/tiny-kjv/config.json``).
* ``visibility``: which keys each query sees, per layer type: encoder sliding / full (causal), decoder
  sliding / full (the canvas over the retained cache keys, bidirectional within the canvas).
* ``cache_ring``: the positions a sliding and a full layer's cache hold as canvases are committed.
* ``block_timeline``: prefill, canvases, commits and encodes of one run; the last canvas is never encoded.
* ``canvas_denoising``: one canvas step by step: every position's entropy and when it was accepted.
* ``temperature_schedule``: τ_n = t_min + (t_max - t_min) n / N over the steps of a canvas.
* ``speed``: the same run's tokens per decoder pass and per model pass (encoder passes counted) beside one
  per pass for an autoregressive loop, and the weight values read per token at the released shape
  (``RELEASED``), dense and mixture of experts, as a canvas takes more steps.

The two mask pictures (``visibility``, ``cache_ring``) share one drawing size, W = 4 and C = 6, so that
every cell can be seen; everything else is the shipped model's run or the released shape. Floats are
stored with ``DIGITS`` decimals, and ``write`` keeps a JSON whose regenerated data agrees with it within
the tolerance, so regenerating on a machine whose BLAS sums in another order rewrites no file.

matplotlib is needed only to draw (``pip install -e ".[plot]"``); ``figure_data`` and ``--check`` need
NumPy and the reference alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
from typing import Any, Callable

import numpy as np

__all__ = ["FIGURES", "figure_data", "draw", "stale", "write", "check", "main", "FigureError", "FIGURE_DIR",
           "SHIPPED_MODEL"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE_DIR = os.path.join(ROOT, "docs", "figures")
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-kjv")
PROMPT = "In the beginning God created"  # the prompt of the run the run-based figures show
SEED = 0  # its SeededDraws seed
NEW_TOKENS = 96  # three canvases of the shipped model's 32
DPI = {"architecture": 84}  # the widest picture, kept under the 150 KB the tests allow a PNG
DIGITS = 4  # decimals kept in the JSON: float32 noise of another BLAS sits far below the last one kept
RTOL, ATOL = 1e-4, 5e-4  # a regenerated number within this of the committed one is the same number (a value
# near a rounding boundary may land one unit of the last decimal away on another machine)


# ================================================================================================ data
def _r(x: float) -> float:
    return round(float(x), DIGITS)


def _shipped():
    from diffusiongemma.reference import GenerationConfig, Model

    return Model.from_pretrained(SHIPPED_MODEL), GenerationConfig.from_pretrained(SHIPPED_MODEL)


def _prompt_ids() -> tuple[list[int], Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(SHIPPED_MODEL, "tokenizer.json"))
    return tokenizer.encode(PROMPT).ids, tokenizer


def architecture_data() -> dict:
    """The shipped model's sizes per component (config.json, ``reference.weights.expected_shapes``)."""
    from diffusiongemma.reference import ModelConfig
    from diffusiongemma.reference.weights import expected_shapes

    config = ModelConfig.from_json_file(os.path.join(SHIPPED_MODEL, "config.json"))
    shapes = expected_shapes(config)
    layers = [{"index": l, "type": "sliding" if config.is_sliding(l) else "full",
               "query_heads": config.num_attention_heads, "kv_heads": config.layer_num_key_value_heads[l],
               "head_dim": config.layer_head_dim[l], "value_projection": f"layers.{l}.v_proj" in shapes,
               "cache_keeps": (f"last W-1 = {config.sliding_window - 1}" if config.is_sliding(l) else "all")}
              for l in range(config.num_hidden_layers)]
    return {
        "model": "diffusiongemma/assets/tiny-kjv",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "canvas_length": config.canvas_length,
        "sliding_window": config.sliding_window, "layers": layers,
        "dense_mlp": list(shapes["layers.0.mlp.gate_proj"]),
        "experts": {"num_experts": config.num_experts, "top_k": config.top_k_experts,
                    "gate_up_proj": list(shapes["layers.0.experts.gate_up_proj"]),
                    "router": list(shapes["layers.0.router.proj"])},
        "self_conditioning": {name.split(".", 1)[1]: list(shape) for name, shape in shapes.items()
                              if name.startswith("self_conditioning.")},
        "final_logit_softcapping": config.final_logit_softcapping,
        "embedding": list(shapes["embed_tokens"]),
    }


def visibility_data(prompt_length: int = 9, window: int = 4, canvas_length: int = 6) -> dict:
    """Visibility matrices from ``reference.masks`` for a small example: a ``prompt_length``-token prompt
    encoded with sliding window W = ``window``, then a canvas of ``canvas_length``."""
    from diffusiongemma.reference.masks import (cache_retains, canvas_window, decoder_visibility,
                                                encoder_visibility)

    L, W, C = prompt_length, window, canvas_length
    positions = np.arange(L)
    real = np.ones((1, L), dtype=bool)
    panels = {}
    for kind, w in (("sliding", W), ("full", None)):
        visible = encoder_visibility(positions, positions, real, w)[0]  # (L, L)
        panels[f"encoder {kind}"] = {"queries": positions.tolist(), "keys": positions.tolist(),
                                     "visible": visible.astype(int).tolist()}
    for kind, w in (("sliding", W), ("full", None)):
        kept = cache_retains(positions, np.array([L]), w)[0]  # what this layer's cache holds when the canvas starts
        keys = positions[kept]
        window_rows = canvas_window(keys, L, C, W) if w is not None else None
        visible = decoder_visibility(np.ones((1, keys.size), dtype=bool), C, window_rows)[0]
        visible = np.broadcast_to(visible, (C, keys.size + C))  # a full layer returns one row for all queries
        # drawn over every position 0 .. L + C - 1: 1 visible, 0 hidden, -1 not held by this layer's cache
        grid = np.full((C, L + C), -1, dtype=int)
        grid[:, np.concatenate([keys, np.arange(L, L + C)])] = visible
        panels[f"decoder {kind}"] = {
            "queries": list(range(L, L + C)), "keys": list(range(L + C)), "cached_keys": keys.tolist(),
            "visible": grid.tolist(), "every_query_sees_the_same_keys": bool((visible == visible[:1]).all())}
    return {"prompt_length": L, "sliding_window": W, "canvas_length": C, "panels": panels}


def cache_ring_data(prompt_length: int = 9, window: int = 4, canvas_length: int = 6, canvases: int = 3) -> dict:
    """The positions a sliding and a full layer's ``KVCache`` hold after each encoder call, on a random tiny
    model (``diffusiongemma.tiny``) with W = ``window`` and C = ``canvas_length``: the prefill, then each
    committed canvas but the last (the last one committed is never encoded)."""
    from diffusiongemma.reference import Model
    from diffusiongemma.tiny import make_config, random_tensors

    config = make_config(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                         layer_types="SF", num_attention_heads=2, sliding_head_dim=8, sliding_kv_heads=1,
                         full_head_dim=8, full_kv_heads=1, sliding_window=window, num_experts=2, top_k_experts=1,
                         canvas_length=canvas_length)
    model = Model(config, random_tensors(config, seed=0))
    cache = model.new_cache(1)
    rng = np.random.default_rng(0)
    states, new = [], rng.integers(3, 32, (1, prompt_length))
    for k in range(canvases):
        what = f"prefill ({prompt_length} tokens)" if k == 0 else f"canvas {k - 1} committed and encoded"
        model.encode(new, cache)
        states.append({"event": what, "length": int(cache.length),
                       "sliding": cache.positions(0).tolist(), "full": cache.positions(1).tolist(),
                       "canvas": list(range(cache.length, cache.length + canvas_length))})
        new = rng.integers(3, 32, (1, canvas_length))
    states.append({"event": f"canvas {canvases - 1} committed, never encoded", "length": int(cache.length),
                   "sliding": cache.positions(0).tolist(), "full": cache.positions(1).tolist(),
                   "canvas": [], "unencoded": list(range(cache.length, cache.length + canvas_length))})
    return {"sliding_window": window, "capacity": window - 1, "canvas_length": canvas_length,
            "prompt_length": prompt_length, "states": states}


class _RunLog:
    """Observer of one ``generate`` run: encoder calls, canvases and steps (row 0), commits, in order."""

    records = True
    layers = False

    def __init__(self):
        self.events: list[dict] = []
        self.steps: list[list[dict]] = []
        self._position = 0

    def __getattr__(self, name):  # the observer points not used here
        from diffusiongemma.reference.support.observer import NULL_OBSERVER

        return getattr(NULL_OBSERVER, name)

    def begin_encode(self, input_ids, attention_mask=None):
        n = int(np.shape(input_ids)[1])
        self.events.append({"kind": "encode", "start": self._position, "length": n})
        self._position += n

    def begin_canvas(self, initial_canvas):
        self.steps.append([])
        self.events.append({"kind": "canvas", "index": len(self.steps) - 1, "start": self._position,
                            "length": int(np.shape(initial_canvas)[1]), "steps": 0})

    def end_step(self, **step):
        self.steps[-1].append({"temperature": _r(step["temperature"]),
                               "entropies": [_r(h) for h in step["entropies"][0]],
                               "accepted": step["accepted"][0].astype(int).tolist(),
                               "draft": step["draft"][0].tolist(), "finished": bool(step["finished"][0])})
        self.events[-1]["steps"] += 1

    def commit(self, tokens, ended):
        self.events.append({"kind": "commit", "index": len(self.steps) - 1, "ended": bool(ended[0])})


@functools.lru_cache(maxsize=1)
def _run() -> tuple[_RunLog, Any, Any, list[int], Any]:
    """The one run the run-based figures show (computed once per process; nothing mutates it)."""
    from diffusiongemma.reference import SeededDraws, generate

    model, settings = _shipped()
    ids, tokenizer = _prompt_ids()
    log = _RunLog()
    result = generate(model, np.array([ids]), generation_config=settings, random=SeededDraws(SEED),
                      max_new_tokens=NEW_TOKENS, trace=log)
    return log, result, settings, ids, tokenizer


def block_timeline_data() -> dict:
    """Encoder calls, canvases and commits of one run of the shipped model (``generate``, ``SeededDraws``)."""
    log, result, settings, ids, _ = _run()
    return {"model": "diffusiongemma/assets/tiny-kjv", "prompt": PROMPT, "prompt_tokens": len(ids), "seed": SEED,
            "max_new_tokens": NEW_TOKENS, "max_denoising_steps": settings.max_denoising_steps,
            "events": log.events, "steps_per_canvas": list(result.steps_per_canvas),
            "cache_length_at_end": int(result.cache.length), "output_length": int(result.sequences.shape[1])}


def canvas_denoising_data(canvas: int = 0) -> dict:
    """Canvas ``canvas`` of the same run, step by step: entropies (nats), accepted positions, drafts."""
    log, result, settings, ids, tokenizer = _run()
    steps = log.steps[canvas]
    C = len(steps[0]["entropies"])
    committed = result.sequences[0, len(ids) + canvas * C:len(ids) + (canvas + 1) * C].tolist()
    return {"model": "diffusiongemma/assets/tiny-kjv", "prompt": PROMPT, "seed": SEED, "canvas": canvas,
            "entropy_bound": settings.entropy_bound, "max_denoising_steps": settings.max_denoising_steps,
            "steps": steps, "committed": committed,
            "committed_text": [tokenizer.decode([t]).strip() or repr(tokenizer.decode([t])) for t in committed]}


def temperature_schedule_data() -> dict:
    """``sampling.temperature`` over every step of a canvas, for the shipped generation config."""
    from diffusiongemma.reference.sampling import temperature

    _, settings = _shipped()
    N, lo, hi = settings.max_denoising_steps, settings.t_min, settings.t_max
    return {"max_denoising_steps": N, "t_min": lo, "t_max": hi,
            "steps": [{"step_index": i, "cur_step": n, "noise_level": _r(n / N),
                       "temperature": _r(temperature(n, N, lo, hi))} for i, n in enumerate(range(N, 0, -1))]}


# the released model's shape (Gemma 4 26B-A4B), for the weight reads the speed figure computes
RELEASED = {"vocab_size": 262_144, "hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
            "layer_types": "SSSSSF" * 5, "num_attention_heads": 16, "sliding_head_dim": 256, "sliding_kv_heads": 8,
            "full_head_dim": 512, "full_kv_heads": 2, "sliding_window": 1024, "num_experts": 128,
            "top_k_experts": 8, "canvas_length": 256}
RELEASED_STEPS = 48  # N of the released generation config


def released_weights() -> dict:
    """Weight values of the released shape (``reference.weights.expected_shapes``): all of them, the routed
    experts' share, and what one pass over T tokens reads when the router spreads its T·K choices evenly over
    the E experts (the expected number of distinct experts a layer touches is E·(1 - (1 - K/E)^T))."""
    from diffusiongemma.reference.weights import expected_shapes
    from diffusiongemma.tiny import make_config

    config = make_config(**RELEASED)
    shapes = expected_shapes(config)
    total = sum(math.prod(shape) for shape in shapes.values())
    experts = sum(math.prod(shape) for name, shape in shapes.items() if ".experts." in name)
    E, K = config.num_experts, config.top_k_experts

    def touched(tokens: int) -> float:
        return E * (1 - (1 - K / E) ** tokens)

    def read(tokens: int) -> float:
        return total - experts + experts * touched(tokens) / E

    return {"total": total, "experts": experts, "num_experts": E, "top_k": K, "layers": config.num_hidden_layers,
            "canvas_length": config.canvas_length, "touched": touched, "read": read}


def speed_data() -> dict:
    """Tokens per pass of the figures' run (decoder passes, and model passes with the encoder's counted)
    beside an autoregressive loop at one token per pass, and the weight values read per generated token at
    the released shape, for a dense model and for the mixture of experts, as a canvas takes more steps."""
    log, result, settings, ids, _ = _run()
    tokens = int((result.sequences[0, len(ids):] != settings.pad_token_id).sum())
    decoder = int(result.forward_passes[0])
    encoder = sum(e["kind"] == "encode" for e in log.events)
    w = released_weights()
    C, N, total = w["canvas_length"], RELEASED_STEPS, w["total"]
    one, canvas = w["read"](1), w["read"](C)
    return {
        "model": "diffusiongemma/assets/tiny-kjv", "prompt": PROMPT, "seed": SEED,
        "measured": {"new_tokens": tokens, "decoder_passes": decoder, "encoder_passes": encoder,
                     "tokens_per_decoder_pass": _r(tokens / decoder),
                     "tokens_per_model_pass": _r(tokens / (decoder + encoder)),
                     "tokens_per_forward": _r(result.tokens_per_forward[0]),
                     "steps_per_canvas": list(result.steps_per_canvas)},
        "autoregressive": {"tokens_per_pass": 1.0, "passes": tokens},
        "released": {
            "canvas_length": C, "max_denoising_steps": N, "num_experts": w["num_experts"], "top_k": w["top_k"],
            "layers": w["layers"], "weights_billion": _r(total / 1e9), "experts_billion": _r(w["experts"] / 1e9),
            "experts_touched_one_token": _r(w["touched"](1)), "experts_touched_canvas": _r(w["touched"](C)),
            "read_one_token_billion": _r(one / 1e9), "read_canvas_pass_billion": _r(canvas / 1e9),
            "tokens_per_decoder_pass_all_steps": _r(C / N), "tokens_per_model_pass_all_steps": _r(C / (N + 1)),
            "break_even_steps": _r(C * one / canvas - 1),
            "per_token_billion": [{"steps": n, "moe_canvas": _r(canvas * (n + 1) / C / 1e9),
                                   "dense_canvas": _r(total * (n + 1) / C / 1e9)} for n in range(1, N + 1)],
            "moe_autoregressive_billion": _r(one / 1e9), "dense_autoregressive_billion": _r(total / 1e9)},
    }


FIGURES: dict[str, Callable[[], dict]] = {
    "architecture": architecture_data, "visibility": visibility_data, "cache_ring": cache_ring_data,
    "block_timeline": block_timeline_data, "canvas_denoising": canvas_denoising_data,
    "temperature_schedule": temperature_schedule_data, "speed": speed_data,
}


def figure_data(name: str) -> dict:
    """The JSON-ready data of figure ``name`` (a key of ``FIGURES``); ``KeyError`` for another name."""
    if name not in FIGURES:
        raise KeyError(f"unknown figure {name!r}; known: {', '.join(FIGURES)}")
    return json.loads(json.dumps(FIGURES[name]()))  # exactly what the JSON file holds


def stale(committed: Any, fresh: Any, where: str = "") -> list[str]:
    """The differences between committed and regenerated figure data: every key, length, string, integer
    and boolean must match exactly, floats to within RTOL/ATOL (BLAS summation order may move last bits)."""
    if isinstance(committed, dict) and isinstance(fresh, dict):
        out = [f"{where}/{k}: only in one of them" for k in sorted(set(committed) ^ set(fresh))]
        for k in committed:
            if k in fresh:
                out += stale(committed[k], fresh[k], f"{where}/{k}")
        return out
    if isinstance(committed, list) and isinstance(fresh, list):
        if len(committed) != len(fresh):
            return [f"{where}: {len(committed)} entries committed, {len(fresh)} now"]
        return [d for i, (a, b) in enumerate(zip(committed, fresh)) for d in stale(a, b, f"{where}[{i}]")]
    if isinstance(committed, float) or isinstance(fresh, float):
        if isinstance(committed, (int, float)) and isinstance(fresh, (int, float)) \
                and not isinstance(committed, bool) and not isinstance(fresh, bool) \
                and math.isclose(committed, fresh, rel_tol=RTOL, abs_tol=ATOL):
            return []
        return [f"{where}: {committed!r} committed, {fresh!r} now"]
    if committed == fresh and type(committed) is type(fresh):
        return []
    return [f"{where}: {committed!r} committed, {fresh!r} now"]


# ================================================================================================ drawing
def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError('drawing the figures needs matplotlib: pip install -e ".[plot]"') from exc
    return plt


def _box(ax, x, y, w, h, text, color, fontsize=8, **kw):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=color,
                                edgecolor="#333333", linewidth=0.8, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, a, b, color="#333333", style="-|>", **kw):
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=color, linewidth=1.0,
                                 shrinkA=0, shrinkB=0, **kw))


def draw_architecture(d: dict):
    plt = _plt()
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(13.9, 7.0))
    ax.set_xlim(-0.4, 13.5)
    ax.set_ylim(0.1, 7.0)
    ax.axis("off")
    H, V, C = d["hidden_size"], d["vocab_size"], d["canvas_length"]
    layers = d["layers"]
    enc_x, cache_x, dec_x, sc_x, blk_x = 0.1, 2.95, 4.95, 7.85, 10.55
    bw, bh, cw, base, gap = 2.5, 0.62, 1.65, 1.45, 0.95
    heads = [(enc_x + bw / 2, "Encoder (causal)\nprompt, then each committed canvas"),
             (cache_x + cw / 2, "KV cache\nper layer"),
             (dec_x + bw / 2, f"Decoder (bidirectional)\nC = {C} noisy tokens, same weights"),
             (sc_x + 1.1, "Sampler and\nself-conditioning"), (blk_x + 1.45, "One block, in detail")]
    for x, text in heads:
        ax.text(x, 6.75, text, ha="center", va="center", fontsize=8.5, weight="bold")
    for i, layer in enumerate(layers):
        y = base + i * gap
        color = "#cfe3f7" if layer["type"] == "sliding" else "#f7dcc4"
        label = (f"layer {layer['index']}: {layer['type']}\n{layer['query_heads']} q / {layer['kv_heads']} kv heads, "
                 f"d = {layer['head_dim']}" + ("" if layer["value_projection"] else ", values = keys"))
        _box(ax, enc_x, y, bw, bh, label + "\n× encoder layer scalar", color, fontsize=7)
        _box(ax, dec_x, y, bw, bh, label + "\n× decoder layer scalar", color, fontsize=7)
        _box(ax, cache_x, y + 0.06, cw, bh - 0.12, f"keys, values:\n{layer['cache_keeps']}", "#e8e8e8",
             fontsize=7)
        _arrow(ax, (enc_x + bw, y + bh / 2), (cache_x, y + bh / 2))
        _arrow(ax, (cache_x + cw, y + bh / 2), (dec_x, y + bh / 2))
        if i:
            _arrow(ax, (enc_x + bw / 2, y - gap + bh), (enc_x + bw / 2, y))
            _arrow(ax, (dec_x + bw / 2, y - gap + bh), (dec_x + bw / 2, y))
    top = base + (len(layers) - 1) * gap + bh
    _box(ax, enc_x, 0.45, bw, 0.55, f"embed(ids) × √{H} (no norm)\nV = {V} ids, hidden width {H}", "#ffffff",
         fontsize=7)
    _arrow(ax, (enc_x + bw / 2, 1.0), (enc_x + bw / 2, base))
    _box(ax, dec_x, 0.45, bw, 0.55, f"RMSNorm(embed(canvas) × √{H} + g)\nweightless norm, every step", "#ffffff",
         fontsize=7)
    _arrow(ax, (dec_x + bw / 2, 1.0), (dec_x + bw / 2, base))
    _box(ax, dec_x, top + 0.3, bw, 0.55, f"final norm → tied LM head\n→ soft-cap {d['final_logit_softcapping']:g}",
         "#ffffff", fontsize=7)
    _arrow(ax, (dec_x + bw / 2, top), (dec_x + bw / 2, top + 0.3))
    _box(ax, sc_x, top + 0.3, 2.2, 0.55, "logits z (C × V): draft,\nentropy bound, renoise", "#fff6c2", fontsize=7)
    _arrow(ax, (dec_x + bw, top + 0.57), (sc_x, top + 0.57))
    sc = d["self_conditioning"]
    _box(ax, sc_x, 0.3, 2.2, 1.0, f"softmax(z / τ) @ embedding × √{H}\n→ RMSNorm → gated MLP → g\n"
         f"({sc['gate_proj'][1]} → {sc['gate_proj'][0]} → {sc['down_proj'][0]})", "#e3f2d9", fontsize=7)
    _arrow(ax, (sc_x + 1.1, top + 0.3), (sc_x + 1.1, 1.3), color="#3a7d2c")
    ax.text(sc_x + 1.2, (top + 1.6) / 2 - 0.2, "this step's ẑ\nfeeds the next step\n(none at a canvas's\nfirst step)",
            fontsize=7, color="#3a7d2c", va="center")
    _arrow(ax, (sc_x, 0.62), (dec_x + bw, 0.62), color="#3a7d2c")
    # the renoised canvas goes back into the decoder at the next step
    _arrow(ax, (sc_x + 0.25, top + 0.3), (dec_x + bw, 0.9), color="#2b4c9b")
    ax.text(sc_x + 0.3, (top + 1.6) / 2 + 0.2, "next canvas x′:\naccepted draws,\nfresh noise\nelsewhere",
            fontsize=7, color="#2b4c9b", va="center")
    # after the canvas's last step its draft is committed and the encoder appends it to the cache
    ax.plot([sc_x + 1.8, sc_x + 1.8, -0.25, -0.25], [top + 0.85, 6.35, 6.35, 0.72], color="#a0522d", linewidth=1.0)
    _arrow(ax, (-0.25, 0.72), (enc_x, 0.72), color="#a0522d")
    ax.text(5.0, 6.43, "after the canvas's last step: the draft (argmax) is committed, and the encoder appends "
            "it to the cache before the next canvas starts", fontsize=7.5, color="#a0522d", ha="center")
    # one block: attention, then the dense MLP and the mixture of experts side by side
    e = d["experts"]
    ax.add_patch(Rectangle((blk_x - 0.1, 0.25), 3.0, 5.55, facecolor="none", edgecolor="#888888", linestyle="--",
                           linewidth=0.8))
    bx, w2 = blk_x, 2.8
    _box(ax, bx, 5.05, w2, 0.55, "attention: RMSNorm, q/k norms, RoPE,\nscores q·k (no 1/√d), softmax", "#ffffff",
         fontsize=6.8)
    _box(ax, bx, 4.2, w2, 0.5, "RMSNorm, + residual → h₁", "#ffffff", fontsize=6.8)
    _arrow(ax, (bx + w2 / 2, 5.05), (bx + w2 / 2, 4.7))
    _box(ax, bx, 2.7, 1.25, 1.1, f"dense MLP\nRMSNorm, gated\nGELU {d['dense_mlp'][1]} → {d['dense_mlp'][0]}"
                                 "\n→ RMSNorm", "#ffffff", fontsize=6.5)
    _box(ax, bx + 1.4, 2.7, 1.4, 1.1, f"router on raw h₁:\nsoftmax over {e['num_experts']},\ntop-{e['top_k']}, "
                                      "renormalise,\n× per-expert scale", "#fde2e4", fontsize=6.5)
    _arrow(ax, (bx + 0.62, 4.2), (bx + 0.62, 3.8))
    _arrow(ax, (bx + 2.1, 4.2), (bx + 2.1, 3.8))
    experts_text = (f"{e['top_k']} of {e['num_experts']} experts\n(width {e['gate_up_proj'][1] // 2}) on "
                    "RMSNorm(h₁),\nweighted sum → RMSNorm")
    _box(ax, bx + 1.4, 1.55, 1.4, 0.8, experts_text, "#fde2e4", fontsize=6.5)
    _arrow(ax, (bx + 2.1, 2.7), (bx + 2.1, 2.35))
    _box(ax, bx, 0.45, w2, 0.6, "RMSNorm(dense + experts), + h₁,\n× layer scalar", "#ffffff", fontsize=6.8)
    _arrow(ax, (bx + 0.62, 2.7), (bx + 0.62, 1.05))
    _arrow(ax, (bx + 2.1, 1.55), (bx + 2.1, 1.05))
    ax.set_title(f"DiffusionGemma: encoder, KV cache, decoder, self-conditioning, and one block "
                 f"({d['model']})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_visibility(d: dict):
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    panels = d["panels"]
    fig, axes = plt.subplots(1, 4, figsize=(13.5, 3.8), gridspec_kw={"width_ratios": [
        len(p["keys"]) for p in panels.values()]})
    colors = ["#ffffff", "#e2e2e2", "#2b6cb0"]  # not in the cache, hidden, visible
    for ax, (name, p) in zip(axes, panels.items()):
        m = np.array(p["visible"]) + 1
        ax.imshow(m, cmap=ListedColormap(colors), vmin=0, vmax=2, aspect="equal")
        ax.set_xticks(range(len(p["keys"])))
        ax.set_xticklabels(p["keys"], fontsize=7)
        ax.set_yticks(range(len(p["queries"])))
        ax.set_yticklabels(p["queries"], fontsize=7)
        ax.set_xticks(np.arange(-0.5, len(p["keys"])), minor=True)
        ax.set_yticks(np.arange(-0.5, len(p["queries"])), minor=True)
        ax.grid(which="minor", color="#bbbbbb", linewidth=0.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xlabel("key position", fontsize=8)
        if name.startswith("decoder"):
            ax.axvline(d["prompt_length"] - 0.5, color="#c53030", linewidth=1.5)
            kept, L = p["cached_keys"], d["prompt_length"]
            ax.set_title(f"{name} (canvas queries)\ncached keys {kept[0]}-{kept[-1]} | canvas keys {L}-"
                         f"{L + d['canvas_length'] - 1}", fontsize=9)
        else:
            ax.set_title(name + ("\n(window W = %d)" % d["sliding_window"] if "sliding" in name else "\n(causal)"),
                         fontsize=9)
    axes[0].set_ylabel("query position", fontsize=8)
    fig.legend([Patch(facecolor=c, edgecolor="#999999") for c in colors[::-1]],
               ["visible", "hidden by the mask", "not held by this layer's cache"], loc="lower center", ncol=3,
               fontsize=8, frameon=False)
    fig.suptitle(f"Who sees whom: a prompt of {d['prompt_length']} tokens, W = {d['sliding_window']}, a canvas of "
                 f"{d['canvas_length']}. In a sliding layer every canvas query sees the same W - 1 = "
                 f"{d['sliding_window'] - 1} cached keys and the whole canvas", fontsize=9.5)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    return fig


def draw_cache_ring(d: dict):
    plt = _plt()
    from matplotlib.patches import Rectangle

    states = d["states"]
    width = max(s["length"] for s in states) + d["canvas_length"]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(states) + 1.5))
    cap = d["capacity"]
    for row, s in enumerate(states):
        y = len(states) - 1 - row
        for p in range(width):
            if p in s["sliding"]:
                color, text = "#2b6cb0", ""
            elif p in s["full"]:
                color, text = "#f6ad55", ""
            elif p in s["canvas"]:
                color, text = "#fff6c2", "c"
            elif p in s.get("unencoded", []):
                color, text = "#ffffff", ""
            else:
                continue
            hatch = "//" if p in s.get("unencoded", []) else None
            ax.add_patch(Rectangle((p, y + 0.1), 0.92, 0.8, facecolor=color, edgecolor="#555555", linewidth=0.5,
                                   hatch=hatch))
            if text:
                ax.text(p + 0.46, y + 0.5, text, ha="center", va="center", fontsize=7,
                        color="white" if color == "#2b6cb0" else "black")
        ax.text(-0.4, y + 0.5, s["event"], ha="right", va="center", fontsize=8)
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-0.1, len(states) + 0.1)
    ax.set_yticks([])
    ax.set_xticks([p + 0.46 for p in range(width)])
    ax.set_xticklabels(range(width))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("token position", fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="#555555", hatch=h) for c, h in
               (("#2b6cb0", None), ("#f6ad55", None), ("#fff6c2", None), ("#ffffff", "//"))]
    ax.legend(handles, [f"held by sliding and full layers (a sliding layer keeps the last W - 1 = {cap})",
                        "held by full layers only", "canvas being denoised (reads the cache)",
                        "committed, never encoded"], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              fontsize=7.5, frameon=False)
    ax.set_title(f"KV cache as canvases are committed: W = {d['sliding_window']}, a sliding layer keeps the last "
                 f"W - 1 = {cap} positions, a full layer keeps all; C = {d['canvas_length']}", fontsize=9.5)
    fig.tight_layout()
    return fig


def draw_block_timeline(d: dict):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.4))
    t = 0.0
    lanes = {"encode": 1.2, "canvas": 0.2}
    commits = []
    for e in d["events"]:
        if e["kind"] == "encode":
            w = 1.6
            label = (f"prefill\n{e['length']} tokens\n(pos {e['start']}-{e['start'] + e['length'] - 1})"
                     if e["start"] == 0 else f"encode canvas\n{e['length']} tokens\n(pos {e['start']}-"
                                             f"{e['start'] + e['length'] - 1})")
            _box(ax, t, lanes["encode"], w, 0.75, label, "#f6ad55", fontsize=7)
            t += w + 0.15
        elif e["kind"] == "canvas":
            w = 0.16 * e["steps"]
            _box(ax, t, lanes["canvas"], w, 0.75, f"canvas {e['index']}: {e['steps']} denoising steps\n"
                                                  f"(pos {e['start']}-{e['start'] + e['length'] - 1})", "#90cdf4",
                 fontsize=7)
            t += w + 0.15
        else:
            commits.append((t - 0.08, e["index"], e["ended"]))
    for x, k, ended in commits:
        ax.plot([x, x], [0.1, 2.05], color="#c53030", linewidth=1.2, linestyle="--")
        ax.text(x, 2.1, f"commit {k}", ha="center", fontsize=7, color="#c53030")
    last = commits[-1][0] if commits else t
    _box(ax, last + 0.25, lanes["encode"], 2.1, 0.75, "no encode: the last\ncommitted canvas never\nenters the cache\n"
                                                      "(nothing follows it)", "#ffffff", fontsize=7, linestyle="--")
    ax.set_xlim(-0.1, t + 2.6)
    ax.set_ylim(0, 2.4)
    ax.set_yticks([lanes["canvas"] + 0.37, lanes["encode"] + 0.37])
    ax.set_yticklabels(["decoder", "encoder"], fontsize=8)
    ax.set_xticks([])
    ax.set_xlabel("time (box widths: decoder passes; the encoder makes one pass per call)", fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"One run, block by block: \"{d['prompt']}\" ({d['prompt_tokens']} tokens), "
                 f"{d['max_new_tokens']} new tokens, seed {d['seed']}; at the end the cache holds "
                 f"{d['cache_length_at_end']} of {d['output_length']} positions", fontsize=9)
    fig.tight_layout()
    return fig


def draw_canvas_denoising(d: dict):
    plt = _plt()
    steps = d["steps"]
    H = np.array([s["entropies"] for s in steps])  # (S, C)
    A = np.array([s["accepted"] for s in steps], dtype=bool)
    S, C = H.shape
    fig, (ax, side) = plt.subplots(1, 2, figsize=(12, 6.2), gridspec_kw={"width_ratios": [C, 5]}, sharey=True)
    im = ax.imshow(H, aspect="auto", cmap="magma_r", vmin=0, vmax=max(float(H.max()), 1e-6))
    ys, xs = np.nonzero(A)
    ax.scatter(xs, ys, s=16, facecolors="none", edgecolors="#08519c", linewidths=1.4, label="accepted at this step "
               "(the rest renoised)")
    ax.set_xticks(range(C))
    ax.set_xticklabels([f"{t}" for t in d["committed_text"]], rotation=90, fontsize=6.5)
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"{i + 1} (τ = {s['temperature']:.3f})" for i, s in enumerate(steps)], fontsize=7)
    ax.set_ylabel("denoising step (temperature)", fontsize=8)
    ax.set_xlabel("canvas position, labelled with the token it committed", fontsize=8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 1.07), fontsize=7.5, frameon=False)
    cbar = fig.colorbar(im, ax=side, fraction=0.25, pad=0.04)
    cbar.set_label("entropy of softmax(z / τ) (nats)", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    side.barh(range(S), A.sum(axis=1), color="#08519c")
    side.set_xlabel("positions accepted", fontsize=8)
    side.tick_params(labelsize=7)
    fig.suptitle(f"Canvas {d['canvas']} of \"{d['prompt']}\" (seed {d['seed']}), step by step. Each step accepts "
                 f"the lowest-entropy positions while the entropies before them sum to at most {d['entropy_bound']:g} "
                 "nats,\nand renoises the rest; the canvas commits the last step's draft (the argmax) at every "
                 "position, accepted or not", fontsize=9.5)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def draw_temperature_schedule(d: dict):
    plt = _plt()
    steps = d["steps"]
    x = [s["step_index"] + 1 for s in steps]
    T = [s["temperature"] for s in steps]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.plot(x, T, "o-", color="#2b6cb0", markersize=4, label="τ_n = t_min + (t_max - t_min) · n / N")
    ax.axhline(d["t_max"], color="#999999", linestyle=":", linewidth=1)
    ax.axhline(d["t_min"], color="#c53030", linestyle=":", linewidth=1)
    ax.text(x[0], d["t_min"] + 0.005, "t_min: never reached", ha="left", va="bottom", fontsize=7.5, color="#c53030")
    ax.text(x[1], d["t_max"] + 0.005, "t_max: the first step's temperature", ha="left", va="bottom", fontsize=7.5)
    ax.annotate(f"last step: t_min + (t_max - t_min) / N = {T[-1]:.4g}", xy=(x[-1], T[-1]),
                xytext=(x[len(x) // 2], d["t_min"] + 0.03), ha="center", fontsize=7.5,
                arrowprops={"arrowstyle": "->", "color": "#555555"})
    ax.set_xlabel("denoising step of a canvas (n = N at the first, 1 at the last)", fontsize=8)
    ax.set_ylabel("temperature τ_n", fontsize=8)
    ax.set_xticks(x)
    ax.tick_params(labelsize=7)
    twin = ax.twinx()
    twin.plot(x, [s["noise_level"] for s in steps], "s--", color="#2bb673", markersize=3, linewidth=0.8,
              label="n / N: the training noise level")
    twin.set_ylabel("n / N", fontsize=8, color="#2bb673")
    twin.tick_params(labelsize=7, colors="#2bb673")
    twin.set_ylim(0, 1.1)
    lines = ax.get_lines()[:1] + twin.get_lines()
    ax.legend(lines, [l.get_label() for l in lines], fontsize=7.5, loc="upper right", frameon=False)
    ax.set_ylim(d["t_min"] - 0.05, d["t_max"] + 0.06)
    ax.set_title(f"Temperature schedule (N = {d['max_denoising_steps']}, t_min = {d['t_min']:g}, "
                 f"t_max = {d['t_max']:g}; the shipped model's generation config)", fontsize=9)
    fig.tight_layout()
    return fig


def draw_speed(d: dict):
    plt = _plt()
    m, r = d["measured"], d["released"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.0), gridspec_kw={"width_ratios": [1, 1.2]})
    N = r["max_denoising_steps"]
    bars = [("autoregressive\n(one token\nper pass)", d["autoregressive"]["tokens_per_pass"], "#999999"),
            ("shipped model:\nper decoder\npass", m["tokens_per_decoder_pass"], "#2b6cb0"),
            ("shipped model:\nper model pass\n(+ encoder)", m["tokens_per_model_pass"], "#90cdf4"),
            (f"released, {N}\nsteps: per\ndecoder pass", r["tokens_per_decoder_pass_all_steps"], "#c05621"),
            (f"released, {N}\nsteps: per model\npass (+ encoder)", r["tokens_per_model_pass_all_steps"],
             "#f6ad55")]
    left.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    for i, (_, v, _) in enumerate(bars):
        left.text(i, v + 0.08, f"{v:.2f}", ha="center", fontsize=8)
    left.set_xticks(range(len(bars)))
    left.set_xticklabels([b[0] for b in bars], fontsize=7)
    left.set_ylabel("generated tokens per pass", fontsize=8)
    left.tick_params(labelsize=7)
    left.set_title(f"Shipped model, measured: \"{d['prompt']}\", seed {d['seed']},\n{m['new_tokens']} tokens "
                   f"in {m['decoder_passes']} decoder + {m['encoder_passes']} encoder passes. Released model:\n"
                   f"a canvas of {r['canvas_length']} that uses all N = {N} steps (the fewest tokens per pass)",
                   fontsize=8.5)
    steps = [p["steps"] for p in r["per_token_billion"]]
    right.plot(steps, [p["dense_canvas"] for p in r["per_token_billion"]], "-", color="#2b6cb0", linewidth=3,
               label="canvas, dense model (every weight, every pass)")
    right.plot(steps, [p["moe_canvas"] for p in r["per_token_billion"]], "--", color="#c05621",
               label=f"canvas, mixture of experts ({r['experts_touched_canvas']:.0f} of {r['num_experts']} "
                     "experts touched: the same line)")
    right.axhline(r["dense_autoregressive_billion"], color="#2b6cb0", linestyle=":",
                  label="dense model, autoregressive")
    right.axhline(r["moe_autoregressive_billion"], color="#c05621", linestyle=":",
                  label=f"mixture of experts, autoregressive ({r['top_k']} of {r['num_experts']} experts)")
    right.axvline(r["break_even_steps"], color="#555555", linewidth=0.8)
    right.text(r["break_even_steps"] - 0.5, r["moe_autoregressive_billion"] * 1.5,
               f"{r['break_even_steps']:.1f} steps:\nthe mixture of experts\nbreaks even", ha="right", fontsize=7)
    right.set_yscale("log")
    right.set_xlabel(f"decoder steps per canvas of {r['canvas_length']} (one encoder pass added)", fontsize=8)
    right.set_ylabel("weight values read per generated token (billions)", fontsize=8)
    right.tick_params(labelsize=7)
    right.legend(fontsize=7, loc="lower right", frameon=False)
    right.set_ylim(0.1, 60)
    right.set_title(f"Computed for the released shape ({r['weights_billion']:.2f} B weights, {r['layers']} layers, "
                    f"{r['num_experts']} experts, top-{r['top_k']})", fontsize=8.5)
    fig.tight_layout()
    return fig


DRAW = {"architecture": draw_architecture, "visibility": draw_visibility, "cache_ring": draw_cache_ring,
        "block_timeline": draw_block_timeline, "canvas_denoising": draw_canvas_denoising,
        "temperature_schedule": draw_temperature_schedule, "speed": draw_speed}


def draw(name: str, data: dict):
    """The matplotlib figure of ``name`` drawn from its ``data`` (as ``figure_data`` returns it)."""
    return DRAW[name](data)


# ================================================================================================ files
class FigureError(Exception):
    """A bad ``--out`` or a write that failed: one line for the user, naming the path."""


def clone_figure_dir(cwd: str | None = None) -> str:
    """``docs/figures`` of the clone this package runs from, for ``--docs``; refused unless the current folder
    is inside that clone (an installed package has no docs folder to rewrite)."""
    root = os.path.realpath(ROOT)
    here = os.path.realpath(cwd or os.getcwd())
    if not (os.path.isdir(os.path.join(root, ".git")) or os.path.isfile(os.path.join(root, ".git"))) \
            or not os.path.isdir(FIGURE_DIR):
        raise FigureError(f"--docs needs a clone of the project: {FIGURE_DIR} is not a clone's docs/figures folder")
    if os.path.commonpath([root, here]) != root:
        raise FigureError(f"--docs means {FIGURE_DIR}: run it from inside that clone ({root}), not from {here}")
    return FIGURE_DIR


def output_folder(out: str) -> str:
    """``out`` checked before anything is computed: not empty, not a file, not below a file, writable.
    A folder that does not exist yet is fine when the nearest existing folder above it is writable."""
    if not out or not out.strip():
        raise FigureError("--out is empty: name a folder (or leave --out out for the current folder)")
    path = os.path.abspath(out)
    probe = path
    while not os.path.exists(probe):  # the nearest existing ancestor decides
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == path else f"lies below {probe}, which is a file"
        raise FigureError(f"--out {out} {where}, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".figures-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise FigureError(f"--out {out}: cannot write in {probe} ({exc.strerror or exc})") from None
    return path


def _rounded(data: Any) -> bool:
    """True when every float in ``data`` has at most DIGITS decimals (as ``figure_data`` stores them)."""
    if isinstance(data, dict):
        return all(_rounded(v) for v in data.values())
    if isinstance(data, list):
        return all(_rounded(v) for v in data)
    return not isinstance(data, float) or round(data, DIGITS) == data


def _json_text(data: dict) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def write(name: str, out_dir: str = ".", data: dict | None = None) -> tuple[str, str]:
    """Compute (unless given) and write ``<name>.json`` and ``<name>.png`` into ``out_dir``; returns both paths.

    When ``out_dir`` already holds a ``<name>.json`` that the fresh data matches (``stale`` finds nothing:
    the same discrete values, floats within the tolerance), that file is kept byte for byte and the picture
    is drawn from it, so regenerating on a machine whose BLAS sums in another order rewrites nothing.
    Each file is written to a temporary name first and renamed, so a failure leaves no partial file."""
    data = figure_data(name) if data is None else data
    os.makedirs(out_dir, exist_ok=True)
    json_path, png_path = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".png")
    text = _json_text(data)
    try:
        with open(json_path, encoding="utf-8") as f:
            old = f.read()
        kept = json.loads(old)
        if not stale(kept, data) and _rounded(kept):
            data, text = kept, old
    except (OSError, ValueError):  # absent, unreadable or not JSON: replaced by the fresh data
        pass
    fig = draw(name, data)
    try:
        with open(json_path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        fig.savefig(png_path + ".tmp.png", dpi=DPI.get(name, 90), metadata={"Software": None},
                    pil_kwargs={"optimize": True})
        os.replace(json_path + ".tmp", json_path)
        os.replace(png_path + ".tmp.png", png_path)
    except OSError as exc:
        for leftover in (json_path + ".tmp", png_path + ".tmp.png"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise FigureError(f"cannot write {name} into {out_dir} ({exc.strerror or exc})") from None
    finally:
        _plt().close(fig)
    return json_path, png_path


def check(names: list[str], folder: str) -> int:
    """``--check``: compare each ``<name>.json`` in ``folder`` with the data computed now; the number of
    figures that are missing, unreadable, not JSON or stale (each named on its own line)."""
    bad = 0
    for name in names:
        path = os.path.join(folder, name + ".json")
        if not os.path.isfile(path):
            print(f"{name}: {path} is missing")
            bad += 1
            continue
        try:
            with open(path, encoding="utf-8") as f:
                committed = json.load(f)
        except (OSError, UnicodeDecodeError) as exc:
            print(f"{name}: {path} cannot be read ({getattr(exc, 'strerror', None) or exc})")
            bad += 1
            continue
        except ValueError as exc:
            print(f"{name}: {path} is not valid JSON ({exc})")
            bad += 1
            continue
        diffs = stale(committed, figure_data(name))
        print(f"{name}: " + ("current" if not diffs else f"STALE ({len(diffs)} differences, first: {diffs[0]})"))
        bad += bool(diffs)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusiongemma.figures", description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="folder for <name>.json and <name>.png (default: the current folder)")
    where.add_argument("--docs", action="store_true", help="the clone's docs/figures (run from inside the clone)")
    parser.add_argument("--only", nargs="+", choices=list(FIGURES), help="these figures only")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a JSON in the folder "
                                                             "differs from the data computed now")
    args = parser.parse_args(argv)
    names = args.only or list(FIGURES)
    try:
        folder = clone_figure_dir() if args.docs else os.path.abspath(os.curdir if args.out is None else args.out)
        if args.check:
            return 1 if check(names, folder) else 0
        if not args.docs:
            folder = output_folder(os.curdir if args.out is None else args.out)
        for name in names:
            json_path, png_path = write(name, folder)
            print(f"{name}: {png_path} ({os.path.getsize(png_path) // 1024} KB), {json_path}")
    except FigureError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
