"""The bfloat16 verdict: every stage of the peer's run repeated on the peer's own input to that stage, against
the null distribution of a correct bfloat16 run (``bf16_null``).

A whole bfloat16 call compared end to end cannot tell a rounding change from a correct run: one one-ulp flip
in an early layer reaches most logits, so two correct runs differ in a third of their logits on the shipped
model. Each stage is therefore fed the peer's own input and compared on its own output:

    encoder input     the embedding of the ids the peer encoded (SPEC §10.1 B1)
    encoder layer l   layer l of the encoder on the peer's layer l - 1 output and the peer's cache before
                      that encode: its output and the keys and values it adds to the cache (B2-B7)
    decoder input     the canvas embedding and self-conditioning of the peer's canvas ids and SC input (B1, B8)
    decoder layer l   layer l of the decoder on the peer's layer l - 1 output and the peer's cache (B2-B7)
    output            the final norm, output projection and soft-cap of the peer's last layer output (B9)

The same stage is run twice more on the same inputs with the reference's float32 sums in another order
(``bf16_null.summation_order``: reversed and blocked): what a correct implementation that rounds at the same
points looks like on that very call. Per call and stage two numbers are read (``bf16_null.deviation``): how
far (max |d| in bfloat16 ulps at the tensor's scale) and how many values differ (the share beyond float32
noise: a value left unrounded moves many values by less than an ulp and shows in the count, not the size).

Rule (``judge``), for each stage over all the calls of a run: a call is beyond the null when its share is
above ``SHARE_FACTOR`` x the null's share on that same call (the larger of the two orders) plus
``SHARE_FLOOR``, or its size above ``SIZE_FACTOR`` x the null's size on that call plus ``SIZE_FLOOR`` ulps.
The stage differs when at least ``MIN_CALLS`` calls and more than ``CALL_SHARE`` of its calls are beyond (a
stage seen on one call only never differs: one flipped value of a norm feeding the output projection moves a
whole token's logits, a share of 1/C, on a correct run too): a
systematic change of one rounding point moves the stage on (nearly) every call, while rare flips, amplified
or not, move a few.

Router ties (SPEC B10, trap T25): where the peer's expert choice for a token differs from ours and the two
experts' router probabilities are exactly equal or within ``NEAR_TIE`` (router logits one bfloat16 ulp
apart), the peer's choice is replayed for that token and the rest compared; the counts are reported.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bf16_null import KINDS, deviation, summation_order
from .report import Divergence

SHARE_FACTOR = 4.0
SHARE_FLOOR = 0.02
SIZE_FACTOR = 4.0
SIZE_FLOOR = 2.0
MIN_CALLS = 2
CALL_SHARE = 0.5
NEAR_TIE = 2.0 ** -5  # |log p_a - log p_b| below this: a near tie (router logits one bfloat16 ulp apart)

ITEMS = {"encoder input": "B1 embedding", "decoder input": "B1 embedding / B8 self-conditioning",
         "output": "B9 final norm and output projection"}
LAYER_ITEMS = "B2-B7 (a norm, projection, RoPE, attention, router, expert or residual rounding)"

RULE = (f"each stage (encoder input and layers with their cache entries, decoder input and layers, output) is "
        f"repeated on the peer's own input to it and set against a correct bfloat16 run that sums in another "
        f"order (the reference with reversed and blocked float32 sums, on the same call); a call is beyond it when "
        f"its share of differing values exceeds {SHARE_FACTOR:g} x the null's + {SHARE_FLOOR:g}, or its max |d| "
        f"{SIZE_FACTOR:g} x the null's + {SIZE_FLOOR:g} bfloat16 ulps; a stage differs when at least {MIN_CALLS} "
        f"and more than {CALL_SHARE:.0%} of its calls are beyond (docs/SPEC.md §10.3)")


# ================================================================================ the peer's stage inputs
@dataclass
class Tap:
    """One encoder or decoder call of the peer: the input to its first layer, each layer's output, the expert
    choices of each layer (N, K)."""

    first: np.ndarray | None = None
    layers: list = field(default_factory=list)
    routing: list = field(default_factory=list)
    parts: list = field(default_factory=list)  # per layer {"attention", "dense", "weights", "experts"} (localising)


class Taps:
    """Hooks on a transformers DiffusionGemma that keep each encoder and decoder call's stage inputs, in call
    order (``encodes``, ``decodes``). A context manager: the hooks are removed on exit."""

    def __init__(self, model: Any):
        self.model = model
        self.encodes: list = []
        self.decodes: list = []
        self._hooks: list = []

    def __enter__(self) -> "Taps":
        encoder, decoder = self.model.model.encoder.language_model, self.model.model.decoder

        def arr(t):
            return t.detach().float().numpy().copy()

        def watch(calls, first_module, layers):
            def routed(m, a, out):  # a hook's return value would replace the output: return nothing
                calls[-1].routing.append(out[2].detach().numpy().copy())
                calls[-1].parts[-1].update(weights=arr(out[1]))

            self._hooks.append(first_module.register_forward_hook(lambda m, a, out: calls.append(Tap(first=arr(out)))))
            for layer in layers:
                self._hooks.append(layer.register_forward_hook(
                    lambda m, a, out: calls[-1].layers.append(arr(out[0] if isinstance(out, tuple) else out))))
                self._hooks.append(layer.self_attn.register_forward_hook(
                    lambda m, a, out: calls[-1].parts.append({"attention": arr(out[0])})))
                self._hooks.append(layer.mlp.register_forward_hook(
                    lambda m, a, out: calls[-1].parts[-1].update(dense=arr(out))))
                self._hooks.append(layer.router.register_forward_hook(routed))
                self._hooks.append(layer.experts.register_forward_hook(
                    lambda m, a, out: calls[-1].parts[-1].update(experts=arr(out))))

        watch(self.encodes, encoder.embed_tokens, encoder.layers)
        watch(self.decodes, decoder.self_conditioning, decoder.layers)
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


# ================================================================================ router ties
class ReplayTies:
    """A ``router_top_k``: torch's CPU order, except for the tokens whose experts differ from the peer's only
    across an exact or near tie at the K-th place; those take the peer's choice (rows counted)."""

    def __init__(self, peer_choice: np.ndarray | None):
        self.peer = peer_choice
        self.exact: set = set()  # rows replayed across an exact tie
        self.near: set = set()  # rows replayed across a near tie

    def __call__(self, probs: np.ndarray, k: int) -> np.ndarray:
        from diffusiongemma.reference.variants.router import torch_cpu_top_k

        ours = torch_cpu_top_k(probs, k)
        if self.peer is None or self.peer.shape != ours.shape:
            return ours
        out = ours.copy()
        for row in range(ours.shape[0]):
            mine, theirs = set(ours[row].tolist()), set(self.peer[row].tolist())
            if mine == theirs:
                continue
            a = min(float(probs[row, e]) for e in mine - theirs)
            b = max(float(probs[row, e]) for e in theirs - mine)
            if a == b:
                self.exact.add(row)
            elif a > 0 and b > 0 and abs(np.log(a) - np.log(b)) <= NEAR_TIE:
                self.near.add(row)
            else:
                continue
            out[row] = self.peer[row]
        return out


