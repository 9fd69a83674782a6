"""benchmarks/bench_peers.py's bookkeeping (#33): transformers at its default attention, llama.cpp timed warm
(weights read at load), rounds disturbed by other load flagged and rerun, the CPU's vendor beside the table."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers_under_test", os.path.join(ROOT, "benchmarks",
                                                                                          "bench_peers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transformers_runs_its_default_attention(bench):
    source = inspect.getsource(bench._worker_generate)
    assert "attn_implementation=" not in source  # eager was forced; a user gets SDPA
    assert 'ATTENTION["transformers"]' in source


def test_llama_cpp_reads_its_weights_at_load(bench, tmp_path):
    fake = tmp_path / "llama-diffusion-cli"
    argv = tmp_path / "argv"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {argv}\necho 'total time: 250.0 ms (16 steps)'\n")
    fake.chmod(0o755)
    paths = {"prompt_ids": [2, 3, 4], "prompt_text": "abc", "canvas": 32, "steps": 16}
    out = bench.run_llama(str(fake), str(tmp_path / "m.gguf"), paths, 1, 2, 60)
    assert "--no-mmap" in argv.read_text().split()
    assert out["seconds"] == [0.25, 0.25] and out["passes"] == 16
    assert out["other_runnable"] is not None and out["other_runnable"] >= 0


def test_disturbed_rounds_are_counted_and_the_last_attempt_kept(bench):
    def run(round_, attempt, seconds, disturbed):
        return {"config": "small", "threads": 1, "impl": "fast", "round": round_, "attempt": attempt, "canvas": 32,
                "seconds": [seconds], "passes": 16, "rss_mib": 10.0, "disturbed": disturbed}
    table = bench.summarize([run(0, 0, 9.0, True), run(0, 1, 1.0, False), run(1, 0, 5.0, True),
                             run(1, 1, 4.0, True), run(2, 0, 2.0, False)])
    (row,) = table
    assert row["per_round"] == [1.0, 4.0, 2.0] and row["disturbed"] == 1 and row["seconds"] == 2.0
    text = bench.format_table(table)
    assert text.splitlines()[0].endswith("| rounds | disturbed |") and text.splitlines()[2].endswith("| 3 | 1 |")


def test_the_cpu_vendor_is_reported_beside_the_results(bench):
    facts = {"cpu": bench.cpu_facts(), "commit": "abc", "load_start": [1.0], "load_end": [2.0]}
    if sys.platform == "linux" and "vendor_id" in open("/proc/cpuinfo").read():
        assert facts["cpu"]["vendor"] not in ("", "unknown")
    line = bench.cpu_line(facts)
    assert line.startswith(f"CPU: {facts['cpu']['vendor']}, {facts['cpu']['model']};") and "commit abc" in line


def test_other_runnable_leaves_out_the_measured_process(bench):
    seen = bench.other_runnable(os.getpid())
    assert seen is None or seen >= 0
