"""Each stage of ``reference.variants`` pinned on scripted inputs (no model, no peer).

Every test states the two choices of one stage on an input where they differ, so that swapping a choice
in a variant (or breaking a stage function) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffusiongemma.reference import variants as S
from diffusiongemma.reference.stages import STAGES
from diffusiongemma.reference.variants.acceptance import (ar_euler_accept, block_refinement_accept,
                                                          confidence_threshold_accept)
from diffusiongemma.reference.variants.stopping import ArgmaxHistoryStop, HeldCounterStop, InputCanvasStop


from diffusiongemma.reference.support.errors import ConfigError
from diffusiongemma.reference.sampling import StableAndConfident


STRICT = STAGES["stop_comparison"]["strict"]


def make_stopper(semantics, s, gamma):
    """The stopper a run with ``semantics`` uses (None without adaptive stopping), as ``generate`` makes it."""
    if s is None or gamma is None:
        return None
    return semantics.stop_history.make(s, gamma, semantics.stop_comparison)


def stage(field, name):
    """The stage object registered under ``name`` for ``field``."""
    return STAGES[field][name]


# ------------------------------------------------------------------------------------------ the variants
def test_every_variant_is_selectable_and_only_transformers_is_the_default():
    assert set(S.SEMANTICS) == {"transformers", "jax", "llama.cpp", "vllm", "mlx-vlm", "diffusers"}
    for name, variant in S.SEMANTICS.items():
        assert S.get_semantics(name) is variant
        assert variant.runs_on_any_backend == (name == "transformers")  # the rest change a step's stages
        for switch, choice in variant.switches().items():
            assert choice in S.SWITCHES[switch], (name, switch)
    assert S.get_semantics(None) is S.SEMANTICS["transformers"]


def test_unknown_names_and_choices_are_refused():
    with pytest.raises(ConfigError, match="unknown semantics 'sglang'"):
        S.get_semantics("sglang")
    with pytest.raises(ConfigError, match="commit must be one of"):
        S.Semantics("x", commit="majority")


def test_variant_choices_match_the_peer_table():
    jax, llama, mlx, dif, vllm = (S.SEMANTICS[n] for n in ("jax", "llama.cpp", "mlx-vlm", "diffusers", "vllm"))
    names = lambda *stages: tuple(getattr(st, "name", st) for st in stages)  # noqa: E731
    assert names(jax.commit, jax.stop_comparison, jax.stop_history, jax.canvas_window) == (
        "sampled", "non-strict", "input-canvas", "W-1-i")
    assert names(llama.stop_history, llama.sc_temperature, llama.temperature, llama.eos) == (
        "held-counter", "multiply-inverse", "c-float", "llama.cpp")
    assert names(mlx.sampler, mlx.denoiser_draw, mlx.eos, mlx.threshold) == (
        "confidence-threshold", "argmax", "stop-excluded", 0.9)
    assert "last canvas" in mlx.note and "not reproduced" in mlx.note
    assert names(dif.commit, dif.stop_history, dif.eos, dif.temperature) == (
        "sampled-unless-stopped", "argmax-history-min1", "first-id-only", "double")
    assert names(vllm.temperature, vllm.eos) == ("double", "cut-after")


# ------------------------------------------------------------------------------------------ temperature
def test_temperature_float32_and_double_differ_in_the_last_bit_at_step_37_of_48():
    f32 = stage("temperature", "float32")(37, 48, 0.4, 0.8)
    f64 = stage("temperature", "double")(37, 48, 0.4, 0.8)
    assert f32 == np.float32(0.7083334) and f64 == np.float32(0.7083333)
    assert np.nextafter(f64, np.float32(1)) == f32
    assert stage("temperature", "c-float")(48, 48, 0.4, 0.8) == np.float32(0.8)


def test_c_float_temperature_uses_llama_cpp_operation_order():
    # llama.cpp: t_min + (t_max - t_min) * ((float) cur_step / (float) S), the fraction rounded first
    lo, hi = np.float32(0.4), np.float32(0.8)
    for n, N in ((7, 48), (7, 9)):
        expected = np.float32(lo + np.float32(np.float32(hi - lo) * np.float32(np.float32(n) / np.float32(N))))
        assert stage("temperature", "c-float")(n, N, 0.4, 0.8) == expected
    assert stage("temperature", "c-float")(7, 9, 0.4, 0.8) == np.float32(0.7111111)  # ((hi - lo) * n) / N: 0.71111107


def test_sc_input_divide_multiply_inverse_and_raw():
    raw = np.array([[[1.0, -0.31630015, -2.0]]], dtype=np.float32)
    T = np.float32(0.7)
    processed = raw / T
    assert stage("sc_temperature", "divide")(raw, processed, T) is processed
    inv = stage("sc_temperature", "multiply-inverse")(raw, processed, T)
    np.testing.assert_array_equal(inv, raw * np.float32(np.float32(1) / T))
    assert not np.array_equal(inv, processed)  # -0.3163 / 0.7 and -0.3163 * (1 / 0.7) round apart
    np.testing.assert_array_equal(stage("sc_temperature", "raw")(raw, processed, T), raw)


# ------------------------------------------------------------------------------------------ stopping
def _h(*values):
    return np.array([values], dtype=np.float32)


def test_strict_and_non_strict_confidence_at_the_threshold():
    gamma = 0.005
    at = _h(gamma, gamma)  # mean exactly float32(γ)
    strict = ArgmaxHistoryStop(0, gamma, stage("stop_comparison", "strict"))
    loose = ArgmaxHistoryStop(0, gamma, stage("stop_comparison", "non-strict"))
    draft = np.array([[4, 5]])
    assert not strict(draft, at)[0] and loose(draft, at)[0]


def test_argmax_history_matches_transformers_rule_and_min1_reads_zero_as_one():
    low = _h(0.0, 0.0)
    drafts = [np.array([[1, 2]]), np.array([[1, 2]]), np.array([[3, 2]])]
    for s in (0, 1, 2):
        ours, hf = ArgmaxHistoryStop(s, 0.005, STRICT), StableAndConfident(s, 0.005)
        assert [bool(ours(d, low)[0]) for d in drafts] == [bool(hf(d, low)[0]) for d in drafts]
    zero = ArgmaxHistoryStop(0, 0.005, STRICT)
    diffusers_zero = ArgmaxHistoryStop(0, 0.005, STRICT, min_history=1)
    assert zero(drafts[0], low)[0]  # s = 0: always stable
    assert not diffusers_zero(drafts[0], low)[0]  # diffusers: a history of one, filled with -1
    assert diffusers_zero(drafts[1], low)[0]


def test_held_counter_equals_the_argmax_history():
    rng = np.random.default_rng(3)
    low = np.zeros((2, 3), dtype=np.float32)
    for s in (0, 1, 2, 3):
        a, b = HeldCounterStop(s, 0.005, STRICT), ArgmaxHistoryStop(s, 0.005, STRICT)
        for _ in range(12):
            draft = rng.integers(0, 2, (2, 3))
            assert (a(draft, low) == b(draft, low)).all(), s


def test_input_canvas_stability_compares_with_the_canvas_fed_in():
    stop = InputCanvasStop(0.005, stage("stop_comparison", "non-strict"))
    low = _h(0.0, 0.0)
    draft = np.array([[7, 8]])
    assert stop(draft, low, input_canvas=np.array([[7, 8]]))[0]
    assert not stop(draft, low, input_canvas=np.array([[7, 9]]))[0]
    with pytest.raises(ConfigError, match="input canvas"):
        stop(draft, low)


def test_make_stopper_picks_the_variant_rule():
    assert make_stopper(S.SEMANTICS["transformers"], 1, None) is None
    assert isinstance(make_stopper(S.SEMANTICS["jax"], 1, 0.005), InputCanvasStop)
    assert isinstance(make_stopper(S.SEMANTICS["llama.cpp"], 1, 0.005), HeldCounterStop)
    assert make_stopper(S.SEMANTICS["diffusers"], 0, 0.005).s == 1


# ------------------------------------------------------------------------------------------ committing
def test_commit_rules():
    draft, canvas = np.array([[1, 2], [3, 4]]), np.array([[9, 2], [9, 9]])
    stopped = np.array([True, False])
    np.testing.assert_array_equal(stage("commit", "argmax")(draft, canvas, stopped), draft)
    np.testing.assert_array_equal(stage("commit", "sampled")(draft, canvas, stopped), canvas)
    np.testing.assert_array_equal(stage("commit", "sampled-unless-stopped")(draft, canvas, stopped),
                                  [[1, 2], [9, 9]])


def test_eos_rules_in_the_loop():
    tokens = np.array([[5, 1, 6, 106]])
    none = np.zeros(1, dtype=bool)
    hf, done = stage("eos", "transformers").finalize(tokens, none, (1, 106), None)
    assert done[0] and hf.tolist() == [[5, 1, 6, 106]]  # no pad id: nothing rewritten
    jax, _ = stage("eos", "jax").finalize(tokens, none, (1, 106), None)
    assert jax.tolist() == [[5, 1, 0, 0]]  # PAD = 0 after the first end token, which is kept
    first, done = stage("eos", "first-id-only").finalize(np.array([[5, 106]]), none, (1, 106), 0)
    assert not done[0] and first.tolist() == [[5, 106]]  # diffusers knows only the first id
    kept, done = stage("eos", "stop-excluded").finalize(tokens, none, (1, 106), 0)
    assert done[0] and kept.tolist() == tokens.tolist()


def test_output_trimming_rules():
    row = [5, 6, 1, 7, 8]
    assert stage("eos", "stop-excluded").trim(row, (1,), 256) == [5, 6]
    assert stage("eos", "stop-excluded").trim([4] * 10, (1,), 3) == [4, 4, 4]
    assert stage("eos", "cut-after").trim(row, (1,), 256) == [5, 6, 1]
    assert stage("eos", "transformers").trim(row, (1,), 2) == row
    # llama.cpp's trim_canvas (its lambda compiled and run on these rows): a loop is 6 equal pairs in a row
    llama = stage("eos", "llama.cpp")
    assert llama.trim([3, 9, 9, 9, 9, 9, 9, 9, 2], (1,), 256) == [3]  # seven 9s: six equal pairs
    assert llama.trim([3, 9, 9, 9, 9, 9, 9, 2], (1,), 256) == [3, 9, 9, 9, 9, 9, 9, 2]  # six 9s: only five
    assert llama.trim([3] + [4, 5] * 6, (1,), 256) == [3] + [4, 5] * 6  # stride 2 over 12: five pairs
    assert llama.trim([3] + [4, 5] * 6 + [4], (1,), 256) == [3]  # 13 positions: six pairs
    assert llama.trim([3, 4, 7, 4, 8, 4, 9, 4, 6, 4, 2, 4, 0, 4, 5], (1,), 256) == [3]  # one parity suffices
    assert llama.trim([5, 1, 9] + [9] * 8, (1,), 256) == [5]  # the end id first
    # canvas by canvas: a loop across a canvas boundary is not seen; the first cut canvas ends the reply
    assert llama.trim([2, 3, 9, 9, 9, 9] + [9, 9, 9, 9, 7, 8], (1,), 256, canvas_length=6) == [2, 3, 9, 9, 9, 9,
                                                                                                 9, 9, 9, 9, 7, 8]
    assert llama.trim([2, 3, 9, 9, 9, 9] + [9, 9, 9, 9, 7, 8], (1,), 256) == [2, 3]  # one canvas: a loop
    assert llama.trim([4, 1, 5, 6] + [7, 8, 9, 10], (1,), 256, canvas_length=4) == [4]


class StageSpy:
    """Wraps a stage object and records whether the loop called it or one of its methods."""

    def __init__(self, inner):
        self.inner, self.used = inner, False

    name = property(lambda self: self.inner.name)
    source = property(lambda self: self.inner.source)

    def __call__(self, *args, **kwargs):
        self.used = True
        return self.inner(*args, **kwargs)

    def __getattr__(self, attr):
        value = getattr(self.inner, attr)
        if not callable(value):
            return value

        def method(*args, **kwargs):
            self.used = True
            return value(*args, **kwargs)
        return method


def run_with_spies(fields, **settings):
    """A tiny reference run whose stages named in ``fields`` are spies; returns {field: used}."""
    from diffusiongemma.reference.generate import generate
    from diffusiongemma.reference.model import Model
    from diffusiongemma.tiny import make_config, random_tensors

    cfg = make_config(vocab_size=32, canvas_length=6)
    model = Model(cfg, random_tensors(cfg, seed=1, final_norm_gain=25.0, self_conditioning_gain=1e-3))
    spies = {field: StageSpy(getattr(S.TRANSFORMERS, field)) for field in fields}
    semantics = S.TRANSFORMERS.replace(name="spied", **spies)
    generate(model, np.array([[5, 6, 7, 8]]), random=0, semantics=semantics, max_new_tokens=12,
             max_denoising_steps=6, eos_token_id=[1], pad_token_id=0, **settings)
    return {field: spy.used for field, spy in spies.items()}


def test_every_stage_is_applied_by_the_loop():
    """A stage the loop never applies would make a variant look reproduced when it is not (a declared
    ``last_canvas`` stage was once recorded for mlx-vlm but never applied)."""
    used = run_with_spies(list(STAGES))
    assert set(used) == set(STAGES) and len(used) >= 9
    assert all(used.values()), f"stages the loop never applies: {[f for f, u in used.items() if not u]}"


def test_the_stage_spy_sees_an_unapplied_stage():
    """Negative control: without adaptive stopping the loop never consults the stopping stages, and the spies
    say so."""
    used = run_with_spies(["stop_history", "stop_comparison", "temperature"], stability_threshold=None)
    assert used == {"stop_history": False, "stop_comparison": False, "temperature": True}


# ------------------------------------------------------------------------------------------ samplers
def test_confidence_threshold_reveals_above_threshold_else_the_best():
    conf = np.array([[0.95, 0.2, 0.91, 0.5], [0.1, 0.3, 0.2, 0.25]], dtype=np.float32)
    revealed = np.array([[False, False, True, False], [False, False, False, False]])
    out = confidence_threshold_accept(conf, revealed, 0.9)
    assert out.tolist() == [[True, False, False, False], [False, True, False, False]]
    assert confidence_threshold_accept(conf, revealed, 0.9, force_all=True).tolist() == (~revealed).tolist()
    at = confidence_threshold_accept(np.float32([[0.9, 0.9]]), np.zeros((1, 2), bool), 0.9)
    assert at.tolist() == [[True, True]]  # >= (with > only the forced best one would be revealed)


def test_block_refinement_quota_and_threshold():
    conf = np.array([[0.2, 0.96, 0.5, 0.4, 0.3, 0.1, 0.6, 0.7]], dtype=np.float32)
    committed = np.zeros((1, 8), dtype=bool)
    # step 0 of 4: quota ceil(8/4) = 2 -> the two most confident; 0.96 > 0.95 is among them anyway
    out = block_refinement_accept(conf, committed, 0, 4, 0.95)
    assert np.flatnonzero(out[0]).tolist() == [1, 7]
    # with a low threshold every uncommitted position above it is committed beyond the quota
    out = block_refinement_accept(conf, committed, 0, 4, 0.45)
    assert np.flatnonzero(out[0]).tolist() == [1, 2, 6, 7]
    # the last step fills the quota to the whole canvas
    assert block_refinement_accept(conf, out, 3, 4, 0.95).sum() + out.sum() == 8


def test_ar_euler_accepts_everything_and_renoises_nothing_at_the_last_step():
    u = np.array([[0.0, 0.49, 0.51, 0.99]])
    accept, renoised = ar_euler_accept(u, u, step=2, max_steps=4)
    assert accept.tolist() == [[True, True, False, False]]
    assert renoised.tolist() == [[True, False, False, False]]  # probability 0.8 * 1 / 4 = 0.2
    accept, renoised = ar_euler_accept(u, u, step=1, max_steps=4)
    assert accept.all() and not renoised.any()


def test_sliding_window_per_query_rules():
    W, P, C = 4, 10, 3
    keys = np.arange(P - (W - 1) - 1, P)  # the last W positions, oldest first: 6, 7, 8, 9
    # W-1: every key the cache retains (its last W-1), for every query; W: likewise on a cache of W keys
    assert stage("canvas_window", "W-1").keys(keys[1:], P, C, W).tolist() == [[True, True, True]] * C
    assert stage("canvas_window", "W").keys(keys, P, C, W).tolist() == [[True, True, True, True]] * C
    per_query = stage("canvas_window", "W-1-i").keys(keys, P, C, W)  # (C, T + C): the canvas keys follow
    assert per_query[:, :len(keys)].tolist() == [
        [False, True, True, True], [False, False, True, True], [False, False, False, True]]
    assert per_query[:, len(keys):].all()  # C <= W: every canvas key
    band = stage("canvas_window", "W-1-i").keys(keys, P, 6, W)[:, len(keys):]  # C > W: JAX's |i - j| < W
    assert (band == (np.abs(np.arange(6)[:, None] - np.arange(6)[None, :]) < W)).all()


# ------------------------------------------------------------------------------------------ in the loop
class _Scripted:
    """A stand-in model whose decoder returns scripted logits (no weights): V = 6, C = 4."""

    def __init__(self, script):
        from types import SimpleNamespace

        self.config = SimpleNamespace(vocab_size=6, canvas_length=4)
        self.script = script  # (call index, canvas) -> (1, 4, 6) float32
        self.calls = 0

    def new_cache(self, batch_size):
        from types import SimpleNamespace

        return SimpleNamespace(length=0, batch_size=batch_size)

    def encode(self, ids, cache, mask=None):
        cache.length += ids.shape[1]

    DENOISE_REPORTS = True  # denoise takes the run's observer and window stage (both unused here)

    def denoise(self, canvas, cache, sc_logits=None, *, observer=None, canvas_window=None, sc_embedding=None):
        self.calls += 1
        return self.script(self.calls - 1, canvas)


def _run(semantics, script, **settings):
    from diffusiongemma.reference.generate import generate

    steps, canvases = [], []

    class Log:
        def on_step(self, info):
            steps.append(info)

        def on_canvas(self, info):
            canvases.append(info.tokens.copy())

    model = _Scripted(script)
    base = dict(max_new_tokens=4, max_denoising_steps=3, stability_threshold=1, confidence_threshold=0.005)
    base.update(settings)
    result = generate(model, np.array([[2, 3]]), semantics=semantics, random=7, callback=Log(), **base)
    return result, steps, canvases, model


def _flat(call, canvas):
    """Uncertain everywhere (uniform logits): only the lowest-entropy position is accepted each step."""
    z = np.zeros((1, 4, 6), dtype=np.float32)
    z[..., 2] = 0.1 * (np.arange(4)[None, :] + 1)
    return z


def test_generate_semantics_commit_rule_in_the_loop():
    _, steps, canvases, _ = _run("transformers", _flat)
    assert (canvases[0] == steps[-1].draft).all()  # the argmax draft
    _, steps, canvases, _ = _run("jax", _flat)
    assert (canvases[0] == steps[-1].canvas).all()  # the last sampled-and-renoised canvas
    assert not (canvases[0] == steps[-1].draft).all()


def test_generate_semantics_stability_zero_transformers_versus_diffusers():
    peaked = lambda call, canvas: np.where(np.arange(6) == 4, 30.0, -30.0).astype(np.float32)[None, None].repeat(4, 1)
    _, steps, _, _ = _run("transformers", peaked, stability_threshold=0)
    assert len(steps) == 1  # s = 0: confident is enough
    _, steps, _, _ = _run("diffusers", peaked, stability_threshold=0)
    assert len(steps) == 2  # max(s, 1) = 1 repeat needed


def test_generate_semantics_argmax_proposals_make_no_categorical_draw():
    from diffusiongemma.reference.support.replay import RecordingDraws
    from diffusiongemma.reference.draws import SeededDraws
    from diffusiongemma.reference.generate import generate

    for name, expect in (("transformers", True), ("mlx-vlm", False)):
        draws = RecordingDraws(SeededDraws(0))
        generate(_Scripted(_flat), np.array([[2, 3]]), semantics=name, random=draws, max_new_tokens=4,
                 max_denoising_steps=2)
        assert any(kind == "categorical" for kind, _ in draws.tape) == expect, name


def test_generate_semantics_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown semantics"):
        _run("sglang", _flat)


def test_canvas_window_rules_in_the_decoder():
    from diffusiongemma.reference.model import Model
    from tests.random_weights import make_config, random_tensors

    prompt = np.arange(3, 3 + 12)[None]  # P = 12
    canvas = np.arange(16)[None]
    outputs = {}
    for W in (8, 40):  # 40: longer than prompt + canvas, so no window rule can bite
        config = make_config(sliding_window=W)
        model = Model(config, random_tensors(config, seed=1))
        cache = model.new_cache(1)
        model.encode(prompt, cache)
        outputs[W] = (model.denoise(canvas, cache), model.denoise(canvas, cache, canvas_window=stage("canvas_window", "W-1-i").keys))
        if W == 8:
            wide = stage("canvas_window", "W").new_cache(model, 1)
            model.encode(prompt, wide)
            assert [wide.keys[l].shape[2] for l in range(config.num_hidden_layers)] == [8, 8, 12, 8, 12]
            assert np.abs(model.denoise(canvas, wide) - outputs[8][0]).max() > 1e-3  # one more prompt key
    # bit-exact: with a window of 40 both stages mask no key, so the same denoise call runs twice
    np.testing.assert_array_equal(outputs[40][1], outputs[40][0])
    assert np.abs(outputs[8][1] - outputs[8][0]).max() > 1e-3  # later queries see fewer prompt keys


def test_command_line_semantics_switch(capsys):
    import json

    from diffusiongemma.cli.generate_cmd import SEMANTICS_NAMES
    from diffusiongemma.cli.main import main

    assert SEMANTICS_NAMES == tuple(S.SEMANTICS)
    runs = {}
    for name in ("transformers", "jax"):
        assert main(["generate", "And God said", "-n", "32", "--steps", "4", "--seed", "3", "--json",
                     "--view", "plain", "--semantics", name]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["token_ids"]
    assert runs["transformers"] != runs["jax"]  # JAX commits the sampled canvas, not the argmax
    assert main(["generate", "x", "--semantics", "jax", "--backend", "cpu"]) == 2
    assert "--backend reference" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(S.SEMANTICS))
def test_every_variant_runs_the_reference_model(name):
    """Each named variant generates with the real reference model (window, cache and stages wired)."""
    from diffusiongemma.reference.generate import generate
    from diffusiongemma.reference.model import Model
    from tests.random_weights import make_config, random_tensors

    config = make_config()
    model = Model(config, random_tensors(config, seed=2, final_norm_gain=6.0, self_conditioning_gain=1e-2))
    result = generate(model, np.arange(3, 15)[None], semantics=name, random=0, max_new_tokens=32,
                      max_denoising_steps=4, eos_token_id=(1,), pad_token_id=0)
    assert result.sequences.shape[1] in (12 + 16, 12 + 32)
    assert len(result.steps_per_canvas) == (result.sequences.shape[1] - 12) // 16
