"""What a denoising step of the GPU path asks of the device, counted on cuda-sim for the shipped model
(``fast/gpu/counting.py``): inside a canvas no copy comes back to the host but the stop flag, read once per
``sync_every`` steps, and the committed draft once per canvas; nothing is copied to the device per step.

Each canvas's whole denoising step (decoder pass, sampling, acceptance and renoising, stop state, the step
index) is captured once and replayed (``fast/gpu/graph.py``): from the third step on, a step is one replay
(one CUDA graph launch on a GPU) and nothing else is issued from Python. The same counts on the spec's
per-step loop (``device_loop=False``, what every step did before the device loop) show what the counter sees
when a step does round trips: several copies back per step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffusiongemma.fast import gpu
from diffusiongemma.fast.gpu.counting import AllocationLimitError, CountingDevice, count_generate
from diffusiongemma.fast.gpu.sim import SimDevice
from diffusiongemma.reference.generation_config import GenerationConfig

SHIPPED = "diffusiongemma/assets/tiny-kjv"
PROMPT = np.array([[2, 310, 47, 1022, 9, 88]])


@pytest.fixture(scope="module")
def shipped():
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), SHIPPED)
    device = CountingDevice(SimDevice(checks=False))
    return gpu.Model.from_pretrained(path, device=device), GenerationConfig.from_pretrained(path)


def run(shipped, steps: int, **options):
    model, config = shipped
    model.device.phases.clear()
    return count_generate(model, PROMPT, generation_config=config, random=1, max_new_tokens=32,
                          max_denoising_steps=steps, backend_options=options)


@pytest.mark.parametrize("k", [4, 3])
def test_a_canvas_reads_back_only_its_stop_flag_and_its_draft(shipped, k):
    steps = 8
    result, canvases = run(shipped, steps, sync_every=k)
    reference, spec_canvases = run(shipped, steps, device_loop=False)
    np.testing.assert_array_equal(result.sequences, reference.sequences)  # the same tokens as the spec's loop
    B, C = PROMPT.shape[0], shipped[0].config.canvas_length
    for canvas in canvases:
        n, counts = canvas["steps"], canvas["canvas"]
        flags = math.ceil(n / k)
        assert counts.d2h == flags + 1, counts.as_dict()  # the stop flags, then the committed draft
        assert counts.d2h_bytes <= flags * 4 * (B + k) + 8 * B * C, counts.as_dict()
        assert counts.waits <= flags + 1, counts.as_dict()  # <= 1 synchronisation per k steps (+ the draft)
        # copies to the device: the canvas's draws and inputs, once per canvas, none per step
        assert counts.h2d <= 12, counts.as_dict()
        # the step: issued at steps 1 (no self-conditioning) and 2 (captured), then one replay per step
        assert counts.replays == n - 2 and counts.replayed_launches > 50 * (n - 2), counts.as_dict()
        assert counts.kernels["dg_sample_step"] == counts.kernels["dg_step_end"] == 2, counts.kernels
        spec = spec_canvases[0]["canvas"]
        assert counts.python_launches < spec.python_launches / 2, (counts.as_dict(), spec.as_dict())


def test_a_step_is_one_graph_replay_and_nothing_else(shipped):
    """Where graphs are on (cuda-sim's default), each step after the second is one replay and adds no other
    Python-issued launch (kernel, array-module call) to its canvas: a canvas of more steps differs from one of
    fewer by exactly its extra replays."""
    short_result, short = run(shipped, 4)
    long_result, long = run(shipped, 9, sync_every=2)
    assert len(short) == len(long)
    for a, b in zip(short, long):
        na, nb = a["steps"], b["steps"]
        assert nb > na > 2, (na, nb)  # steps beyond the capture in both, more of them in the second
        ca, cb = a["canvas"], b["canvas"]
        assert (ca.replays, cb.replays) == (na - 2, nb - 2), (ca.as_dict(), cb.as_dict())
        assert cb.python_launches - ca.python_launches == nb - na, (ca.as_dict(), cb.as_dict())
        assert (cb.launches, cb.xp_calls) == (ca.launches, ca.xp_calls), (ca.as_dict(), cb.as_dict())
        # what one replay runs: the decoder pass and the step's sampling, acceptance and stop-state kernels
        assert cb.replayed_launches // cb.replays == ca.replayed_launches // ca.replays > 50


def test_the_per_step_loop_is_what_the_counter_catches(shipped):
    """The spec's loop on the GPU backend copies flags, draws, entropies and the next canvas back at every
    step: the counter sees it (so the test above can fail)."""
    steps = 3
    _, canvases = run(shipped, steps, device_loop=False)
    counts = canvases[0]["canvas"]
    assert counts.d2h >= 5 * steps and counts.h2d >= 5 * steps, counts.as_dict()


def test_h2d_per_canvas_does_not_grow_with_the_steps(shipped):
    run(shipped, 2)  # the model's first canvas also uploads what is kept for the model's life (tables reused
    # by every later pass), so which test runs first would decide the counts below: measure a warm model
    _, short = run(shipped, 2)
    _, long = run(shipped, 6)
    assert short[0]["canvas"].h2d == long[0]["canvas"].h2d
    assert long[0]["canvas"].d2h == short[0]["canvas"].d2h + 1  # one more stop flag (k = 4)


def test_a_bfloat16_canvas_asks_what_a_float32_canvas_asks():
    """A bfloat16 model's canvas runs on the device loop too (its self-conditioning input, SPEC B8, is written by
    the sampling kernel's bf16 flag): per canvas the same copies each way, waits and replays as the float32
    model's, the same captured step at every replay, and after the capture one replay per step and no other
    Python-issued launch. A small model of each dtype (the shipped one in bfloat16 is slow on cuda-sim), no
    stopping rule (every canvas takes its N steps, whatever its tokens)."""
    from diffusiongemma.tiny import make_config, random_tensors

    config = make_config(layer_types="SF", canvas_length=8)
    tensors = random_tensors(config, seed=5)
    prompt = np.random.default_rng(0).integers(3, 120, size=(2, 5))
    counts = {}
    for dtype in ("float32", "bfloat16"):
        model = gpu.Model(config, tensors, device=CountingDevice(SimDevice(checks=False)), dtype=dtype)
        for steps, k in ((4, 4), (9, 2)):
            model.device.phases.clear()
            result, canvases = count_generate(model, prompt, random=1, max_new_tokens=16, max_denoising_steps=steps,
                                              eos_token_id=[1], pad_token_id=0, backend_options=dict(sync_every=k))
            assert result.steps_per_canvas == [steps, steps]
            counts[dtype, steps] = [c["canvas"] for c in canvases]
    for steps in (4, 9):
        for f32, b16 in zip(counts["float32", steps], counts["bfloat16", steps]):
            a, b = f32.as_dict(), b16.as_dict()
            same = ("d2h", "d2h_bytes", "h2d", "h2d_bytes", "syncs", "waits", "replays")
            assert {n: b[n] for n in same} == {n: a[n] for n in same}, (a, b)
            assert b16.replays == steps - 2 and b16.kernels["dg_sample_step"] == 2, b
    for short, long in zip(counts["bfloat16", 4], counts["bfloat16", 9]):
        assert long.python_launches - short.python_launches == 9 - 4, (short.as_dict(), long.as_dict())
        assert (long.launches, long.xp_calls) == (short.launches, short.xp_calls)
        assert long.replayed_launches // long.replays == short.replayed_launches // short.replays > 50


def test_an_allocation_over_the_limit_is_refused_with_its_shape():
    device = CountingDevice(SimDevice(checks=False), limit_bytes=1 << 20)
    kept = device.empty((512, 256), np.float32)  # 512 KiB
    with pytest.raises(AllocationLimitError, match=r"\(256, 520\) float32"):
        device.zeros((256, 520), np.float32)  # another 520 KiB: over 1 MiB with the first
    del kept
    device.zeros((256, 520), np.float32)  # the first was released
    assert device.peak_live_bytes == 520 * 1024
