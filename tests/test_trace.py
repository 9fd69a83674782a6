"""Golden traces on the reference: what is recorded, the file format and its errors, the comparison, the CLI.

The model is the shipped tiny-kjv checkpoint (V = 4096, H = 160, C = 32, layers [S, F, S, F], W = 16), so
these tests need neither torch nor transformers; test_trace_transformers.py covers transformers and the fast
path.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from diffusiongemma import fast
from diffusiongemma.checkpoint import default_model_dir
from diffusiongemma.cli.main import main
from diffusiongemma.reference.support.replay import ReplayDraws
from diffusiongemma.reference.generate import GenerationConfig, generate
from diffusiongemma.reference.model import Model
from diffusiongemma.trace import (DEFAULT_ATOL, METADATA_KEY, Row, Trace, TraceError, TraceRecorder, compare_traces,
                                  format_report, summarize_logits)
from diffusiongemma.trace.compare import _compare_topk_ids

SETTINGS = GenerationConfig(max_new_tokens=33, max_denoising_steps=3, stability_threshold=1,
                            confidence_threshold=0.005, eos_token_id=(), pad_token_id=0)  # no EOS: two canvases
PROMPT = np.array([[2, 818, 1337, 7, 99, 4000, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]])  # P = 18 > W


@pytest.fixture(scope="module")
def model():
    return Model.from_pretrained(default_model_dir())


def record(model, path, layers=True, logits="auto", seed=1, prompt=PROMPT, random=None, **changes):
    recorder = TraceRecorder(layers=layers, logits=logits, top_k=8)
    result = generate(model, prompt, generation_config=SETTINGS.replace(**changes),
                      random=seed if random is None else random, trace=recorder)
    recorder.save(path)
    return result, recorder


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trace") / "base.trace")
    result, recorder = record(model, path)
    return path, result, recorder


def compare(a, b, **tolerances):
    with Trace(a) as ta, Trace(b) as tb:
        return compare_traces(ta, tb, **tolerances)


def perturbed(model, name, scale):
    tensors = {k: v.copy() for k, v in model.tensors.items()}
    noise = np.random.default_rng(0).standard_normal(tensors[name].shape).astype(np.float32)
    tensors[name] += scale * np.abs(tensors[name]).mean() * noise
    return Model(model.config, tensors)


# ------------------------------------------------------------------------------------------------ content
def test_trace_holds_the_run_in_order(model, baseline):
    path, result, _ = baseline
    with Trace(path) as trace:
        names = trace.names
        assert names[0] == "prompt.input_ids"
        np.testing.assert_array_equal(trace.get("prompt.input_ids"), PROMPT)
        # one encode of the prompt, two canvases (33 tokens), the second after encoding the first
        L, C = model.config.num_hidden_layers, model.config.canvas_length
        first_canvas = names.index("canvas0.initial")
        assert [n for n in names[1:first_canvas]] == [f"encode0.layer{l}.{w}" for l in range(L)
                                                      for w in ("keys", "values", "cached")]
        assert names.index("canvas0.committed") < names.index("encode1.layer0.keys") < names.index("canvas1.initial")
        assert names[-1] == "output.sequences"
        np.testing.assert_array_equal(trace.get("output.sequences"), result.sequences)
        step = ["input_embedding"] + [f"layer{l}.output" for l in range(L)] + [
            "logits", "temperature", "draft", "sampled", "sampler_entropy", "accepted", "canvas", "finished"]
        assert names[first_canvas + 1:first_canvas + 1 + len(step)] == [f"canvas0.step0.{w}" for w in step]
        assert len(result.steps_per_canvas) == 2
        # sliding layers retain W - 1 = 15 of the 18 prompt tokens, full layers all of them
        assert [int(trace.get(f"encode0.layer{l}.cached")) for l in range(L)] == [15, 18, 15, 18]
        assert trace.get("encode0.layer0.keys").shape == (1, 2, 15, 32)
        assert trace.get("encode1.layer1.keys").shape == (1, 1, C, 64)  # the C newest of 50 cached
        assert trace.header["logits"] == {"mode": "full", "top_k": None}
        assert trace.header["generation"] == SETTINGS.to_dict()
        assert trace.header["draws"]["source"] == "SeededDraws" and trace.header["draws"]["seed"] == 1
        assert trace.header["draws"]["tape"][:3] == ["canvas", "categorical", "renoise"]
        assert trace.header["complete"] is True


def test_recorded_values_are_the_models(model, baseline):
    """The trace is not a copy of itself: its tensors equal what the model computes independently."""
    path, result, _ = baseline
    cache = model.new_cache(1)
    model.encode(PROMPT, cache)
    with Trace(path) as trace:
        for l in range(model.config.num_hidden_layers):
            # bit-exact: the trace recorded this model's own encode and denoise of these inputs (same shapes, same calls)
            np.testing.assert_array_equal(trace.get(f"encode0.layer{l}.keys"), cache.keys[l][:, :, -15:]
                                          if model.config.is_sliding(l) else cache.keys[l])
        canvas = trace.get("canvas0.initial")
        logits = model.denoise(canvas, cache)
        np.testing.assert_array_equal(trace.get("canvas0.step0.logits"), logits)
        np.testing.assert_array_equal(trace.get("canvas0.step0.input_embedding"), model.canvas_input(canvas, None))
        np.testing.assert_array_equal(trace.get("canvas0.committed"), result.sequences[:, 18:50])
        assert float(trace.get("canvas0.step0.temperature")) == np.float32(0.8)


def test_tracing_does_not_change_the_run(model, baseline):
    _, traced, _ = baseline
    plain = generate(model, PROMPT, generation_config=SETTINGS, random=1)
    # bit-exact: tracing only reads the run: both runs make the same calls on the same shapes
    np.testing.assert_array_equal(plain.sequences, traced.sequences)
    np.testing.assert_array_equal(plain.tokens_per_forward, traced.tokens_per_forward)


def test_replaying_the_tape_reproduces_the_trace_exactly(model, baseline, tmp_path):
    path, result, _ = baseline
    with Trace(path) as trace:
        draws = ReplayDraws(trace.draw_tape())
    replayed, _ = record(model, tmp_path / "replay.trace", random=draws)
    draws.check_exhausted()
    comparison = compare(path, tmp_path / "replay.trace", atol=0.0, rtol=0.0)
    assert comparison.ok, format_report(comparison)
    assert max(row.max_abs for row in comparison.rows if row.max_abs is not None) == 0.0
    assert any(note.startswith("both runs used the same") for note in comparison.notes)


# ------------------------------------------------------------------------------------------------ divergence
@pytest.mark.parametrize("tensor, scale, first", [
    ("layers.2.k_proj", 0.3, "encode0.layer2.keys"),  # the brief's example: layer 2's keys, nothing before
    ("layers.2.v_proj", 0.3, "encode0.layer2.values"),  # keys of layer 2 still agree
    ("layers.3.mlp.down_proj", 0.3, "canvas0.step0.layer3.output"),  # last layer's MLP: no cached K/V reads it
    ("layers.0.decoder_layer_scalar", 0.2, "canvas0.step0.layer0.output"),  # decoder-only tensor
    ("final_norm", 0.3, "canvas0.step0.logits"),  # after every layer output
    ("self_conditioning.up_proj", 0.3, "canvas0.step1.input_embedding"),  # unused at step 0
])
def test_first_divergence_is_the_first_tensor_the_weight_affects(model, baseline, tmp_path, tensor, scale, first):
    record(perturbed(model, tensor, scale), tmp_path / "bad.trace")
    comparison = compare(baseline[0], tmp_path / "bad.trace")
    row = comparison.first_divergence
    assert row is not None and row.name == first, format_report(comparison)
    index = comparison.rows.index(row)
    assert index > 0 and all(r.ok for r in comparison.rows[:index])
    assert row.max_abs > 100 * DEFAULT_ATOL  # a real difference, far above float32 noise
    report = format_report(comparison, table=False)
    assert f"First divergence: {first} (#{index} in run order" in report and "hint:" in report


def test_first_divergence_without_layer_outputs_points_at_the_logits(model, baseline, tmp_path):
    record(perturbed(model, "layers.3.mlp.down_proj", 0.3), tmp_path / "bad.trace", layers=False)
    comparison = compare(baseline[0], tmp_path / "bad.trace")
    assert comparison.skipped == {"layer_output": f"only in {baseline[0]}"}
    assert comparison.first_divergence.name == "canvas0.step0.logits"
    assert "also any decoder layer" in comparison.hint


def test_different_seeds_part_at_the_initial_canvas(baseline, model, tmp_path):
    record(model, tmp_path / "seed2.trace", seed=2)
    comparison = compare(baseline[0], tmp_path / "seed2.trace")
    assert comparison.first_divergence.name == "canvas0.initial"
    assert any("different random draws from draw 0 on (canvas" in note for note in comparison.notes)


def test_runs_of_different_length_show_the_missing_tensors(baseline, model, tmp_path):
    """A run with fewer steps is not silently compared on the common part only."""
    with Trace(baseline[0]) as trace:
        draws = ReplayDraws(trace.draw_tape())
    recorder = TraceRecorder(layers=True)

    def stop_after_two_steps(canvas, cache, sc_logits):
        if recorder._step >= 2:
            raise RuntimeError("engine crashed")
        return model.denoise(canvas, cache, sc_logits)

    with pytest.raises(RuntimeError):
        generate(model, PROMPT, generation_config=SETTINGS, random=draws, trace=recorder, denoiser=stop_after_two_steps)
    recorder.save(tmp_path / "partial.trace", error="RuntimeError: engine crashed")
    comparison = compare(baseline[0], tmp_path / "partial.trace")
    first = comparison.first_divergence
    assert first.name == "canvas0.step2.logits" and first.detail.startswith("missing in")
    assert any("incomplete" in note and "engine crashed" in note for note in comparison.notes)
    # a custom denoiser bypasses the model, so no decoder inputs were recorded for the partial run
    assert "input_embedding" in comparison.skipped


def test_frozen_rows_are_canonical(model):
    """Rows that stopped denoising: model tensors 0, sampled -1, accepted False, whether given or skipped."""
    recorder = TraceRecorder(layers=True)
    recorder.begin_run(model.config, SETTINGS, np.zeros((2, 3), dtype=np.int64))
    C, H, V = model.config.canvas_length, model.config.hidden_size, model.config.vocab_size
    recorder.begin_canvas(np.zeros((2, C), dtype=np.int64))
    recorder.begin_step(np.array([True, False]))
    recorder.decoder_input(np.ones((1, C, H)), rows=np.array([0]))  # a fast path decoding live rows only
    recorder.logits(np.ones((2, C, V), dtype=np.float32))  # another path decoding every row
    recorder.end_step(temperature=0.5, draft=np.ones((2, C)), sampled=np.full((2, C), 7), entropies=np.ones((2, C)),
                      accepted=np.ones((2, C), dtype=bool), canvas=np.ones((2, C)), finished=np.array([True, True]))
    t = recorder.tensors
    assert (t["canvas0.step0.input_embedding"][0] == 1).all() and (t["canvas0.step0.input_embedding"][1] == 0).all()
    assert (t["canvas0.step0.logits"][1] == 0).all() and (t["canvas0.step0.logits"][0] == 1).all()
    assert (t["canvas0.step0.sampled"] == [[7] * C, [-1] * C]).all()
    assert t["canvas0.step0.accepted"][0].all() and not t["canvas0.step0.accepted"][1].any()
    with pytest.raises(TraceError, match="not finished"):
        recorder.save("never-written.trace")
    assert not os.path.exists("never-written.trace")


def test_calls_out_of_order_are_refused(model):
    recorder = TraceRecorder()
    with pytest.raises(TraceError, match="begin_run"):
        recorder.logits(np.zeros((1, 32, 4096), dtype=np.float32))
    recorder.begin_run(model.config, SETTINGS, PROMPT)
    with pytest.raises(TraceError, match="state 'run'"):
        recorder.decoder_input(np.zeros((1, 32, 160)))
    recorder.begin_encode(PROMPT)
    recorder.encoder_kv(0, np.zeros((1, 2, 15, 32)), np.zeros((1, 2, 15, 32)))
    with pytest.raises(TraceError, match=r"layers \[1, 2, 3\] were not recorded"):
        recorder.end_encode()


# ------------------------------------------------------------------------------------------------ top-k
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(2, 40), st.integers(1, 50), st.integers(0, 2**31 - 1), st.booleans())
def test_summarize_logits_matches_brute_force(rows, V, k, seed, ties):
    rng = np.random.default_rng(seed)
    z = (rng.integers(-3, 3, size=(rows, V)) if ties else 5 * rng.standard_normal((rows, V))).astype(np.float32)
    s = summarize_logits(z, k)
    K = min(k, V)
    for r in range(rows):
        order = sorted(range(V), key=lambda v: (-z[r, v], v))[:K]  # descending, lower id first on ties
        assert list(s["topk_ids"][r]) == order
        np.testing.assert_array_equal(s["topk_values"][r], z[r, order])
        wide = z[r].astype(np.float64)
        lse = np.log(np.exp(wide - wide.max()).sum()) + wide.max()
        p = np.exp(wide - lse)
        np.testing.assert_allclose(s["logsumexp"][r], lse, rtol=1e-6)
        np.testing.assert_allclose(s["entropy"][r], -(p * np.log(p)).sum(), rtol=1e-5, atol=1e-6)


def judge(ids_a, ids_b, values_a, values_b):
    row = Row("x", "logits", "topk_ids", (1, 3), True)
    _compare_topk_ids(row, np.array([ids_a]), np.array([ids_b]), np.array([values_a], dtype=np.float32),
                      np.array([values_b], dtype=np.float32), 2e-4, 1e-4)
    return row.ok


def test_topk_ids_compare_up_to_ties_only():
    assert judge([5, 9, 2], [5, 9, 2], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0])
    assert judge([5, 9, 2], [9, 5, 2], [3.0, 3.00001, 1.0], [3.00001, 3.0, 1.0])  # near-tie swapped
    assert not judge([5, 9, 2], [9, 5, 2], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0])  # ids permuted: values disagree
    assert judge([5, 9, 2], [5, 9, 7], [3.0, 2.0, 1.0], [3.0, 2.0, 1.00001])  # tie at the cut-off
    assert not judge([5, 9, 2], [5, 9, 7], [3.0, 2.0, 1.0], [3.0, 2.0, 0.5])  # a different third id


def test_full_and_topk_traces_of_one_run_compare_clean(model, baseline, tmp_path):
    with Trace(baseline[0]) as trace:
        draws = ReplayDraws(trace.draw_tape())
    _, recorder = record(model, tmp_path / "topk.trace", logits="topk", random=draws)
    assert recorder.tensors["canvas0.step0.logits.topk_ids"].shape == (1, 32, 8)
    for a, b in ((baseline[0], tmp_path / "topk.trace"), (tmp_path / "topk.trace", baseline[0])):
        comparison = compare(a, b)
        assert comparison.ok, format_report(comparison)
        assert any("derived from the full logits" in note for note in comparison.notes)
        assert "canvas0.step0.logits.entropy" in [row.name for row in comparison.rows]


# ------------------------------------------------------------------------------------------------ bad files
def rewrite(src, dst, header_change=None, drop=None, add=None):
    """Copy a trace, editing its header or tensors without any validation."""
    with safe_open(str(src), "np") as f:
        header = json.loads(f.metadata()[METADATA_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != drop}
    if header_change:
        header_change(header)
    tensors.update(add or {})
    save_file(tensors, str(dst), metadata={METADATA_KEY: json.dumps(header)})
    return dst


def set_in(path, value):
    def change(header):
        target = header
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


@pytest.mark.parametrize("case, message", [
    (dict(header_change=set_in(["version"], 2)), "trace format version 2; this diffusiongemma reads version 1"),
    (dict(header_change=set_in(["version"], "1")), "'version' must be an integer"),
    (dict(header_change=set_in(["format"], "something-else")), "'format' is 'something-else'"),
    (dict(drop="canvas0.step1.logits"), "missing from the file, first 'canvas0.step1.logits'"),
    (dict(drop="draws.3"), "'draws.3' is missing"),
    (dict(add={"stray": np.zeros(2, np.float32)}), "neither in the run order nor the draw tape, first 'stray'"),
    (dict(header_change=set_in(["tensors", 3, "kind"], "fuzzy")), "has kind 'fuzzy'"),
    (dict(header_change=set_in(["tensors", 1, "kind"], "exact")), "declared exact (integers or booleans) but "
                                                                  "stored as float32"),
    (dict(header_change=set_in(["model", "vocab_size"], 0)), "model.vocab_size must be a positive integer"),
])
def test_corrupt_files_are_refused_with_a_clear_error(baseline, tmp_path, case, message):
    bad = rewrite(baseline[0], tmp_path / "bad.trace", **case)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trace(bad)


def test_truncated_unrelated_and_missing_files_are_refused(baseline, tmp_path):
    data = open(baseline[0], "rb").read()
    (tmp_path / "cut.trace").write_bytes(data[: len(data) - 100])
    with pytest.raises(TraceError, match="not a readable safetensors file"):
        Trace(tmp_path / "cut.trace")
    (tmp_path / "head.trace").write_bytes(data[:20])
    with pytest.raises(TraceError, match="not a readable safetensors file"):
        Trace(tmp_path / "head.trace")
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(TraceError, match="not a diffusiongemma trace"):
        Trace(tmp_path / "weights.safetensors")
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "json.trace"), metadata={METADATA_KEY: "{oops"})
    with pytest.raises(TraceError, match="not valid JSON"):
        Trace(tmp_path / "json.trace")
    with pytest.raises(TraceError, match="does not exist"):
        Trace(tmp_path / "nothing.trace")


@pytest.mark.parametrize("change, message", [
    (set_in(["model", "config_hash"], "sha256:" + "0" * 64), "different model configurations"),
    (set_in(["model", "hidden_size"], 161), "hidden_size is 160 in .* but 161 in"),
    (set_in(["generation", "max_denoising_steps"], 4), "different generation settings: max_denoising_steps = 3"),
])
def test_traces_of_other_models_or_settings_are_not_compared(baseline, tmp_path, change, message):
    other = rewrite(baseline[0], tmp_path / "other.trace", header_change=change)
    with pytest.raises(TraceError, match=message):
        compare(baseline[0], other)
    assert main(["compare", baseline[0], str(other)]) == 2


def test_missing_config_hash_is_said_not_hidden(baseline, tmp_path):
    other = rewrite(baseline[0], tmp_path / "port.trace", header_change=set_in(["model", "config_hash"], None))
    comparison = compare(baseline[0], other)
    assert comparison.ok and any("config hash missing" in note for note in comparison.notes)


def test_nan_never_compares_ok(baseline, tmp_path):
    with safe_open(baseline[0], "np") as f:
        logits = f.get_tensor("canvas0.step0.logits")
    logits[0, 3, 5] = np.nan
    nan = rewrite(baseline[0], tmp_path / "nan.trace", add={"canvas0.step0.logits": logits})
    for a, b in ((baseline[0], nan), (nan, nan)):
        comparison = compare(a, b)
        assert comparison.first_divergence.name == "canvas0.step0.logits"
        assert "NaN" in comparison.first_divergence.detail


# ------------------------------------------------------------------------------------------------ command line
def test_cli_trace_compare_and_replay(tmp_path, capsys):
    a, b, c = (str(tmp_path / name) for name in ("a.trace", "b.trace", "c.trace"))
    base = ["--prompt", "And God said", "--steps", "2", "--max-new-tokens", "33", "--no-progress"]
    assert main(["trace", *base, "--seed", "1", "-o", a]) == 0
    assert "wrote" in capsys.readouterr().err
    assert main(["compare", a, a]) == 0
    assert "RESULT: OK" in capsys.readouterr().out
    assert main(["trace", *base, "--seed", "2", "-o", b, "--no-layers"]) == 0
    capsys.readouterr()
    assert main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert "canvas0.initial" in out.splitlines()[-2] and "NOT OK" in out
    assert "not compared: layer_output" in out
    assert main(["trace", "--replay", a, "-o", c, "--no-progress"]) == 0
    assert main(["compare", a, c, "--summary"]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()  # --summary: the notes and the verdict, no table
    # the shipped model writes both canvases of the 33-token budget on seed 1 (no EOS): 10 draws, 84 tensors
    assert lines[0] == "note: both runs used the same 10 random draws", out
    assert lines[-1].startswith("RESULT: OK. All 84 compared tensors") and len(lines) == 2, out
    assert main(["trace", "--replay", a, "--seed", "3", "-o", c]) == 2
    assert "drop --seed" in capsys.readouterr().err


def test_cli_reference_and_fast_traces_compare_clean(tmp_path, capsys):
    """The reference's and the compiled CPU path's traces of one run agree. The two sum in different orders
    (their logits differ by ~1e-5 here), and at the shipped model's 4096 ids a categorical draw's interval is
    often narrower than that moves its edges: the CPU run therefore replays the reference run's drawn ids
    (``--replay``, teacher-forced draws), and every other decision of the run (argmax, acceptance, stop) is
    checked to stand under any logit error up to 1e-4 (tests/decision_margins.py)."""
    from diffusiongemma.checkpoint import default_model_dir, load_generation_config, load_text_side
    from diffusiongemma.reference.generate import generate
    from diffusiongemma.reference.model import Model
    from tests.decision_margins import StepsKept, UniformsKept, assert_clear_of_ties, margins

    path, noise = default_model_dir(), 1e-4
    settings = load_generation_config(path).replace(max_new_tokens=64, max_denoising_steps=3)
    kept, steps = UniformsKept(0), StepsKept()
    generate(Model.from_pretrained(path), np.array([load_text_side(path).encode("In the beginning")]),
             generation_config=settings, random=kept, callback=steps)
    assert_clear_of_ties(margins(steps.steps, kept.kept, noise, settings.entropy_bound,
                                 settings.confidence_threshold, draws=False), noise)
    ref, cpu = str(tmp_path / "ref.trace"), str(tmp_path / "cpu.trace")
    base = ["--prompt", "In the beginning", "--steps", "3", "--max-new-tokens", "64", "--no-progress"]
    assert main(["trace", *base, "--seed", "0", "-o", ref]) == 0
    assert main(["trace", "--replay", ref, "--no-progress", "-o", cpu, "--backend", "cpu"]) == 0
    capsys.readouterr()
    assert main(["compare", ref, cpu, "--full"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "RESULT: OK" in out and "encode0.layer3.values" in out and "canvas0.step0.logits" in out


def _both(changes):
    def change(header):
        for apply in changes:
            apply(header)
    return change


@pytest.mark.parametrize("sides, change, message", [
    ("b", set_in(["model", "config", "rms_norm_eps"], 1e-5),
     "header model.config does not match model.config_hash: the recorded model configuration was altered"),
    ("ab", set_in(["generation", "t_max"], 0.95),
     "header generation does not match generation_hash: the recorded generation settings were altered"),
    ("ab", _both([set_in(["generation_hash"], None), set_in(["generation", "max_denoising_steps"], 2)]),
     "header generation.max_denoising_steps is 2 but canvas 0 ran 3 steps"),
    ("ab", _both([set_in(["model", "config"], None), set_in(["model", "config_hash"], None),
                  set_in(["model", "vocab_size"], 4000)]), "has shape .* but header model.vocab_size is 4000"),
    ("b", _both([set_in(["model", "config_hash"], None), set_in(["model", "config", "canvas_length"], 16)]),
     "header model.canvas_length is 32 but model.config.canvas_length is 16"),
])
def test_compare_refuses_a_trace_whose_recorded_configuration_was_altered(baseline, tmp_path, capsys, sides, change,
                                                                           message):
    """Editing a trace's header after recording went unnoticed when both sides agreed (or the hash was kept)."""
    a = rewrite(baseline[0], tmp_path / "a.trace", header_change=change if "a" in sides else None)
    b = rewrite(baseline[0], tmp_path / "b.trace", header_change=change if "b" in sides else None)
    with pytest.raises(TraceError, match=message):
        compare(a, b)
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("altered" in err or "header model." in err), err


def test_a_recorded_trace_carries_the_digests_compare_checks(baseline):
    from diffusiongemma.trace.format import json_digest

    with Trace(baseline[0]) as trace:
        assert trace.header["generation_hash"] == json_digest(trace.header["generation"])
        assert trace.header["model"]["config_hash"] == json_digest(trace.header["model"]["config"])
