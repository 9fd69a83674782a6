"""Thread sizing (diffusiongemma/threads.py), the same from Python and from the command line: the free cores,
passive OpenMP waits, a user's own setting kept, ``threads=`` / ``--threads`` winning, and nothing written
to the environment (an in-process run of the command line must leave ``os.environ`` as it found it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy  # noqa: F401  (the BLAS these tests size is NumPy's: loaded here, not by whichever plugin ran first)
import pytest

from diffusiongemma import threads


@pytest.fixture
def cores(monkeypatch):
    def set_cores(usable, busy):
        monkeypatch.setattr(threads, "usable_cores", lambda: usable)
        monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    return set_cores


@pytest.fixture
def no_thread_variables(monkeypatch):
    for name in threads.COUNT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("usable,busy,expected", [(2, 0, 2), (2, 1, 1), (2, 2, 1), (2, 7, 1), (1, 0, 1)])
def test_thread_count_is_the_free_cores(cores, no_thread_variables, usable, busy, expected):
    cores(usable, busy)
    before = dict(os.environ)
    assert threads.configure() == expected
    assert dict(os.environ) == before  # nothing written to the environment
    described = threads.describe()
    assert (described["threads"], described["chosen_by"]) == (expected, "diffusiongemma")
    assert described["blas_threads"] and set(described["blas_threads"]) == {expected}  # the loaded BLAS itself


@pytest.mark.parametrize("given", threads.COUNT_VARIABLES)
def test_a_users_setting_wins(cores, no_thread_variables, monkeypatch, given):
    cores(2, 0)
    threads.configure(threads=1)
    monkeypatch.setenv(given, "3")
    before = dict(os.environ)
    assert threads.configure() is None
    assert dict(os.environ) == before
    described = threads.describe()
    assert (described["threads"], described["chosen_by"]) == (3, "environment")
    assert set(described["blas_threads"]) == {1}  # left as it was: the user's variable is the user's business


def test_an_explicit_count_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.configure(threads=1) == 1
    described = threads.describe()
    assert (described["threads"], described["chosen_by"], set(described["blas_threads"])) == (1, "threads=", {1})
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            threads.configure(threads=bad)


def _tasks(folder, states) -> str:
    """A fake /proc/self/task: one thread per state letter (a name with spaces and a ')' as real ones may)."""
    for n, state in enumerate(states):
        (folder / str(100 + n)).mkdir(parents=True)
        (folder / str(100 + n) / "stat").write_text(f"{100 + n} (python3 (x) y) {state} 1 2 3 4\n")
    return str(folder)


def test_busy_cores_reads_the_runnable_count(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("1.50 1.20 0.80 4/312 12345\n")
    one = _tasks(tmp_path / "one", "RSS")  # only the reading thread runs
    assert threads.busy_cores(samples=3, interval=0, loadavg=str(loadavg), tasks=one) == 3
    assert threads.busy_cores(loadavg=str(tmp_path / "missing")) == 0


def test_this_processs_own_threads_are_not_load(tmp_path):
    """#33: after `import numpy`, OpenBLAS's worker of this very process still spins (state R) and was counted
    as another process's load, so `import numpy; import diffusiongemma` picked 1 thread on an idle 2-core
    machine. Three running threads of our own and a runnable count of 3: nothing else is busy."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.10 0.10 0.10 3/312 12345\n")
    ours = _tasks(tmp_path / "task", "RRSRS")
    assert threads.own_running_threads(ours) == 3
    assert threads.busy_cores(samples=3, interval=0, loadavg=str(loadavg), tasks=ours) == 0
    assert threads.own_running_threads(str(tmp_path / "missing")) == 1  # unreadable: the reader itself


