"""The stored golden traces (tests/golden/, docs/TRACE_FORMAT.md "Golden traces") hold the code to transformers.

Each case was recorded from transformers' own ``generate`` by ``examples/record_golden.py``; here the NumPy
reference replays each trace's random draws and must agree with it at the default float32 tolerances, so any
drift of the code (a changed formula, a changed loop rule) fails CI without torch being needed. A last test
runs ``examples/check_port.py`` (a port checking its forward, its sampler and its whole loop) in a process
where torch and transformers cannot be imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from diffusiongemma.reference.model import Model
from diffusiongemma.trace import FORMAT_VERSION, Trace, compare_traces, format_report, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
CASES = sorted(d for d in os.listdir(GOLDEN) if os.path.isfile(os.path.join(GOLDEN, d, "case.json")))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record_golden = _load("record_golden")  # imports no torch at module level
check_port = _load("check_port")


def case_info(name: str) -> dict:
    with open(os.path.join(GOLDEN, name, "case.json"), encoding="utf-8") as f:
        return json.load(f)


def model_dir(name: str) -> str:
    _, directory = check_port.load_case(os.path.join(GOLDEN, name))
    return directory


def test_golden_set_is_complete_small_and_versioned():
    assert CASES == sorted(record_golden.CASES)
    total = 0
    for name in CASES:
        info = case_info(name)
        assert info["golden_version"] == record_golden.GOLDEN_VERSION
        with Trace(os.path.join(GOLDEN, name, "golden.trace")) as trace:
            assert trace.header["version"] == FORMAT_VERSION == info["trace_format_version"]
            assert trace.header["producer"].startswith("transformers 5.24.0")
            assert trace.header["logits"]["mode"] == "full"  # a forward-only port needs full logits for SC
            assert trace.draw_tape()  # a port can replay it
        # the golden belongs to these weights: a replaced shipped model needs a re-recorded golden
        assert record_golden.weights_digest(model_dir(name)) == info["weights"], (
            f"{name}: the weights changed since the golden was recorded; run python examples/record_golden.py {name}")
        total += sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(GOLDEN, name))
                     for f in fs)
    assert total < 8 * 2**20, f"golden set is {total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", CASES)
def test_reference_reproduces_the_golden_run(name, tmp_path):
    """The drift check: our whole run, replaying transformers' draws, equals transformers' recorded one."""
    golden = os.path.join(GOLDEN, name, "golden.trace")
    ours = record_golden.replay_reference(model_dir(name), golden, str(tmp_path / "ours.trace"))
    with Trace(golden) as a, Trace(ours) as b:
        comparison = compare_traces(a, b)
    assert comparison.ok and not comparison.skipped, format_report(comparison)
    assert len(comparison.rows) == case_info(name)["tensors"]


def test_a_perturbed_weight_fails_at_the_first_tensor_it_touches(tmp_path):
    """Drift is caught: 2% noise on one k_proj makes that layer's cached keys the first divergence."""
    directory = model_dir("tiny-a")
    model = Model.from_pretrained(directory)
    tensors = dict(model.tensors)
    noise = np.random.default_rng(0).standard_normal(tensors["layers.2.k_proj"].shape).astype(np.float32)
    tensors["layers.2.k_proj"] = tensors["layers.2.k_proj"] + np.float32(0.02) * noise
    golden = os.path.join(GOLDEN, "tiny-a", "golden.trace")
    out = str(tmp_path / "bad.trace")
    with Trace(golden) as trace:
        check_port.run_loop(trace, Model(model.config, tensors), out)
    with Trace(golden) as a, Trace(out) as b:
        comparison = compare_traces(a, b)
    assert comparison.first_divergence is not None
    assert comparison.first_divergence.name == "encode0.layer2.keys", format_report(comparison)


