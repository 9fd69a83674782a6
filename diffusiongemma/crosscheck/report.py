"""The cross-check report: forward rows, generation rows, adaptations, defects; text and JSON renderings.

A report agrees when every forward row is within its tolerance and every generation row matches token for
token. ``exit_code`` is 0 then, 1 otherwise (usage and setup errors never produce a report: exit 2).
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

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@dataclass
class Divergence:
    """Where a peer's run and ours part: the first denoising step whose input canvas differs."""

    canvas: int  # canvas index
    step: int  # 0-based step index within the canvas (decoder call); -1: the committed canvas only
    position: int  # first differing canvas position
    peer_token: int
    our_token: int
    cause: str  # one sentence: logits beyond tolerance / near tie / acceptance decision / stopping / commit


@dataclass
class GenerationRow:
    """The peer's sampler against our implementation of that peer's semantics, one configuration."""

    label: str  # e.g. "entropy-bound, seeded, replayed draws"
    semantics: str  # our ``semantics=`` value, with any replaced switches
    draws: str  # "replayed" (the peer's random stream fed into ours) or "greedy" (no randomness compared)
    canvases: list = field(default_factory=list)  # per canvas {"agree": n, "of": C, "steps_peer": s, "steps_ours": s}
    peer_tokens: list = field(default_factory=list)  # the tokens the peer reports
    our_tokens: list = field(default_factory=list)  # ours, after the variant's output rule
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.peer_tokens == self.our_tokens


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
        lines = [f"crosscheck {self.peer} {self.peer_version} on {self.model}", "",
                 "forward (max |peer - reference| per logits tensor)"]
        for r in self.forward:
            mark = "ok  " if r.ok else ("note" if r.probe else "DIFF")
            lines.append(f"  {mark} {r.name:<18} shape={str(tuple(r.shape)):<14} "
                         f"max|d|={r.max_abs_diff:.2e} tol={r.tolerance:.2e} max|x|={r.max_abs_value:.2e} "
                         f"argmax agree={r.argmax_agreement:.3f}")
        lines.append(f"  tolerance: {self.tolerance_note}")
        if any(r.probe for r in self.forward):
            lines.append("  probe rows (note) show known differences; they do not decide the result")
        lines.append("")
        lines.append("generation (peer's sampler vs our semantics= variant, same weights and prompt)")
        for g in self.generation:
            lines.append(f"  {'ok  ' if g.ok else 'DIFF'} {g.label}  [semantics={g.semantics}, draws={g.draws}]")
            for k, c in enumerate(g.canvases):
                tokens = f"{c['agree']}/{c['of']} tokens agree" if c["of"] else "no tokens reported (an end token first)"
                lines.append(f"       canvas {k}: {tokens}, steps peer {c['steps_peer']} ours {c['steps_ours']}")
            if len(g.peer_tokens) != len(g.our_tokens):
                lines.append(f"       output length: peer {len(g.peer_tokens)}, ours {len(g.our_tokens)}")
            if g.divergence is not None:
                d = g.divergence
                where = "the committed canvas" if d.step < 0 else f"step {d.step}"
                lines.append(f"       first difference: canvas {d.canvas}, {where}, position {d.position} "
                             f"(peer {d.peer_token}, ours {d.our_token}): {d.cause}")
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