# ================================================================================ one stage, ours and the null
def _cache_from(model: Any, arrays: list | None, length: int) -> Any:
    """A reference KVCache holding the peer's keys and values (sliding layers trimmed to what we retain)."""
    from diffusiongemma.reference.cache import KVCache

    cache = model.new_cache(1)
    if arrays is None:
        return cache
    keys, values = [], []
    for l, (k, v) in enumerate(arrays):
        cap = cache.layer_capacity(l)
        if cap is not None and k.shape[2] > cap:
            k, v = k[:, :, -cap:], v[:, :, -cap:]
        keys.append(np.asarray(k, dtype=np.float32))
        values.append(np.asarray(v, dtype=np.float32))
    return KVCache(model.config, 1, keys, values, np.ones((1, length), dtype=bool))


def _with_routing(model: Any, replay: ReplayTies) -> Any:
    other = copy.copy(model)
    other.router_top_k = replay
    return other


def _attention_inputs(model: Any, l: int, h: np.ndarray, cache: Any) -> tuple:
    """(q, keys, values, positions) of layer ``l`` on input ``h`` (1, S, H) after ``cache``."""
    from diffusiongemma.reference import layers as L
    from diffusiongemma.reference import model as M

    config, w, dt = model.config, model.layers[l], model.dtype
    positions = cache.length + np.arange(h.shape[1], dtype=np.int64)
    cos, sin = M.rope_cos_sin(positions[None], model._omega[config.layer_types[l]], dt)
    q, k, v = L.project_qkv(M.rms_norm(h, w["input_layernorm"], config.rms_norm_eps, dt), w, config, l, cos, sin, dt)
    return q, k, v, positions


