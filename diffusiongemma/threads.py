"""Thread sizing of BLAS and OpenMP, the same for the library and the command line.

NumPy's OpenBLAS and the fast path's OpenMP kernels each start one thread per core by default. On a machine
whose cores are busy with other work, that oversubscribes them: a BLAS call splits its work statically over
its threads and waits for the slowest, and a thread that shares its core with a busy process runs only every
few milliseconds, so every small matrix product waits a scheduler time slice (the shipped model ran 10-30x
slower with one busy background process on two cores). Threads that spin while they wait make it worse,
taking the cores from the threads doing the work.

``configure`` therefore sizes this process's thread pools:

* to ``threads`` when given (``configure(threads=2)``, ``diffusiongemma generate --threads 2``);
* else, when the environment sets a count (any of ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
  ``MKL_NUM_THREADS``, ``GOTO_NUM_THREADS``, ``BLIS_NUM_THREADS``), to nothing: the user's setting wins;
* else to the cores that are free now: the cores this process may use (CPU affinity, capped by a cgroup CPU
  quota) minus the runnable tasks of other processes, at least 1. This process's own threads are not load:
  the runnable count of ``/proc/loadavg`` is taken less this process's threads in state R
  (``/proc/self/task``), so an OpenBLAS worker still spinning after ``import numpy`` is not counted.

A count above the cores this process may use (``usable_cores``) is refused (``ValueError`` naming the value
and the limit): more threads than cores only take turns on them, and every BLAS call waits for the last.

Only this package's thread pools are sized: NumPy's BLAS and the GNU OpenMP runtime of the fast path's
kernels. The OpenMP and BLAS libraries that torch bundles (``torch/lib``) are left as the caller set them, so
``torch.get_num_threads()`` is the same before and after ``import diffusiongemma``; where torch was imported
first and its OpenMP runtime is the one the kernels then share, the kernels run on torch's count.

Importing ``diffusiongemma`` calls ``configure()`` once, so ``generate`` and the models run on the same
threads from Python as from the command line. Nothing is written to ``os.environ``: the BLAS libraries
already loaded are limited at run time (threadpoolctl), and GNU OpenMP, which reads its settings only once,
when it loads, is loaded here with passive waits (``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy:
an idle worker sleeps instead of spinning) and the chosen count in the environment for the duration of that
load only. Child processes therefore start from the user's own environment and size themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time
from typing import Mapping

__all__ = ["COUNT_VARIABLES", "usable_cores", "busy_cores", "choose_thread_count", "configure", "describe",
           "blas_threads", "check_thread_count", "own_running_threads"]

COUNT_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS",
                   "BLIS_NUM_THREADS")  # the variables that set a thread count (any one set: the user's choice)
WAIT_VARIABLE = "OMP_WAIT_POLICY"

# What ``configure`` last did: the count it set (None: none set), who chose it, the OpenMP wait policy.
_state: dict = {"threads": None, "chosen_by": "library default", "wait_policy": None}
_openmp = {"loaded": False, "wait_policy": None}  # GNU OpenMP, loaded by ``_load_openmp`` (once per process)


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (``cpu.max``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(cores, 1)


def own_running_threads(tasks: str = "/proc/self/task") -> int:
    """Threads of this process in state R (running or runnable) now, from ``tasks/*/stat``; at least 1 (the
    thread reading them), and 1 where the folder cannot be read."""
    running = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return 1
    for name in names:
        try:
            with open(os.path.join(tasks, name, "stat"), encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
        running += bool(fields) and fields[0] == "R"
    return max(running, 1)


def busy_cores(samples: int = 5, interval: float = 0.002, loadavg: str = "/proc/loadavg",
               tasks: str = "/proc/self/task") -> int:
    """Runnable tasks of other processes right now: the median over ``samples`` readings of the kernel's
    count of runnable tasks (``/proc/loadavg``, 4th field) less this process's running threads
    (``own_running_threads``: the reading thread, and e.g. BLAS workers still spinning). 0 where /proc is
    missing."""
    counts = []
    for n in range(samples):
        try:
            with open(loadavg, encoding="ascii") as f:
                runnable = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        counts.append(runnable - own_running_threads(tasks))
        if n + 1 < samples:
            time.sleep(interval)
    counts.sort()
    return max(counts[len(counts) // 2], 0)


def choose_thread_count() -> int:
    """The cores free for this run: usable cores minus busy ones, at least 1."""
    return max(1, usable_cores() - busy_cores())


def users_count(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, value) of the first thread-count variable set in ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return next(((name, environ[name]) for name in COUNT_VARIABLES if name in environ), None)


def _gomp_loaded() -> bool:
    """Whether a GNU OpenMP runtime named libgomp.so.1 is mapped into this process already."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in f)
    except OSError:  # pragma: no cover - not Linux
        return True  # cannot tell: leave the runtime to load as it will


def _load_openmp(count: int | None) -> None:
    """Load GNU OpenMP (the runtime the fast path's kernels link) with passive waits and ``count`` threads.

    libgomp reads ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS`` once, when it loads; the kernels' extension,
    loaded later, shares this copy. The variables are set for the load only and restored at once."""
    if _openmp["loaded"]:
        return
    _openmp["loaded"] = True
    # on Linux the loader finds libgomp by its soname at no cost; find_library runs ldconfig (30-50 ms a start)
    name = "libgomp.so.1" if sys.platform.startswith("linux") else ctypes.util.find_library("gomp")
    if name is None or _gomp_loaded():
        _openmp["wait_policy"] = os.environ.get(WAIT_VARIABLE)
        return
    temporary = {WAIT_VARIABLE: os.environ.get(WAIT_VARIABLE) or "PASSIVE"}
    if count is not None:
        temporary["OMP_NUM_THREADS"] = str(count)
    saved = {key: os.environ.get(key) for key in temporary}
    try:
        os.environ.update(temporary)
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        _openmp["wait_policy"] = temporary[WAIT_VARIABLE]
    except OSError:  # pragma: no cover - a broken installation: the kernels will say so when they load
        _openmp["wait_policy"] = saved[WAIT_VARIABLE]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_thread_count(threads, what: str = "threads") -> int:
    """``threads`` when it is an integer from 1 to ``usable_cores()``; else ``ValueError`` naming ``what``, the
    value and the limit."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{what} must be a positive integer, got {threads!r}")
    limit = usable_cores()
    if threads > limit:
        raise ValueError(f"{what} {threads} is more than this machine can run at once: this process may use "
                         f"{limit} core{'s' if limit != 1 else ''} (CPU affinity and cgroup quota); give 1 to {limit}")
    return threads


def configure(threads: int | None = None) -> int | None:
    """Size BLAS and OpenMP as the module docstring says; returns the count set, or None when the
    environment's own setting was kept. ``threads``: a count from 1 to ``usable_cores()`` that wins over
    everything (``ValueError`` otherwise, naming the value and the limit)."""
    if threads is not None:
        count, chosen_by = check_thread_count(threads, "threads="), "threads="
    elif users_count() is not None:
        count, chosen_by = None, "environment"
    else:
        count, chosen_by = choose_thread_count(), "diffusiongemma"
    _state.pop("reference_blas_threads", None)
    _load_openmp(count)
    if count is None:
        _AFTER_NUMPY.count = None  # no longer limit a NumPy loaded later (the user's setting wins now)
    else:
        _limit_pools(count, "openmp")
        _limit_blas_when_loaded(count)
    _state.update(threads=count, chosen_by=chosen_by, wait_policy=os.environ.get(WAIT_VARIABLE)
                  or _openmp["wait_policy"])
    return count


def cap_blas_to_free_cores() -> tuple[int, int] | None:
    """For a run whose only parallelism is BLAS (the reference): limit the loaded BLAS to the cores free now
    (``choose_thread_count``) when it has more threads; returns (threads before, threads now) when it did,
    else None. Why: the reference makes many small BLAS calls, each split statically over the BLAS threads
    and waiting for the slowest, and OpenBLAS's workers spin between calls, so on busy cores two threads ran
    the shipped model 5-16x slower than one. The fast path needs no cap: its kernels run BLAS serially, tile
    by tile, on OpenMP threads with dynamic schedules. Recorded as ``reference_blas_threads`` in ``describe``."""
    current = max(blas_threads(), default=1)
    free = choose_thread_count()
    if current <= free:
        return None
    _limit_pools(free, "blas")
    _state["reference_blas_threads"] = free
    return current, free


def _bundled_by_torch(filepath: str | None) -> bool:
    """Whether a loaded library is one of torch's own (``.../torch/lib/...``): its thread count is torch's."""
    parts = os.path.normpath(filepath or "").split(os.sep)
    return any(a == "torch" and b == "lib" for a, b in zip(parts, parts[1:]))


def _limit_pools(count: int, user_api: str) -> None:
    """Set ``count`` threads on the loaded libraries of ``user_api`` ("blas" or "openmp"), torch's excepted."""
    from threadpoolctl import ThreadpoolController

    for lib in ThreadpoolController().select(user_api=user_api).lib_controllers:
        if not _bundled_by_torch(lib.filepath):
            lib.set_num_threads(count)


def _limit_blas(count: int) -> None:
    _limit_pools(count, "blas")


class _AfterNumpy:
    """An import hook that limits NumPy's BLAS as soon as NumPy has been imported, so that importing the
    package does not import NumPy itself (a command's start-up stays light, and a Ctrl-C while NumPy loads
    reaches the command, which reports it in one line)."""

    count: int | None = None

    def find_spec(self, name, path=None, target=None):
        if name != "numpy" or self.count is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run, hook = spec.loader.exec_module, self

                def exec_module(module, _run=run):
                    _run(module)
                    count, hook.count = hook.count, None
                    if count is not None:
                        _limit_blas(count)

                spec.loader.exec_module = exec_module
                return spec
        return None


_AFTER_NUMPY = _AfterNumpy()


def _limit_blas_when_loaded(count: int) -> None:
    """Limit the BLAS now if NumPy is loaded, else as soon as it is."""
    if "numpy" in sys.modules:
        _AFTER_NUMPY.count = None
        _limit_blas(count)
        return
    _AFTER_NUMPY.count = count
    if _AFTER_NUMPY not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_NUMPY)


def blas_threads() -> list[int]:
    """Threads of every BLAS library loaded in this process that ``configure`` sizes (torch's own excepted), as
    threadpoolctl reports them."""
    from threadpoolctl import threadpool_info

    return [int(info["num_threads"]) for info in threadpool_info()
            if info.get("user_api") == "blas" and not _bundled_by_torch(info.get("filepath"))]


def describe() -> dict:
    """What the process uses: ``{"threads": n or None, "chosen_by": "diffusiongemma" | "threads=" |
    "environment" | "library default", "wait_policy": ..., "blas_threads": [threads of each loaded BLAS]}``
    (``generate --json``)."""
    threads, chosen_by = _state["threads"], _state["chosen_by"]
    if chosen_by == "environment":
        try:
            threads = int(users_count()[1])
        except (TypeError, ValueError):
            threads = None
    described = {"threads": threads, "chosen_by": chosen_by, "wait_policy": _state["wait_policy"],
                 "blas_threads": blas_threads()}
    if _state.get("reference_blas_threads") is not None:
        described["reference_blas_threads"] = _state["reference_blas_threads"]
    return described
