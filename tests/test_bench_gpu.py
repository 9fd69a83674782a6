"""benchmarks/bench_gpu.py: the comparison against transformers (ours fp32, ours bf16, transformers fp32 and
bf16 eager) runs without a GPU (--dry-run: the 26B layer pattern at tiny sizes, torch on the CPU, ours on
cuda-sim), so a typo in it cannot first show on a GPU; and its verdict on the issue's target (ours bf16 ahead
of transformers bf16 on encode, denoise and generate) is computed from the times."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_gpu as bench  # noqa: E402

NAN = float("nan")


def table_rows(markdown: str) -> dict:
    """operation -> the cells after it, for the rows of the table against transformers."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| dry run:"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[1]] = cells[2:]
    return rows


def ms(cell: str) -> float:
    assert cell.endswith(" ms"), cell
    return float(cell[:-3])


def ratio(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


def test_dry_run_times_every_run_of_the_comparison(tmp_path):
    out = tmp_path / "bench_gpu.md"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert "did not run" not in text and "skipped" not in text, text
    rows = table_rows(text)
    assert bench.gpu_model_takes_dtype()  # fast.gpu.Model(..., dtype="bfloat16"), issue #30
    for op in ("encode", "denoise", "generate"):
        ours, ours16, hf32, hf16, ratio32, ratio16 = rows[op]
        for cell in (ours, ours16, hf32, hf16):
            assert ms(cell) > 0 and math.isfinite(ms(cell)), (op, cell)
        assert ratio(ratio32) == pytest.approx(ms(ours) / ms(hf32), rel=0.01, abs=0.01)  # of rounded times
        assert ratio(ratio16) == pytest.approx(ms(ours16) / ms(hf16), rel=0.01, abs=0.01)
    assert float(rows["max |logit diff| ours fp32 vs hf fp32"][0]) < 1e-3  # the same weights and inputs
    scale = float(rows["max |logit diff| hf bf16 vs hf fp32 (bfloat16's own size, for scale)"][3])
    assert 0 < scale < 10
    assert 0 < float(rows["max |logit diff| ours bf16 vs hf bf16"][1]) < 10 * scale
    # the bf16 row is the bfloat16 run, not the float32 one again
    assert float(rows["max |logit diff| ours bf16 vs ours fp32"][1]) > 1e-3
    assert "ours bf16 ahead of transformers bf16 eager (target: on all three): encode " in text
    assert "| dry run: 26B layer pattern (S+F) at tiny sizes, torch CPU, ours cuda-sim | " in text  # float64 table


def test_the_verdict_on_the_target_follows_the_times():
    def rows(encode16):  # (label, op, ours fp32, ours bf16, hf fp32, hf bf16)
        return [("c", "encode", 2.0, encode16, 1.0, 0.5), ("c", "denoise", 2.0, 0.25, 1.0, 0.5),
                ("c", "generate", 2.0, 0.1, 1.0, 0.5), ("c", "max |logit diff| ours fp32 vs hf fp32", 1e-4, NAN,
                                                        NAN, NAN)]

    met = bench.comparison_table([("c", rows(0.4))])
    assert "| c | encode | 2000.00 ms | 400.00 ms | 1000.00 ms | 500.00 ms | 2.00x | 0.80x |" in met
    assert met[-1] == ("- c: ours bf16 ahead of transformers bf16 eager (target: on all three): encode yes "
                       "(0.80x); denoise yes (0.50x); generate yes (0.20x); target met")
    missed = bench.comparison_table([("c", rows(0.6))])
    assert missed[-1].endswith("encode NO (1.20x); denoise yes (0.50x); generate yes (0.20x); target NOT met")
    none = bench.comparison_table([("c", rows(NAN))])  # ours bf16 did not run: no verdict on encode
    assert "target NOT met" in none[-1] and "encode" not in none[-1]
    assert "| c | encode | 2000.00 ms | - | 1000.00 ms | 500.00 ms | 2.00x | - |" in none


def test_without_the_bf16_gpu_run_the_row_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "gpu_model_takes_dtype", lambda: False)
    out = tmp_path / "bench_gpu.md"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    assert f"- ours bf16 {bench.NO_BF16_YET}" in text
    assert table_rows(text)["denoise"][1] == "-"
