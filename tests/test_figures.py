"""The SPEC's figures (docs/figures/): their data is what the reference computes now, and every picture exists
and is shown in the docs.

``python -m diffusiongemma.figures`` recomputes each figure's data from the reference and redraws it; a change
of the reference that changes what a figure shows must come with the regenerated figure. These tests
recompute the data only (never the pixels) and compare it with the committed JSON.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from diffusiongemma import figures

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
MAX_BYTES = 150 * 1024


def _committed(name: str) -> dict:
    return json.loads((FIGURES / f"{name}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_committed_figure_data_is_current(name):
    diffs = figures.stale(_committed(name), figures.figure_data(name))
    assert not diffs, (f"docs/figures/{name}.json is stale ({len(diffs)} differences, first: {diffs[0]}); "
                       "regenerate with: python -m diffusiongemma.figures")


def test_a_changed_value_is_reported_stale():
    data = _committed("temperature_schedule")
    changed = copy.deepcopy(data)
    changed["steps"][-1]["temperature"] += 1e-2  # beyond the float tolerance
    assert figures.stale(data, changed) == [f"/steps[{len(data['steps']) - 1}]/temperature: "
                                            f"{data['steps'][-1]['temperature']!r} committed, "
                                            f"{changed['steps'][-1]['temperature']!r} now"]
    nudged = copy.deepcopy(data)
    nudged["steps"][-1]["temperature"] += 1e-7  # summation-order noise is not staleness
    assert figures.stale(data, nudged) == []
    flipped = _committed("canvas_denoising")
    other = copy.deepcopy(flipped)
    other["steps"][0]["accepted"][0] ^= 1  # a discrete decision must match exactly
    assert len(figures.stale(flipped, other)) == 1
    other = copy.deepcopy(flipped)
    other["steps"].pop()
    assert figures.stale(flipped, other) == [f"/steps: {len(flipped['steps'])} entries committed, "
                                             f"{len(flipped['steps']) - 1} now"]


def test_the_figures_show_what_the_spec_says():
    vis = _committed("visibility")["panels"]
    assert vis["decoder sliding"]["every_query_sees_the_same_keys"]
    assert len(vis["decoder sliding"]["cached_keys"]) == _committed("visibility")["sliding_window"] - 1
    timeline = _committed("block_timeline")
    encodes = [e for e in timeline["events"] if e["kind"] == "encode"]
    canvases = [e for e in timeline["events"] if e["kind"] == "canvas"]
    assert len(encodes) == len(canvases)  # the prefill, then every committed canvas but the last
    assert timeline["cache_length_at_end"] == timeline["output_length"] - canvases[-1]["length"]
    ring = _committed("cache_ring")
    assert all(len(s["sliding"]) <= ring["capacity"] for s in ring["states"])
    # the two mask pictures share one drawing size
    assert (ring["sliding_window"], ring["canvas_length"]) == (_committed("visibility")["sliding_window"],
                                                             _committed("visibility")["canvas_length"])
    # speed: the run of the timeline, counted; an encoder pass per canvas but the last, plus the prompt's
    speed = _committed("speed")
    run = speed["measured"]
    assert run["encoder_passes"] == len(encodes) and run["decoder_passes"] == sum(timeline["steps_per_canvas"])
    per_pass = round(run["new_tokens"] / run["decoder_passes"], 4)
    assert run["tokens_per_decoder_pass"] == run["tokens_per_forward"] == per_pass
    assert run["tokens_per_model_pass"] < run["tokens_per_decoder_pass"]
    released = speed["released"]
    assert released["experts_touched_one_token"] == released["top_k"]
    assert released["experts_touched_canvas"] > released["num_experts"] - 0.01
    steps = released["break_even_steps"]  # where the mixture of experts reads as much per token as one token
    below = [p for p in released["per_token_billion"] if p["steps"] < steps]
    assert all(p["moe_canvas"] < released["moe_autoregressive_billion"] for p in below)
    assert released["per_token_billion"][-1]["moe_canvas"] > released["moe_autoregressive_billion"]


@pytest.mark.parametrize("name", list(figures.FIGURES))
def test_every_figure_exists_is_small_and_is_shown_in_the_docs(name):
    png = FIGURES / f"{name}.png"
    assert png.is_file(), f"{png} is missing: python -m diffusiongemma.figures"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size < MAX_BYTES, f"{png.name} is {png.stat().st_size} bytes"
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # not docs/figures/README.md
    link = re.compile(r"\]\((?:\.?/?docs/)?figures/" + re.escape(name) + r"\.png\)")
    assert any(link.search(p.read_text(encoding="utf-8")) for p in docs), \
        f"no document links figures/{name}.png"


def test_the_script_writes_both_files_and_checks_them(tmp_path, capsys):
    deeper = tmp_path / "elsewhere" / "new" / "sub"
    assert figures.main(["--out", str(deeper), "--only", "temperature_schedule"]) == 0
    assert sorted(p.name for p in deeper.iterdir()) == ["temperature_schedule.json", "temperature_schedule.png"]
    tmp_path = tmp_path / "here"
    assert figures.main(["--out", str(tmp_path), "--only", "visibility", "temperature_schedule"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["temperature_schedule.json", "temperature_schedule.png",
                                                         "visibility.json", "visibility.png"]
    assert figures.main(["--check", "--out", str(tmp_path), "--only", "visibility"]) == 0
    data = json.loads((tmp_path / "visibility.json").read_text())
    data["panels"]["decoder sliding"]["visible"][0][-1] = 0
    (tmp_path / "visibility.json").write_text(json.dumps(data))
    assert figures.main(["--check", "--out", str(tmp_path), "--only", "visibility"]) == 1
    assert "visibility: STALE" in capsys.readouterr().out


def test_the_default_folder_is_the_current_one_and_docs_needs_the_clone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert figures.main(["--only", "temperature_schedule"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["temperature_schedule.json", "temperature_schedule.png"]
    before = {p: p.stat().st_mtime_ns for p in FIGURES.iterdir()}
    capsys.readouterr()
    assert figures.main(["--docs", "--only", "temperature_schedule"]) == 2  # run from outside the clone
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--docs" in err and "inside that clone" in err, err
    assert {p: p.stat().st_mtime_ns for p in FIGURES.iterdir()} == before
    monkeypatch.chdir(ROOT)
    assert figures.main(["--docs", "--check", "--only", "temperature_schedule"]) == 0


def _unwritable(folder):
    real = figures.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise PermissionError(13, "Permission denied", str(folder))
        return real(*args, dir=dir, **kwargs)

    return mkstemp


@pytest.mark.parametrize("case", ["empty", "blank", "file", "below a file", "read-only"])
def test_a_bad_out_folder_is_one_line_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    (tmp_path / "plain.txt").write_text("x")
    out = {"empty": "", "blank": "  ", "file": str(tmp_path / "plain.txt"),
           "below a file": str(tmp_path / "plain.txt" / "deeper" / "figs"),
           "read-only": str(tmp_path / "locked")}[case]
    if case == "read-only":
        (tmp_path / "locked").mkdir()
        monkeypatch.setattr(figures.tempfile, "mkstemp", _unwritable(tmp_path / "locked"))
    called = []
    monkeypatch.setattr(figures, "figure_data", lambda name: called.append(name))  # nothing may be computed
    assert figures.main(["--out", out, "--only", "temperature_schedule"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "--out" in captured.err and (out.strip() == "" or out in captured.err), captured.err
    assert "Traceback" not in captured.err and not called
    assert sorted(p.name for p in tmp_path.rglob("*")) == (["locked", "plain.txt"] if case == "read-only"
                                                           else ["plain.txt"])


def test_check_names_a_json_that_does_not_parse(tmp_path, capsys):
    (tmp_path / "visibility.json").write_text('{"panels": [1, 2,')
    (tmp_path / "temperature_schedule.json").write_bytes(b"\xff\xfe{}")
    assert figures.main(["--check", "--out", str(tmp_path), "--only", "visibility", "temperature_schedule"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"visibility: {tmp_path / 'visibility.json'} is not valid JSON (") and "line 1" in out[0]
    assert out[1].startswith(f"temperature_schedule: {tmp_path / 'temperature_schedule.json'} cannot be read")


def test_regenerating_over_data_within_the_tolerance_changes_no_byte(tmp_path):
    """Another machine's BLAS moves the last bits of a float: the committed JSON stays byte for byte."""
    assert figures.main(["--out", str(tmp_path), "--only", "temperature_schedule"]) == 0
    path = tmp_path / "temperature_schedule.json"
    data = json.loads(path.read_text())
    data["steps"][3]["temperature"] += 2e-4  # as if it had been rounded on another machine
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    path.write_text(text)
    assert figures.main(["--out", str(tmp_path), "--only", "temperature_schedule"]) == 0
    assert path.read_text() == text
    data["steps"][3]["temperature"] += 1e-2  # a real change is written
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    assert figures.main(["--out", str(tmp_path), "--only", "temperature_schedule"]) == 0
    assert json.loads(path.read_text()) == figures.figure_data("temperature_schedule")


def test_the_stored_numbers_are_rounded_below_float32_noise():
    """Every float a figure stores has at most figures.DIGITS decimals, so float32 noise of another BLAS
    (about 1e-6 relative) cannot reach a stored digit except at a rounding boundary (then the writer keeps
    the committed value, see above)."""
    def floats(x):
        if isinstance(x, dict):
            return [f for v in x.values() for f in floats(v)]
        if isinstance(x, list):
            return [f for v in x for f in floats(v)]
        return [x] if isinstance(x, float) else []

    for name in figures.FIGURES:
        values = floats(_committed(name))
        assert all(round(v, figures.DIGITS) == v for v in values), name
