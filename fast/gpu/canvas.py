"""A canvas's denoising steps on the device, with no host round trip inside the canvas.

The generation loop (``reference.generate``) asks a backend, before it runs a canvas's steps itself, whether
the backend runs them (``backend.run_canvas``, optional: ``None`` means "run the spec's ``denoise_canvas``").
``GpuBackend.run_canvas`` answers with ``run_canvas`` below when the run is one it reproduces exactly: the
spec's stages (``stages.TRANSFORMERS``), draws from ``SeededDraws``, no observer (a test's logits
hook is allowed: it copies the canvas out and its logits in at each step). Every other run (a replayed or recorded draw
source, a trace, a variant) takes the spec's loop, one step per call, as before.

What stays on the device for the whole canvas (B rows, C positions, N = max_denoising_steps):

    canvas, draft, entropies (B, C)      the loop's state (SPEC §8.2 j); the draft starts as the canvas
    finished (B,), finish_step (B,)      per-row stop state: step index at which a row stopped (N: never)
    history (s, B, C)                    the stable-and-confident rule's last s drafts (a ring: the rule
                                         only asks whether the new draft equals every one of them)
    uniforms, noise (N, B, C)            the canvas's draws, made ahead and uploaded once (below)
    flags (N, B*C)                       the sampling kernel's NaN / +inf / no-finite flags of every step
    step (1,), temperatures (N,)         the step index (advanced on the device) and each step's temperature
    the self-conditioning buffer         ``GpuBackend.buffer``, as in the per-step backend; a bfloat16
                                         model's second (B, C, V) buffer (``GpuBackend.sc_buffer``): the
                                         sampling kernel's bf16 flag writes there the softmax of the processed
                                         logits rounded to bfloat16 (SPEC B8), the next step's input
    per-step records (N, ...)            draft, sampled, entropies, accepted, canvas, finished: only when a
                                         callback asked for steps; copied to the host once, after the canvas

Each step is the spec's (``reference.generate.denoise_canvas``) as four things issued to the device, each
reading the step index from a device counter, so that a step issues the same launches on the same buffers
every time: the decoder pass (reading the canvas, or for some rows a fixed copy of theirs), ``dg_sample_step``
(the temperature of the step from a (N,) table, its uniforms from the canvas's draws), ``dg_step_update``
(acceptance and renoising, the freezing of finished rows, the stable-and-confident rule: the draft equals each
of the last s drafts and the mean entropy, NumPy's float32 pairwise mean as ``pairwise_mean`` spells it, is
below γ; the per-step records) and ``dg_step_end`` (the stop flag below, then the step index advances). With
``GpuBackend.graphs`` the whole step is captured once per canvas (and again when the live rows change), from
the second step on, with self-conditioning on, and replayed (``graph.py``): one CUDA graph launch per step on
a GPU, the recorded plan of launches run by the executor on cuda-sim.

The host reads back, every ``sync_every`` steps, one small int32 array: one flag per step of that stretch
(did the sampling kernel flag anything) followed by ``finish_step`` (``dg_step_end`` writes both into ``status``
so that they are one contiguous slice). That is the stop flag: when every row has
stopped, the canvas ends at the step the last row stopped; the steps already issued after it are no-ops on
the device (every row is frozen), so the results are the same as stopping at once. The committed draft is
read once, after the last step. A flagged step raises the reference's ``SamplingError`` for the first flagged
(step, row, position) of a row still denoising, as the per-step backend would.

The draws: the uniforms and renoise ids of a step never depend on the model's outputs, so the N steps'
draws are made up front, by the same ``SeededDraws`` calls in the same order as the spec's loop (step by
step: ``categorical_uniforms(B, C)`` then ``renoise_ids(B, C, V)``), recording the generator's state after
each step. When the canvas ends after S steps the generator is put back to the state after step S, so the
next canvas's draws (and everything after) are the spec's, bit for bit.

Forward passes are counted as the spec counts them: a row not ended is counted for each step executed up
to and including the step at which it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusiongemma.reference.draws import SeededDraws
from diffusiongemma.reference.sampling import StableAndConfident
from diffusiongemma.reference.stages import TRANSFORMERS
from diffusiongemma.reference.support.observer import NULL_OBSERVER, StepInfo, notify, readonly

from . import graph
from . import launch as gl
from .flags import flat_rows, raise_for_flags

__all__ = ["run_canvas", "prefetch_draws", "pairwise_mean", "applies"]

#: Steps issued between two reads of the stop flag (``GpuBackend(sync_every=...)``).
SYNC_EVERY = 4


def applies(backend: Any, draws: Any, observer: Any, semantics: Any, stopper: Any) -> bool:
    """Whether ``run_canvas`` reproduces this run exactly (module docstring); else the spec's loop runs. A
    bfloat16 model's run is reproduced too: its self-conditioning input (SPEC B8) is written by the sampling
    kernel's bf16 flag."""
    return (getattr(backend, "device_loop", True) and type(draws) is SeededDraws
            and observer is NULL_OBSERVER and semantics == TRANSFORMERS
            and (stopper is None or type(stopper) is StableAndConfident))