def test_the_cases_reach_every_code_path():
    """What the golden set claims to cover, recomputed from its files (and equal to case.json)."""
    from safetensors import safe_open

    found = {}
    for name in CASES:
        coverage = record_golden.coverage(model_dir(name), os.path.join(GOLDEN, name, "golden.trace"))
        assert coverage == case_info(name)["coverage"], name
        found[name] = coverage
    random = [found[n] for n in CASES if n != record_golden.SHIPPED]
    assert any(c["window_shorter_than_prompt_and_canvas"] for c in random)
    assert {r for c in random for r in c["gqa_ratios"]} >= {2, 3, 4}
    assert any(c["moe_calls_with_an_unused_expert"] > 0 and c["top_k_experts"] < c["num_experts"] for c in random)
    assert all(c["self_conditioning_steps"] > 0 for c in random)
    assert any(c["canvases"] >= 2 for c in random)
    assert any(c["eos_mid_canvas"] for c in random)
    assert any(c["left_padding"] for c in random)
    assert any(c["frozen_rows"] for c in random)
    for name in CASES:  # full layers have no v_proj, in the stored checkpoint itself
        path = os.path.join(model_dir(name), "model.safetensors")
        with safe_open(path, framework="np") as f:
            keys = set(f.keys())
        for layer in found[name]["full_layers_without_v_proj"]:
            assert f"model.decoder.layers.{layer}.self_attn.v_proj.weight" not in keys
            assert f"model.decoder.layers.{layer}.self_attn.k_proj.weight" in keys


def test_compare_only_selects_the_groups(tmp_path, capsys):
    """--only sampler ignores a logits difference that --only forward and all report; exit 1 on a mismatch."""
    from diffusiongemma.cli.main import main

    golden = os.path.join(GOLDEN, "tiny-b", "golden.trace")
    with Trace(golden) as trace:
        header = dict(trace.header)
        tensors = {name: trace.get(name) for name in trace.shapes}
    tensors["canvas0.step1.logits"] = tensors["canvas0.step1.logits"] + np.float32(0.01)
    changed = str(tmp_path / "changed.trace")
    write_trace(changed, header, tensors)
    assert main(["compare", golden, changed, "--only", "sampler", "--summary"]) == 0
    assert main(["compare", golden, changed, "--only", "forward", "--summary"]) == 1
    out = capsys.readouterr().out
    assert "First divergence: canvas0.step1.logits" in out and "atol=0.0002, rtol=0.0001" in out
    assert main(["compare", golden, changed]) == 1


BLOCKER = '''
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test (a port's environment has no torch)")
        return None

sys.meta_path.insert(0, _Blocked())
'''


@pytest.mark.slow
def test_check_port_runs_without_torch(tmp_path):
    """examples/check_port.py (forward, sampler, whole loop on every case) in a process without torch."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), OMP_NUM_THREADS="1")
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked" in probe.stderr
    script = os.path.join(ROOT, "examples", "check_port.py")
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in CASES:
        for mode in ("forward", "sampler", "all"):
            assert f"== {name} --only {mode}: agrees" in result.stdout
    broken = subprocess.run([sys.executable, script, "--case", "tiny-a", "--mode", "forward", "--perturb",
                             "layers.2.k_proj"], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "First divergence: encode0.layer2.keys" in broken.stdout


@pytest.mark.parametrize("name", CASES)
def test_fast_cpu_path_reproduces_the_golden_run(name, tmp_path):
    """The compiled CPU path, replaying the same draws, agrees with transformers' run too."""
    from diffusiongemma import fast
    from diffusiongemma.reference.support.replay import ReplayDraws
    from diffusiongemma.reference.generation_config import GenerationConfig
    from diffusiongemma.trace import TraceRecorder, record_generate

    golden = os.path.join(GOLDEN, name, "golden.trace")
    with Trace(golden) as trace:
        draws = ReplayDraws(trace.draw_tape())
        ids = trace.get("prompt.input_ids")
        mask = trace.get("prompt.attention_mask") if "prompt.attention_mask" in trace.names else None
        settings = GenerationConfig.from_dict(trace.header["generation"])
    recorder = TraceRecorder(layers=True, producer="diffusiongemma fast")
    record_generate(fast.generate, fast.Model.from_pretrained(model_dir(name)), ids, recorder,
                    attention_mask=mask, generation_config=settings, random=draws)
    draws.check_exhausted()
    recorder.save(tmp_path / "fast.trace")
    with Trace(golden) as a, Trace(tmp_path / "fast.trace") as b:
        comparison = compare_traces(a, b)
    assert comparison.ok, format_report(comparison)
    # the fast path may not expose its decoder internals; everything else is compared
    assert set(comparison.skipped) <= {"input_embedding", "layer_output"}
