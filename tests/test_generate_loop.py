"""The generation loop (reference/generate.py) on scripted logits: properties that must hold for any model.

A ``ScriptedModel`` stands in for the network: its ``denoise`` returns whatever logits a test scripts, and
its ``encode`` only records what it was given. Together with recorded or replayed draws this isolates the
loop: lengths, ordering of draws, self-conditioning, stopping, freezing, EOS handling, errors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiongemma.reference.support.replay import RecordingDraws, ReplayDraws
from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.support.errors import ConfigError, InputError, SamplingError
from diffusiongemma.reference.generate import GenerationCallback, GenerationConfig, generate
from diffusiongemma.reference.sampling import temperature

SETTINGS = settings(max_examples=25, deadline=None)
V, C = 32, 6


class StubCache:
    def __init__(self, length=0):
        self.length = length


class ScriptedModel:
    """``denoise`` calls ``script(call_index, canvas, sc_logits)``; ``encode`` records its inputs."""

    def __init__(self, script, vocab_size=V, canvas_length=C):
        self.config = SimpleNamespace(vocab_size=vocab_size, canvas_length=canvas_length)
        self.script = script
        self.calls = []  # (canvas, sc_logits) per denoise call
        self.encoded = []  # (ids, mask) per encode call

    def new_cache(self, batch_size):
        return StubCache()

    def encode(self, ids, cache, mask=None):
        self.encoded.append((np.array(ids), None if mask is None else np.array(mask)))
        cache.length += ids.shape[1]

    def denoise(self, canvas, cache, sc_logits=None):
        self.calls.append((np.array(canvas), None if sc_logits is None else np.array(sc_logits)))
        return self.script(len(self.calls) - 1, canvas, sc_logits)


def random_logits(seed, scale=4.0):
    """A script returning fresh random logits (B, C, V) at every call, favouring the canvas's own tokens."""
    def script(i, canvas, sc):
        rng = np.random.default_rng([seed, i])
        z = (rng.standard_normal((canvas.shape[0], C, V)) * scale).astype(np.float32)
        np.put_along_axis(z, np.asarray(canvas)[..., None], np.float32(scale), axis=-1)
        return z
    return script


def constant_logits(seed, scale=12.0):
    """The same peaked logits at every call (per row and position)."""
    def script(i, canvas, sc):
        rng = np.random.default_rng(seed)
        return (rng.standard_normal((canvas.shape[0], C, V)) * scale).astype(np.float32)
    return script


class Log(GenerationCallback):
    def __init__(self):
        self.prompt, self.steps, self.canvases, self.result = None, [], [], None

    def on_prompt(self, ids):
        self.prompt = ids

    def on_step(self, info):
        self.steps.append(info)

    def on_canvas(self, info):
        self.canvases.append(info)

    def on_end(self, result):
        self.result = result


def run(script=None, B=2, P=4, seed=0, **kw):
    model = ScriptedModel(script or random_logits(seed))
    ids = np.random.default_rng(seed).integers(3, V, size=(B, P))
    log = Log()
    result = generate(model, ids, callback=log, **kw)
    return model, result, log


# ------------------------------------------------------------------------------------------------ lengths
@pytest.mark.parametrize("max_new_tokens", [1, C - 1, C, C + 1, 2 * C + 3])
def test_whole_canvases_are_generated_and_never_truncated(max_new_tokens):
    model, result, _ = run(max_new_tokens=max_new_tokens, max_denoising_steps=3)
    canvases = math.ceil(max_new_tokens / C)
    assert result.sequences.shape == (2, 4 + canvases * C) and result.sequences.dtype == np.int64
    assert result.steps_per_canvas == [3] * canvases
    assert len(model.encoded) == canvases  # the prompt, then every committed canvas but the last


def test_max_length_takes_over_only_while_max_new_tokens_is_the_default():
    assert run(max_length=4 + 2 * C + 1, max_denoising_steps=2)[1].sequences.shape[1] == 4 + 3 * C
    # max_new_tokens set: it decides the number of canvases, but reaching max_length stops the run
    _, result, log = run(max_new_tokens=3 * C, max_length=4 + C + 1, max_denoising_steps=2)
    assert result.sequences.shape[1] == 4 + 2 * C
    assert log.canvases[-1].finished.all()


