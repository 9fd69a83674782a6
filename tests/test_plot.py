"""Pictures of the denoising (diffusiongemma.plot, `diffusiongemma plot`): every figure is produced and draws
exactly the run's numbers, from a `generate --json` file and from a trace."""

from __future__ import annotations

import json

import numpy as np
import pytest

from diffusiongemma import plot
from diffusiongemma.checkpoint import default_model_dir, load_text_side
from diffusiongemma.cli.main import main
from diffusiongemma.reference.support.errors import InputError
from diffusiongemma.reference.generate import GenerationConfig, generate
from diffusiongemma.reference.model import Model

# the ground truth below is the reference's run: the command must run the reference too (its default backend
# is now the fastest available, whose float32 sums round differently)
RUN = ["And God said", "--seed", "3", "-n", "96", "--steps", "6", "--ignore-eos", "--no-progress",
       "--backend", "reference"]


class Steps:
    """Keeps every StepInfo of row 0 (the ground truth the record must equal)."""

    def __init__(self):
        self.steps = []

    def on_step(self, info):
        self.steps.append((info.canvas_index, np.array(info.entropies[0]), np.array(info.accepted[0]),
                           np.array(info.draft[0]), info.temperature))


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    """A `generate --json` file of a 3-canvas run, its parsed object, and the StepInfos of the same run."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", *RUN, "--json"]) == 0
    data = json.loads(out.getvalue())
    path = tmp_path_factory.mktemp("plot") / "run.json"
    path.write_text(out.getvalue())
    model = Model.from_pretrained(default_model_dir())
    settings = GenerationConfig.from_dict(data["settings"])
    truth = Steps()
    generate(model, np.array([data["prompt_token_ids"]]), generation_config=settings, random=3, callback=truth)
    return path, data, truth.steps


def truth_grid(steps, C, what):
    canvases = sorted({k for k, *_ in steps})
    s_max = max(sum(1 for k, *_ in steps if k == c) for c in canvases)
    grid = np.full((len(canvases) * C, s_max), np.nan)
    index = {"entropy": 1, "accepted": 2}[what]
    for c in canvases:
        rows = [s[index] for s in steps if s[0] == c]
        grid[c * C:(c + 1) * C, :len(rows)] = np.array(rows, dtype=np.float64).T
    return grid


def test_record_holds_every_step_of_the_run(run_json):
    _, data, steps = run_json
    record = plot.DenoisingRecord.from_json(data)
    assert len(record.canvases) == data["canvases"] == 3
    assert [c.steps for c in record.canvases] == data["steps_per_canvas"]
    flat = [(k, i) for k, c in enumerate(record.canvases) for i in range(c.steps)]
    assert len(flat) == len(steps)
    for (k, i), (k_true, entropy, accepted, draft, temp) in zip(flat, steps):
        canvas = record.canvases[k]
        assert k == k_true
        np.testing.assert_allclose(canvas.entropies[i], entropy, atol=1e-6)
        assert np.array_equal(canvas.accepted[i], accepted) and np.array_equal(canvas.drafts[i], draft)
        assert canvas.temperatures[i] == pytest.approx(temp)
    committed = np.concatenate([c.committed for c in record.canvases])
    assert committed.tolist() == data["token_ids"]


def test_settled_steps_is_the_first_step_of_the_final_run_of_drafts():
    drafts = np.array([[5, 1, 7], [5, 2, 7], [5, 2, 8], [5, 2, 8]])
    canvas = plot.CanvasRecord(np.zeros((4, 3), np.float32), np.zeros((4, 3), bool), drafts,
                               np.zeros(4, np.float32))
    assert canvas.settled_steps().tolist() == [0, 1, 2]


@pytest.mark.parametrize("name", plot.FIGURES)
def test_each_figure_is_written(run_json, tmp_path, name):
    path, _, _ = run_json
    png, svg = tmp_path / f"{name}.png", tmp_path / f"{name}.svg"
    assert main(["plot", str(path), "--figure", name, "-o", str(png)]) == 0
    assert main(["plot", str(path), "--figure", name, "-o", str(svg)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "<svg" in svg.read_text()[:1000]


def test_figures_draw_the_runs_numbers(run_json):
    _, data, steps = run_json
    record = plot.DenoisingRecord.from_json(data)
    C = data["canvas_length"]
    fig = plot.entropy_heatmap(record)
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(np.float64), np.nan)
    np.testing.assert_allclose(drawn, truth_grid(steps, C, "entropy"), atol=1e-6, equal_nan=True)

    fig = plot.acceptance_heatmap(record)
    drawn = np.ma.filled(fig.axes[0].images[0].get_array().astype(np.float64), np.nan)
    np.testing.assert_array_equal(drawn, truth_grid(steps, C, "accepted"))

    fig = plot.accepted_per_step(record)
    heights = [bar.get_height() for bar in fig.axes[0].patches]
    assert heights == [int(s[2].sum()) for s in steps]

    fig = plot.temperature_schedule(record)
    ys = np.concatenate([line.get_ydata() for line in fig.axes[0].lines if line.get_marker() == "."])
    np.testing.assert_allclose(ys, [s[4] for s in steps], rtol=1e-6)

    fig = plot.commit_order(record)
    drawn = np.asarray(fig.axes[0].images[0].get_array())
    assert np.array_equal(drawn, np.stack([c.settled_steps() for c in record.canvases]))

    fig = plot.summary(record)
    assert len([ax for ax in fig.axes if ax.get_title()]) == 5


def test_trace_gives_the_same_record_as_the_json(run_json, tmp_path):
    _, data, _ = run_json
    trace = tmp_path / "run.trace"
    assert main(["trace", "--prompt", data["prompt"], "--seed", "3", "-n", "96", "--steps", "6", "--no-layers",
                 "--logits", "topk", "--ignore-eos", "-o", str(trace), "--no-progress"]) == 0
    from_trace = plot.load_record(str(trace))
    from_json = plot.DenoisingRecord.from_json(data)
    assert len(from_trace.canvases) == len(from_json.canvases) == 3
    for a, b in zip(from_trace.canvases, from_json.canvases):
        np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-6)
        assert np.array_equal(a.accepted, b.accepted) and np.array_equal(a.drafts, b.drafts)
        np.testing.assert_allclose(a.temperatures, b.temperatures, rtol=1e-6)
    png = tmp_path / "trace.png"
    assert main(["plot", str(trace), "-o", str(png)]) == 0 and png.stat().st_size > 5000


def test_animation_page_is_self_contained_and_has_every_step(run_json, tmp_path):
    path, data, steps = run_json
    page = tmp_path / "run.html"
    assert main(["plot", str(path), "-o", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "http" not in text.replace("<!DOCTYPE html>", "") and "src=" not in text
    frames = json.loads(text.split("const frames = ", 1)[1].split(";\n", 1)[0].replace("<\\/", "</"))
    assert len(frames) == len(steps) + 1
    assert frames[0]["header"].startswith(f"canvas 1/3 · step 1/6 · accepted {int(steps[0][2].sum())}/32 · T=")
    side = load_text_side(default_model_dir())
    assert frames[-1]["committed"] == "".join(side.decode([t], skip_special_tokens=False) for t in data["token_ids"])


def test_plot_reads_a_run_from_standard_input(run_json, tmp_path, monkeypatch):
    import io
    import sys

    path, data, _ = run_json
    png = tmp_path / "stdin.png"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    assert main(["plot", "-", "--figure", "entropy", "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_errors_name_the_problem(run_json, tmp_path, capsys):
    path, _, _ = run_json
    assert main(["plot", str(path), "-o", str(tmp_path / "x.jpeg")]) == 2
    assert "-o/--output" in capsys.readouterr().err
    assert main(["plot", str(path), "-o", str(tmp_path / "missing" / "x.png")]) == 2
    assert "-o/--output" in capsys.readouterr().err
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"text": "no steps"}))
    assert main(["plot", str(bare), "-o", str(tmp_path / "x.png")]) == 2
    assert "bare.json holds no per-step data" in capsys.readouterr().err
    with pytest.raises(InputError, match="no denoising steps"):
        plot.figure(plot.DenoisingRecord(32, 6, []))
