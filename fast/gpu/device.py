"""The GPU devices: CuPy arrays on one CUDA GPU and the kernels of ``fast/gpu/cuda`` compiled by NVRTC
(``CupyDevice``), or the same kernels executed on the CPU with checks (``sim.SimDevice``, "cuda-sim").

The host code of the GPU path talks to a device only through the small interface of ``CupyDevice``
(``xp``, ``launch``, ``empty``, ``zeros``, ``to_device``, ``to_host``, ``synchronize``, ``context``).
``make_device(name)`` maps a device string to a device.
"""

from __future__ import annotations

from typing import Any

import numpy as np


from diffusiongemma.reference.support.errors import InputError


from . import launch as gl
from .build import NVRTC_OPTIONS  # the one compile mode of the kernels (see build.py)

__all__ = ["CupyDevice", "gpu_available", "device_index", "make_device", "DEVICE_NAMES"]

#: The device strings ``make_device`` accepts (N: a GPU index).
DEVICE_NAMES = ("cuda", "cuda:N", "cuda-sim")


def make_device(name: str):
    """The device named ``name``: "cuda" / "cuda:N" -> ``CupyDevice`` (GPU 0 / GPU N); "cuda-sim" ->
    ``sim.SimDevice()``: the kernels run on the CPU by the executor of ``fast/gpu/sim``, with its bounds,
    race, divergence and schedule checks on (every launch runs twice). Raises ``InputError`` for any other
    string, ``RuntimeError`` when the device is not usable here (no CuPy or GPU; no C++ compiler for a
    run-time build of the simulator)."""
    if name == "cuda-sim":
        from .sim import SimDevice

        return SimDevice()
    if not isinstance(name, str) or not (name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise InputError(f"device must be 'cuda', 'cuda:N' or 'cuda-sim', got {name!r}")
    return CupyDevice(name)



# ================================================================================================ devices
class CupyDevice:
    """The real device: CuPy arrays on one CUDA GPU and the kernels of ``fast/gpu/cuda`` compiled by NVRTC.

    device: "cuda" (GPU 0) or "cuda:N". Raises ``RuntimeError`` when CuPy is not installed, when no CUDA
    driver/GPU is usable, or when the kernels do not compile (with the compiler log), and ``InputError`` for
    a malformed device string.
    """

    def __init__(self, device: str = "cuda"):
        index = device_index(device)
        try:
            import cupy
        except ImportError as error:
            raise RuntimeError("the GPU backend needs CuPy, which is not installed: pip install "
                               "'diffusiongemma[gpu]' (cupy-cuda12x), or cupy-cuda13x for a CUDA 13 driver") from error
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # CUDARuntimeError: no driver, no device, driver too old
            raise RuntimeError(f"CuPy is installed but no usable CUDA GPU was found ({error})") from error
        if index >= count:
            raise RuntimeError(f"device {device!r} asked for GPU {index}, but {count} CUDA GPU(s) are visible")
        from .build import assemble_all

        self.xp = cupy
        self.name = f"cuda:{index}"
        self._device = cupy.cuda.Device(index)
        #: "sm_XY" and cudaDevAttrMaxSharedMemoryPerBlockOptin of this GPU (the limits launch.check_resources
        #: applies; cuda-sim applies launch.SHARED_OPT_IN_LIMITS[target], checked against this on a GPU)
        self.arch = f"sm_{self._device.compute_capability}"
        self.opt_in_limit = int(self._device.attributes["MaxSharedMemoryPerBlockOptin"])
        self._source = assemble_all()
        self._kernels: dict[str, Any] = {}
        self._opted_in: dict[str, int] = {}
        with self._device:
            try:  # compile now, so that a broken toolchain fails here and not mid-generation
                for name in gl.signatures():
                    self._kernel(name).compile()
            except Exception as error:
                raise RuntimeError(f"the CUDA kernels did not compile on {self.name}: {error}") from error

    def _kernel(self, name: str):
        kernel = self._kernels.get(name)
        if kernel is None:
            # every kernel shares one source text: CuPy compiles it once and caches the module
            kernel = self.xp.RawKernel(self._source, name, options=NVRTC_OPTIONS)
            self._kernels[name] = kernel
        return kernel

    def context(self):
        return self._device

    def launch(self, launch: gl.Launch) -> None:
        kernel = self._kernel(launch.kernel)
        # refuse what the driver would refuse, with the text cuda-sim gives, and opt in when static + dynamic
        # shared memory exceeds 48 KiB (the static part counts: a launch of 47 KiB dynamic may need it)
        need = gl.check_resources(launch, kernel.shared_size_bytes, kernel.max_threads_per_block,
                                  self.opt_in_limit, self.arch)
        if need > self._opted_in.get(launch.kernel, 0):
            kernel.max_dynamic_shared_size_bytes = need
            self._opted_in[launch.kernel] = need
        args = tuple(np.uint64(0) if a is None else a for a in launch.args)  # None would not be NULL in CuPy
        kernel(launch.grid, launch.block, args, shared_mem=launch.shared_mem)

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def to_device(self, array: np.ndarray):
        return self.xp.asarray(np.ascontiguousarray(array))

    def to_host(self, array) -> np.ndarray:
        return self.xp.asnumpy(array)

    def synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()

    def replay(self, plan: Any) -> None:
        """Launch a captured pass (``graph.Plan``: one CUDA graph launch on the current stream)."""
        from .graph import run_plan

        run_plan(self, plan)

    def available_memory(self) -> int | None:
        """Bytes this GPU can still allocate: the driver's free memory plus what CuPy's pool holds unused."""
        try:
            with self._device:
                free = int(self.xp.cuda.runtime.memGetInfo()[0])
            pool = self.xp.get_default_memory_pool()
            return free + int(pool.free_bytes())
        except Exception:  # noqa: BLE001  (an unknown amount: the allocation itself will tell)
            return None


def device_index(device: str) -> int:
    if not isinstance(device, str):
        raise InputError(f"device must be a string like 'cuda' or 'cuda:1', got {device!r}")
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    raise InputError(f"device must be 'cuda' or 'cuda:N', got {device!r}")


def gpu_available() -> tuple[bool, str]:
    """(True, description) when CuPy imports and sees a CUDA GPU, else (False, the reason). Never raises."""
    try:
        import cupy
    except ImportError as error:
        return False, f"CuPy is not installed ({error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:
        return False, f"CuPy cannot reach a CUDA GPU ({error})"
    if count == 0:
        return False, "no CUDA GPU is visible"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props.get("name"), bytes) else props.get("name")
    return True, f"{count} GPU(s), GPU 0 = {name}, CuPy {cupy.__version__}"

