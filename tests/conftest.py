"""Shared pytest set-up for the test package.

The helpers (``tests.hf_tiny``, ``tests.hf_oracle``, ``tests.random_weights``, ``tests.gpu_kernel_helpers``) are
imported as modules of this package, so the repository root must be importable; pytest puts it on ``sys.path``
because ``tests/`` is a package (``tests/__init__.py``).

Every test runs in the process state it found: the autouse fixture ``process_state`` puts back, after each
test, the environment variables, the thread counts of every BLAS and OpenMP library loaded before the test
(an in-process run of the command line sizes them, ``torch.set_num_threads`` changes torch's), and what
``diffusiongemma.threads`` reports. So the suite passes in any order (CI runs it in a random one:
pytest-randomly, whose seed is printed in the header; ``-p randomly --randomly-seed=N`` replays an order)
and with any environment the caller has; a test that checks what the other tests of its module did is
marked ``last_in_module`` and kept after them. ``-m "not slow"`` skips the slow tests.

Nothing is written into the user's home: ``pytest_configure`` points the run-time builds of cuda-sim
(``DIFFUSIONGEMMA_SIM_CACHE``, fast/gpu/sim.py, otherwise ``~/.cache/diffusiongemma``) into pytest's own cache
folder (``.pytest_cache/d/diffusiongemma-cuda-sim``: kept between runs, ``--cache-clear`` empties it), or, with
the cache plugin off, into a temporary folder removed when the session ends; child processes inherit it.
Temporary files go under ``tmp_path``, whose folders pytest removes at the end of the session unless their
test failed (``tmp_path_retention_policy`` in pyproject.toml).
"""

from __future__ import annotations

import os
import sys

import pytest


SIM_CACHE_VARIABLE = "DIFFUSIONGEMMA_SIM_CACHE"
_session: dict = {}


def pytest_configure(config):
    """The cuda-sim build cache of this session: pytest's cache folder, else a temporary folder."""
    _session["saved"] = os.environ.get(SIM_CACHE_VARIABLE)
    cache = getattr(config, "cache", None)
    if cache is not None:
        folder = str(cache.mkdir("diffusiongemma-cuda-sim"))
    else:
        import tempfile

        folder = _session["temporary"] = tempfile.mkdtemp(prefix="diffusiongemma-cuda-sim-")
    os.environ[SIM_CACHE_VARIABLE] = folder


def pytest_unconfigure(config):
    if "temporary" in _session:
        import shutil

        shutil.rmtree(_session.pop("temporary"), ignore_errors=True)
    if "saved" in _session:
        saved = _session.pop("saved")
        if saved is None:
            os.environ.pop(SIM_CACHE_VARIABLE, None)
        else:
            os.environ[SIM_CACHE_VARIABLE] = saved


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``last_in_module`` (they check what the other tests of their module did) run after the
    other tests of their module, also when pytest-randomly has shuffled the order."""
    yield
    last = [item for item in items if item.get_closest_marker("last_in_module")]
    for item in last:
        items.remove(item)
        module = [n for n, other in enumerate(items) if getattr(other, "module", None) is item.module]
        items.insert(module[-1] + 1 if module else len(items), item)


def _thread_pools() -> list:
    """(controller, threads) of every BLAS and OpenMP library loaded now."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a declared dependency
        return []
    return [(lib, lib.get_num_threads()) for lib in ThreadpoolController().lib_controllers]


@pytest.fixture(autouse=True)
def process_state():
    """Restore os.environ, the loaded thread pools' sizes, torch's thread count and the package's thread
    record after the test."""
    from diffusiongemma import threads

    environ = dict(os.environ)
    pools = _thread_pools()
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    record = dict(threads._state)
    yield
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    for lib, count in pools:
        if count is not None and lib.get_num_threads() != count:
            lib.set_num_threads(count)
    if torch_threads is not None and torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    threads._state.clear()
    threads._state.update(record)
