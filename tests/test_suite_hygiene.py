"""The suite leaves nothing behind (#33): no file in the user's home (cuda-sim's run-time builds went to
~/.cache/diffusiongemma), nothing big under the system's temporary folder (a full run left 1.9 GB there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffusiongemma.fast.gpu import sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cuda_sim_builds_go_to_the_suites_folder_not_home():
    folder = os.environ.get("DIFFUSIONGEMMA_SIM_CACHE")
    assert folder, "tests/conftest.py sets the cuda-sim build folder"
    user_cache = os.path.realpath(os.path.join(os.path.expanduser("~"), ".cache"))
    assert not os.path.realpath(folder).startswith(user_cache + os.sep), folder
    assert sim.cache_dir() == folder


def test_the_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFUSIONGEMMA_SIM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sim.cache_dir() == str(tmp_path / "xdg" / "diffusiongemma" / "cuda-sim")


def test_passed_tests_leave_no_tmp_path_folder(request):
    assert request.config.getini("tmp_path_retention_policy") == "failed"


def _size(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files
               if not os.path.islink(os.path.join(d, f)))


@pytest.mark.slow
@pytest.mark.parametrize("cache_plugin", [True, False])
def test_a_run_leaves_nothing_in_home_or_the_temporary_folder(tmp_path, cache_plugin):
    """Two tests that write (a cuda-sim build with contraction on; checkpoints converted into tmp_path) run in
    a child pytest whose HOME and TMPDIR are empty folders: both stay (nearly) empty."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    env.pop("DIFFUSIONGEMMA_SIM_CACHE")
    env.pop("XDG_CACHE_HOME", None)
    tests = ["tests/test_gpu_limits.py::test_contraction_changes_the_bits_of_a_norm_kernel",
             "tests/test_cli_defaults.py::test_convert_draws_no_progress_bar_into_a_stderr_that_is_not_a_terminal"]
    extra = [] if cache_plugin else ["-p", "no:cacheprovider"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *extra, *tests], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]
    assert not (home / ".cache" / "diffusiongemma").exists()
    assert _size(home) == 0, sorted(os.listdir(home))
    assert _size(tmp) < 64 * 1024, [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs][:20]


# What `pip install -e ".[test]"` (the README's test command) installs: the project, its requirements and the
# test extra (setup.py). A test must not skip when one of them is missing: a missing build is a failure.
INSTALLED_BY_THE_README = {"diffusiongemma", "numpy", "ml_dtypes", "safetensors", "tokenizers", "tqdm", "jinja2",
                           "threadpoolctl", "gguf", "pytest", "hypothesis", "torch", "transformers", "matplotlib",
                           "diffusers"}


def _python_files(folder: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, folder)) for f in files
                  if f.endswith(".py"))


def test_no_test_skips_what_the_readme_installs():
    import ast

    skipped = []
    for path in _python_files("tests"):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] in INSTALLED_BY_THE_README):
                skipped.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.args[0].value}")
    assert not skipped, f"import these (the README's install provides them), do not skip: {skipped}"


def test_benchmarks_import_nothing_from_the_tests():
    """The benchmarks run from an installed package alone: what they share with the tests lives in the package
    (diffusiongemma.tiny, diffusiongemma.crosscheck.bf16_teacher, diffusiongemma.fast.gpu.bf16_whole_calls...)."""
    import ast

    found = []
    for path in _python_files("benchmarks"):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    assert not found, found
