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
    assert threads.configure_threads(env, force=True) == expected
    assert all(env[name] == str(expected) for name in threads.COUNT_VARIABLES)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.describe(env) == {"threads": expected, "chosen_by": "diffusiongemma", "wait_policy": "PASSIVE"}


@pytest.mark.parametrize("given", threads.COUNT_VARIABLES)
def test_a_users_setting_wins(cores, given):
    cores(8, 0)
    env = {given: "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.configure_threads(env, force=True) is None
    assert env == {given: "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.describe(env)["chosen_by"] == "environment"


def test_nothing_changes_once_numpy_is_loaded(cores):
    import numpy  # noqa: F401  (the libraries have read their settings by now)

    cores(8, 0)
    env = {}
    assert threads.configure_threads(env) is None and env == {}


def test_busy_cores_reads_the_runnable_count(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("1.50 1.20 0.80 4/312 12345\n")
    assert threads.busy_cores(samples=3, interval=0, loadavg=str(loadavg)) == 3  # minus the reading process
    assert threads.busy_cores(loadavg=str(tmp_path / "missing")) == 0


def test_entry_point_sets_blas_threads_before_numpy_loads():
    """In a fresh process, importing the command line sizes OpenBLAS/OpenMP before NumPy is imported."""
    env = {k: v for k, v in os.environ.items() if k not in threads.COUNT_VARIABLES and k != "OMP_WAIT_POLICY"}
    code = ("import json, os, diffusiongemma.cli.main, numpy, threadpoolctl; "
            "info = threadpoolctl.threadpool_info(); "
            "print(json.dumps({'env': {k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', "
            "'OMP_WAIT_POLICY')}, 'blas': [i['num_threads'] for i in info if i['internal_api'] == 'openblas']}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                    timeout=120, check=True).stdout)
    count = int(out["env"]["OMP_NUM_THREADS"])
    assert 1 <= count <= threads.usable_cores()
    assert out["env"]["OPENBLAS_NUM_THREADS"] == str(count) and out["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert out["blas"] and set(out["blas"]) == {count}
    env["OMP_NUM_THREADS"] = "1"
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                    timeout=120, check=True).stdout)
    assert out["env"]["OMP_NUM_THREADS"] == "1" and out["env"]["OPENBLAS_NUM_THREADS"] is None
    assert set(out["blas"]) == {1}
