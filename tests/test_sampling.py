"""The sampler stages of reference/sampling.py, one at a time.

Where transformers has the same stage, it is the oracle (temperature, entropies, acceptance, stopping
rule, EOS/pad finalisation); elsewhere the documented rule is checked directly, with hypothesis for the
properties that must hold for every input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diffusiongemma.reference.support.errors import InputError, SamplingError
from diffusiongemma.reference.sampling import (StableAndConfident, argmax_tokens, categorical_from_uniform,
                                               entropy_bound_accept, finalize_canvas, freeze_rows, renoise,
                                               scale_logits, softmax_and_entropy, temperature, tokens_per_forward)
from diffusiongemma.reference.support.logits import check_logits

import torch  # the test extra (README) installs it
import transformers.models.diffusion_gemma.generation_diffusion_gemma as hf_generation

SETTINGS = settings(max_examples=40, deadline=None)


def entropies_strategy(B_max=3, C_max=24, allow_ties=True):
    """(B, C) float32 entropies in [0, 1.5], optionally drawn from a few values so that ties are common."""
    elements = (st.sampled_from([0.0, 0.01, 0.03, 0.05, 0.1, 0.2]) if allow_ties
                else st.floats(0, 1.5, width=32))
    shape = st.tuples(st.integers(1, B_max), st.integers(1, C_max))
    return hnp.arrays(np.float32, shape, elements=elements)


# ------------------------------------------------------------------------------------------------ temperature
@SETTINGS
@given(N=st.integers(1, 200), data=st.data(), t=st.tuples(st.floats(0, 2), st.floats(0.001, 2)))
def test_temperature_matches_transformers_schedule_bit_for_bit(N, data, t):
    """Processed logits z / T equal transformers' LinearTemperatureScheduleLogitsProcessor output exactly."""
    t_min, t_max = t[0], t[0] + t[1]
    step = data.draw(st.integers(1, N))
    processor = hf_generation.LinearTemperatureScheduleLogitsProcessor(t_min=t_min, t_max=t_max,
                                                                       max_denoising_steps=N)
    z = np.random.default_rng(step).standard_normal((2, 3, 7)).astype(np.float32) * 10
    ours = scale_logits(z, temperature(step, N, t_min, t_max))
    theirs = processor(None, torch.from_numpy(z), cur_step=torch.tensor(step, dtype=torch.int32)).numpy()
    assert ours.dtype == np.float32 and isinstance(temperature(step, N, t_min, t_max), np.float32)
    np.testing.assert_array_equal(ours, theirs)


def test_temperature_counts_down_and_never_reaches_t_min():
    N = 48
    temps = [temperature(n, N, 0.4, 0.8) for n in range(N, 0, -1)]
    assert temps[0] == np.float32(0.8)  # first step: t_max
    assert np.all(np.diff(np.array(temps)) < 0)
    assert temps[-1] == np.float32(np.float32(0.4) + np.float32(0.4) * (np.float32(1) / np.float32(48)))
    assert abs(float(temps[-1]) - 0.408333) < 1e-5 and temps[-1] > np.float32(0.4)


@pytest.mark.parametrize("step", [0, 49, -1])
def test_temperature_rejects_steps_outside_the_schedule(step):
    with pytest.raises(InputError, match=str(step)):
        temperature(step, 48, 0.4, 0.8)


def test_no_schedule_leaves_logits_unchanged_and_copies():
    z = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    out = scale_logits(z, None)
    np.testing.assert_array_equal(out, z)
    out[0, 0, 0] = 99
    assert z[0, 0, 0] == 0


# ------------------------------------------------------------------------------------------------ distributions
@SETTINGS
@given(z=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(2, 40)),
                    elements=st.floats(-60, 60, width=32)))
