"""Exact parity of the reference generation loop with transformers' ``generate`` (SPEC §14, check 3).

The model forward pass is checked elsewhere (test_model_parity.py) to float32 noise; discrete decisions
are chaotic under that noise (trap T20), so the loop is checked by teacher forcing instead:

1. Run transformers' ``model.generate`` on a tiny randomised model with peaked logits
   (``final_norm_gain=25``, fp32, eager), recording
   * every random draw, in order: ``torch.randint`` (initial canvas, or renoise when it follows a
     multinomial) and ``torch.multinomial`` (one categorical id per position);
   * every decoder call: its input canvas, its self-conditioning logits and the soft-capped logits
     ``generate`` receives (by wrapping ``model.forward``, which ``generate`` calls as the decoder; the
     soft-cap is applied there, after ``lm_head``);
   * every encoder call's input ids (a forward pre-hook on ``model.model.encoder``).
2. Run our ``generate`` with a ``ReplayDraws`` of the recorded draws, a denoiser that returns transformers'
   logits for the same call (asserting that our input canvas and self-conditioning logits equal
   transformers' bit for bit at every step), and an encoder that asserts the same ids are encoded.
3. Require identical sequences, tokens_per_forward (float32, exact), steps per canvas, and that every
   recorded draw and decoder call was consumed.

Each case also asserts the path it is meant to reach (rows stopping at different steps, EOS inside a
canvas, rows ending at different canvases...), so a change of the tiny model cannot silently turn a case
into a trivial one.

Scripted cases. The random tiny model never produces a stable draft: its argmax canvas changes at almost
every position from one step to the next, so with stability_threshold >= 1 no row ever stops early. To
reach that path in transformers' own loop, the "scripted" cases replace, inside transformers' decoder
call, a row's logits from a chosen step on by ``0.1 * logits + 20 * onehot(target)`` (fixed targets per
row, position and canvas). The loop under test (transformers' and ours) is unchanged; only the numbers it
is fed differ, and they are recorded and replayed like any others. This also pins down, against
transformers, that constant logits with stability threshold s stop a row exactly s steps after they start.

Left padding runs transformers with sdpa attention: in 5.24.0 ``generate`` with an attention mask fails
under eager attention (the decoder mask is built from the integer canvas and ``torch.finfo`` rejects its
dtype). Teacher forcing makes the attention backend irrelevant here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from diffusiongemma.reference.support.replay import ReplayDraws
from diffusiongemma.reference.generate import generate
from tests.hf_tiny import TinySpec, tiny_model

import torch  # the test extra (README) installs it

V, C = 128, 16  # tiny model vocabulary and canvas length (TinySpec defaults)


# ------------------------------------------------------------------------------------------------ recording
@dataclass
class Recording:
    """Everything one transformers ``generate`` call did."""

    tape: list = field(default_factory=list)  # [(kind, (B, C) int64)] in draw order
    decoder_calls: list = field(default_factory=list)  # [(canvas, sc logits or None, logits)]
    encoder_inputs: list = field(default_factory=list)  # [(B, n) int64]
    order: list = field(default_factory=list)  # "enc" / "dec" per call, in order
    lm_head_outputs: list = field(default_factory=list)  # raw (un-capped) lm_head output per decoder call
    sequences: np.ndarray | None = None
    tokens_per_forward: np.ndarray | None = None

    @property
    def steps_per_canvas(self) -> list[int]:
        steps: list[int] = []
        for call in self.order:
            if call == "enc":
                steps.append(0)
            else:
                steps[-1] += 1
        return steps


def record_transformers(model, input_ids, attention_mask=None, seed=0, script=None, **kwargs) -> Recording:
    """Run ``model.generate`` with torch's RNG seeded and one torch thread, recording draws and calls.

    script: None, or ``f(logits (B, C, V) float32, canvas_index, step_index) -> logits`` applied to the
    decoder's output inside transformers' loop (see the module docstring).
    """
    rec = Recording()
    B = input_ids.shape[0]
    vocab, canvas_length = model.config.text_config.vocab_size, model.config.canvas_length
    randint, multinomial = torch.randint, torch.multinomial
    previous = [None]

    def recording_randint(*args, **kw):
        out = randint(*args, **kw)
        kind = "renoise" if previous[0] == "categorical" else "canvas"  # SPEC §8.3 order
        rec.tape.append((kind, out.numpy().astype(np.int64)))
        previous[0] = kind
        return out

    def recording_multinomial(probs, num_samples, *args, **kw):
        out = multinomial(probs, num_samples, *args, **kw)
        assert num_samples == 1 and probs.shape == (B * canvas_length, vocab)
        rec.tape.append(("categorical", out.view(B, canvas_length).numpy().astype(np.int64)))
        previous[0] = "categorical"
        return out

    forward = model.forward

    def recording_forward(*args, **kw):
        out = forward(*args, **kw)
        if script is not None:
            canvas_index = rec.order.count("enc") - 1
            step_index = rec.order[::-1].index("enc")  # decoder calls since the last encode
            out.logits = torch.from_numpy(script(out.logits.detach().numpy(), canvas_index, step_index))
        sc = kw.get("self_conditioning_logits")
        rec.decoder_calls.append((kw["decoder_input_ids"].numpy().copy(),
                                  None if sc is None else sc.numpy().copy(),
                                  out.logits.detach().numpy().copy()))
        rec.order.append("dec")
        return out

    def encoder_hook(module, args, kw):
        rec.encoder_inputs.append(kw["input_ids"].numpy().astype(np.int64))
        rec.order.append("enc")

    def lm_head_hook(module, args, out):
        rec.lm_head_outputs.append(out.detach().numpy().copy())

    hooks = [model.model.encoder.register_forward_pre_hook(encoder_hook, with_kwargs=True),
             model.lm_head.register_forward_hook(lm_head_hook)]
    torch.randint, torch.multinomial = recording_randint, recording_multinomial
    model.forward = recording_forward  # generate() binds self.forward as its decoder
    threads = torch.get_num_threads()
    # one torch thread: the cases' expected paths (early exits, staggered stops) are those of these numbers,
    # and torch's sums, hence the tokens, change with its thread count, which depends on the order tests ran
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        extra = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        for key in ("decoder_input_ids", "self_conditioning_logits"):
            if key in kwargs:
                kwargs[key] = torch.tensor(kwargs[key])
        out = model.generate(torch.tensor(input_ids), **extra, **kwargs)
    finally:
        torch.set_num_threads(threads)
        torch.randint, torch.multinomial = randint, multinomial
        del model.forward
        for hook in hooks:
            hook.remove()
    rec.sequences = out.sequences.numpy()
    rec.tokens_per_forward = out.tokens_per_forward.numpy()
    return rec


# ------------------------------------------------------------------------------------------------ replaying
class StubCache:
    """Stands in for the KV cache: the replayed denoiser ignores it; only ``length`` is tracked."""

    def __init__(self):
        self.length = 0


class StepLog:
    """Callback keeping the per-step finished flags and every committed canvas."""

    def __init__(self):
        self.finished: list[tuple[int, np.ndarray]] = []
        self.canvases: list[np.ndarray] = []

    def on_step(self, info):
        self.finished.append((info.canvas_index, info.finished.copy()))

    def on_canvas(self, info):
        self.canvases.append(info.tokens.copy())


def replay_ours(rec: Recording, input_ids, attention_mask=None, **settings):
    """Our ``generate`` teacher-forced with transformers' logits and draws."""
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=V, canvas_length=C), new_cache=lambda b: StubCache())
    calls = iter(enumerate(rec.decoder_calls))
    encodes = iter(enumerate(rec.encoder_inputs))

    def denoiser(canvas, cache, sc_logits):
        i, (hf_canvas, hf_sc, hf_logits) = next(calls)
        np.testing.assert_array_equal(canvas, hf_canvas, err_msg=f"input canvas of decoder call {i}")
        assert (sc_logits is None) == (hf_sc is None), f"self-conditioning presence at decoder call {i}"
        if sc_logits is not None:
            # bit-exact: our self-conditioning input is transformers' own logits (returned below) scaled elementwise: no sum
            np.testing.assert_array_equal(sc_logits, hf_sc, err_msg=f"self-conditioning logits of call {i}")
        return hf_logits

    def encoder(ids, cache, mask):
        j, hf_ids = next(encodes)
        np.testing.assert_array_equal(ids, hf_ids, err_msg=f"ids of encoder call {j}")
        if j == 0:
            assert (mask is None) == (attention_mask is None)
        elif mask is not None:
            assert mask.shape == ids.shape and (mask == 1).all()
        cache.length += ids.shape[1]

    draws = ReplayDraws(rec.tape)
    log = StepLog()
    ours = generate(model, input_ids, attention_mask, random=draws, denoiser=denoiser, encoder=encoder,
                    callback=log, **settings)
    draws.check_exhausted()
    assert next(calls, None) is None, "transformers made more decoder calls than we did"
    assert next(encodes, None) is None, "transformers made more encoder calls than we did"
    return ours, log


