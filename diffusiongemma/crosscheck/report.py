"""The cross-check report: forward rows, generation rows, adaptations, defects; text and JSON renderings.

A report agrees when every forward row is within its tolerance and every generation row agrees under teacher
forcing (every decoder call on the peer's inputs within tolerance, our sampler's decisions on the peer's
logits and draws the peer's). The free-running token comparison is reported, not decisive. ``exit_code`` is
0 then, 1 otherwise (usage and setup errors never produce a report: exit 2).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ForwardRow:
    """One logits tensor computed by the peer and by the reference on the same weights and inputs."""

    name: str  # "prefill" / "self-conditioning" / "after commit"
    shape: tuple  # (B, C, V)
    max_abs_diff: float  # max |peer - reference|
    max_abs_value: float  # max |reference|, for scale
    tolerance: float  # the bound it is checked against (see ``tolerance_note``)
    argmax_agreement: float  # share of positions whose argmax is the same
    probe: bool = False  # a known-difference probe: reported, but it does not decide agreement
    undefined_upstream: str = ""  # why the difference is one upstream leaves undefined (an exact router tie)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance or bool(self.undefined_upstream)


@dataclass
class Divergence:
    """The first difference a comparison found, with its cause."""

    stage: str  # "forward input", "forward layer L", "forward", "cache/context", "self-conditioning input",
    #             "acceptance", "renoise", "stopping", "commit", "EOS", "length", "draws" ("tie": rounding)
    canvas: int  # canvas index
    step: int  # 0-based denoising step within the canvas (decoder call); -1: the committed canvas / the cache
    position: int  # first differing canvas position (cache: entry)
    peer_token: int  # -1 when no token is involved
    our_token: int
    cause: str  # one sentence with the numbers
    values: dict = field(default_factory=dict)  # the numbers (max_abs_diff, tolerance, margin, layer)


@dataclass
class GenerationRow:
    """One sampler configuration of the peer, compared three ways (see ``common``): teacher-forced forward,
    our sampler on the peer's logits and draws (these two decide), and the free run (information)."""

    label: str  # e.g. "transformers generate, entropy-bound, seeded"
    semantics: str  # our ``semantics=`` value, with any replaced stage choices
    draws: str  # "replayed" (the peer's random stream fed into ours)
    teacher_forced: dict = field(default_factory=dict)  # calls compared, max |d|, worst d / tolerance, where
    sampler: dict = field(default_factory=dict)  # steps and canvases checked on the peer's logits, ties seen
    free_run: dict = field(default_factory=dict)  # agreement, first drift, where the tokens parted
    canvases: list = field(default_factory=list)  # free run, per canvas {"agree", "of", "steps_peer", "steps_ours"}
    peer_tokens: list = field(default_factory=list)  # the tokens the peer reports
    our_tokens: list = field(default_factory=list)  # ours in the free run, after the variant's output rule
    divergence: Divergence | None = None  # the first difference of the deciding comparisons
    notes: list = field(default_factory=list)  # str: what a reader should know (ties, free-run explanation)

    @property
    def ok(self) -> bool:
        return self.divergence is None


