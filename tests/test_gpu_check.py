"""benchmarks/gpu_check.sh fits in its 6 minutes: every stage is time-boxed, the limits add up to the budget,
and a stage that hangs is cut off by the script's own deadline (run here with a stand-in Python that hangs).
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SCRIPT = os.path.join(BENCHMARKS, "gpu_check.sh")
STAGES = os.path.join(BENCHMARKS, "gpu_stages.sh")  # sourced by the script: the stage runner and set_up's stages
LIMIT_S = 6 * 60


def script_lines() -> list[str]:
    """The script's lines followed by those of the file it sources (whose stages count toward its budget)."""
    with open(SCRIPT) as f:
        text = f.read()
    assert ". benchmarks/gpu_stages.sh" in text and "\nset_up\n" in text, "gpu_check.sh no longer runs set_up"
    with open(STAGES) as f:
        return text.splitlines() + f.read().splitlines()


def test_the_stage_limits_add_up_to_at_most_six_minutes():
    text = "\n".join(script_lines())
    limits = [int(n) for n in re.findall(r"\bstage [a-z_]+ (\d+) ", text)]
    budget = int(re.search(r'BUDGET="\$\{DG_CHECK_BUDGET:-(\d+)\}"', text).group(1))
    assert len(limits) >= 7, limits
    assert sum(limits) <= budget <= LIMIT_S - 10, (limits, budget)


def test_every_python_command_is_time_boxed():
    """Each line that starts Python runs under ``stage`` (which applies ``timeout``) or ``timeout`` itself,
    or inside the ``environment`` function, which runs as a stage."""
    lines, inside_function, loose = script_lines(), False, []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if re.match(r"^environment\(\) \{", code):
            inside_function = True
        elif code.startswith("}"):
            inside_function = False
        if '"$PY"' not in code or inside_function or "print(" in code and i and lines[i - 1].rstrip().endswith("<<'PYEOF'"):
            continue
        continued = i > 0 and lines[i - 1].rstrip().endswith("\\")
        if not (re.search(r"\bstage \w+ \d+ ", code) or re.search(r"\btimeout\b", code) or continued):
            loose.append(line)
    assert not loose, f"commands without a time limit: {loose}"


@pytest.mark.skipif(not os.path.exists("/usr/bin/timeout") and not os.path.exists("/bin/timeout"),
                    reason="coreutils timeout is not installed")
def test_a_hanging_stage_cannot_take_the_run_past_its_budget(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nsleep 60\n")
    fake.chmod(0o755)
    results = tmp_path / "results"
    env = dict(os.environ, PYTHON=str(fake), DG_CHECK_BUDGET="8", DG_SKIP_BUILD="1", PATH=os.environ["PATH"])
    start = time.monotonic()
    subprocess.run(["bash", SCRIPT, str(results)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=120)
    elapsed = time.monotonic() - start
    summary = (results / "summary.txt").read_text()
    assert elapsed < 8 + 30, f"the run took {elapsed:.0f} s on an 8 s budget:\n{summary}"
    assert "skipped" in summary and "exit 124" in summary, summary
    assert set(os.listdir(results)) <= {"summary.txt", "environment.txt", "compile.txt", "build.log",
                                        "gpu_tests.log", "bench_gpu.md", "bench.log"}, os.listdir(results)


# ------------------------------------------------------------------------------------ the bf16 check's stage
def bf16_check():
    import sys

    sys.path.insert(0, BENCHMARKS)
    import gpu_bf16_check

    return gpu_bf16_check


def test_the_bf16_check_is_a_time_boxed_stage_that_writes_into_the_tests_log():
    text = "\n".join(script_lines())
    line = re.search(r"^stage bf16_check (\d+) .*gpu_bf16_check\.py --device cuda", text, re.M)
    assert line, "gpu_check.sh no longer runs benchmarks/gpu_bf16_check.py on the GPU"
    following = text[line.end():].splitlines()[1]
    assert '| tee -a "$RESULTS/gpu_tests.log"' in following, following  # no file beyond the seven


def test_the_bf16_check_runs_on_cuda_sim_and_prints_a_ratio_per_call(capsys):
    """The script the GPU stage runs, here on cuda-sim on one of the test file's models: every call's ratio
    printed and the verdict."""
    rc = bf16_check().main(["--device", "cuda-sim", "--config", "full only, top-3 of 6"])
    out = capsys.readouterr().out
    assert rc == 0, out
    calls = [line for line in out.splitlines() if line.startswith("  full only, top-3 of 6: ") and line.endswith(" ok")]
    assert len(calls) >= 5 and any("(forced " in line for line in calls), out
    assert out.splitlines()[-1] == "bf16 check: every call passes"


def test_the_bf16_check_fails_a_call_outside_the_criterion(monkeypatch, capsys):
    from diffusiongemma.fast.gpu import bf16_whole_calls as check  # where the script takes its criterion from

    monkeypatch.setattr(check, "within", lambda r: all(plain <= 1e-9 for plain, forced in r.values()))
    rc = bf16_check().main(["--device", "cuda-sim", "--config", "full only, top-3 of 6"])
    out = capsys.readouterr().out
    assert rc == 1 and " FAILED" in out and out.splitlines()[-1].endswith("call(s) FAILED"), out


def test_the_bf16_check_names_an_unknown_model(capsys):
    assert bf16_check().main(["--device", "cuda-sim", "--config", "no such model"]) == 2
    assert "unknown --config ['no such model']" in capsys.readouterr().out


def test_without_the_bf16_gpu_run_the_check_says_so(monkeypatch, capsys):
    from diffusiongemma.fast import gpu

    class Float32Only:  # a GPU model from before issue #30
        def __init__(self, config, tensors, device="cuda"):
            raise AssertionError("not to be built")

    monkeypatch.setattr(gpu, "Model", Float32Only)
    assert bf16_check().main(["--device", "cuda-sim"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("bf16 check: not run: ") and len(out.splitlines()) == 1, out