# ------------------------------------------------------------------------------------------------ cases
def prompt(B: int, P: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, V - 3, size=(B, P)).astype(np.int64)  # no image ids


SCRIPTED_EOS = [1, 50, 106]  # the released checkpoint's EOS ids (all < V here)


@dataclass
class Script:
    """Rows whose logits are replaced from step ``starts[row]`` (0-based, None = never) in every canvas by
    ``0.1 * logits + 20 * onehot(target)``; ``eos_at`` puts EOS ids among the targets."""

    starts: tuple
    eos_at: tuple = ()  # (row, canvas, position, token)
    seed: int = 0

    def targets(self, B: int, canvases: int = 4) -> np.ndarray:
        rng = np.random.default_rng(100 + self.seed)
        t = rng.integers(3, V - 3, size=(canvases, B, C))
        t[np.isin(t, SCRIPTED_EOS)] = 7  # EOS only where planned
        for row, canvas, position, token in self.eos_at:
            t[canvas, row, position] = token
        return t

    def __call__(self, B: int):
        targets = self.targets(B)

        def script(logits, canvas_index, step_index):
            active = np.array([s is not None and step_index >= s for s in self.starts])  # (B,)
            onehot = np.zeros_like(logits)
            np.put_along_axis(onehot, targets[canvas_index][..., None], np.float32(20.0), axis=-1)
            forced = np.float32(0.1) * logits + onehot
            return np.where(active[:, None, None], forced, logits).astype(np.float32)

        return script


