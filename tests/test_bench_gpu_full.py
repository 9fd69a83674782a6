"""benchmarks/bench_gpu_full.py: every part runs at tiny shapes on the CPU (--dry-run), so a typo cannot
first show on a GPU; without a GPU it stops with a clear message; the full shape is the released one."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_gpu_full as bench  # noqa: E402

from diffusiongemma.tiny import FULL, SLIDING  # noqa: E402


def test_the_full_shape_is_the_released_one():
    """SPEC §1/§2.1's sizes, the ([S]*5 + F) x 5 pattern, and 25.23 B parameters counted independently."""
    spec = bench.model_spec(1, 30)
    assert spec.layer_types == ([SLIDING] * 5 + [FULL]) * 5
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.moe_intermediate_size) == \
        (262_144, 2816, 2112, 704)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (16, 8, 256)
    assert (spec.num_global_key_value_heads, spec.global_head_dim) == (2, 512)
    assert (spec.num_experts, spec.top_k_experts, spec.sliding_window, spec.canvas_length) == (128, 8, 1024, 256)
    config = bench.our_config(spec)
    full_layers = [i for i, kind in enumerate(config.layer_types) if kind == FULL]
    assert full_layers == [5, 11, 17, 23, 29]
    assert {config.layer_head_dim[i] for i in full_layers} == {512}  # "05" read too (zero-padded keys)
    assert {config.layer_num_key_value_heads[i] for i in full_layers} == {2}
    counts = bench.parameter_counts(config)
    V, H, Id, Ie, E = 262_144, 2816, 2112, 704, 128
    sliding = (16 * 256 + 2 * 8 * 256) * H + H * 16 * 256 + 2 * 256  # q, k, v, o, q/k norms
    full = (16 * 512 + 2 * 512) * H + H * 16 * 512 + 2 * 512  # q, k (= v), o, q/k norms
    shared = 3 * H * Id + E * H + E + 3 * E * Ie * H + 8 * H + 2  # MLP, router, experts, 8 norms, 2 scalars
    total = V * H + H + (H + 3 * H * Id) + 25 * sliding + 5 * full + 30 * shared
    assert counts["total"] == total
    assert 25.2e9 < total < 25.3e9 and counts["experts"] == 30 * 3 * E * Ie * H
    assert counts["decoder_macs_per_token"] == total - counts["experts"] + counts["experts"] // 16 + V * H


def test_released_pattern_keeps_the_last_layer_full():
    assert bench.released_layer_types(4) == [SLIDING, SLIDING, SLIDING, FULL]
    assert bench.released_layer_types(7) == [SLIDING] * 5 + [FULL, FULL]


def test_without_a_gpu_it_says_so_and_writes_nothing(monkeypatch, tmp_path, capsys):
    from diffusiongemma.fast import gpu

    monkeypatch.setattr(gpu, "gpu_available", lambda: (False, "no device in this test"))
    assert bench.main(["--out", str(tmp_path / "out")]) == 2
    assert "no GPU: no device in this test" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--prompts", "16,x"], ["--batches", "0"], ["--scale", "0"]])
def test_bad_options_are_one_line_errors(argv, capsys):
    assert bench.main(["--dry-run"] + argv) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_dry_run_runs_every_part_and_writes_json_and_markdown(tmp_path):
    out = tmp_path / "out"
    argv = ["--dry-run", "--scale", "128", "--layers", "2", "--prompts", "16,24", "--batches", "1,2",
            "--out", str(out)]
    assert bench.main(argv) == 0
    data = json.loads((out / "bench_gpu_full.json").read_text())
    assert bench.gpu_model_takes_dtype()  # fast.gpu.Model(..., dtype="bfloat16"), issue #30
    assert [n for n in data["notes"] if "did not run" in n or "skipped" in n] == []
    for key in ("ours_bf16", "torch_bf16", "ours_fp32"):
        part = data[key]
        assert sorted(part["prefill"]) == ["16", "24"], key
        assert sorted(part["step"]) == ["1", "2"], key
        for row in list(part["prefill"].values()) + list(part["step"].values()):
            assert row["s"] > 0 and math.isfinite(row["s"])
        for B, row in part["step"].items():
            assert row["floor_s"] == max(row["bandwidth_floor_s"], row["compute_floor_s"]) > 0
            assert row["tokens_per_s"] == pytest.approx(int(B) * row["tokens_per_s_per_user"])
    facts = data["torch_bf16"]["facts"]
    assert facts["equals the spec's count (so encoder and decoder share their layers)"] is True
    assert data["torch_bf16"]["step"]["1"]["experts_touched"].endswith("of 4")
    rates = data["device_rates"]
    assert rates["copy_bytes_per_s"] > 0 and "measured" not in rates
    markdown = (out / "bench_gpu_full.md").read_text()
    assert "### torch bf16 eager (transformers)" in markdown and "### ours, float32" in markdown
    assert markdown.count("| 2 |") == 4  # the batch-2 row of each part's table and of the summary's
    assert not [p for p in os.listdir(out) if p.endswith(".part")]
    ours, theirs = data["ours_bf16"], data["torch_bf16"]
    assert ours["facts"]["the model's dtype (model.dtype)"] == "bfloat16"
    assert data["ours_fp32"]["facts"]["the model's dtype (model.dtype)"] == "float32"
    # half the bytes per weight: its bandwidth floor is half float32's, at the same copy rate
    assert ours["step"]["1"]["bandwidth_floor_s"] == pytest.approx(
        data["ours_fp32"]["step"]["1"]["bandwidth_floor_s"] / 2)
    assert ours["step"]["1"]["bandwidth_floor_s"] == pytest.approx(theirs["step"]["1"]["bandwidth_floor_s"])
    summary = data["summary"]
    assert sorted(summary["step"]) == ["1", "2"] and sorted(summary["prefill"]) == ["16", "24"]
    for B, row in summary["step"].items():
        assert row["step_over_bandwidth_floor"] == pytest.approx(ours["step"][B]["s"] /
                                                                 ours["step"][B]["bandwidth_floor_s"])
        assert row["ours_over_torch_bf16"] == pytest.approx(ours["step"][B]["s"] / theirs["step"][B]["s"])
    assert summary["prefill"]["24"]["ours_over_torch_bf16"] == pytest.approx(
        ours["prefill"]["24"]["s"] / theirs["prefill"]["24"]["s"])
    assert "### Ours bfloat16 against the floor and torch bf16 eager" in markdown
    assert "### ours, bfloat16" in markdown
    # the part that matters most runs first (the JSON keeps the order the parts wrote in), and is shown first
    order = list(data)
    assert order.index("ours_bf16") < order.index("torch_bf16") < order.index("ours_fp32")
    assert markdown.index("### ours, bfloat16") < markdown.index("### torch bf16 eager")


def test_without_the_bf16_gpu_run_the_part_is_skipped_with_a_note(monkeypatch, tmp_path):
    """Before ``fast.gpu.Model`` takes a dtype, the bfloat16 part says so and the rest of the run goes on."""
    monkeypatch.setattr(bench, "gpu_model_takes_dtype", lambda: False)
    out = tmp_path / "out"
    assert bench.main(["--dry-run", "--scale", "128", "--layers", "2", "--prompts", "16", "--batches", "1",
                       "--skip", "torch", "--out", str(out)]) == 0
    data = json.loads((out / "bench_gpu_full.json").read_text())
    assert bench.NO_BF16_YET in data["notes"] and "ours_bf16" not in data
    assert sorted(data["ours_fp32"]["step"]) == ["1"] and data["summary"] == {"step": {}, "prefill": {}}
