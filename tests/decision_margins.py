"""How far each discrete decision of a run lies from flipping, for tests that compare the tokens of two
computations whose float32 sums may run in a different order (two backends, a replayed and a direct pass,
two BLAS builds). Their logits then differ by a few float32 ulps, and a token comparison is only sound where
no decision of the run lies within that distance of its threshold: a seed is chosen by that margin, and the
test checks the margin on every machine (``assert_clear_of_ties``), so a near-tie fails as a near-tie, never
as a wrong token.

A run's decisions and what a perturbation of every raw (soft-capped) logit by at most ``e`` can do to them,
at temperature T (the processed logits move by at most e/T):

* the categorical draw (inverse CDF, ``sampling.categorical_from_uniform``): each cumulative probability
  F_v moves by at most exp(2e/T) - 1, so the draw stands if its uniform lies farther than that from both
  edges of the drawn id's interval [F_{s-1}, F_s);
* the argmax draft (EOS, stability): stands if the top raw logit leads the second by more than 2e;
* entropies: to first order |dH| <= 2(e/T) * sum_v p_v |log p_v + H| <= 4eH/T; twice that is used
  (``entropy_slack``);
* entropy-bound acceptance (a lowest-entropy prefix): stands if every rejected entropy exceeds every
  accepted one by more than their slacks, and the two sums the rule compares with the bound (the accepted
  entropies but the largest; all of them) stay on their side of it by more than the summed slack;
* the confidence stop (mean entropy < gamma): stands if the mean lies farther than the mean slack from gamma.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diffusiongemma.reference.draws import SeededDraws


class UniformsKept(SeededDraws):
    """``SeededDraws`` that keeps each categorical draw's probabilities, uniforms and ids."""

    def __init__(self, seed):
        super().__init__(seed)
        self.kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def categorical(self, probs, **_):
        from diffusiongemma.reference.sampling import categorical_from_uniform

        p = np.asarray(probs, dtype=np.float32)
        u = self.categorical_uniforms(*p.shape[:-1])
        ids = categorical_from_uniform(p, u)
        self.kept.append((p.copy(), u.copy(), ids.copy()))
        return ids


class StepsKept:
    """A ``generate`` callback that keeps every ``StepInfo``."""

    def __init__(self):
        self.steps = []

    def on_step(self, info):
        self.steps.append(info)


def entropy_slack(probs: np.ndarray, entropies: np.ndarray, e: float, temperature: float) -> np.ndarray:
    """Twice the first-order bound on how far each position's entropy moves when every raw logit moves by e."""
    p = probs.astype(np.float64)
    logp = np.log(np.where(p > 0, p, 1.0))
    spread = (p * np.abs(logp + entropies.astype(np.float64)[..., None])).sum(-1)
    return 2.0 * 2.0 * (e / temperature) * spread


@dataclass
class Margins:
    """The smallest margin of each kind over the run, divided by what a logit error of ``e`` can take."""

    draw: float = np.inf
    argmax: float = np.inf
    acceptance: float = np.inf
    confidence: float = np.inf
    where: dict = field(default_factory=dict)

    def note(self, kind: str, ratio: float, where: str) -> None:
        if ratio < getattr(self, kind):
            setattr(self, kind, ratio)
            self.where[kind] = where

    @property
    def smallest(self) -> float:
        return min(self.draw, self.argmax, self.acceptance, self.confidence)


def margins(steps, kept, e: float, entropy_bound: float, confidence_threshold: float | None,
            draws: bool = True) -> Margins:
    """Each decision's margin over its slack (> 1: a logit error of at most ``e`` cannot flip it), from a
    reference run's ``StepInfo``s and the draws ``UniformsKept`` kept, in step order. Rows that had
    finished before a step are skipped (their proposals are discarded). ``draws=False`` leaves out the
    categorical draws, for a comparison in which the other side replays this run's drawn ids."""
    assert len(steps) == len(kept), (len(steps), len(kept))
    out = Margins()
    finished_before = None
    for info, (p, u, ids) in zip(steps, kept):
        B, C = ids.shape
        if finished_before is None or info.step_index == 0:
            finished_before = np.zeros(B, dtype=bool)
        T = float(info.temperature) if info.temperature is not None else 1.0
        at = f"canvas {info.canvas_index} step {info.step_index}"
        p64 = p.astype(np.float64)
        H = info.entropies.astype(np.float64)
        slack = entropy_slack(p, info.entropies, e, T)  # (B, C)
        for b in np.flatnonzero(~finished_before):
            cdf = np.cumsum(p64[b], axis=-1)
            F = cdf / cdf[:, -1:]  # (C, V)
            s = ids[b]
            hi = F[np.arange(C), s]
            lo = np.where(s > 0, F[np.arange(C), np.maximum(s - 1, 0)], 0.0)
            gap = np.minimum(u[b] - lo, hi - u[b])  # distance of the uniform to its interval's edges
            j = int(np.argmin(gap))
            if draws:
                out.note("draw", float(gap[j]) / np.expm1(2 * e / T), f"{at} row {b} position {j}")
            top2 = np.sort(np.log(np.maximum(p64[b], 1e-300)), axis=-1)[:, -2:]  # processed logits up to a shift
            lead = T * (top2[:, 1] - top2[:, 0])  # in raw logits
            j = int(np.argmin(lead))
            out.note("argmax", float(lead[j]) / (2 * e), f"{at} row {b} position {j}")
            a = info.accepted[b]
            if a.any():
                acc_H, acc_s = H[b][a], slack[b][a]
                total_slack = float(acc_s.sum())
                last = float((acc_H + acc_s).max())
                below = entropy_bound - (float(acc_H.sum()) - last) - total_slack  # the largest accepted stays in
                above = float((acc_H - acc_s).sum()) - entropy_bound if (~a).any() else np.inf  # the next stays out
                order = float(((H[b] - slack[b])[~a]).min()) - last if (~a).any() else np.inf
                out.note("acceptance", 1.0 + min(below, above, order) / max(total_slack, 1e-30),
                         f"{at} row {b}")
            if confidence_threshold is not None:
                mean, mean_slack = float(H[b].mean()), float(slack[b].mean())
                out.note("confidence", abs(mean - confidence_threshold) / mean_slack, f"{at} row {b}")
        finished_before = info.finished.copy()
    return out


def assert_clear_of_ties(m: Margins, e: float) -> None:
    assert m.smallest > 1.0, (
        f"a decision of this run lies within a logit error of {e:g} of its threshold (near-tie), so two "
        f"float32 sum orders may part here; pick a seed with a margin: {m}")