def test_softmax_and_entropy_match_torch_categorical(z):
    probs, H = softmax_and_entropy(z)
    dist = torch.distributions.Categorical(logits=torch.from_numpy(z))
    np.testing.assert_allclose(probs, torch.softmax(torch.from_numpy(z), -1).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(H, dist.entropy().numpy(), rtol=1e-4, atol=2e-6)
    assert probs.dtype == np.float32 and H.dtype == np.float32 and H.shape == z.shape[:-1]
    assert (H >= -1e-6).all()


def test_excluded_ids_have_zero_probability_and_finite_entropy():
    z = np.array([[[0.0, -np.inf, 1.0, -np.inf]]], np.float32)
    probs, H = softmax_and_entropy(z)
    assert probs[0, 0, 1] == 0 and probs[0, 0, 3] == 0
    assert np.isfinite(H).all()
    hf = torch.distributions.Categorical(logits=torch.from_numpy(z)).entropy().numpy()
    np.testing.assert_allclose(H, hf, rtol=1e-6)


@pytest.mark.parametrize("bad, reason", [(np.nan, "NaN"), (np.inf, r"\+inf")])
def test_check_logits_names_the_bad_position(bad, reason):
    z = np.zeros((2, 3, 5), np.float32)
    z[1, 2, 4] = bad
    with pytest.raises(SamplingError, match=rf"\(1, 2\).*{reason}"):
        check_logits(z, "denoiser logits")


def test_check_logits_refuses_a_position_without_finite_logits_but_allows_some_neg_inf():
    z = np.zeros((1, 2, 4), np.float32)
    z[0, 0, :2] = -np.inf
    check_logits(z)  # partly excluded: fine
    z[0, 1, :] = -np.inf
    with pytest.raises(SamplingError, match=r"\(0, 1\).*all -inf"):
        check_logits(z)


def test_argmax_takes_the_first_index_on_ties_like_torch():
    z = np.array([[[1, 3, 3, 0], [5, 5, 5, 5]]], np.float32)
    np.testing.assert_array_equal(argmax_tokens(z), torch.argmax(torch.from_numpy(z), -1).numpy())
    np.testing.assert_array_equal(argmax_tokens(z), [[1, 0]])


# ------------------------------------------------------------------------------------------------ categorical
def test_categorical_rule_is_first_id_whose_cdf_exceeds_u_times_total():
    p = np.array([0.0, 0.25, 0.0, 0.5, 0.25], np.float32)  # cdf 0, .25, .25, .75, 1
    u = np.array([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.999999])
    ids = categorical_from_uniform(np.broadcast_to(p, (6, 5)), u)
    np.testing.assert_array_equal(ids, [1, 1, 3, 3, 4, 4])
    unnormalised = categorical_from_uniform(np.broadcast_to(4 * p, (6, 5)), u)  # rows need not sum to 1
    np.testing.assert_array_equal(unnormalised, ids)


def test_categorical_never_draws_excluded_ids():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((20, 50)).astype(np.float32)
    z[rng.random(z.shape) < 0.6] = -np.inf
    z[:, 7] = 0.0  # keep every row samplable
    probs, _ = softmax_and_entropy(z)
    u = rng.random((20, 500))  # 10^4 draws
    ids = categorical_from_uniform(probs, u)
    assert ids.shape == (20, 500)
    allowed = np.isfinite(z)
    assert np.take_along_axis(allowed, ids, axis=1).all()
    assert all(len(np.unique(ids[r])) > 1 for r in range(20) if allowed[r].sum() > 1)


def test_categorical_draws_a_tiny_tail_of_a_262144_token_vocabulary_at_the_right_rate():
    """1e-3 of the mass spread over 262,143 ids (3.8e-9 each): drawn at rate 1e-3 within 4 sigma."""
    V, head, tail_mass, n = 262_144, 100_000, 1e-3, 1_000_000
    p = np.full(V, tail_mass / (V - 1), np.float32)
    p[head] = np.float32(1 - tail_mass)
    u = np.random.default_rng(1).random((1, n))
    ids = categorical_from_uniform(p[None], u)[0]
    tail = ids != head
    expected, sigma = n * tail_mass, np.sqrt(n * tail_mass * (1 - tail_mass))
    assert abs(tail.sum() - expected) < 4 * sigma, (tail.sum(), expected, sigma)
    below, above = (ids[tail] < head).sum(), (ids[tail] > head).sum()  # the tail on both sides is reached
    assert abs(below - tail.sum() * head / (V - 1)) < 4 * np.sqrt(tail.sum() * 0.25)
    assert len(np.unique(ids[tail])) > 0.9 * tail.sum()  # spread out, not a few favoured ids
    assert above > 0


@SETTINGS
@given(V=st.integers(2, 12), seed=st.integers(0, 2**32 - 1))
def test_categorical_frequencies_follow_the_probabilities(V, seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V) * 0.7).astype(np.float32)
    n = 20_000
    ids = categorical_from_uniform(p[None], rng.random((1, n)))[0]
    counts = np.bincount(ids, minlength=V)
    sigma = np.sqrt(n * p * (1 - p)) + 1
    assert (np.abs(counts - n * p / p.sum()) < 5 * sigma).all()
    assert (counts[p == 0] == 0).all()


