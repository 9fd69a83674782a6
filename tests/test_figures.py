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
    changed["steps"][-1]["temperature"] += 1e-3  # beyond the float tolerance
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
    assert figures.main(["--out", str(tmp_path), "--only", "visibility", "temperature_schedule"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["temperature_schedule.json", "temperature_schedule.png",
                                                         "visibility.json", "visibility.png"]
    assert figures.main(["--check", "--out", str(tmp_path), "--only", "visibility"]) == 0
    data = json.loads((tmp_path / "visibility.json").read_text())
    data["panels"]["decoder sliding"]["visible"][0][-1] = 0
    (tmp_path / "visibility.json").write_text(json.dumps(data))
    assert figures.main(["--check", "--out", str(tmp_path), "--only", "visibility"]) == 1
    assert "visibility: STALE" in capsys.readouterr().out
