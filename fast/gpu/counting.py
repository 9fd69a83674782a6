"""What the GPU path asks of its device, counted: transfers, synchronisations, launches, graph replays and
memory, per phase of a run.

``CountingDevice(device)`` wraps any device of ``fast.gpu`` (``CupyDevice`` on a GPU, ``sim.SimDevice`` for
"cuda-sim") and forwards every call to it, counting on the way:

* ``d2h`` / ``d2h_bytes``: ``to_host`` calls (device -> host copies) and their bytes;
* ``h2d`` / ``h2d_bytes``: ``to_device`` calls (host -> device copies) and their bytes;
* ``syncs``: ``synchronize`` calls. On a GPU every ``to_host`` also waits for the stream, so a run's
  synchronisations are ``syncs + d2h`` (``waits`` below);
* ``launches``: kernels issued one by one from Python (``launch``), per kernel name in ``kernels``;
* ``xp_calls``: calls of the array module (``xp.matmul``, ``xp.where``, ...): each is at least one launch
  on a GPU (cuBLAS, CuPy's elementwise kernels), issued from Python;
* ``replays``: replays of a captured step (``replay``: one CUDA graph launch on a GPU, the recorded plan
  of launches executed by cuda-sim's executor), and ``replayed_launches``, the kernels they contain;
* ``allocated_bytes`` / ``peak_live_bytes``: bytes of every ``empty`` / ``zeros`` / ``to_device`` array,
  and the most bytes alive at once (an array stops counting when it is garbage collected). With
  ``limit_bytes``, an allocation that would bring the live bytes above it raises ``AllocationLimitError``
  naming its shape, so that a test sized for a real GPU can be checked on the CPU.

``mark(label)`` closes the current phase under ``label``; ``phases`` lists (label, ``Counts``) in order,
``counts`` is the total. Only what goes through the device object is seen: an implicit copy made by the
array module itself (``int(cupy_array)``, indexing a device array with a host array) is not. The GPU path
is written so that each of its transfers is an explicit ``to_host`` / ``to_device``.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["Counts", "CountingDevice", "AllocationLimitError"]


class AllocationLimitError(MemoryError):
    """An allocation would take the device's live bytes above ``CountingDevice.limit_bytes``."""


@dataclass
class Counts:
    """Counters of one phase (or of the whole run). See the module docstring."""

    d2h: int = 0
    d2h_bytes: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    syncs: int = 0
    launches: int = 0
    xp_calls: int = 0
    replays: int = 0
    replayed_launches: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    kernels: collections.Counter = field(default_factory=collections.Counter)

    @property
    def waits(self) -> int:
        """Host waits for the device: explicit synchronisations plus the copies back (each waits)."""
        return self.syncs + self.d2h

    @property
    def python_launches(self) -> int:
        """Launches issued from Python: kernels one by one, array-module calls and graph replays."""
        return self.launches + self.xp_calls + self.replays

    def add(self, other: "Counts") -> None:
        for f in fields(self):
            if f.name == "kernels":
                self.kernels.update(other.kernels)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kernels"}
        out.update(waits=self.waits, python_launches=self.python_launches)
        return out


class _CountingXp:
    """The wrapped device's array module; a call of one of its functions counts as one Python-issued launch
    (type objects such as ``xp.float32`` and non-callables are passed through uncounted)."""

    def __init__(self, xp: Any, owner: "CountingDevice"):
        self._xp, self._owner = xp, owner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._xp, name)
        if not callable(value) or isinstance(value, type):
            return value
        owner = self._owner

        def counted(*args: Any, **kwargs: Any) -> Any:
            owner._current.xp_calls += 1
            return value(*args, **kwargs)

        return counted