@dataclass
class Case:
    B: int
    P: int
    settings: dict  # our GenerationConfig fields (also transformers' generate kwargs, except entropy_bound)
    left_pads: tuple | None = None  # pads per row, for an attention mask
    seed: int = 0
    expect: tuple = ()  # paths this case must reach (checked in the test)
    eos_from: str | None = None  # pick EOS ids from that (EOS-free) case's output
    script: Script | None = None
    start_canvas: bool = False  # pass decoder_input_ids and self_conditioning_logits (first canvas only)


def steps(n, s, conf, **more):
    return dict(max_denoising_steps=n, stability_threshold=s, confidence_threshold=conf, **more)


CASES = {
    # the model's own logits
    "one_token_B1": Case(1, 5, dict(max_new_tokens=1, **steps(8, 0, 0.6))),
    "C-1_B3_s0_staggered": Case(3, 13, dict(max_new_tokens=C - 1, **steps(8, 0, 0.6)), seed=2,
                                expect=("early_exit", "staggered_stop")),
    "C_B3_s0_leftpad": Case(3, 9, dict(max_new_tokens=C, **steps(8, 0, 0.6)), left_pads=(0, 3, 1),
                            expect=("staggered_stop",)),
    "C+1_B2_leftpad_two_canvases": Case(2, 9, dict(max_new_tokens=C + 1, **steps(5, 1, 0.8)), left_pads=(2, 0),
                                        seed=1),
    "C+1_B2_s1_conf0.3": Case(2, 6, dict(max_new_tokens=C + 1, **steps(6, 1, 0.3)), seed=2),
    "2C+3_B3_s1_conf0.8": Case(3, 13, dict(max_new_tokens=2 * C + 3, **steps(6, 1, 0.8)), seed=3),
    "default_48_steps_B2_s0_conf0.5": Case(2, 7, dict(max_new_tokens=C, stability_threshold=0,
                                                      confidence_threshold=0.5), seed=4, expect=("early_exit",)),
    # EOS ids picked from what the EOS-free run with the same seed emitted
    "eos_one_id_pad0": Case(2, 6, dict(max_new_tokens=C + 1, pad_token_id=0, **steps(6, 1, 0.3)), seed=2,
                            eos_from="C+1_B2_s1_conf0.3", expect=("eos_mid_canvas", "padded_after_end")),
    "eos_three_ids_pad0": Case(3, 13, dict(max_new_tokens=2 * C + 3, pad_token_id=0, **steps(6, 1, 0.8)), seed=3,
                               eos_from="2C+3_B3_s1_conf0.8", expect=("eos_mid_canvas",)),
    "eos_without_pad": Case(2, 6, dict(max_new_tokens=C + 1, **steps(6, 1, 0.3)), seed=2,
                            eos_from="C+1_B2_s1_conf0.3"),
    # lengths
    "max_length_B2": Case(2, 10, dict(max_length=10 + 20, **steps(5, 1, 0.8)), seed=5),
    "max_length_stops_before_max_new_tokens": Case(2, 10, dict(max_new_tokens=40, max_length=15,
                                                               max_denoising_steps=5), seed=5),
    # settings switched off or changed
    "no_adaptive_stopping": Case(2, 8, dict(max_new_tokens=C + 1, max_denoising_steps=5,
                                            confidence_threshold=None), seed=6),
    "no_temperature_schedule": Case(1, 8, dict(max_new_tokens=C, max_denoising_steps=5, t_min=None), seed=7),
    "entropy_bound_0.5": Case(2, 8, dict(max_new_tokens=C, entropy_bound=0.5, **steps(6, 0, 0.5)), seed=8),
    "start_canvas_and_sc_logits": Case(2, 8, dict(max_new_tokens=C + 1, max_denoising_steps=5), seed=9,
                                       start_canvas=True),
    # scripted logits (see the module docstring): stability thresholds 1 and 2, staggered stops, EOS plans
    "scripted_s1_conf0.3_staggered": Case(3, 7, dict(max_new_tokens=C, **steps(8, 1, 0.3)), seed=10,
                                          script=Script(starts=(0, 2, None)), expect=("scripted_stops",)),
    "scripted_s2_conf1.5": Case(2, 7, dict(max_new_tokens=C + 1, **steps(8, 2, 1.5)), seed=11,
                                script=Script(starts=(0, 1)), expect=("scripted_stops", "early_exit")),
    "scripted_s2_conf10_B1": Case(1, 7, dict(max_new_tokens=C, **steps(8, 2, 10.0)), seed=12,
                                  script=Script(starts=(0,)), expect=("scripted_stops", "early_exit")),
    "scripted_s1_conf0.8_eos_list": Case(
        3, 7, dict(max_new_tokens=2 * C + 3, eos_token_id=SCRIPTED_EOS, pad_token_id=0, **steps(6, 1, 0.8)),
        seed=13, script=Script(starts=(0, 0, 1), eos_at=((0, 0, 5, 50), (0, 0, 9, 1), (1, 1, 11, 106))),
        expect=("scripted_stops", "eos_mid_canvas", "rows_end_apart", "padded_after_end", "later_eos_padded")),
}


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model(TinySpec(final_norm_gain=25), seed=0)