@pytest.mark.parametrize("probs, error, match", [
    (np.array([[0.5, np.nan]], np.float32), SamplingError, "NaN"),
    (np.array([[0.5, -0.1]], np.float32), SamplingError, "negative"),
    (np.array([[0.0, 0.0]], np.float32), SamplingError, "row 0 sums to 0"),
])
def test_categorical_refuses_undefined_distributions(probs, error, match):
    with pytest.raises(error, match=match):
        categorical_from_uniform(probs, np.array([0.3]))


@pytest.mark.parametrize("u", [np.array([1.0]), np.array([-0.1]), np.array([0.1, 0.2])])
def test_categorical_refuses_bad_uniforms(u):
    with pytest.raises(InputError):
        categorical_from_uniform(np.array([[0.5, 0.5]], np.float32), u)


# ------------------------------------------------------------------------------------------------ acceptance
@SETTINGS
@given(H=entropies_strategy(), bound=st.sampled_from([0.0001, 0.05, 0.1, 0.3, 1.0]))
def test_acceptance_is_a_nonempty_prefix_of_the_stable_ascending_order(H, bound):
    accepted = entropy_bound_accept(H, bound)
    assert accepted.dtype == bool and accepted.shape == H.shape
    assert accepted.any(axis=-1).all()  # at least one position per row
    order = np.argsort(H, axis=-1, kind="stable")
    in_order = np.take_along_axis(accepted, order, axis=-1)
    k = in_order.sum(axis=-1)
    for row in range(H.shape[0]):
        assert in_order[row, :k[row]].all() and not in_order[row, k[row]:].any()  # a prefix
        sorted_row = H[row, order[row]].astype(np.float64)
        before = np.concatenate([[0.0], np.cumsum(sorted_row)[:-1]])  # entropies strictly before each item
        margin = 1e-5
        assert (before[:k[row]] <= bound + margin).all()  # accepted items satisfy the bound
        assert (before[k[row]:] > bound - margin).all()  # the first rejected one breaks it


@SETTINGS
@given(B=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), ties=st.booleans(),
       bound=st.sampled_from([0.05, 0.1, 0.5, 2.0]))
def test_acceptance_matches_transformers_entropy_bound_sampler_on_16_positions(B, seed, ties, bound):
    """torch.sort is stable for rows of <= 16 (the tiny model's canvas): same mask even with ties."""
    rng = np.random.default_rng(seed)
    C, V = 16, 32
    logits = (rng.standard_normal((B, C, V)) * rng.uniform(0.5, 8)).astype(np.float32)
    if ties:  # duplicate rows give bit-identical entropies
        logits[:, 8:] = logits[:, :8]
    sampler = hf_generation.EntropyBoundSampler(hf_generation.EntropyBoundSamplerConfig(entropy_bound=bound),
                                                canvas_length=C, vocab_size=V, max_denoising_steps=1)
    t = torch.from_numpy(logits)
    sampler.accept_canvas(torch.zeros(B, C, dtype=torch.long), torch.ones(B, C, dtype=torch.long), t, 1)
    torch_entropy = torch.distributions.Categorical(logits=t).entropy().numpy()
    np.testing.assert_array_equal(entropy_bound_accept(torch_entropy, bound), sampler.accepted_token_mask.numpy())


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), bound=st.sampled_from([0.1, 1.0, 5.0]))
def test_acceptance_matches_transformers_on_256_positions_without_ties(seed, bound):
    rng = np.random.default_rng(seed)
    H = (rng.random((2, 256)) ** 3 * 0.2).astype(np.float32)  # many small entropies, distinct values
    sorted_H, order = torch.sort(torch.from_numpy(H), dim=-1)
    mask_sorted = (torch.cumsum(sorted_H, -1) - sorted_H) <= bound
    torch_mask = torch.zeros_like(mask_sorted).scatter(-1, order, mask_sorted).numpy()
    np.testing.assert_array_equal(entropy_bound_accept(H, bound), torch_mask)