def test_cached_tokens_count_toward_max_length():
    model = ScriptedModel(random_logits(0))
    ids = np.full((1, 3), 5)
    result = generate(model, ids, cache=StubCache(length=10), max_length=10 + 3 + C, max_denoising_steps=2)
    assert result.sequences.shape == (1, 3 + C)
    with pytest.raises(InputError, match="max_length 13 leaves no room"):
        generate(model, ids, cache=StubCache(length=10), max_length=13)
    with pytest.raises(InputError, match="max_length 13 leaves no room"):  # also with a token budget set
        generate(model, ids, cache=StubCache(length=10), max_length=13, max_new_tokens=32)


# ------------------------------------------------------------------------------------------------ draws and inputs
def test_draw_order_is_canvas_then_categorical_and_renoise_per_step():
    recorder = RecordingDraws(SeededDraws(1))
    _, result, _ = run(max_new_tokens=C + 1, max_denoising_steps=3, confidence_threshold=None, random=recorder)
    kinds = [kind for kind, _ in recorder.tape]
    assert kinds == (["canvas"] + ["categorical", "renoise"] * 3) * 2


def test_a_starting_canvas_is_used_once_and_the_random_canvas_is_still_drawn():
    start = np.arange(2 * C).reshape(2, C) % V
    sc = np.random.default_rng(0).standard_normal((2, C, V)).astype(np.float32)
    recorder = RecordingDraws(SeededDraws(2))
    model, _, _ = run(max_new_tokens=C + 1, max_denoising_steps=2, decoder_input_ids=start,
                      self_conditioning_logits=sc, random=recorder)
    first_canvas, first_sc = model.calls[0]
    np.testing.assert_array_equal(first_canvas, start)
    np.testing.assert_array_equal(first_sc, sc)
    canvas_draws = [ids for kind, ids in recorder.tape if kind == "canvas"]
    assert len(canvas_draws) == 2  # drawn for the first canvas too, and discarded
    second_canvas, second_sc = model.calls[2]
    np.testing.assert_array_equal(second_canvas, canvas_draws[1])
    assert second_sc is None


@SETTINGS
@given(B=st.integers(1, 3), N=st.integers(1, 5), new=st.integers(1, 3 * C), seed=st.integers(0, 1000))
def test_self_conditioning_is_absent_at_each_canvas_start_and_is_the_previous_processed_logits(B, N, new, seed):
    model, result, log = run(B=B, max_new_tokens=new, max_denoising_steps=N, confidence_threshold=None, seed=seed)
    call = 0
    for k, steps in enumerate(result.steps_per_canvas):
        for step_index in range(steps):
            canvas, sc = model.calls[call]
            if step_index == 0:
                assert sc is None
            else:
                raw = model.script(call - 1, model.calls[call - 1][0], None)  # the previous call's logits
                expected = raw / temperature(N - step_index + 1, N, 0.4, 0.8)
                np.testing.assert_array_equal(sc, expected)
            call += 1
    assert call == len(model.calls)


@SETTINGS
@given(B=st.integers(1, 3), N=st.integers(2, 6), seed=st.integers(0, 1000))
def test_each_next_canvas_is_the_accepted_draws_with_fresh_noise_elsewhere(B, N, seed):
    recorder = RecordingDraws(SeededDraws(seed))
    model, _, log = run(B=B, max_new_tokens=C, max_denoising_steps=N, confidence_threshold=None, seed=seed,
                        random=recorder)
    categorical = [ids for kind, ids in recorder.tape if kind == "categorical"]
    noise = [ids for kind, ids in recorder.tape if kind == "renoise"]
    for i, info in enumerate(log.steps):
        assert info.accepted.any(axis=1).all()
        np.testing.assert_array_equal(info.sampled, categorical[i])
        np.testing.assert_array_equal(info.canvas, np.where(info.accepted, categorical[i], noise[i]))
        if i + 1 < len(model.calls):
            np.testing.assert_array_equal(model.calls[i + 1][0], info.canvas)