def test_an_idle_two_core_machine_with_numpy_loaded_first_picks_two(monkeypatch, no_thread_variables, tmp_path):
    """The same through configure: 2 usable cores, the runnable count made only of this process's threads."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.00 0.00 0.00 2/100 1\n")
    ours = _tasks(tmp_path / "task", "RR")  # the importing thread and a spinning BLAS worker
    real = threads.busy_cores
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: real(samples=3, interval=0, loadavg=str(loadavg), tasks=ours))
    assert threads.configure() == 2


def test_own_running_threads_sees_threads_that_run(tmp_path):
    import hashlib
    import threading

    data, stop = bytes(32 << 20), threading.Event()

    def spin():
        while not stop.is_set():
            hashlib.sha256(data).digest()  # hashing releases the GIL: the thread stays runnable

    workers = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        seen = max(threads.own_running_threads() for _ in range(200))
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert seen >= 2, seen  # the reader and at least one hashing thread at the same reading


TORCH_UNTOUCHED = r"""
import json
import torch
torch.set_num_threads(2)
import numpy
import diffusiongemma
from diffusiongemma import threads
after_import = torch.get_num_threads()
threads.configure(threads=1)
print(json.dumps([after_import, torch.get_num_threads(), threads.describe()["blas_threads"]]))
"""


def test_the_callers_torch_threads_are_left_alone():
    """#33: sizing the package's pools capped torch's intra-op threads (torch's own OpenMP runtime) too."""
    proc = subprocess.run([sys.executable, "-c", TORCH_UNTOUCHED], capture_output=True, text=True, env=clean_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    after_import, after_configure, blas = json.loads(proc.stdout)
    assert (after_import, after_configure) == (2, 2)
    assert blas == [1]  # NumPy's BLAS is still sized


@pytest.mark.parametrize("count", [100000, 2**63, 10**30])
def test_thread_counts_above_the_usable_cores_are_refused(count, capsys):
    from diffusiongemma.cli.main import main

    limit = threads.usable_cores()
    with pytest.raises(ValueError, match=rf"threads= {count} is more than .* {limit} core.*give 1 to {limit}"):
        threads.configure(threads=count)
    for command in (["generate", "And God said"], ["trace", "--prompt", "And God said", "-o", "x.trace"]):
        assert main([*command, "--threads", str(count)]) == 2
        err = capsys.readouterr().err
        assert err == (f"diffusiongemma {command[0]}: error: --threads {count} is more than this machine can run at "
                       f"once: this process may use {limit} core{'s' if limit != 1 else ''} (CPU affinity and cgroup "
                       f"quota); give 1 to {limit}\n")
    assert threads.configure(threads=limit) == limit


def test_the_reference_never_runs_blas_on_more_threads_than_free_cores(monkeypatch, capsys):
    """#33: --threads 2 on the reference ran 5-16x slower than --threads 1 on two busy cores (OpenBLAS splits
    each small product over both and waits for the descheduled one). With one core free the reference's BLAS
    runs on one thread, with a note; the fast path keeps the count (its BLAS runs serially in its kernels)."""
    from diffusiongemma.cli.main import main

    if threads.usable_cores() < 2:
        pytest.skip("one usable core: no count above it can be given")
    monkeypatch.setattr(threads, "busy_cores", lambda: threads.usable_cores() - 1)
    args = ["generate", "And God said", "-n", "8", "--steps", "2", "--seed", "1", "--json", "--threads", "2"]
    assert main([*args, "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    described = json.loads(captured.out)["threads"]
    assert described["threads"] == 2 and described["reference_blas_threads"] == 1
    assert set(described["blas_threads"]) == {1}  # NumPy's, and SciPy's when a test has loaded it
    assert "--threads 2: 1 core free now, so the reference's BLAS runs on 1" in captured.err
    assert main([*args, "--backend", "cpu"]) == 0
    described = json.loads(capsys.readouterr().out)["threads"]
    assert set(described["blas_threads"]) == {2} and "reference_blas_threads" not in described


def test_an_in_process_run_leaves_the_environment_alone(capsys):
    """The cause of an order-dependent failure once: ``main`` wrote its choice into os.environ, which every
    later test and child process then read as the user's own setting."""
    from diffusiongemma.cli.main import main

    before = dict(os.environ)
    assert main(["generate", "And God said", "-n", "8", "--steps", "2", "--seed", "1", "--json", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["threads"]["chosen_by"] == "threads="
    assert dict(os.environ) == before


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in threads.COUNT_VARIABLES and k != "OMP_WAIT_POLICY"}


def run_cli(env, *extra) -> dict:
    proc = subprocess.run([sys.executable, "-m", "diffusiongemma", "generate", "And God said", "-n", "32", "--steps",
                           "2", "--seed", "1", "--json", *extra], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["threads"]


@pytest.mark.slow
def test_the_command_runs_blas_on_the_chosen_threads():
    """A real run without thread variables: OpenBLAS (loaded when the package is imported) runs on the count
    chosen; a user's OMP_NUM_THREADS and wait policy are kept; --threads wins."""
    env = clean_env()
    chosen = run_cli(env)
    assert chosen["chosen_by"] == "diffusiongemma" and chosen["wait_policy"] == "PASSIVE"
    assert 1 <= chosen["threads"] <= threads.usable_cores()
    assert chosen["blas_threads"] and set(chosen["blas_threads"]) == {chosen["threads"]}
    given = run_cli({**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"})
    assert (given["threads"], given["chosen_by"], given["wait_policy"]) == (1, "environment", "ACTIVE")
    assert set(given["blas_threads"]) == {1}
    forced = run_cli({**env, "OMP_NUM_THREADS": "2"}, "--threads", "1")
    assert (forced["threads"], forced["chosen_by"], set(forced["blas_threads"])) == (1, "threads=", {1})


LIBRARY_RUN = r"""
import json, os
import numpy  # loaded first, as a user's script does: its BLAS is limited after the fact
import diffusiongemma.reference
from diffusiongemma import fast, threads
from threadpoolctl import threadpool_info
pools = {info["user_api"]: info["num_threads"] for info in threadpool_info()}
print(json.dumps({"described": threads.describe(), "pools": pools,
                  "environ": sorted(k for k in os.environ if k in threads.COUNT_VARIABLES + ("OMP_WAIT_POLICY",))}))
"""


LOADS_NUMPY_LATER = r"""
import json, sys
from diffusiongemma import threads
assert "numpy" not in sys.modules, "importing the package loaded NumPy"
threads.configure(threads=1)  # OpenBLAS would start one thread per core
import numpy  # the import hook limits its BLAS once it has loaded
print(json.dumps(threads.describe()))
"""


def test_numpy_loaded_after_the_package_is_limited_too():
    proc = subprocess.run([sys.executable, "-c", LOADS_NUMPY_LATER], capture_output=True, text=True, env=clean_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    described = json.loads(proc.stdout)
    assert (described["chosen_by"], described["blas_threads"]) == ("threads=", [1])


def test_the_library_is_sized_like_the_command():
    """Importing the package sizes BLAS and the kernels' OpenMP to the free cores, without writing a thread
    variable into the environment that child processes would inherit."""
    proc = subprocess.run([sys.executable, "-c", LIBRARY_RUN], capture_output=True, text=True, env=clean_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    described = out["described"]
    assert described["chosen_by"] == "diffusiongemma" and described["wait_policy"] == "PASSIVE"
    assert out["pools"] == {"blas": described["threads"], "openmp": described["threads"]}
    assert out["environ"] == []