@dataclass
class Report:
    """Everything ``crosscheck PEER`` found."""

    peer: str  # transformers / mlx-vlm / diffusers
    peer_version: str
    model: str  # the checkpoint (or "tiny random (built in a temporary directory)")
    tolerance_note: str  # how the forward tolerances were set
    forward: list = field(default_factory=list)  # ForwardRow
    generation: list = field(default_factory=list)  # GenerationRow
    adaptations: list = field(default_factory=list)  # str: what was changed for the peer, and where
    defects: list = field(default_factory=list)  # str: defects and known differences observed in this run
    rule: str = ""  # how the verdict is decided, when not by the tolerances alone (bfloat16: the null rule)

    @property
    def agree(self) -> bool:
        return all(r.ok for r in self.forward if not r.probe) and all(g.ok for g in self.generation)

    @property
    def exit_code(self) -> int:
        return 0 if self.agree else 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["agree"] = self.agree
        for row, data in zip(self.forward, out["forward"]):
            data["ok"] = row.ok
        for row, data in zip(self.generation, out["generation"]):
            data["ok"] = row.ok
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_jsonable)

    def to_text(self) -> str:
        lines = [f"crosscheck {self.peer} {self.peer_version} on {self.model}"]
        if self.rule:
            lines.append(f"verdict rule: {self.rule}")
        lines += ["", "forward (max |peer - reference| per logits tensor)"]
        for r in self.forward:
            mark = ("tie " if r.undefined_upstream else "ok  ") if r.ok else ("note" if r.probe else "DIFF")
            lines.append(f"  {mark} {r.name:<18} shape={str(tuple(r.shape)):<14} "
                         f"max|d|={r.max_abs_diff:.2e} tol={r.tolerance:.2e} max|x|={r.max_abs_value:.2e} "
                         f"argmax agree={r.argmax_agreement:.3f}")
            if r.undefined_upstream:
                lines.append(f"       undefined upstream: {r.undefined_upstream}")
        lines.append(f"  tolerance: {self.tolerance_note}")
        if self.rule and self.forward and all(r.probe for r in self.forward):
            lines.append("  bfloat16: whole calls are information (one flip reaches most logits); the stage-forced "
                         "comparison below decides")
        elif any(r.probe for r in self.forward):
            lines.append("  probe rows (note) show known differences; they do not decide the result")
        lines.append("")
        lines.append("generation (the peer's sampler configurations; teacher forcing and the sampler check decide)")
        for g in self.generation:
            lines.append(f"  {'ok  ' if g.ok else 'DIFF'} {g.label}  [semantics={g.semantics}, draws={g.draws}]")
            tf = g.teacher_forced
            if tf and "stages" in tf:
                lines.append(f"       stage-forced (bfloat16): {tf.get('calls', 0)} decoder calls and {tf.get('encodes', 0)} "
                             f"encodes, each stage on the peer's own input to it; router choices replayed across "
                             f"{tf.get('router_ties_replayed', 0)} exact and {tf.get('router_near_ties_replayed', 0)} "
                             f"near ties; context: {tf.get('context', '?')}")
            elif tf:
                at = tf.get("worst_at")
                lines.append(f"       teacher-forced forward: {tf.get('calls', 0)} decoder calls on the peer's inputs, "
                             f"max |d| {tf.get('max_abs_diff', 0.0):.2e}, worst {tf.get('worst_ratio', 0.0):.2f} x "
                             f"tolerance" + (f" (canvas {at[0]} step {at[1]})" if at else "")
                             + f", {tf.get('caches_compared', 0)} cache(s) compared; context: {tf.get('context', '?')}")
            sc = g.sampler
            if sc:
                lines.append(f"       sampler on the peer's logits and draws: steps checked {sc.get('steps', 0)}, "
                             f"canvases committed {sc.get('canvases', 0)}")
            fr = g.free_run
            if fr:
                state = "tokens identical" if fr.get("agree") else "tokens differ"
                drift = fr.get("first_drift")
                parted = fr.get("parted")
                text = f"       free run (information): {state}"
                if drift:
                    text += (f"; inputs first drifted at canvas {drift['canvas']} step {drift['step']} "
                             f"({drift['input']} max |d| {drift['max_abs_diff']:.1e})")
                if parted and parted.get("canvas", -1) >= 0:
                    text += (f"; parted at canvas {parted['canvas']} step {parted['step']} position "
                             f"{parted['position']} ({parted['what']})")
                elif parted:
                    text += f"; parted: {parted['what']}"
                lines.append(text)
            for stage, v in (tf.get("stages") or {}).items():
                lines.append(f"         {stage:<16} calls {v['calls']:3d}, beyond the null {v['beyond']:3d}; peer: up to "
                             f"{v['peer_max_ulps']:.2f} ulps, median share {v['peer_median_share']:.4f}; null: up to "
                             f"{v['null_max_ulps']:.2f} ulps, median share {v['null_median_share']:.4f}")
            for k, c in enumerate(g.canvases):
                tokens = f"{c['agree']}/{c['of']} tokens agree" if c["of"] else "no tokens reported (an end token first)"
                lines.append(f"         canvas {k}: {tokens}, steps peer {c['steps_peer']} ours {c['steps_ours']}")
            for note in g.notes:
                lines.append(f"       note: {note}")
            if g.divergence is not None:
                d = g.divergence
                where = "the committed canvas" if d.step < 0 else f"step {d.step}"
                tokens = "" if d.peer_token < 0 and d.our_token < 0 else f" (peer {d.peer_token}, ours {d.our_token})"
                lines.append(f"       DIFFER at stage {d.stage}: canvas {d.canvas}, {where}, position {d.position}"
                             f"{tokens}: {d.cause}")
        lines.append("")
        lines.append("adaptations made for the peer")
        lines.extend(f"  - {a}" for a in self.adaptations or ["none"])
        lines.append("defects and known differences seen")
        lines.extend(f"  - {d}" for d in self.defects or ["none"])
        lines.append("")
        lines.append(f"result: {'AGREE' if self.agree else 'DIFFER'} (exit {self.exit_code})")
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(value)