def test_a_position_accepted_at_one_step_can_change_at_the_next():
    def script(i, canvas, sc):
        z = np.zeros((1, C, V), np.float32)  # uniform: entropy log(32)
        if i == 0:
            z[0, 0, 5] = 50.0  # position 0 certain: accepted
        else:
            z[0, 1, 5] = 50.0  # position 1 certain, positions 2.. entropy ~0.15, position 0 uniform:
            z[0, 2:] = -50.0  # the sum before position 3 exceeds 0.1, so position 0 is rejected
            z[0, 2:, 5], z[0, 2:, 6] = 0.0, -2.0
        return z

    tape = [("canvas", np.zeros((1, C), np.int64)),
            ("categorical", np.full((1, C), 5)), ("renoise", np.full((1, C), 9)),
            ("categorical", np.full((1, C), 5)), ("renoise", np.full((1, C), 11))]
    _, result, log = run(script, B=1, max_new_tokens=1, max_denoising_steps=2, confidence_threshold=None,
                         random=ReplayDraws(tape))
    first, second = log.steps
    assert first.accepted[0, 0] and first.canvas[0, 0] == 5
    np.testing.assert_array_equal(second.accepted[0], [False, True, True, False, False, False])
    assert second.canvas[0, 0] == 11  # renoised, not kept


# ------------------------------------------------------------------------------------------------ stopping
@SETTINGS
@given(k=st.integers(0, 4), B=st.integers(1, 3), seed=st.integers(0, 1000), canvases=st.integers(1, 2))
def test_constant_logits_commit_at_step_k_plus_one(k, B, seed, canvases):
    """Stability threshold k: the draft must repeat over k + 1 steps, so never at step 1 when k >= 1."""
    _, result, log = run(constant_logits(seed), B=B, max_new_tokens=canvases * C, max_denoising_steps=10,
                         stability_threshold=k, confidence_threshold=10.0, seed=seed)  # always confident (V=32)
    assert result.steps_per_canvas == [k + 1] * canvases
    np.testing.assert_array_equal(result.forward_passes, (k + 1) * canvases)


def test_finished_rows_are_frozen_while_the_others_continue():
    def script(i, canvas, sc):
        z = (np.random.default_rng(i).standard_normal((2, C, V)) * 4).astype(np.float32)
        z[0] = np.random.default_rng(99).standard_normal((C, V)) * 30  # row 0: constant, confident
        return z

    model, result, log = run(script, B=2, max_new_tokens=C, max_denoising_steps=6, stability_threshold=1,
                             confidence_threshold=0.5)
    stop = next(i for i, info in enumerate(log.steps) if info.finished[0])
    assert stop == 1 and not log.steps[-1].finished[1]  # row 0 stops after 2 steps, row 1 never
    for later in range(stop + 1, len(log.steps)):
        np.testing.assert_array_equal(log.steps[later].draft[0], log.steps[stop].draft[0])
        np.testing.assert_array_equal(log.steps[later].canvas[0], log.steps[stop].canvas[0])
        assert not log.steps[later].accepted[0].any()
        canvas, sc = model.calls[later + 1] if later + 1 < len(model.calls) else (None, None)
        if canvas is not None:  # the decoder still sees row 0, with frozen inputs
            np.testing.assert_array_equal(canvas[0], model.calls[stop + 1][0][0])
            np.testing.assert_array_equal(sc[0], model.calls[stop + 1][1][0])
    np.testing.assert_array_equal(result.forward_passes, [stop + 1, 6])


def test_without_adaptive_stopping_every_step_runs():
    _, result, _ = run(constant_logits(0), max_new_tokens=C, max_denoising_steps=7, stability_threshold=0,
                       confidence_threshold=None)
    assert result.steps_per_canvas == [7]