def test_acceptance_sums_in_float64_like_torch_cpu_cumsum():
    """A float32 running sum drifts; the rule uses torch CPU's double accumulation (rounded per item)."""
    rng = np.random.default_rng(3)
    mismatched_by_float32_sum = 0
    for _ in range(200):
        H = (rng.random((1, 256)) ** 3 * 0.004).astype(np.float32)
        bound = float(np.float32(np.sort(H)[0, :200].astype(np.float64).sum()))  # a bound near the boundary
        sorted_H, order = torch.sort(torch.from_numpy(H), dim=-1)
        mask_sorted = (torch.cumsum(sorted_H, -1) - sorted_H) <= bound
        torch_mask = torch.zeros_like(mask_sorted).scatter(-1, order, mask_sorted).numpy()
        np.testing.assert_array_equal(entropy_bound_accept(H, bound), torch_mask)
        f32 = np.cumsum(np.sort(H), dtype=np.float32) - np.sort(H) <= np.float32(bound)
        mismatched_by_float32_sum += int(f32.sum() != torch_mask.sum())
    assert mismatched_by_float32_sum > 0  # the distinction is real on these inputs


def test_acceptance_ties_are_broken_by_position():
    H = np.array([[0.06, 0.06, 0.06, 0.0]], np.float32)  # sums before: 0, 0, .06, .12 -> 3 accepted
    np.testing.assert_array_equal(entropy_bound_accept(H, 0.1), [[True, True, False, True]])


def test_renoise_takes_draws_where_accepted_and_noise_elsewhere():
    sampled = np.array([[1, 2, 3]])
    noise = np.array([[7, 8, 9]])
    out = renoise(sampled, np.array([[True, False, True]]), noise)
    np.testing.assert_array_equal(out, [[1, 8, 3]])
    assert out.dtype == np.int64


def test_freeze_rows_keeps_old_values_of_finished_rows_only():
    new, old = np.arange(12.0).reshape(2, 2, 3), -np.ones((2, 2, 3))
    out = freeze_rows(np.array([True, False]), new, old)
    np.testing.assert_array_equal(out[0], old[0])
    np.testing.assert_array_equal(out[1], new[1])


# ------------------------------------------------------------------------------------------------ stopping
@SETTINGS
@given(s=st.integers(0, 4), steps=st.integers(1, 8), data=st.data())
def test_stopping_rule_matches_transformers(s, steps, data):
    B, C, V = 3, 5, 4
    gamma = data.draw(st.sampled_from([0.3, 0.8, 1.5, 10.0]))
    ours = StableAndConfident(s, gamma)
    theirs = hf_generation.StableAndConfidentStoppingCriteria(stability_threshold=s, confidence_threshold=gamma)
    for _ in range(steps):
        draft = data.draw(hnp.arrays(np.int64, (B, C), elements=st.integers(0, 1)))  # repeats are likely
        logits = data.draw(hnp.arrays(np.float32, (B, C, V), elements=st.floats(-8, 8, width=32)))
        H = torch.distributions.Categorical(logits=torch.from_numpy(logits)).entropy().numpy()
        np.testing.assert_array_equal(ours(draft, H), theirs(torch.from_numpy(draft), torch.from_numpy(logits)).numpy())


@pytest.mark.parametrize("s", [1, 2, 3])
def test_stability_needs_s_plus_one_equal_drafts(s):
    rule = StableAndConfident(s, 10.0)
    H = np.zeros((1, 4), np.float32)
    drafts = [0] * (s + 2) + [1] * (s + 1)  # a change restarts the count
    results = [bool(rule(np.full((1, 4), d, np.int64), H)[0]) for d in drafts]
    assert results == [False] * s + [True, True] + [False] * s + [True]
    rule.reset()  # a new canvas forgets the history
    assert not rule(np.full((1, 4), 1, np.int64), H)[0]


