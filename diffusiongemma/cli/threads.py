"""Thread settings of the command line, chosen before NumPy (and its BLAS) is loaded.

NumPy's OpenBLAS and the fast path's OpenMP kernels each start one thread per core by default. On a machine
whose cores are busy with other work, that oversubscribes them: a BLAS call splits its work statically over
its threads and waits for the slowest, and a thread that shares its core with a busy process runs only every
few milliseconds, so every small matrix product waits a scheduler time slice (the shipped model ran 10-30x
slower with one busy background process on two cores). Threads that spin while they wait make it worse,
taking the cores from the threads doing the work.

``configure_threads`` therefore, when the user has set none of the thread variables:

* sizes OpenMP and every BLAS to the cores that are free now: the cores this process may use (CPU affinity,
  capped by a cgroup CPU quota) minus the runnable tasks of other processes, at least 1;
* makes OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``), so an idle worker sleeps instead of
  spinning.

An explicit setting wins: with any of ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``,
``GOTO_NUM_THREADS``, ``BLIS_NUM_THREADS`` in the environment, no count is changed (``OMP_WAIT_POLICY`` is
still defaulted to PASSIVE unless set).

The libraries read the variables once, when they load. Libraries loaded later (the fast path's OpenMP
runtime) follow the variables; a BLAS already loaded (importing the package loads NumPy) is limited at run
time with threadpoolctl. ``main`` calls this first, so importing the command line changes nothing.
"""

from __future__ import annotations

import os
import time
from typing import MutableMapping

COUNT_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GOTO_NUM_THREADS",
                   "BLIS_NUM_THREADS")  # the variables that set a thread count (any one set: user's choice)
_SET_BY_US = "DIFFUSIONGEMMA_THREADS"  # records the count chosen here (read back by ``describe``)


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


def busy_cores(samples: int = 5, interval: float = 0.002, loadavg: str = "/proc/loadavg") -> int:
    """Runnable tasks of other processes right now: the median over ``samples`` readings of the kernel's
    count of runnable tasks (``/proc/loadavg``, 4th field), minus this process. 0 where /proc is missing."""
    counts = []
    for n in range(samples):
        try:
            with open(loadavg, encoding="ascii") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # minus the reading process
        except (OSError, ValueError, IndexError):
            return 0
        if n + 1 < samples:
            time.sleep(interval)
    counts.sort()
    return max(counts[len(counts) // 2], 0)


def choose_thread_count() -> int:
    """The cores free for this run: usable cores minus busy ones, at least 1."""
    return max(1, usable_cores() - busy_cores())


_limits = None  # the threadpoolctl limiter in force (kept referenced for the life of the process)


def configure_threads(environ: MutableMapping[str, str] | None = None, *, limit_loaded: bool = True) -> int | None:
    """Set the thread variables in ``environ`` (default ``os.environ``) as the module docstring says, and
    (``limit_loaded``) limit the BLAS libraries already loaded to the same count.

    Returns the thread count set, or None when the user's own setting was kept.
    """
    global _limits
    environ = os.environ if environ is None else environ
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if any(name in environ for name in COUNT_VARIABLES):
        return None
    count = choose_thread_count()
    for name in COUNT_VARIABLES:
        environ[name] = str(count)
    environ[_SET_BY_US] = str(count)
    if limit_loaded:
        from threadpoolctl import threadpool_limits

        _limits = threadpool_limits(limits=count, user_api="blas")
    return count


def blas_threads() -> list[int]:
    """Threads of every BLAS library loaded in this process, as threadpoolctl reports them."""
    from threadpoolctl import threadpool_info

    return [int(info["num_threads"]) for info in threadpool_info() if info.get("user_api") == "blas"]


def describe(environ: MutableMapping[str, str] | None = None) -> dict:
    """What the run uses: ``{"threads": n or None, "chosen_by": "diffusiongemma" | "environment" | "library
    default", "wait_policy": ..., "blas_threads": [threads of each loaded BLAS]}`` (``generate --json``)."""
    environ = os.environ if environ is None else environ
    ours = environ.get(_SET_BY_US)
    given = next((environ[name] for name in COUNT_VARIABLES if name in environ), None)
    if ours is not None and given == ours:
        chosen_by = "diffusiongemma"
    elif given is not None:
        chosen_by = "environment"
    else:
        chosen_by = "library default"
    try:
        threads = int(given) if given is not None else None
    except ValueError:
        threads = None
    return {"threads": threads, "chosen_by": chosen_by, "wait_policy": environ.get("OMP_WAIT_POLICY"),
            "blas_threads": blas_threads()}