# ------------------------------------------------------------------------------------------------ EOS and pad
def test_committed_canvas_is_the_draft_rewritten_after_eos_and_is_what_gets_encoded():
    def script(i, canvas, sc):
        z = np.zeros((2, C, V), np.float32)
        z[:, :, 9] = 40.0  # draft 9 everywhere ...
        z[0, 2, 9], z[0, 2, 1] = 0.0, 40.0  # ... except an EOS (1) at row 0, position 2
        z[0, 4, 9], z[0, 4, 1] = 0.0, 40.0  # and a second EOS later in the same canvas
        return z

    model, result, log = run(script, B=2, P=3, max_new_tokens=2 * C, max_denoising_steps=3, eos_token_id=[1],
                             pad_token_id=0, attention_mask=np.ones((2, 3), np.int64))
    new = result.sequences[:, 3:]
    np.testing.assert_array_equal(new[0, :C], [9, 9, 1, 0, 0, 0])
    np.testing.assert_array_equal(new[0, C:], [0] * C)  # ended earlier: all pad
    np.testing.assert_array_equal(new[1], [9] * 2 * C)  # no EOS: untouched
    encoded_canvas, mask = model.encoded[1]
    np.testing.assert_array_equal(encoded_canvas, new[:, :C])  # the rewritten canvas is encoded next
    np.testing.assert_array_equal(mask, np.ones((2, C)))  # with the mask extended by ones
    assert len(model.encoded) == 2  # the last canvas is never encoded
    valid = (new != 0).sum(axis=1)
    np.testing.assert_array_equal(result.tokens_per_forward, valid.astype(np.float32) / result.forward_passes)


def test_all_rows_ended_stops_the_run():
    def script(i, canvas, sc):
        z = np.zeros((2, C, V), np.float32)
        z[:, :, 1] = 40.0  # EOS everywhere
        return z

    _, result, _ = run(script, B=2, max_new_tokens=3 * C, max_denoising_steps=2, eos_token_id=1, pad_token_id=0)
    assert result.sequences.shape[1] == 4 + C
    np.testing.assert_array_equal(result.sequences[:, 4:], [[1] + [0] * (C - 1)] * 2)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("where", [(0, 0, 3), (1, 5, 0)])
def test_nan_logits_raise_instead_of_becoming_tokens(where):
    def script(i, canvas, sc):
        z = np.zeros((2, C, V), np.float32)
        if i == 1:
            z[where] = np.nan
        return z

    with pytest.raises(SamplingError, match=rf"\({where[0]}, {where[1]}\).*NaN"):
        run(script, max_new_tokens=C, max_denoising_steps=4, confidence_threshold=None, pad_token_id=0)


def test_temperature_overflow_is_refused():
    def script(i, canvas, sc):
        return np.full((2, C, V), 3e38, np.float32)

    with pytest.raises(SamplingError, match="temperature"):
        run(script, max_new_tokens=1, max_denoising_steps=2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_ids=np.array([[1, 2, V]])), InputError, f"token id {V}"),
    (dict(input_ids=np.array([1, 2])), InputError, "2-D"),
    (dict(input_ids=np.zeros((1, 0), np.int64)), InputError, "at least one"),
    (dict(attention_mask=np.ones((1, 2))), InputError, "attention_mask has shape"),
    (dict(attention_mask=np.full((1, 3), 2)), InputError, "only 0 and 1"),
    (dict(decoder_input_ids=np.zeros((1, C + 1), np.int64)), InputError, "decoder_input_ids"),
    (dict(self_conditioning_logits=np.zeros((1, C, V))), InputError, "float32"),
    (dict(eos_token_id=V), ConfigError, f"eos_token_id {V}"),
    (dict(pad_token_id=V + 5), ConfigError, "pad_token_id"),
    (dict(top_k=3), ConfigError, "top_k"),
    (dict(generation_config={"max_new_tokens": 3}), ConfigError, "GenerationConfig"),
])
def test_bad_inputs_raise_the_documented_errors(kwargs, error, match):
    model = ScriptedModel(random_logits(0))
    kwargs = dict(dict(input_ids=np.array([[1, 2, 3]])), **kwargs)
    with pytest.raises(error, match=match):
        generate(model, **kwargs)


@pytest.mark.parametrize("bad, match", [
    (lambda z: z.astype(np.float64), "float64 logits"),
    (lambda z: z[:, :-1], r"shape \(1, 5, 32\)"),
])
def test_a_denoiser_returning_the_wrong_array_is_refused(bad, match):
    model = ScriptedModel(random_logits(0))
    with pytest.raises(InputError, match=match):
        generate(model, np.array([[1, 2]]), denoiser=lambda c, cache, sc: bad(model.denoise(c, cache, sc)))


