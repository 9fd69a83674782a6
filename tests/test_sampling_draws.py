"""Draw sources (reference/draws.py): the documented generator calls, replay checks, record -> replay."""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.reference.draws import DrawSource, SeededDraws
from diffusiongemma.reference.support.replay import RecordingDraws, ReplayDraws, ReplayError
from diffusiongemma.reference.support.checks import as_draw_source
from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.sampling import categorical_from_uniform, softmax_and_entropy


def probs_for(B, C, V, seed=0):
    z = np.random.default_rng(seed).standard_normal((B, C, V)).astype(np.float32) * 3
    return softmax_and_entropy(z)[0]


def test_seeded_draws_make_exactly_the_documented_generator_calls():
    B, C, V = 2, 5, 300
    probs = probs_for(B, C, V)
    source = SeededDraws(1234)
    got = [source.canvas_ids(B, C, V), source.categorical(probs), source.renoise_ids(B, C, V),
           source.categorical(probs), source.renoise_ids(B, C, V)]
    g = np.random.Generator(np.random.Philox(1234))
    expected = [g.integers(0, V, size=(B, C), dtype=np.int64),
                categorical_from_uniform(probs, g.random(size=(B, C), dtype=np.float64)),
                g.integers(0, V, size=(B, C), dtype=np.int64),
                categorical_from_uniform(probs, g.random(size=(B, C), dtype=np.float64)),
                g.integers(0, V, size=(B, C), dtype=np.int64)]
    for ours, theirs in zip(got, expected):
        assert ours.dtype == np.int64 and ours.shape == (B, C)
        np.testing.assert_array_equal(ours, theirs)


def test_seeded_draws_are_reproducible_and_seed_dependent():
    a, b, c = SeededDraws(7), SeededDraws(7), SeededDraws(8)
    np.testing.assert_array_equal(a.canvas_ids(3, 16, 1000), b.canvas_ids(3, 16, 1000))
    assert not np.array_equal(b.renoise_ids(3, 16, 1000), c.renoise_ids(3, 16, 1000))
    ids = a.canvas_ids(4, 256, 262_144)
    assert ids.min() >= 0 and ids.max() < 262_144


def test_as_draw_source_defaults_to_seed_zero():
    np.testing.assert_array_equal(as_draw_source(None).canvas_ids(1, 8, 50), SeededDraws(0).canvas_ids(1, 8, 50))
    np.testing.assert_array_equal(as_draw_source(3).canvas_ids(1, 8, 50), SeededDraws(3).canvas_ids(1, 8, 50))
    source = ReplayDraws([])
    assert as_draw_source(source) is source
    for bad in ("seed", 1.5, True):
        with pytest.raises(InputError, match="random must be"):
            as_draw_source(bad)


def make_tape(B=1, C=3):
    return [("canvas", np.zeros((B, C), np.int64)), ("categorical", np.ones((B, C), np.int64)),
            ("renoise", np.full((B, C), 2, np.int64))]


def test_replay_returns_the_tape_in_order():
    replay = ReplayDraws(make_tape())
    probs = np.full((1, 3, 4), 0.25, np.float32)
    np.testing.assert_array_equal(replay.canvas_ids(1, 3, 4), [[0, 0, 0]])
    np.testing.assert_array_equal(replay.categorical(probs), [[1, 1, 1]])
    np.testing.assert_array_equal(replay.renoise_ids(1, 3, 4), [[2, 2, 2]])
    assert replay.remaining == 0
    replay.check_exhausted()
    with pytest.raises(ReplayError, match="ran out.*canvas draw"):
        replay.canvas_ids(1, 3, 4)


def test_replay_refuses_draws_that_do_not_fit():
    probs = np.full((1, 3, 4), 0.25, np.float32)
    with pytest.raises(ReplayError, match="renoise draw was requested but tape entry 0 is a canvas"):
        ReplayDraws(make_tape()).renoise_ids(1, 3, 4)
    with pytest.raises(ReplayError, match=r"shape \(1, 3\), the run needs \(2, 3\)"):
        ReplayDraws(make_tape()).canvas_ids(2, 3, 4)
    with pytest.raises(ReplayError, match=r"outside \[0, 2\)"):
        replay = ReplayDraws(make_tape())
        replay.canvas_ids(1, 3, 4), replay.categorical(probs)
        replay.renoise_ids(1, 3, 2)
    with pytest.raises(ReplayError, match="1 recorded draws were never used"):
        replay = ReplayDraws(make_tape())
        replay.canvas_ids(1, 3, 4), replay.categorical(probs)
        replay.check_exhausted()


def test_replay_refuses_a_categorical_outcome_of_zero_probability():
    replay = ReplayDraws(make_tape())
    replay.canvas_ids(1, 3, 4)
    probs = np.full((1, 3, 4), 0.25, np.float32)
    probs[0, 2, 1] = 0.0  # the recorded id 1 is impossible at position 2
    with pytest.raises(ReplayError, match=r"id 1 at \(row, position\) \(0, 2\)"):
        replay.categorical(probs)


@pytest.mark.parametrize("tape, match", [
    ([("noise", np.zeros((1, 2), np.int64))], "kind 'noise'"),
    ([("canvas", np.zeros((1, 2), np.float32))], "not integer ids"),
    ([("canvas",)], "not a \\(kind, ids\\) pair"),
])
def test_replay_refuses_malformed_tapes(tape, match):
    with pytest.raises(ReplayError, match=match):
        ReplayDraws(tape)


def test_replay_error_is_an_input_error():
    assert issubclass(ReplayError, InputError) and issubclass(ReplayError, ValueError)


def test_recording_then_replaying_reproduces_every_draw():
    B, C, V = 2, 4, 9
    probs = probs_for(B, C, V, seed=3)
    recorder = RecordingDraws(SeededDraws(5))
    first = [recorder.canvas_ids(B, C, V), recorder.categorical(probs), recorder.renoise_ids(B, C, V)]
    replay = ReplayDraws(recorder.tape)
    second = [replay.canvas_ids(B, C, V), replay.categorical(probs), replay.renoise_ids(B, C, V)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert [kind for kind, _ in recorder.tape] == ["canvas", "categorical", "renoise"]


def test_the_interface_methods_are_abstract():
    with pytest.raises(NotImplementedError):
        DrawSource().canvas_ids(1, 1, 1)