def _encoder_attention(model: Any, l: int, h: np.ndarray, cache: Any) -> tuple:
    config = model.config
    q, k, v, positions = _attention_inputs(model, l, h, cache)
    keys = np.concatenate([cache.keys[l], k], axis=2)
    values = np.concatenate([cache.values[l], v], axis=2)
    key_pos = np.concatenate([cache.positions(l), positions])
    is_real = np.ones((1, cache.length + h.shape[1]), dtype=bool)
    window = config.sliding_window if config.is_sliding(l) else None
    return model._causal_attention(q, keys, values, positions, key_pos, is_real[:, key_pos], window), k, v


def _decoder_attention(model: Any, l: int, h: np.ndarray, cache: Any) -> np.ndarray:
    from diffusiongemma.reference import masks
    from diffusiongemma.reference import model as M

    config, C = model.config, h.shape[1]
    q, k, v, _ = _attention_inputs(model, l, h, cache)
    keys = np.concatenate([cache.keys[l], k], axis=2)
    values = np.concatenate([cache.values[l], v], axis=2)
    window = (masks.canvas_window(cache.positions(l), cache.length, C, config.sliding_window)
              if config.is_sliding(l) else None)
    visible = masks.decoder_visibility(cache.is_real[:, cache.positions(l)], C, window)
    return M.attend(q, keys, values, visible, model.dtype)


def encoder_layer(model: Any, l: int, h: np.ndarray, cache: Any) -> tuple:
    """(output, new keys, new values) of encoder layer ``l`` on input ``h`` (1, n, H) after ``cache``
    (``Model.encode``'s loop body, one layer)."""
    attn, k, v = _encoder_attention(model, l, h, cache)
    return model._block_tail(h, attn, model.layers[l], model.layers[l]["encoder_layer_scalar"]), k, v


def decoder_layer(model: Any, l: int, h: np.ndarray, cache: Any) -> np.ndarray:
    """Decoder layer ``l`` on input ``h`` (1, C, H) reading ``cache`` (``Model.denoise``'s loop body)."""
    attn = _decoder_attention(model, l, h, cache)
    return model._block_tail(h, attn, model.layers[l], model.layers[l]["decoder_layer_scalar"])


# the parts of a layer, in the order of the forward pass: (name, SPEC §10.1 items)
PARTS = (("attention", "B2-B5 (input norm, q/k/v projections and norms, RoPE, scores, softmax weights, product "
                       "with V, o_proj)"),
         ("dense", "B2/B3 (the dense MLP and its norm)"),
         ("weights", "B6 (the router: norm, scales, logits, softmax, renormalisation)"),
         ("experts", "B6 (the experts and their weighted sum)"))


PART_NAMES = {"attention": "attention block", "dense": "dense MLP", "weights": "router", "experts": "experts"}