# ------------------------------------------------------------------------------------------------ observability
def test_callback_sees_every_step_and_canvas_with_read_only_arrays():
    model, result, log = run(max_new_tokens=C + 1, max_denoising_steps=4, confidence_threshold=None)
    assert log.prompt.shape == (2, 4) and log.result is result
    assert [(s.canvas_index, s.step, s.step_index) for s in log.steps] == \
        [(k, n, 4 - n) for k in range(2) for n in (4, 3, 2, 1)]
    assert [s.temperature for s in log.steps[:4]] == [float(temperature(n, 4, 0.4, 0.8)) for n in (4, 3, 2, 1)]
    assert log.steps[0].temperature == pytest.approx(0.8)
    for info in log.steps:
        assert info.entropies.shape == (2, C) and info.entropies.dtype == np.float32
        with pytest.raises(ValueError):
            info.draft[0, 0] = 1
    assert [c.steps for c in log.canvases] == result.steps_per_canvas
    np.testing.assert_array_equal(np.concatenate([c.tokens for c in log.canvases], axis=1), result.sequences[:, 4:])
    np.testing.assert_array_equal(log.canvases[0].tokens, log.steps[3].draft)  # the draft is committed


def test_default_randomness_is_seeded_and_reproducible_and_the_library_prints_nothing(capsys):
    a = run(max_new_tokens=C, max_denoising_steps=3)[1].sequences
    b = run(max_new_tokens=C, max_denoising_steps=3, random=0)[1].sequences
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == "", "generate printed without a callback asking"
    c = run(max_new_tokens=C, max_denoising_steps=3, random=1)[1].sequences
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_generation_config_precedence():
    model = ScriptedModel(random_logits(0))
    model.generation_config = GenerationConfig(max_denoising_steps=2, max_new_tokens=C)
    ids = np.array([[1, 2]])
    assert generate(model, ids).steps_per_canvas == [2]
    explicit = GenerationConfig(max_denoising_steps=3, max_new_tokens=C)
    assert generate(model, ids, generation_config=explicit).steps_per_canvas == [3]
    assert generate(model, ids, generation_config=explicit, max_denoising_steps=1).steps_per_canvas == [1]


def test_a_backend_that_runs_whole_canvases_goes_through_the_same_loop():
    """The optional ``run_canvas`` of a backend (a GPU's device loop): the loop uses its answer, or runs the
    spec's steps when it answers None; either way the run is the spec's."""
    from diffusiongemma.reference.generate import ReferenceBackend, denoise_canvas

    calls = []

    class WholeCanvas(ReferenceBackend):
        def run_canvas(self, k, canvas, draws, stopper, config, ended, forward_passes, callback, observer,
                       n_canvases, semantics):
            calls.append(k)
            if k == 0:
                return None  # the spec's loop, one step at a time
            return denoise_canvas(k, canvas, self, draws, stopper, config, ended, forward_passes, callback,
                                    observer, n_canvases, self.V, semantics)

    class Model(ScriptedModel):
        def denoising_backend(self, draws, batch_size, denoiser=None, observer=None, **options):
            return WholeCanvas(self.denoise, draws, V, batch_size, max_steps=4)

    kwargs = dict(max_new_tokens=3 * C, max_denoising_steps=4, stability_threshold=1, confidence_threshold=2.0)
    prompt = np.array([[3, 4, 5], [6, 7, 8]])
    draws_a, draws_b = SeededDraws(2), SeededDraws(2)
    got = generate(Model(random_logits(1)), prompt, random=draws_a, **kwargs)
    expected = generate(ScriptedModel(random_logits(1)), prompt, random=draws_b, **kwargs)
    assert calls == [0, 1, 2]
    np.testing.assert_array_equal(got.sequences, expected.sequences)
    np.testing.assert_array_equal(got.forward_passes, expected.forward_passes)
    assert got.steps_per_canvas == expected.steps_per_canvas
    np.testing.assert_array_equal(draws_a.categorical_uniforms(1, 3), draws_b.categorical_uniforms(1, 3))
