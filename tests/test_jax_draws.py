"""``JaxDraws`` and the ``jax.random`` functions under it (reference/variants/jax_draws.py).

Two sources of truth: the values ``examples/record_jax_golden.py`` stored from jax itself
(tests/golden/jax/draws.json, temperature.json), checked everywhere; and, where jax is importable, jax
itself on inputs hypothesis picks (jax is not part of the test extra: ``pip install -e ".[jax]"``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiongemma.reference import InputError
from diffusiongemma.reference.variants import jax_draws as J

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "jax")
_spec = importlib.util.spec_from_file_location("record_jax_golden", os.path.join(ROOT, "examples", "record_jax_golden.py"))
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)  # numpy and the standard library only at import time

try:
    import jax
except ImportError:  # pragma: no cover - depends on the environment
    jax = None
needs_jax = pytest.mark.skipif(jax is None, reason='jax is not installed: pip install -e ".[jax]"')


def stored(name: str) -> dict:
    with open(os.path.join(GOLDEN, name), encoding="utf-8") as f:
        return json.load(f)


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------------------------ stored values
def test_keys_splits_and_bits_match_the_stored_jax_values():
    data = stored("draws.json")
    for seed, words in data["keys"].items():
        assert J.prng_key(int(seed)).tolist() == words
    split = data["split"]
    assert J.split(J.prng_key(split["seed"]), split["num"]).tolist() == split["keys"]
    b = data["bits"]
    assert J.random_bits(J.prng_key(b["seed"]), b["shape"]).ravel().tolist() == b["values"]


def test_randint_and_uniform_match_the_stored_jax_values():
    data = stored("draws.json")
    for case in data["randint"]:
        got = J.randint(J.prng_key(case["seed"]), case["shape"], case["minval"], case["maxval"])
        assert got.shape == tuple(case["shape"]) and got.ravel().tolist() == case["values"], case
    for case in data["uniform"]:
        got = J.uniform(J.prng_key(case["seed"]), case["shape"], case["minval"], case["maxval"])
        assert got.dtype == np.float32 and bits(got).ravel().tolist() == case["bits"], case


def test_gumbel_matches_jax_bit_for_bit_on_65536_values():
    g = stored("draws.json")["gumbel"]
    values = J.gumbel(J.prng_key(g["seed"]), (g["count"],))
    assert bits(values[:16]).tolist() == g["first"]
    assert hashlib.sha256(values.astype("<f4").tobytes()).hexdigest() == g["sha256"]


def test_categorical_matches_the_stored_jax_draws_with_ties_and_minus_inf():
    c = stored("draws.json")["categorical"]
    logits = record.categorical_logits(tuple(c["shape"]))
    got = J.categorical(J.prng_key(c["seed"]), logits)
    assert got.shape == tuple(c["shape"][:-1]) and got.ravel().tolist() == c["values"]
    assert not (got == 7).any()  # the -inf category is never drawn


def test_categorical_in_small_chunks_equals_one_whole_draw(monkeypatch):
    c = stored("draws.json")["categorical"]
    logits = record.categorical_logits(tuple(c["shape"]))
    monkeypatch.setattr(J, "_CHUNK", 700)  # two rows of 300 per chunk, a last chunk of one
    assert J.categorical(J.prng_key(c["seed"]), logits).ravel().tolist() == c["values"]


def test_the_sampler_key_tree_replays_the_stored_stream():
    """JaxDraws answers the reference's requests in the order generate makes them with the draws the JAX
    sampler's key tree gives (canvas, then per step categorical and renoise)."""
    s = stored("draws.json")["stream"]
    B, C, V = s["batch_size"], s["canvas_length"], s["vocab_size"]
    draws = J.JaxDraws(s["seed"])
    for entry in s["draws"]:
        if entry["kind"] == "canvas":
            got = draws.canvas_ids(B, C, V)
        elif entry["kind"] == "categorical":
            logits = record.stream_logits(entry["step"], B, C, V)
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            got = draws.categorical(probs / probs.sum(-1, keepdims=True), logits=logits)
        else:
            got = draws.renoise_ids(B, C, V)
        assert got.dtype == np.int64 and got.tolist() == entry["ids"], entry["kind"]


def test_the_draw_order_is_enforced():
    draws = J.JaxDraws(0)
    probs = np.full((1, 2, 3), 1 / 3, dtype=np.float32)
    with pytest.raises(InputError, match="before any canvas"):
        draws.categorical(probs)
    with pytest.raises(InputError, match="before this step's categorical"):
        draws.renoise_ids(1, 2, 3)
    draws.canvas_ids(1, 2, 3)
    draws.categorical(probs)
    with pytest.raises(InputError, match="renoise draw was skipped"):
        draws.categorical(probs)
    with pytest.raises(InputError, match="32 signed bits"):
        J.JaxDraws(2**31)
    with pytest.raises(InputError, match="two uint32 words"):
        J.JaxDraws(key=[1, 2, 3])