def layer_parts(model: Any, l: int, h: np.ndarray, cache: Any, encoder: bool, part: dict, replay: Any) -> dict:
    """Each part of layer ``l`` on the peer's own input to it (``part``: the peer's attention output, router
    weights and choices): {name: array} in ``PARTS`` order."""
    from diffusiongemma.reference import layers as L
    from diffusiongemma.reference import model as M
    from diffusiongemma.reference.primitives import gated_mlp, round_to

    config, w, dt, eps = model.config, model.layers[l], model.dtype, model.config.rms_norm_eps
    attn = (_encoder_attention(model, l, h, cache)[0] if encoder else _decoder_attention(model, l, h, cache))
    out = {"attention": M.linear(attn, w["o_proj"], dt)}
    h1 = round_to(h + M.rms_norm(np.asarray(part["attention"], dtype=np.float32), w["post_attention_layernorm"],
                                 eps, dt), dt)
    out["dense"] = gated_mlp(M.rms_norm(h1, w["pre_feedforward_layernorm"], eps, dt), w["mlp.gate_proj"],
                             w["mlp.up_proj"], w["mlp.down_proj"], dt)
    flat = h1.reshape(-1, h1.shape[-1])
    index, out["weights"] = L.route(flat, w, config, replay, dtype=dt)
    if "experts" in part and "weights" in part and replay.peer is not None:
        out["experts"] = L.experts(M.rms_norm(flat, w["pre_feedforward_layernorm_2"], eps, dt), replay.peer,
                                   np.asarray(part["weights"], dtype=np.float32), w, dt)
    return out


@dataclass
class StageStats:
    """Every call of one stage: the peer's (size, share), the null's per call (one per summation order), and
    where each call was."""

    peer: list = field(default_factory=list)  # [(size, share)]
    null: list = field(default_factory=list)  # [[(size, share) per order]]
    where: list = field(default_factory=list)  # [(canvas, step)] step -1: the encode before that canvas


def _worst(pairs) -> tuple[float, float]:
    pairs = list(pairs)
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def _limits(null: list) -> tuple[float, float]:
    """(size limit, share limit) of one call from the null's deviations on that same call."""
    size, share = _worst(null)
    return SIZE_FACTOR * size + SIZE_FLOOR, SHARE_FACTOR * share + SHARE_FLOOR


def beyond(stats: StageStats) -> list:
    """Per call: is the peer beyond the null on that call (module notes)?"""
    out = []
    for (size, share), null in zip(stats.peer, stats.null):
        size_limit, share_limit = _limits(null)
        out.append(size > size_limit or share > share_limit)
    return out


def judge(stats: StageStats) -> dict | None:
    """The numbers of a stage that differs (module notes), or None."""
    marks = beyond(stats)
    count = sum(marks)
    if count < MIN_CALLS or count <= CALL_SHARE * len(marks):
        return None
    first = marks.index(True)
    size_limit, share_limit = _limits(stats.null[first])
    p = np.array(stats.peer)
    return {"beyond": count, "calls": len(marks), "size_limit": size_limit, "share_limit": share_limit,
            "peer_median_share": float(np.median(p[:, 1])), "peer_max_ulps": float(p[:, 0].max()),
            "first": stats.where[first]}


def _stage_order(stage: str) -> tuple:
    if stage == "output":
        return 2, 0
    side = 0 if stage.startswith("encoder") else 1
    return side, (-1 if stage.endswith("input") else int(stage.rsplit(" ", 1)[-1]))


def item(stage: str) -> str:
    """The SPEC §10.1 item(s) a stage computes."""
    return ITEMS.get(stage, LAYER_ITEMS)


