"""The fused sampling pass against the reference sampler stages, decision by decision.

Given the same logits, temperature, uniforms and noise, the fast pass must reproduce every discrete
decision of ``reference.sampling`` (draft, categorical draw, acceptance, next canvas), except where the
reference's own decision sits within a documented epsilon of a tie. Such cases are detected from the
reference's own numbers, listed, and reported as warnings (never silently skipped); a mismatch that is not
such a case fails the test.

Epsilons (why a correct fast pass may decide differently there):
* draw: the fast probabilities differ from the reference's by a few float32 ulp each (its own exp,
  float64 denominators), so cumulative sums differ by at most ~3e-7 of the total. ``EPS_DRAW`` = 1e-6:
  a draw is a near tie when ``u * total`` lies within 1e-6 * total of a boundary of the reference's CDF.
* entropies: the reference forms log p = ẑ - (max + log S) in float32, so every log p carries an
  absolute error of about an ulp of max|ẑ| (4e-6 at ẑ = 60), and sums V float32 terms (pairwise, error
  ~log2(V) * 2^-24 relative); the fast pass computes log S - A/S in float64. ``entropy_tolerance`` =
  2e-6 * (1 + H) + 4 * 2^-24 * max|ẑ| covers both (it is the reference that is the less exact one:
  ``test_entropy_is_closer_to_float64``). Acceptance compares cumulative sums of up to C entropies with
  the bound, so a row is a near tie when some ``S_k - H_(k)`` lies within C times that tolerance of the
  bound, or when two entropies that tolerance apart straddle the accepted prefix.
* argmax: the processed logits are the same float32 divisions on both sides, so the draft must match
  exactly (ties resolve to the first index on both sides).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiongemma.fast.sampling import FusedSampler, sampling_step
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.support.errors import SamplingError
from diffusiongemma.reference.sampling import (argmax_tokens, categorical_from_uniform, entropy_bound_accept,
                                               renoise, scale_logits, softmax_and_entropy)
from diffusiongemma.reference.support.logits import check_logits

EPS_DRAW = 1e-6


def entropy_tolerance(H: np.ndarray, processed: np.ndarray) -> np.ndarray:
    """Allowed |fast - reference| entropy difference per position; processed: (..., V) logits / T."""
    finite = np.where(np.isfinite(processed), np.abs(processed), 0.0)
    return 2e-6 * (1.0 + np.abs(H)) + 4 * 2.0 ** -24 * finite.max(axis=-1)


def reference_step(z, temp, u, noise, bound):
    processed = scale_logits(z, temp)
    check_logits(z, "denoiser logits")
    if temp is not None:
        check_logits(processed, f"logits divided by temperature {float(temp)!r}")
    probs, H = softmax_and_entropy(processed)
    sampled = categorical_from_uniform(probs, u)
    accepted = entropy_bound_accept(H, bound)
    return dict(probs=probs, entropies=H, processed=processed, sampled=sampled, draft=argmax_tokens(processed), accepted=accepted,
                canvas=renoise(sampled, accepted, noise))


def draw_near_ties(probs, u, sampled):
    """(row, position) of draws whose target lies within EPS_DRAW * total of a reference CDF boundary."""
    cdf = np.cumsum(probs, axis=-1, dtype=np.float64)
    total = cdf[..., -1]
    target = u * total
    k = sampled
    above = np.take_along_axis(cdf, k[..., None], -1)[..., 0]
    below = np.where(k > 0, np.take_along_axis(cdf, np.maximum(k - 1, 0)[..., None], -1)[..., 0], 0.0)
    margin = np.minimum(target - below, above - target) / total
    return {tuple(int(i) for i in w) for w in np.argwhere(margin < EPS_DRAW)}


def acceptance_near_ties(H, tolerance, bound):
    """Rows whose accepted set could change under entropy perturbations of ``tolerance`` (B, C)."""
    rows = set()
    for b, (h, tol) in enumerate(zip(H, tolerance)):
        order = np.sort(h)
        lhs = (np.cumsum(order, dtype=np.float64).astype(np.float32) - order).astype(np.float64)
        accepted = int(np.sum(lhs <= np.float32(bound)))
        if np.any(np.abs(lhs - bound) < tol.max() * len(h)):
            rows.add(b)
        if accepted < len(h) and order[accepted] - order[accepted - 1] < 2 * tol.max():
            rows.add(b)
    return rows


def compare(z, temp, u, noise, bound, report):
    ref = reference_step(z, temp, u, noise, bound)
    work = z.copy()
    draft, H, sampled, accepted, canvas = sampling_step(work, temp, u, noise, bound)
    np.testing.assert_array_equal(draft, ref["draft"])
    tolerance = entropy_tolerance(ref["entropies"], ref["processed"])
    assert np.all(np.abs(H - ref["entropies"]) <= tolerance), np.abs(H - ref["entropies"]).max()
    np.testing.assert_allclose(work, ref["probs"], rtol=1e-5, atol=1e-12)  # probabilities left in place
    draw_ties = draw_near_ties(ref["probs"], u, ref["sampled"])
    for where in map(tuple, np.argwhere(sampled != ref["sampled"])):
        assert where in draw_ties, f"draw at {where} differs ({sampled[where]} vs {ref['sampled'][where]}) " \
                                   "and is not a near tie"
    accept_ties = acceptance_near_ties(ref["entropies"], tolerance, bound)
    for b in np.flatnonzero((accepted != ref["accepted"]).any(-1)):
        assert b in accept_ties, f"acceptance of row {b} differs and is not a near tie"
    same = (sampled == ref["sampled"]) & (accepted == ref["accepted"])
    np.testing.assert_array_equal(canvas[same], ref["canvas"][same])
    differing_draws = {tuple(int(i) for i in w) for w in np.argwhere(sampled != ref["sampled"])}
    differing_rows = set(np.flatnonzero((accepted != ref["accepted"]).any(-1)).tolist())
    report.extend([("draw", w, w in differing_draws) for w in sorted(draw_ties)]
                  + [("acceptance row", b, b in differing_rows) for b in sorted(accept_ties)])


@pytest.fixture
def report(request):
    """Collects near ties and reports them as a warning at the end of the test (never hidden)."""
    found: list = []  # (kind, where, decided differently?)
    yield found
    if found:
        differing = [(kind, where) for kind, where, differs in found if differs]
        warnings.warn(f"{request.node.name}: {len(found)} reference decision(s) within epsilon of a tie, "
                      f"{len(differing)} of them decided differently by the fast pass: "
                      f"{differing[:10] or found[:5]}")


logit_rows = st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 300))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=logit_rows, scale=st.sampled_from([0.05, 1.0, 6.0, 30.0]), seed=st.integers(0, 2**31),
       temp=st.sampled_from([None, 0.05, 0.4083333, 0.8, 2.0]), bound=st.sampled_from([0.01, 0.1, 1.0, 50.0]),
       neg_inf=st.booleans(), ties=st.booleans())
def test_fused_step_matches_reference(shape, scale, seed, temp, bound, neg_inf, ties, report):
    B, C, V = shape
    rng = np.random.default_rng(seed)
    z = (scale * rng.standard_normal((B, C, V))).astype(np.float32)
    if neg_inf and V > 1:  # excluded ids (never all of a row)
        z[rng.random((B, C, V)) < 0.3] = -np.inf
        z[..., rng.integers(V)] = np.float32(0.5)
    if ties and V > 2:  # exact argmax ties: the first index must win on both sides
        z[..., 1] = z[..., 2] = z.max(-1) + np.float32(1.0)
    u = rng.random((B, C))
    noise = rng.integers(0, V, (B, C))
    compare(z, None if temp is None else np.float32(temp), u, noise, bound, report)


def test_entropy_is_closer_to_float64():
    """Where fast and reference entropies differ most (peaked rows, large logits), the fast one is the
    closer to a float64 evaluation: the tolerance above is the reference's rounding, not ours."""
    rng = np.random.default_rng(220)
    z = (30.0 * rng.standard_normal((4, 8, 74))).astype(np.float32)
    _, H_ref = softmax_and_entropy(z)
    H_fast = FusedSampler()(z.copy(), np.arange(4), None).entropies
    z64 = z.astype(np.float64)
    p64 = np.exp(z64 - z64.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    H64 = -(p64 * np.log(np.maximum(p64, 1e-300))).sum(-1)
    assert np.abs(H_fast - H64).max() < 1e-7 < np.abs(H_ref - H64).max()


@pytest.mark.parametrize("V", [2047, 2048, 2049, 5000])
def test_rows_spanning_several_blocks(V, report):
    """Rows longer than the kernel's block (2048), with the maximum in a late block (rescaled sums)."""
    rng = np.random.default_rng(V)
    z = (3.0 * rng.standard_normal((2, 5, V))).astype(np.float32)
    z[0, :, -1] = 20.0  # maximum in the last block
    z[1, :, 0] = 20.0  # maximum in the first block
    compare(z, np.float32(0.8), rng.random((2, 5)), rng.integers(0, V, (2, 5)), 0.1, report)


def test_edge_uniforms_and_single_id(report):
    """u = 0 picks the first id of nonzero probability; u just below 1 the last; V = 1 always id 0."""
    z = np.log(np.array([[[0.0, 0.5, 0.0, 0.5]]], dtype=np.float32) + 1e-45).astype(np.float32)
    z[0, 0, [0, 2]] = -np.inf
    for u, expect in ((0.0, 1), (np.nextafter(1.0, 0.0), 3)):
        work = z.copy()
        result = FusedSampler()(work, np.arange(1), None, np.array([[u]]))
        assert result.sampled[0, 0] == expect == categorical_from_uniform(softmax_and_entropy(z)[0], np.array([[u]]))[0, 0]
    one = np.zeros((2, 3, 1), np.float32)
    result = FusedSampler()(one.copy(), np.arange(2), np.float32(0.5), np.full((2, 3), 0.99))
    assert (result.sampled == 0).all() and (result.draft == 0).all() and (result.entropies == 0).all()


def test_near_tie_detector_flags_a_boundary_draw(report):
    """A target exactly on a CDF boundary is a near tie (and both sides still agree there here)."""
    z = np.zeros((1, 1, 4), np.float32)  # uniform: boundaries at 0.25, 0.5, 0.75
    probs, _ = softmax_and_entropy(z)
    u = np.array([[0.5]])
    assert draw_near_ties(probs, u, categorical_from_uniform(probs, u)) == {(0, 0)}
    compare(z, None, u, np.zeros((1, 1), np.int64), 0.1, report)
    assert report[-1][:2] == ("draw", (0, 0))


def test_same_uniforms_as_seeded_source():
    """The fused draw with ``generator.random((B, C))`` equals ``SeededDraws.categorical`` (same seed)."""
    rng = np.random.default_rng(3)
    z = (2.0 * rng.standard_normal((3, 7, 50))).astype(np.float32)
    probs, _ = softmax_and_entropy(scale_logits(z, np.float32(0.8)))
    expected = SeededDraws(11).categorical(probs)
    u = SeededDraws(11).generator.random(size=(3, 7), dtype=np.float64)
    result = FusedSampler()(z.copy(), np.arange(3), np.float32(0.8), u)
    np.testing.assert_array_equal(result.sampled, expected)


def test_subset_of_rows_and_separate_destination():
    """Only the requested batch rows are read and written; a separate probability buffer leaves the
    logits untouched."""
    rng = np.random.default_rng(5)
    z = rng.standard_normal((4, 3, 20)).astype(np.float32)
    probs = np.full_like(z, -1.0)
    before = z.copy()
    result = FusedSampler()(z, np.array([1, 3]), None, rng.random((4, 3)), probs=probs)
    np.testing.assert_array_equal(z, before)
    assert (probs[[0, 2]] == -1).all()
    np.testing.assert_allclose(probs[[1, 3]], softmax_and_entropy(z[[1, 3]])[0], rtol=1e-5)
    np.testing.assert_array_equal(result.draft, argmax_tokens(z[[1, 3]]))


@pytest.mark.parametrize("case", ["nan", "posinf", "all_neginf", "overflow_after_temperature"])
def test_bad_logits_raise_the_reference_error(case):
    z = np.zeros((2, 3, 5), np.float32)
    temp = np.float32(0.5)
    if case == "nan":
        z[1, 2, 3] = np.nan
        z[0, 1, 0] = np.inf  # NaN is reported first even though +inf comes earlier
    elif case == "posinf":
        z[1, 0, 4] = np.inf
    elif case == "all_neginf":
        z[0, 2] = -np.inf
    else:
        z[1, 1, 1] = np.float32(3e38)
        temp = np.float32(0.01)
    with pytest.raises(SamplingError) as expected:
        reference_step(z, temp, np.zeros((2, 3)), np.zeros((2, 3), np.int64), 0.1)
    with pytest.raises(SamplingError) as got:
        FusedSampler()(z.copy(), np.arange(2), temp, np.zeros((2, 3)))
    assert str(got.value) == str(expected.value)