def test_without_logits_the_draw_uses_log_probs_and_stays_a_valid_draw():
    draws = J.JaxDraws(4)
    draws.canvas_ids(1, 3, 4)
    probs = np.array([[[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]], np.float32)
    ids = draws.categorical(probs)
    assert ids[0, 0] == 1 and ids[0, 1] in (0, 1)


def test_jax_temperature_gives_the_shapers_factor_for_all_2016_step_pairs():
    t = stored("temperature.json")
    pairs = 0
    for N, expected in t["bits"].items():
        got = [int(bits(J.jax_temperature(i, int(N), t["t_min"], t["t_max"])[1])) for i in range(int(N))]
        assert got == expected, N
        pairs += len(got)
    assert pairs == 2016


def test_jax_scaling_differs_from_a_division_by_transformers_temperature():
    """Why the variant needs its own temperature stage: z * factor is not z / T_transformers."""
    from diffusiongemma.reference.sampling import temperature

    z = (np.random.default_rng(2).standard_normal(4096) * 8).astype(np.float32)
    differ = 0
    for N in range(1, 64):
        for i in range(N):
            T, factor = J.jax_temperature(i, N, 0.4, 0.8)
            differ += not np.array_equal(bits(z * factor), bits(z / temperature(N - i, N, 0.4, 0.8)))
    assert differ > 1000  # almost every pair: a reciprocal then a product rounds twice
    with pytest.raises(InputError, match="step index"):
        J.jax_temperature(4, 4, 0.4, 0.8)


# ------------------------------------------------------------------------------------------ arithmetic
def _round_to_float32(x: Fraction) -> np.float32:
    """Exact round-to-nearest-even of a rational to float32 (normal range)."""
    guess = np.float32(float(x))
    candidates = {guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))}
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - x), int(bits(c)) & 1))
    return np.float32(best)


floats32 = st.floats(width=32, min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(a=floats32, b=floats32, c=floats32)
def test_fused_multiply_add_rounds_once(a, b, c):
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    got = J._fma(np.float32(a), np.float32(b), np.float32(c))[()]
    assert bits(got) == bits(_round_to_float32(exact)) or exact == 0


def test_fused_multiply_add_at_a_double_rounding_trap():
    # a*b + c = c + 2^6 - 2^-40: just below the midpoint between c (odd) and c + 2^7. Rounding to float64
    # first lands on the midpoint, and ties-to-even would then go up; one rounding goes down, to c.
    a, b = np.float32(8 * (1 + 2**-23)), np.float32(8 * (1 - 2**-23))
    c = np.float32(2**30 + 2**7)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert bits(naive) != bits(c)
    assert bits(J._fma(a, b, c)) == bits(c) == bits(_round_to_float32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))))


# ------------------------------------------------------------------------------------------ live jax
@needs_jax
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(-2**31, 2**31 - 1), num=st.integers(1, 6),
       shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
       span=st.tuples(st.integers(-1000, 1000), st.integers(0, 300000)))
def test_keys_splits_bits_and_randint_agree_with_jax(seed, num, shape, span):
    key = jax.random.key(seed)
    ours = J.prng_key(seed)
    assert np.array_equal(np.asarray(jax.random.key_data(key)), ours)
    assert np.array_equal(np.asarray(jax.random.key_data(jax.random.split(key, num))), J.split(ours, num))
    assert np.array_equal(np.asarray(jax.random.bits(key, tuple(shape))), J.random_bits(ours, shape))
    lo, hi = span[0], span[0] + span[1]
    assert np.array_equal(np.asarray(jax.random.randint(key, tuple(shape), lo, hi)), J.randint(ours, shape, lo, hi))


@needs_jax
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lo=st.floats(-10, 10, width=32), width=st.floats(0.0009765625, 100, width=32))
def test_uniform_and_gumbel_agree_with_jax_bit_for_bit(seed, lo, width):
    key, ours = jax.random.key(seed), J.prng_key(seed)
    hi = float(np.float32(lo) + np.float32(width))
    if not hi > lo:
        return
    assert np.array_equal(bits(jax.random.uniform(key, (512,), minval=lo, maxval=hi)), bits(J.uniform(ours, (512,), lo, hi)))
    assert np.array_equal(bits(jax.random.gumbel(key, (4096,))), bits(J.gumbel(ours, (4096,))))


@needs_jax
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), V=st.integers(1, 400), scale=st.floats(0.01, 30))
def test_categorical_agrees_with_jax(seed, rows, V, scale):
    logits = (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)
    key = jax.random.key(seed)
    assert np.array_equal(np.asarray(jax.random.categorical(key, logits)), J.categorical(J.prng_key(seed), logits))


@needs_jax
def test_xla_log_is_reproduced_on_every_float32_exponent():
    import jax.numpy as jnp

    x = np.random.default_rng(0).integers(0x00800000, 0x7F800000, size=1 << 18, dtype=np.uint32).view(np.float32)
    assert np.array_equal(bits(jax.jit(jnp.log)(x)), bits(J._log(x)))