class CountingDevice:
    """``device`` with every transfer, synchronisation, launch, replay and allocation counted (module
    docstring). limit_bytes: None, or the most device bytes that may be alive at once."""

    def __init__(self, device: Any, limit_bytes: int | None = None):
        self.device = device
        self.limit_bytes = limit_bytes
        self.name = getattr(device, "name", type(device).__name__)
        self.xp = _CountingXp(device.xp, self)
        self.phases: list[tuple[str, Counts]] = []
        self._current = Counts()
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def __getattr__(self, name: str) -> Any:  # anything not counted: the wrapped device's
        return getattr(self.device, name)

    # ------------------------------------------------------------------ phases
    def mark(self, label: str) -> Counts:
        """Close the current phase under ``label`` and return its counts."""
        done, self._current = self._current, Counts()
        self.phases.append((label, done))
        return done

    @property
    def counts(self) -> Counts:
        total = Counts()
        for _, c in self.phases:
            total.add(c)
        total.add(self._current)
        return total

    # ------------------------------------------------------------------ memory
    def _track(self, array: Any) -> Any:
        nbytes = int(array.nbytes)
        self._current.allocations += 1
        self._current.allocated_bytes += nbytes
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        try:
            weakref.finalize(array, self._release, nbytes)
        except TypeError:  # an array type without weak references: counted as alive for good
            pass
        return array

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _check(self, shape: Any, dtype: Any) -> None:
        if self.limit_bytes is None:
            return
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if self.live_bytes + nbytes > self.limit_bytes:
            raise AllocationLimitError(
                f"allocating {shape} {np.dtype(dtype).name} ({nbytes / 2**20:.1f} MiB) would hold "
                f"{(self.live_bytes + nbytes) / 2**20:.1f} MiB on the device, over the limit of "
                f"{self.limit_bytes / 2**20:.1f} MiB")

    # ------------------------------------------------------------------ the device interface
    def context(self) -> Any:
        return self.device.context()

    def empty(self, shape: Any, dtype: Any) -> Any:
        self._check(shape, dtype)
        return self._track(self.device.empty(shape, dtype))

    def zeros(self, shape: Any, dtype: Any) -> Any:
        self._check(shape, dtype)
        return self._track(self.device.zeros(shape, dtype))

    def to_device(self, array: Any) -> Any:
        host = np.asarray(array)
        self._check(host.shape, host.dtype)
        self._current.h2d += 1
        self._current.h2d_bytes += int(host.nbytes)
        return self._track(self.device.to_device(host))

    def to_host(self, array: Any) -> np.ndarray:
        out = self.device.to_host(array)
        self._current.d2h += 1
        self._current.d2h_bytes += int(out.nbytes)
        return out

    def synchronize(self) -> None:
        self._current.syncs += 1
        self.device.synchronize()

    def launch(self, launch: Any) -> None:
        self._current.launches += 1
        self._current.kernels[launch.kernel] += 1
        self.device.launch(launch)

    def replay(self, graph: Any) -> None:
        """Replay a captured step (``graph.replay`` on the wrapped device)."""
        self._current.replays += 1
        self._current.replayed_launches += len(getattr(graph, "launches", ()))
        self.device.replay(graph)


def count_generate(model: Any, input_ids: Any, **generate_kwargs: Any) -> tuple[Any, list[dict]]:
    """Run ``model.generate``'s loop (``fast.gpu.generate``) on a model whose device is a ``CountingDevice``
    and split the counts by canvas. Returns (the ``GenerationResult``, one dict per canvas: "encode" (the
    encode before it), "canvas" (its denoising steps and commit, up to the next encode) and "steps")."""
    from .model import generate

    dev = model.device
    if not isinstance(dev, CountingDevice):
        raise TypeError(f"count_generate needs a model on a CountingDevice, got {type(dev).__name__}")

    def encoder(ids: Any, cache: Any, mask: Any) -> None:
        dev.mark("canvas")  # what came before this encode (the previous canvas, or the set-up)
        model._encode(ids, cache, mask, return_hidden=False)
        dev.mark("encode")

    result = generate(model, input_ids, encoder=encoder, **generate_kwargs)
    dev.mark("canvas")
    phases = dev.phases
    start = next(i for i, (label, _) in enumerate(phases) if label == "encode")
    canvases = []
    for k, steps in enumerate(result.steps_per_canvas):
        encode, canvas = phases[start + 2 * k][1], phases[start + 2 * k + 1][1]
        canvases.append({"encode": encode, "canvas": canvas, "steps": int(steps)})
    return result, canvases
