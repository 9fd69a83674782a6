"""Free runs: our model's own logits driving our loop, fed transformers' recorded random draws.

Teacher forcing (test_generate_parity.py) proves the loop; test_model_parity.py proves the forward pass to
float32 noise. A free run joins the two, and so meets trap T20: ~1e-5 of logit noise can flip a discrete
decision whose margin is that small, after which the runs legitimately part. So the comparison walks the
first canvas step by step, recomputing every discrete decision from transformers' logits and from ours:

* the draft (argmax per position), deciding the committed canvas and the stability history;
* the accepted set (entropy-bound rule on the sorted entropies);
* the confidence test (mean entropy < threshold).

If every decision agrees, the whole first-canvas trajectory must be identical: every input canvas, the
number of steps, the committed canvas. If a decision differs, its margin under transformers' logits must be
a near-tie, or the test fails:

* argmax: top-1 minus top-2 processed logit < ARGMAX_EPS at the position that differs;
* acceptance: |S_k - H_(k) - bound| < ENTROPY_EPS for the sorted item whose decision differs;
* confidence: |mean entropy - threshold| < ENTROPY_EPS.

One more near-tie lives inside the forward pass: the router's top-k choice. From the second step on, the
decoder reads the previous step's logits (self-conditioning), which already differ by float32 noise; if a
token's router probabilities are nearly tied, that noise flips an expert and moves the logits by O(1)
although every discrete decision of the loop agreed. When the logits of a step differ beyond tolerance,
the test re-runs our decoder on transformers' exact inputs (same canvas, transformers' self-conditioning
logits): if that agrees with transformers, the difference came from amplified input noise (reported as a
forward-pass near-tie); if it does not, our forward pass is wrong and the test fails.

The epsilons are 10x the forward-pass tolerance (4e-4 on unit-scale logits, times the tiny model's
final-norm gain of 25) and 0.01 nats on entropies, so a real bug, which moves decisions by O(1) margins, cannot hide behind them. Near-ties are
printed, never silently skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.reference.support.replay import ReplayDraws, ReplayError
from diffusiongemma.reference.generate import generate
from diffusiongemma.reference.model import Model
from diffusiongemma.reference.sampling import (argmax_tokens, entropy_bound_accept, scale_logits,
                                               softmax_and_entropy, temperature)
from tests.hf_tiny import TinySpec, save_tiny, tiny_model
from tests.test_generate_parity import record_transformers

GAIN = 25.0  # final-norm gain of the tiny model: peaked logits, and 25x the hidden-state noise
LOGIT_ATOL = 4e-4 * GAIN  # twice test_model_parity's ATOL (self-conditioning feeds peaked logits back), x gain
ARGMAX_EPS = 10 * LOGIT_ATOL
ENTROPY_EPS = 1e-2


def decisions(logits, step, settings):
    """Processed-logit decisions of one step: (draft, accepted, confident, entropies, processed)."""
    temp = temperature(step, settings["max_denoising_steps"], settings.get("t_min", 0.4), settings.get("t_max", 0.8))
    processed = scale_logits(logits, temp)
    _, entropies = softmax_and_entropy(processed)
    accepted = entropy_bound_accept(entropies, settings.get("entropy_bound", 0.1))
    confident = entropies.mean(axis=-1, dtype=np.float32) < np.float32(settings["confidence_threshold"])
    return argmax_tokens(processed), accepted, confident, entropies, processed


def near_tie_report(hf_logits, our_logits, step, settings) -> list[str]:
    """Describe each differing decision at this step; AssertionError if one is not a near-tie."""
    d_hf, d_ours = decisions(hf_logits, step, settings), decisions(our_logits, step, settings)
    notes = []
    for b, j in zip(*np.nonzero(d_hf[0] != d_ours[0])):
        top2 = np.sort(d_hf[4][b, j])[-2:]
        gap = float(top2[1] - top2[0])
        assert gap < ARGMAX_EPS, f"argmax differs at row {b} position {j} with margin {gap:.3e}"
        notes.append(f"argmax near-tie at row {b} pos {j} (margin {gap:.1e})")
    bound = np.float32(settings.get("entropy_bound", 0.1))
    for b in np.nonzero((d_hf[1] != d_ours[1]).any(axis=-1))[0]:
        h = np.sort(d_hf[3][b])
        before = np.cumsum(h, dtype=np.float64).astype(np.float32) - h  # S_k - H_(k)
        k = int(min(np.sum(before <= bound), len(h) - 1))  # first rejected item (the boundary)
        margin = float(min(abs(before[k] - bound), abs(before[max(k - 1, 0)] - bound)))
        assert margin < ENTROPY_EPS, f"accepted set differs in row {b} with margin {margin:.3e}"
        notes.append(f"acceptance near-tie in row {b} (margin {margin:.1e})")
    gamma = np.float32(settings["confidence_threshold"])
    for b in np.nonzero(d_hf[2] != d_ours[2])[0]:
        margin = float(abs(d_hf[3][b].mean(dtype=np.float32) - gamma))
        assert margin < ENTROPY_EPS, f"confidence differs in row {b} with margin {margin:.3e}"
        notes.append(f"confidence near-tie in row {b} (margin {margin:.1e})")
    return notes


def free_run(hf, ours, prompt, seed, settings):
    """(transformers recording, our decoder calls, our result or the ReplayError that ended our run)."""
    hf_kwargs = {k: v for k, v in settings.items() if k != "entropy_bound"}
    rec = record_transformers(hf, prompt, seed=seed, **hf_kwargs)
    calls = []

    def denoiser(canvas, cache, sc_logits):
        logits = ours.denoise(canvas, cache, sc_logits)
        calls.append((np.array(canvas), logits))
        return logits

    try:
        result = generate(ours, prompt, random=ReplayDraws(rec.tape), denoiser=denoiser, **settings)
    except ReplayError as exc:  # our run asked for a draw transformers never made: it has already parted
        result = exc
    return rec, calls, result


def compare_first_canvas(rec, calls, result, prompt, settings, ours) -> list[str]:
    """Walk canvas 0; return near-tie notes (empty when the canvas matched exactly).

    Up to the first near-tie both runs must be identical step for step. From a near-tie on the runs may
    part, so the rest of transformers' trajectory is checked teacher-forced: at every remaining step our
    decoder, fed transformers' exact canvas and self-conditioning input, must give transformers' logits. A
    near-tie therefore never ends the check early.
    """
    N = settings["max_denoising_steps"]
    cache = ours.new_cache(prompt.shape[0])
    ours.encode(prompt, cache)
    hf_steps, P, C = rec.steps_per_canvas[0], prompt.shape[1], rec.decoder_calls[0][0].shape[1]
    notes: list[str] = []
    for i in range(hf_steps):
        hf_canvas, hf_sc, hf_logits = rec.decoder_calls[i]
        if notes or i >= len(calls):  # after the runs parted: teacher-forced forward-pass check
            forced = float(np.abs(ours.denoise(hf_canvas, cache, hf_sc) - hf_logits).max())
            assert forced < LOGIT_ATOL, f"after the near-tie, step {i}'s logits differ by {forced:.2e} on " \
                                        "transformers' exact inputs"
            continue
        our_canvas, our_logits = calls[i]
        assert np.array_equal(our_canvas, hf_canvas), f"input canvas of step {i} differs with no near-tie before it"
        gap = float(np.abs(our_logits - hf_logits).max())
        if gap >= LOGIT_ATOL:
            on_hf_inputs = float(np.abs(ours.denoise(hf_canvas, cache, hf_sc) - hf_logits).max())
            assert on_hf_inputs < LOGIT_ATOL, (f"logits of step {i} differ by {gap:.2e}, and by {on_hf_inputs:.2e} "
                                               "even on transformers' exact inputs")
            sc_gap = float(np.abs(calls[i - 1][1] - rec.decoder_calls[i - 1][2]).max())
            notes = [f"forward-pass near-tie at step {i}: self-conditioning input noise ({sc_gap:.1e}) moved the "
                     f"logits by {gap:.1e}; on transformers' exact inputs ours agrees to {on_hf_inputs:.1e}"]
            continue
        notes = near_tie_report(hf_logits, our_logits, N - i, settings)
    if notes:
        return notes
    assert not isinstance(result, Exception), f"our run failed without a near-tie: {result}"
    assert result.steps_per_canvas[0] == hf_steps
    np.testing.assert_array_equal(result.sequences[:, P:P + C], rec.sequences[:, P:P + C])
    return []


@pytest.mark.parametrize("B,seed,settings", [
    (1, 0, dict(max_new_tokens=16, max_denoising_steps=12, stability_threshold=0, confidence_threshold=0.8)),
    (2, 1, dict(max_new_tokens=16, max_denoising_steps=10, stability_threshold=1, confidence_threshold=1.5)),
    (3, 2, dict(max_new_tokens=20, max_denoising_steps=8, stability_threshold=0, confidence_threshold=10.0)),
])
def test_free_run_first_canvas_matches_transformers(tmp_path, B, seed, settings):
    hf = tiny_model(TinySpec(final_norm_gain=GAIN), seed=seed)
    ours = Model.from_pretrained(save_tiny(hf, tmp_path / "hf"))
    prompt = np.random.default_rng(seed).integers(3, 120, size=(B, 13))
    rec, calls, result = free_run(hf, ours, prompt, seed, dict(settings, pad_token_id=0))
    notes = compare_first_canvas(rec, calls, result, prompt, settings, ours)
    print("exact first canvas" if not notes else "stopped at a near-tie: " + "; ".join(notes))


def test_shipped_model_reproduces_transformers_token_for_token():
    """The shipped tiny-kjv checkpoint, a real prompt, the checkpoint's own sampler settings: our model and
    loop fed torch's recorded draws give transformers' exact output (sequences and tokens per forward)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.checkpoint import default_model_dir, load_text_side
    from diffusiongemma.reference.generate import GenerationConfig

    path = default_model_dir()
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = Model.from_pretrained(path)
    settings = GenerationConfig.from_pretrained(path).replace(max_new_tokens=64)
    prompt = np.array([load_text_side(path).encode("And God said unto Moses")])
    hf_kwargs = {k: v for k, v in settings.to_dict().items() if k != "sampler_config"}
    rec = record_transformers(hf, prompt, seed=0, **hf_kwargs)
    result = generate(ours, prompt, generation_config=settings, random=ReplayDraws(rec.tape))
    np.testing.assert_array_equal(result.sequences, rec.sequences)
    np.testing.assert_array_equal(result.tokens_per_forward, rec.tokens_per_forward)
    assert result.steps_per_canvas == rec.steps_per_canvas