class StagedCheck:
    """Collects the per-stage deviations of a run (``add``) and judges them (``first_difference``)."""

    def __init__(self, model: Any):
        self.model = model
        self.stages: dict[str, StageStats] = {}
        self.exact_ties = 0
        self.near_ties = 0
        self.parts: dict[str, list] = {}  # layer stages: per call, what ``localise`` needs to split the layer

    def add(self, stage: str, where: tuple, peer_outputs: list, compute, parts: tuple | None = None) -> None:
        """``compute(model) -> [arrays]`` is run as the reference and in each other summation order; each
        array is compared with the peer's (``peer_outputs``, same order) and with the reference's. parts: a
        layer stage's (layer, input, cache, encoder?, the peer's parts, the peer's expert choices)."""
        self.parts.setdefault(stage, []).append(parts)
        mine = compute(self.model)
        stats = self.stages.setdefault(stage, StageStats())
        stats.peer.append(_worst(deviation(a, b) for a, b in zip(mine, peer_outputs)))
        null = []
        for kind in KINDS:
            with summation_order(kind):
                other = compute(self.model)
            null.append(_worst(deviation(a, b) for a, b in zip(mine, other)))
        stats.null.append(null)
        stats.where.append(where)

    def first_difference(self) -> tuple[str, dict] | None:
        """(stage, numbers) of the first stage in the order of the forward pass that differs, or None."""
        for stage in sorted(self.stages, key=_stage_order):
            verdict = judge(self.stages[stage])
            if verdict is not None:
                return stage, verdict
        return None

    def localise(self, stage: str, calls: int = 4) -> str:
        """Which part of a differing layer stage departs (``PARTS``), from up to ``calls`` of its calls beyond
        the null, each part on the peer's own input to it: "part (items)", or "" when it cannot be split."""
        stats = self.stages[stage]
        picked = [i for i, b in enumerate(beyond(stats)) if b and self.parts[stage][i] is not None][:calls]
        if not picked:
            return ""
        found = {name: StageStats() for name, _ in PARTS}
        for i in picked:
            l, h, cache, encoder, peer_parts, choice = self.parts[stage][i]

            def run(m):
                return layer_parts(m, l, h, cache, encoder, peer_parts, ReplayTies(choice))

            mine = run(self.model)
            others = []
            for kind in KINDS:
                with summation_order(kind):
                    others.append(run(self.model))
            for name, _ in PARTS:
                if name not in mine or name not in peer_parts:
                    continue
                found[name].peer.append(deviation(mine[name], peer_parts[name]))
                found[name].null.append([deviation(mine[name], o[name]) for o in others])
                found[name].where.append(stats.where[i])
        for name, items in PARTS:
            marks = beyond(found[name])
            if marks and sum(marks) > CALL_SHARE * len(marks):
                return f"{PART_NAMES[name]}: SPEC §10.1 {items}"
        return "the norms, residual sums or layer scalar around its parts: SPEC §10.1 B2, B7"

    def summary(self) -> dict:
        out = {}
        for stage in sorted(self.stages, key=_stage_order):
            s = self.stages[stage]
            p, n = np.array(s.peer), np.array(s.null).reshape(-1, 2)
            out[stage] = {"calls": len(s.peer), "beyond": int(sum(beyond(s))),
                          "peer_max_ulps": round(float(p[:, 0].max()), 3),
                          "peer_median_share": round(float(np.median(p[:, 1])), 5),
                          "null_max_ulps": round(float(n[:, 0].max()), 3),
                          "null_median_share": round(float(np.median(n[:, 1])), 5)}
        return out


# ================================================================================ a whole run
def _parts(tap: Tap, l: int, h: np.ndarray, cache: Any, encoder: bool) -> tuple | None:
    if l >= len(tap.parts) or l >= len(tap.routing):
        return None
    return l, h, cache, encoder, tap.parts[l], tap.routing[l]