def test_stability_zero_is_always_stable_and_confidence_is_strict():
    H = np.full((2, 4), 0.25, np.float32)
    assert not StableAndConfident(0, 0.25)(np.zeros((2, 4), np.int64), H).any()  # mean == threshold: not <
    assert StableAndConfident(0, 0.2500001)(np.zeros((2, 4), np.int64), H).all()


# ------------------------------------------------------------------------------------------------ committing
def hf_finalize(canvas, finished_before, eos, pad, forced=None):
    """transformers' _finalize_canvas on a (B, P + C) tensor whose last C columns are ``canvas``."""
    from transformers.generation import EosTokenCriteria, StoppingCriteriaList

    B, C = canvas.shape
    criteria = StoppingCriteriaList()
    if forced is not None:
        criteria.append(lambda ids, scores, **kw: torch.from_numpy(forced.copy()))
    if eos:
        criteria.append(EosTokenCriteria(list(eos)))
    config = hf_generation.DiffusionGemmaGenerationConfig(eos_token_id=list(eos) or None, pad_token_id=pad)
    ids = torch.cat([torch.full((B, 2), 5), torch.from_numpy(canvas.copy())], dim=1)
    out, finished = hf_generation.DiffusionGemmaGenerationMixin._finalize_canvas(
        ids, torch.from_numpy(finished_before.copy()), config, criteria, C,
        torch.tensor(list(eos)) if eos else None)
    return out[:, -C:].numpy(), finished.numpy()


@SETTINGS
@given(canvas=hnp.arrays(np.int64, st.tuples(st.integers(1, 4), st.integers(1, 10)), elements=st.integers(0, 6)),
       data=st.data())
def test_finalize_canvas_matches_transformers(canvas, data):
    B = canvas.shape[0]
    finished_before = data.draw(hnp.arrays(bool, (B,)))
    eos = tuple(data.draw(st.lists(st.integers(1, 6), max_size=3, unique=True)))
    pad = data.draw(st.sampled_from([None, 0]))
    forced = data.draw(st.one_of(st.none(), hnp.arrays(bool, (B,))))
    tokens, finished = finalize_canvas(canvas, finished_before, eos, pad, forced)
    hf_tokens, hf_finished = hf_finalize(canvas, finished_before, eos, pad, forced)
    np.testing.assert_array_equal(tokens, hf_tokens)
    np.testing.assert_array_equal(finished, hf_finished)


def test_finalize_canvas_keeps_the_first_eos_and_pads_the_rest():
    canvas = np.array([[5, 1, 6, 1, 7], [5, 6, 7, 8, 9], [9, 9, 9, 9, 9]])
    tokens, finished = finalize_canvas(canvas, np.array([False, False, True]), (1,), 0)
    np.testing.assert_array_equal(tokens, [[5, 1, 0, 0, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(finished, [True, False, True])
    untouched, finished = finalize_canvas(canvas, np.array([False, False, True]), (1,), None)
    np.testing.assert_array_equal(untouched, canvas)  # no pad id: nothing is rewritten
    np.testing.assert_array_equal(finished, [True, False, True])


def test_tokens_per_forward_excludes_pad_ids_and_divides_in_float32():
    new = np.array([[4, 0, 5, 0], [1, 2, 3, 4]])
    passes = np.array([3, 7])
    np.testing.assert_array_equal(tokens_per_forward(new, passes, 0), np.float32([2, 4]) / np.float32([3, 7]))
    np.testing.assert_array_equal(tokens_per_forward(new, np.array([2, 2]), None), [2.0, 2.0])
    sequences = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.from_numpy(new)], 1)
    hf = hf_generation.DiffusionGemmaGenerationMixin._compute_tokens_per_forward(
        sequences, torch.from_numpy(passes).int(), 3, 0)
    np.testing.assert_array_equal(tokens_per_forward(new, passes, 0), hf.numpy())
