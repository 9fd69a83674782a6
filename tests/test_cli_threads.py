"""Thread settings of the command line (cli/threads.py): sized to the free cores, passive waits, the user's
own settings kept, and applied before NumPy's BLAS loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diffusiongemma.cli import threads


@pytest.fixture
def cores(monkeypatch):
    def set_cores(usable, busy):
        monkeypatch.setattr(threads, "usable_cores", lambda: usable)
        monkeypatch.setattr(threads, "busy_cores", lambda: busy)
    return set_cores


@pytest.mark.parametrize("usable,busy,expected", [(8, 0, 8), (8, 3, 5), (2, 1, 1), (2, 2, 1), (2, 7, 1)])
def test_thread_count_is_the_free_cores(cores, usable, busy, expected):
    cores(usable, busy)
    env = {}
    assert threads.configure_threads(env, limit_loaded=False) == expected
    assert all(env[name] == str(expected) for name in threads.COUNT_VARIABLES)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    described = threads.describe(env)
    assert (described["threads"], described["chosen_by"], described["wait_policy"]) == (expected, "diffusiongemma",
                                                                                        "PASSIVE")


@pytest.mark.parametrize("given", threads.COUNT_VARIABLES)
def test_a_users_setting_wins(cores, given):
    cores(8, 0)
    env = {given: "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.configure_threads(env) is None
    assert env == {given: "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.describe(env)["chosen_by"] == "environment"


def test_busy_cores_reads_the_runnable_count(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("1.50 1.20 0.80 4/312 12345\n")
    assert threads.busy_cores(samples=3, interval=0, loadavg=str(loadavg)) == 3  # minus the reading process
    assert threads.busy_cores(loadavg=str(tmp_path / "missing")) == 0


def run_cli(env) -> dict:
    proc = subprocess.run([sys.executable, "-m", "diffusiongemma", "generate", "And God said", "-n", "32", "--steps",
                           "2", "--seed", "1", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["threads"]


def test_the_command_runs_blas_on_the_chosen_threads():
    """A real run without thread variables: OpenBLAS (loaded when the package is imported) runs on the count
    chosen, and later libraries get it through the environment; a user's OMP_NUM_THREADS is kept."""
    env = {k: v for k, v in os.environ.items() if k not in threads.COUNT_VARIABLES and k != "OMP_WAIT_POLICY"}
    chosen = run_cli(env)
    assert chosen["chosen_by"] == "diffusiongemma" and chosen["wait_policy"] == "PASSIVE"
    assert 1 <= chosen["threads"] <= threads.usable_cores()
    assert chosen["blas_threads"] and set(chosen["blas_threads"]) == {chosen["threads"]}
    given = run_cli({**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"})
    assert (given["threads"], given["chosen_by"], given["wait_policy"]) == (1, "environment", "ACTIVE")
    assert set(given["blas_threads"]) == {1}
