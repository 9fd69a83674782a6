"""A denoising step captured once and replayed: a CUDA graph on a GPU, the recorded plan of launches on cuda-sim.

Within a canvas, every step after the first with self-conditioning issues the same launches on the same
arrays (``canvas.py``): the decoder pass reads the canvas from one fixed buffer, the logits go to the
backend's one (B, C, V) buffer, the cache, positions and RoPE tables do not change, the sampling, acceptance
and stop-state kernels read the step index, temperature and draws from device memory, and every intermediate
array the step allocates is kept by the plan (so its address stays valid). ``capture(device, fn)`` runs ``fn(recorder)`` once, with a
device that records what the pass does:

* on cuda-sim (and any device whose array module is NumPy) the operations are executed as they are
  recorded (the capture is also that step's pass) and kept as a list: kernel launches (``launch.Launch``),
  array-module calls and the zero fills of ``zeros``. ``replay`` runs that list again through the same
  device: every launch through the executor, with its checks;
* on a GPU (``CupyDevice``) the same pass runs under CuPy's stream capture (relaxed mode) and becomes one
  CUDA graph; nothing is executed while capturing, so ``capture`` launches it once, and ``replay`` is one
  graph launch.

A copy between host and device or a synchronisation inside a captured pass is refused (``CaptureError``):
it would be a round trip the graph cannot hold. The plan's ``launches`` list what one replay runs
(``counting.CountingDevice`` counts a replay and its launches).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["Plan", "CaptureError", "capture", "replay", "run_plan", "on_gpu"]


class CaptureError(RuntimeError):
    """A captured pass asked for something a graph cannot hold (a host copy, a synchronisation)."""


class Plan:
    """One recorded pass: ``ops`` (kind, ...) in order, the arrays it owns (``keep``), the CUDA graph on a GPU."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.keep: list[Any] = []
        self.graph: Any = None
        self.stream: Any = None

    @property
    def launches(self) -> list:
        """The kernel launches one replay runs (array-module calls not included)."""
        return [op[1] for op in self.ops if op[0] == "launch"]

    def run(self, device: Any) -> None:
        """Execute the recorded operations again on ``device`` (cuda-sim's replay)."""
        for op in self.ops:
            kind = op[0]
            if kind == "launch":
                device.launch(op[1])
            elif kind == "zero":
                op[1].fill(0)
            else:  # an array-module call: into its ``out=``, or into the array it returned when recorded
                _, fn, args, kwargs, result = op
                value = fn(*args, **kwargs)
                if "out" not in kwargs and value is not result:
                    result[...] = value


class _RecordingXp:
    def __init__(self, xp: Any, plan: Plan):
        self._xp, self._plan = xp, plan

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._xp, name)
        if not callable(value) or isinstance(value, type):
            return value
        plan = self._plan
        base = getattr(getattr(self._xp, "_xp", self._xp), name)  # under a counting wrapper: the plain function

        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            plan.ops.append(("xp", base, args, kwargs, result))
            plan.keep.append(result)
            return result

        return recorded


class _Recorder:
    """The device a captured pass runs on: records launches, array calls and allocations into ``plan``."""

    def __init__(self, device: Any, plan: Plan):
        self.device, self.plan = device, plan
        self.xp = _RecordingXp(device.xp, plan)
        self.name = getattr(device, "name", "device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)

    def context(self) -> Any:
        return self.device.context()

    def launch(self, launch: Any) -> None:
        self.plan.ops.append(("launch", launch))
        self.device.launch(launch)

    def empty(self, shape: Any, dtype: Any) -> Any:
        out = self.device.empty(shape, dtype)
        self.plan.keep.append(out)
        return out

    def zeros(self, shape: Any, dtype: Any) -> Any:
        out = self.device.zeros(shape, dtype)
        self.plan.keep.append(out)
        self.plan.ops.append(("zero", out))
        return out

    def to_device(self, array: Any) -> Any:
        raise CaptureError(f"a copy to the device of {np.shape(array)} inside a captured pass")

    def to_host(self, array: Any) -> Any:
        raise CaptureError(f"a copy to the host of {getattr(array, 'shape', '?')} inside a captured pass")

    def synchronize(self) -> None:
        raise CaptureError("a synchronisation inside a captured pass")


def on_gpu(device: Any) -> bool:
    """Whether ``device`` (or a wrapper of one) computes with CuPy on a GPU."""
    return getattr(device.xp, "__name__", "") == "cupy"


def capture(device: Any, fn: Callable[[Any], None]) -> Plan:
    """Capture ``fn(recorder)`` (one pass) into a ``Plan``; the pass has run once when this returns."""
    plan = Plan()
    recorder = _Recorder(device, plan)
    if not on_gpu(device):
        fn(recorder)  # recorded as it executes
        return plan
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    relaxed = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)  # allocations may happen inside
    with stream:
        stream.begin_capture() if relaxed is None else stream.begin_capture(mode=relaxed)
        try:
            fn(recorder)
        finally:
            plan.graph = stream.end_capture()
    plan.stream = stream
    replay(device, plan)  # the capture executed nothing
    return plan


def replay(device: Any, plan: Plan) -> None:
    """Run ``plan`` once more: through ``device.replay`` when it has one (counted), else directly."""
    own = getattr(device, "replay", None)
    if own is not None:
        own(plan)
    else:
        run_plan(device, plan)


def run_plan(device: Any, plan: Plan) -> None:
    """What a device's ``replay`` does: one graph launch on the current stream (GPU), or the recorded list."""
    if plan.graph is not None:
        plan.graph.launch()
    else:
        plan.run(device)