def staged_run(model: Any, run: Any, taps: Taps, contexts: list) -> tuple[dict, Divergence | None, StagedCheck]:
    """Every stage of the peer's recorded run (``run``: a ``PeerRun`` with its caches; ``taps``: its stage
    inputs; ``contexts``: the ids it encoded, call by call) compared on the peer's inputs. Returns (summary,
    divergence or None, the check)."""
    from diffusiongemma.reference import model as M

    check = StagedCheck(model)
    config, dt = model.config, model.dtype
    lengths = np.cumsum([int(np.asarray(c).shape[1]) for c in contexts])
    encodes = 0
    for j, ids in enumerate(contexts):
        if j >= len(taps.encodes) or j not in run.caches:
            break
        tap, ids = taps.encodes[j], np.asarray(ids, dtype=np.int64)
        encodes += 1
        check.add("encoder input", (j, -1), [tap.first],
                  lambda m, ids=ids: [M.embed(ids, m.tensors["embed_tokens"], config.embed_scale, dt)])
        before = _cache_from(model, run.caches.get(j - 1), int(lengths[j - 1]) if j else 0)
        for l in range(config.num_hidden_layers):
            h = tap.first if l == 0 else tap.layers[l - 1]
            replay = ReplayTies(tap.routing[l] if l < len(tap.routing) else None)
            pk, pv = run.caches[j][l]
            new = min(ids.shape[1], pk.shape[2])

            def compute(m, l=l, h=h, replay=replay, before=before, new=new):
                out, k, v = encoder_layer(_with_routing(m, replay), l, h, before)
                return [out, k[:, :, -new:], v[:, :, -new:]]

            check.add(f"encoder layer {l}", (j, -1), [tap.layers[l], pk[:, :, -new:], pv[:, :, -new:]], compute,
                      _parts(tap, l, h, before, True))
            check.exact_ties += len(replay.exact)
            check.near_ties += len(replay.near)
    calls = 0
    for i, call in enumerate(run.calls):
        if i >= len(taps.decodes) or not call.sc_known or call.canvas not in run.caches:
            continue
        calls += 1
        tap = taps.decodes[i]
        cache = _cache_from(model, run.caches[call.canvas], int(lengths[call.canvas]))
        where = (call.canvas, call.step)
        check.add("decoder input", where, [tap.first], lambda m, c=call: [m.canvas_input(c.ids, c.sc)])
        for l in range(config.num_hidden_layers):
            h = tap.first if l == 0 else tap.layers[l - 1]
            replay = ReplayTies(tap.routing[l] if l < len(tap.routing) else None)
            check.add(f"decoder layer {l}", where, [tap.layers[l]],
                      lambda m, l=l, h=h, replay=replay, cache=cache: [decoder_layer(_with_routing(m, replay), l, h,
                                                                                     cache)],
                      _parts(tap, l, h, cache, False))
            check.exact_ties += len(replay.exact)
            check.near_ties += len(replay.near)
        check.add("output", where, [call.logits], lambda m, h=tap.layers[-1]: [m.output_logits(h)])
    summary = {"calls": calls, "encodes": encodes, "stages": check.summary(),
               "router_ties_replayed": check.exact_ties, "router_near_ties_replayed": check.near_ties}
    found = check.first_difference()
    if found is None:
        return summary, None, check
    stage, v = found
    k, step = v["first"]
    part = check.localise(stage) if "layer" in stage else ""
    if part:
        v["part"] = part
    cause = (f"stage-forced (each stage on the peer's own input to it): {stage} departs from a correct bfloat16 run "
             f"on {v['beyond']} of {v['calls']} calls (peer: median share of differing values "
             f"{v['peer_median_share']:.3f}, up to {v['peer_max_ulps']:.1f} bfloat16 ulps; on the first such call a "
             f"correct run that sums in another order allows share {v['share_limit']:.3f} or "
             f"{v['size_limit']:.1f} ulps with the margin): a rounding point of "
             + (f"its {part} differs (each part on the peer's own input to it)" if part else
                f"SPEC §10.1 {item(stage)} differs"))
    return summary, Divergence(f"bf16 {stage}", k, step, 0, -1, -1, cause, v), check