def prefetch_draws(draws: SeededDraws, steps: int, B: int, C: int, V: int) -> tuple[np.ndarray, np.ndarray, list]:
    """The draws of ``steps`` denoising steps, made as the spec's loop makes them (per step: uniforms (B, C)
    float64, then renoise ids (B, C) int64). Returns (uniforms (steps, B, C), noise (steps, B, C), states):
    ``states[s]`` is the generator's state after s steps (``restore_draws``)."""
    bits = draws.generator.bit_generator
    uniforms = np.empty((steps, B, C), dtype=np.float64)
    noise = np.empty((steps, B, C), dtype=np.int64)
    states = [bits.state]
    for i in range(steps):
        uniforms[i] = draws.categorical_uniforms(B, C)
        noise[i] = draws.renoise_ids(B, C, V)
        states.append(bits.state)
    return uniforms, noise, states


def restore_draws(draws: SeededDraws, states: list, executed: int) -> None:
    """Put the generator where ``executed`` steps of the spec's loop leave it."""
    draws.generator.bit_generator.state = states[executed]


def _pairwise_sum(xp: Any, a: Any, lo: int, n: int) -> Any:
    """NumPy's float32 pairwise summation (``pairwise_sum`` of numpy/_core/src/umath/loops_utils.h) of the
    columns ``a[:, lo:lo + n]`` of a (B, C) float32 array, in the same order of float32 additions."""
    if n < 8:
        res = xp.zeros(a.shape[0], dtype=np.float32)
        for i in range(n):
            res = res + a[:, lo + i]
        return res
    if n <= 128:
        m = n - n % 8
        blocks = a[:, lo:lo + m].reshape(a.shape[0], m // 8, 8)
        r = blocks[:, 0, :]
        for i in range(1, m // 8):
            r = r + blocks[:, i, :]
        res = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
        for i in range(m, n):
            res = res + a[:, lo + i]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise_sum(xp, a, lo, n2) + _pairwise_sum(xp, a, lo + n2, n - n2)


def pairwise_mean(xp: Any, entropies: Any) -> Any:
    """``np.mean(entropies, axis=-1, dtype=np.float32)`` bit for bit, on any array module: (B, C) float32 ->
    (B,) float32 (the pairwise float32 sum, divided by C in float64 and rounded once to float32, which is
    the correctly rounded float32 quotient, as NumPy's)."""
    C = entropies.shape[-1]
    total = _pairwise_sum(xp, entropies, 0, C)
    return (total.astype(np.float64) / C).astype(np.float32)


class _Records:
    """Per-step copies of the loop's state, for a callback (copied to the host once per canvas)."""

    def __init__(self, dev: Any, N: int, B: int, C: int):
        self.draft = dev.empty((N, B, C), np.int64)
        self.sampled = dev.empty((N, B, C), np.int64)
        self.canvas = dev.empty((N, B, C), np.int64)
        self.entropies = dev.empty((N, B, C), np.float32)
        self.accepted = dev.empty((N, B, C), np.uint8)
        self.finished = dev.empty((N, B), np.uint8)

    def arrays(self) -> tuple:
        """In the order of ``launch.step_update``'s ``records``."""
        return self.draft, self.sampled, self.canvas, self.entropies, self.accepted, self.finished

    def to_host(self, dev: Any, steps: int) -> dict:
        out = {name: dev.to_host(getattr(self, name)[:steps])
               for name in ("draft", "sampled", "canvas", "entropies", "accepted", "finished")}
        out["accepted"], out["finished"] = out["accepted"] != 0, out["finished"] != 0
        return out


def run_canvas(backend: Any, k: int, canvas: np.ndarray, draws: SeededDraws, stopper: Any, config: Any,
               ended: np.ndarray, forward_passes: np.ndarray, callback: Any, n_canvases: int,
               semantics: Any) -> tuple[np.ndarray, int]:
    """Canvas ``k``'s denoising steps on the device (module docstring); the same contract and results as
    ``reference.generate.denoise_canvas``: returns (the committed draft (B, C) int64, steps executed),
    increments ``forward_passes`` in place, leaves ``draws`` where the spec's loop leaves it, and calls the
    callback's ``on_step`` once per executed step (after the canvas)."""
    dev, model = backend.dev, backend.model
    xp = dev.xp
    B, C, V = backend.B, backend.C, backend.V
    N = config.max_denoising_steps
    temps = [semantics.temperature(step, N, config.t_min, config.t_max) if config.uses_temperature else None
             for step in range(N, 0, -1)]
    cap = model.config.final_logit_softcapping
    bound = config.entropy_bound
    uniforms, noise, states = prefetch_draws(draws, N, B, C, V)
    s = 0 if stopper is None else stopper.stability_threshold
    gamma = 0.0 if stopper is None else float(np.float32(stopper.confidence_threshold))
    every = max(1, int(getattr(backend, "sync_every", SYNC_EVERY)))

    # every buffer a step reads or writes, fixed for the whole canvas (a captured step replays on them)
    u_dev, noise_dev = dev.to_device(uniforms.reshape(N, B * C)), dev.to_device(noise)
    temps_dev = dev.to_device(np.array([0.0 if t is None else t for t in temps], dtype=np.float32))
    step_dev = dev.zeros((1,), np.int32)  # the step index, advanced on the device by each step's last kernel
    state = dev.to_device(np.stack([canvas, canvas]).astype(np.int64))  # the canvas and the draft (it starts as it)
    canvas_dev, draft_dev = state[0], state[1]
    entropies_dev = dev.zeros((B, C), np.float32)
    finished_dev = dev.zeros((B,), np.uint8)
    finish_step = dev.empty((B,), np.int32)
    finish_step.fill(N)
    history = dev.empty((max(s, 1), B, C), np.int64)
    history.fill(-1)
    flags = dev.zeros((N, B * C), np.int32)
    status = dev.zeros((N + B,), np.int32)  # per step: its flag, then every row's finish step (dg_step_end)
    out = backend.outputs(B * C)
    argmax, entropy, sampled = out.argmax[:B * C], out.entropy[:B * C], out.sampled[:B * C]
    records = _Records(dev, N, B, C) if callback is not None else None
    logits = backend.buffer.reshape(B * C, V)
    bf16_sc = backend.sc_buffer().reshape(B * C, V) if getattr(model, "bf16", False) else None

    def tail(device: Any, rows: Any, step_cap: float) -> None:
        """A step after its decoder pass: sampling, acceptance and stop state, then the step index advances."""
        device.launch(gl.sample_step(logits, rows, step_cap, temps_dev, step_dev, u_dev, argmax, entropy, sampled,
                                     flags, bf16_sc))
        device.launch(gl.step_update(argmax, entropy, sampled, noise_dev, step_dev, bound, stopper is not None, s,
                                     gamma, canvas_dev, draft_dev, entropies_dev, finished_dev, finish_step, history,
                                     None if records is None else records.arrays()))
        device.launch(gl.step_end(flags, finish_step, status, step_dev))

    graphs = bool(getattr(backend, "graphs", False))
    plan = plan_key = direct_key = None  # the captured step, for the live rows plan_key
    live = np.arange(B)  # rows the host knows to be denoising (decoded and sampled)
    live_dev = flat_dev = None
    live_at: list[np.ndarray] = []  # the live rows of each issued step
    executed = None
    host_finish = np.full(B, N, dtype=np.int32)
    i = 0
    while executed is None and i < N:
        end = min(N, i + every)
        for j in range(i, end):
            n = live.shape[0]
            if flat_dev is None:
                flat_dev = dev.to_device(flat_rows(live, C))
                live_dev = None if n == B else dev.to_device(live)
            live_at.append(live)
            if backend.logits_hook is None:
                key = live.tobytes()
                if graphs and backend.has_sc and plan_key == key:
                    graph.replay(dev, plan)  # the whole step: one CUDA graph launch on a GPU
                elif graphs and backend.has_sc and direct_key == key:
                    # capture the whole step (graph.py): the decoder pass reads the canvas from a fixed buffer
                    canvas_in = canvas_dev if n == B else dev.empty((n, C), np.int64)
                    plan = graph.capture(dev, lambda rec, x=canvas_in, rows=live, flat=flat_dev, at=live_dev: (
                        _step_on(rec, model, backend, canvas_dev, x, at, rows, flat, tail, cap)))
                    plan_key = key
                else:
                    rows_canvas = canvas_dev if n == B else canvas_dev[live_dev]
                    model._decoder_logits(rows_canvas, backend.cache, live, backend.buffer, backend.has_sc,
                                          sc_probs=backend.sc_probs)
                    tail(dev, flat_dev, cap)
                    direct_key = key  # the pass's inputs are uploaded (model._decoder_inputs): capture next
            else:  # tests: host logits of the canvas replace the decoder (a copy each way, as in GpuBackend.step)
                hooked = np.asarray(backend.logits_hook(dev.to_host(canvas_dev), live), dtype=np.float32)
                backend.buffer[dev.to_device(live)] = dev.to_device(hooked[live])
                tail(dev, flat_dev, 0.0)
            backend.has_sc = True
            if bf16_sc is not None:  # from now on the decoder reads B8's probabilities (the first step may
                backend.sc_probs = backend.sc_buffer()  # have read a caller's, in the buffer)
        # the stop flag: whether each step of this stretch flagged a logit, then when each row stopped
        found = dev.to_host(status[i:end + B])
        stretch_flags, host_finish = found[:end - i], found[end - i:]
        if (host_finish < N).all():
            executed = int(host_finish.max()) + 1
        last = N if executed is None else executed
        for j in range(i, min(end, last)):
            if stretch_flags[j - i]:
                _raise_for_step(dev, flags[j], live_at[j], host_finish, j, B, C, temps[j])
        still = np.flatnonzero(host_finish == N)
        if executed is None and still.shape[0] != live.shape[0]:
            live, flat_dev = still, None
        i = end
    executed = N if executed is None else executed

    restore_draws(draws, states, executed)
    counted = np.minimum(host_finish.astype(np.int64) + 1, executed)
    forward_passes += np.where(ended, 0, counted)
    draft = dev.to_host(draft_dev)
    if records is not None:
        steps = records.to_host(dev, executed)
        for j in range(executed):
            temp = temps[j]
            notify(callback, "on_step", StepInfo(
                canvas_index=k, step=N - j, step_index=j, temperature=None if temp is None else float(temp),
                draft=readonly(steps["draft"][j]), sampled=readonly(steps["sampled"][j]),
                accepted=readonly(steps["accepted"][j]), canvas=readonly(steps["canvas"][j]),
                entropies=readonly(steps["entropies"][j]), finished=readonly(steps["finished"][j].copy()),
                max_steps=N, n_canvases=n_canvases))
    return semantics.commit(draft, canvas, host_finish < N), executed


def _step_on(device: Any, model: Any, backend: Any, canvas: Any, canvas_in: Any, live_dev: Any, rows: np.ndarray,
             flat: Any, tail: Any, cap: float) -> None:
    """One whole step issued to ``device`` (a capture's recorder): the live rows' canvas into the pass's fixed
    input (all rows: the canvas itself), the decoder pass with self-conditioning, then ``tail``."""
    if canvas_in is not canvas:
        device.xp.take(canvas, live_dev, axis=0, out=canvas_in)
    _decode_on(device, model, canvas_in, backend, rows)
    tail(device, flat, cap)


def _decode_on(device: Any, model: Any, canvas: Any, backend: Any, rows: np.ndarray) -> None:
    """The decoder pass of ``rows`` (with self-conditioning) issued to ``device`` (a capture's recorder)."""
    own = model.device
    model.device = device
    try:
        model._decoder_logits(canvas, backend.cache, rows, backend.buffer, True, sc_probs=backend.sc_probs)
    finally:
        model.device = own


def _raise_for_step(dev: Any, step_flags: Any, live: np.ndarray, finish: np.ndarray, j: int, B: int, C: int,
                    temp: Any) -> None:
    """Raise the reference's error for step ``j``'s first flagged position of a row still denoising then
    (step_flags: (B*C,), the flags of every row; rows not decoded at step ``j`` hold 0)."""
    host = dev.to_host(step_flags).reshape(B, C)[live]
    host[finish[live] < j] = 0  # a row that stopped before step j: its outputs were discarded
    if host.any():
        raise_for_flags(host.reshape(-1), flat_rows(live, C), C, temp)