_recordings: dict[str, tuple] = {}


def pick_eos_ids(rec: Recording, P: int, count: int) -> list[int]:
    """EOS ids the run emitted: first, a token inside row 0's first canvas that no other row's first canvas
    holds (so row 0 ends alone, mid-canvas); then tokens from later canvases of the other rows."""
    new = rec.sequences[:, P:]
    first_canvases = new[:, :C]
    ids = [next(int(t) for t in first_canvases[0, C // 4:C - 2] if int(t) not in first_canvases[1:])]
    for token in new[1:, C:].ravel():
        if len(ids) < count and int(token) not in ids and int(token) not in first_canvases:
            ids.append(int(token))
    return ids


def run_case(hf_model, name: str):
    """Record transformers on case ``name`` (once per module) -> (case, recording, ids, mask, our settings)."""
    if name in _recordings:
        return _recordings[name]
    case = CASES[name]
    settings = dict(case.settings)
    if case.eos_from is not None:
        source = CASES[case.eos_from]
        source_rec = run_case(hf_model, case.eos_from)[1]
        settings["eos_token_id"] = pick_eos_ids(source_rec, source.P, 3 if "three" in name else 1)
    ids = prompt(case.B, case.P, seed=case.seed)
    mask = None
    if case.left_pads is not None:
        mask = np.ones_like(ids)
        for row, pads in enumerate(case.left_pads):
            ids[row, :pads], mask[row, :pads] = 0, 0
    if case.start_canvas:
        rng = np.random.default_rng(11)
        settings["decoder_input_ids"] = rng.integers(0, V, size=(case.B, C))
        settings["self_conditioning_logits"] = (3 * rng.standard_normal((case.B, C, V))).astype(np.float32)
    hf_settings = dict(settings)
    if "entropy_bound" in hf_settings:
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        hf_settings["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=hf_settings.pop("entropy_bound"))
    script = None if case.script is None else case.script(case.B)
    if mask is not None:  # eager attention cannot run generate with a mask in 5.24.0 (module docstring)
        hf_model.set_attn_implementation("sdpa")
    try:
        rec = record_transformers(hf_model, ids, mask, seed=case.seed, script=script, **hf_settings)
    finally:
        hf_model.set_attn_implementation("eager")
    _recordings[name] = (case, rec, ids, mask, settings)
    return _recordings[name]


@pytest.mark.parametrize("name", list(CASES))
def test_loop_matches_transformers_token_for_token(hf_model, name):
    case, rec, ids, mask, settings = run_case(hf_model, name)
    ours, log = replay_ours(rec, ids, mask, **settings)

    np.testing.assert_array_equal(ours.sequences, rec.sequences)
    assert ours.sequences.dtype == np.int64
    assert ours.tokens_per_forward.dtype == np.float32
    np.testing.assert_array_equal(ours.tokens_per_forward, rec.tokens_per_forward)
    assert ours.steps_per_canvas == rec.steps_per_canvas
    assert ours.sequences.shape[1] == case.P + C * len(ours.steps_per_canvas)  # never truncated

    N = settings.get("max_denoising_steps", 48)
    s = settings.get("stability_threshold", 1)
    eos = settings.get("eos_token_id") or []
    new = ours.sequences[:, case.P:]
    for path in case.expect:
        if path == "early_exit":
            assert min(ours.steps_per_canvas) < N, ours.steps_per_canvas
        elif path == "staggered_stop":  # some step has rows finished and rows still denoising
            assert any(f.any() and not f.all() for _, f in log.finished), "no row stopped before another"
        elif path == "scripted_stops":  # a row forced from step t stops exactly after step t + s (0-based)
            first_canvas = [f for k, f in log.finished if k == 0]
            for row, start in enumerate(case.script.starts):
                stop = next((i for i, f in enumerate(first_canvas) if f[row]), None)
                assert stop == (None if start is None or start + s >= N else start + s), (row, stop)
        elif path == "eos_mid_canvas":  # an EOS before a canvas end, followed by pad up to the canvas end
            hits = [(r, c) for r in range(new.shape[0]) for c in range(new.shape[1])
                    if new[r, c] in eos and c % C < C - 1 and (new[r, c + 1:(c // C + 1) * C] == 0).all()]
            assert hits, "no EOS inside a canvas"
        elif path == "rows_end_apart":  # rows end in different canvases (or one never ends)
            ends = [next((c // C for c in range(new.shape[1]) if new[r, c] in eos), None) for r in range(case.B)]
            assert len(set(ends)) > 1, ends
        elif path == "padded_after_end":  # a row that ended earlier gets an all-pad later canvas
            assert any((canvas == 0).all(axis=1).any() for canvas in log.canvases[1:]), "no all-pad canvas"
        elif path == "later_eos_padded":  # a second EOS in the same canvas was overwritten with pad
            row, canvas, position, _ = case.script.eos_at[1]
            assert new[row, canvas * C + position] == 0


def test_transformers_sampler_sees_soft_capped_lm_head_output(hf_model):
    """The logits we record (and replay) are lm_head outputs soft-capped at 30, as SPEC §7.5 says."""
    rec = run_case(hf_model, "C-1_B3_s0_staggered")[1]
    assert len(rec.lm_head_outputs) == len(rec.decoder_calls)
    for (_, _, logits), raw in zip(rec.decoder_calls, rec.lm_head_outputs):
        np.testing.assert_allclose(logits, 30.0 * np.tanh(raw.astype(np.float64) / 30.0), rtol=0, atol=1e-5)
        assert np.abs(raw).max() > 30.0 > np.abs(logits).max()  # the cap is active on these peaked logits


def test_replay_detects_a_wrong_draw(hf_model):
    """Teacher forcing is a real check: one changed renoise id is caught at the next decoder call."""
    case, rec, ids, mask, settings = run_case(hf_model, "C-1_B3_s0_staggered")
    index = next(i for i, (kind, _) in enumerate(rec.tape) if kind == "renoise")
    tampered = list(rec.tape)
    kind, ids_drawn = tampered[index]
    changed = ids_drawn.copy()
    changed[0, :] = (changed[0, :] + 1) % V
    tampered[index] = (kind, changed)
    bad = Recording(tape=tampered, decoder_calls=rec.decoder_calls, encoder_inputs=rec.encoder_inputs,
                    order=rec.order)
    with pytest.raises(AssertionError, match="input canvas of decoder call 1"):
        replay_ours(bad, ids, mask, **settings)
