"""``diffusiongemma crosscheck``: the runnable peers (transformers, mlx-vlm, diffusers) against the reference.

The test extra installs transformers and diffusers, so their checks never skip. mlx-vlm is the ``mlx`` extra
(1.1 GB; 5 minutes to install cleanly on two cores, too much for every CI run): its checks run when it is
installed, ``pip install -e ".[mlx]" && python -m pytest -q tests/test_crosscheck.py`` (the README's
"Cross-checking other implementations" section). Each peer runs on the tiny random checkpoint that
``crosscheck`` builds itself.
The checks that must be able to fail are exercised by breaking one side on purpose: a perturbed peer
forward, our loop run with the wrong semantics for a peer, a missing peer, and the reference broken in one
decoder layer, in the encoder, in the acceptance rule and in the commit rule (each must be named as that
stage). The verdict must not depend on a contractive tiny model: random configs drawn with hypothesis
(sliding window below the canvas length, per-layer overrides with missing keys, several experts per token)
must AGREE with transformers, though their free runs part after a few steps.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiongemma.cli.main import main
from diffusiongemma.crosscheck import PeerUnavailable, crosscheck, peer_module
from diffusiongemma.crosscheck import common, variants
from diffusiongemma.crosscheck.mlx_vlm_peer import adapt_checkpoint, full_layer_shape
from diffusiongemma.crosscheck.tiny import write_tiny_checkpoint
from diffusiongemma.tiny import FULL, SLIDING, TinySpec, write_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


def _needs_mlx():
    pytest.importorskip("mlx_vlm", reason='mlx-vlm is the optional extra: pip install -e ".[mlx]"')


@pytest.fixture(scope="module", params=["transformers", "mlx-vlm", "diffusers"])
def report(request, tiny_dir):
    if request.param == "mlx-vlm":
        _needs_mlx()
    return crosscheck(request.param, tiny_dir)


@pytest.mark.slow
def test_every_peer_agrees_with_the_reference_and_its_own_semantics(report):
    assert [r.name for r in report.forward] == ["prefill", "self-conditioning", "after commit", "image id in context"]
    for row in report.forward:
        assert row.ok or (row.probe and report.peer == "mlx-vlm"), row
        assert 0 < row.tolerance < 1e-2 * max(1.0, row.max_abs_value)
    assert report.generation and all(g.draws == "replayed" for g in report.generation)
    for g in report.generation:
        assert g.ok, (g.label, g.divergence)
        assert g.peer_tokens and g.canvases
        tf = g.teacher_forced
        assert tf["calls"] == sum(c["steps_peer"] for c in g.canvases) and 0 < tf["worst_ratio"] <= 1
        assert g.sampler["steps"] == tf["calls"]
        if not g.free_run["agree"]:  # the free run is information: parted by rounding, explained in a note
            assert g.free_run["first_drift"] is not None
            assert any("self-conditioning feedback" in n for n in g.notes)
    assert report.agree and report.exit_code == 0
    assert "result: AGREE (exit 0)" in report.to_text()


def test_a_free_run_parted_by_rounding_does_not_decide(report):
    """The default tiny model's self-conditioning is expansive: on seed 0 the free run against transformers
    parts after a few steps, and the verdict must still be AGREE, with the drift reported."""
    if report.peer == "transformers":
        assert not report.generation[0].free_run["agree"]
    for row in report.generation:
        if row.free_run["agree"]:
            continue
        assert row.ok
        drift, parted = row.free_run["first_drift"], row.free_run["parted"]
        assert drift["input"] == "self-conditioning input" and 0 < drift["max_abs_diff"] < 1e-2
        if parted["canvas"] >= 0:
            assert (drift["canvas"], drift["step"]) < (parted["canvas"], parted["step"])
        assert any("rounding amplified through the self-conditioning feedback" in n for n in row.notes)


def test_adaptations_and_defects_are_named(report):
    if report.peer == "mlx-vlm":
        assert any("global_head_dim" in a and "temporary copy" in a for a in report.adaptations)
        assert any("image placeholder id" in d for d in report.defects)  # the probe row differs
    if report.peer == "diffusers":
        assert any("past_key_values" in a for a in report.adaptations)
        assert any("past_key_values" in d for d in report.defects)
        # diffusers commits the sampled canvas when it does not stop early: transformers semantics part
        assert any("vs transformers semantics: first difference" in d for d in report.defects)


def test_the_users_checkpoint_is_never_modified(tiny_dir):
    def digest():
        h = hashlib.sha256()
        for name in sorted(os.listdir(tiny_dir)):
            with open(os.path.join(tiny_dir, name), "rb") as f:
                h.update(name.encode() + f.read())
        return h.hexdigest()

    _needs_mlx()
    before = digest()
    crosscheck("mlx-vlm", tiny_dir, canvases=1)
    assert digest() == before


def test_a_perturbed_peer_forward_is_reported(monkeypatch, tiny_dir):
    module = peer_module("transformers")
    forward = module.Peer.forward

    def off_by_a_little(self, x):
        out = forward(self, x)
        out["after commit"] = out["after commit"] + np.float32(1e-2)
        return out

    monkeypatch.setattr(module.Peer, "forward", off_by_a_little)
    report = crosscheck("transformers", tiny_dir, canvases=1)
    rows = {r.name: r.ok for r in report.forward}
    assert rows == {"prefill": True, "self-conditioning": True, "after commit": False, "image id in context": True}
    assert report.exit_code == 1 and "DIFF after commit" in report.to_text()


def test_the_wrong_semantics_for_a_peer_is_found_with_step_position_and_cause(monkeypatch, tiny_dir):
    """Our loop run with transformers' semantics against diffusers: the commit rule parts them."""
    import diffusiongemma.crosscheck as X
    from diffusiongemma.reference.variants import SEMANTICS

    configurations = X._configurations

    def wrong(peer):
        return [(label, SEMANTICS["transformers"], options) for label, _, options in configurations(peer)][:1]

    monkeypatch.setattr(X, "_configurations", wrong)
    report = crosscheck("diffusers", tiny_dir, canvases=1)
    row = report.generation[0]  # the checkpoint's settings (the second row: loose stopping)
    assert not row.ok and report.exit_code == 1
    d = row.divergence
    assert d is not None and d.stage == "commit" and d.position >= 0 and d.cause
    assert row.teacher_forced["calls"] > 0 and row.teacher_forced["worst_ratio"] <= 1  # the forward agreed
    assert "DIFFER at stage commit" in report.to_text()


# ------------------------------------------------------------------------------ the reference broken on purpose
def _break_model(monkeypatch, change):
    """Every Model the cross-check loads gets ``change(model)`` applied (a mutation of our side)."""
    from diffusiongemma.reference import Model

    load = Model.from_pretrained.__func__

    def broken(cls, path):
        model = load(cls, path)
        change(model)
        return model

    monkeypatch.setattr(Model, "from_pretrained", classmethod(broken))


def _first_divergence(report):
    assert report.exit_code == 1
    found = [g.divergence for g in report.generation if g.divergence is not None]
    assert found, report.to_text()
    return found[0]


def test_a_mutation_in_one_decoder_layer_is_named_as_that_layer(monkeypatch, tiny_dir):
    def scale_layer_2(model):  # the decoder's layer scalar only: the encoder (and so the cache) is untouched
        # (an assignment: a loaded model's weights are views of its mapped files, replaced, not written into)
        model.layers[2]["decoder_layer_scalar"] = model.layers[2]["decoder_layer_scalar"] * np.float32(1.05)

    _break_model(monkeypatch, scale_layer_2)
    d = _first_divergence(crosscheck("transformers", tiny_dir, canvases=1))
    assert d.stage == "forward layer 2", d
    assert (d.canvas, d.step) == (0, 0) and d.values["max_abs_diff"] > d.values["tolerance"]
    assert "identical inputs" in d.cause and "decoder layer 2" in d.cause


def test_a_mutation_in_the_self_conditioning_path_is_named_as_the_decoder_input(monkeypatch, tiny_dir):
    def scale_sc_norm(model):
        model.tensors["self_conditioning.pre_norm"] = model.tensors["self_conditioning.pre_norm"] * np.float32(1.05)

    _break_model(monkeypatch, scale_sc_norm)
    d = _first_divergence(crosscheck("transformers", tiny_dir, canvases=1))
    assert d.stage == "forward input" and (d.canvas, d.step) == (0, 1), d  # step 0 has no self-conditioning
    assert "self-conditioning" in d.cause


def test_a_mutation_in_the_encoder_is_named_as_the_cache(monkeypatch, tiny_dir):
    def scale_encoder_layer_1(model):
        model.layers[1]["encoder_layer_scalar"] = model.layers[1]["encoder_layer_scalar"] * np.float32(1.05)

    _break_model(monkeypatch, scale_encoder_layer_1)
    d = _first_divergence(crosscheck("transformers", tiny_dir, canvases=1))
    assert d.stage == "cache/context" and d.canvas == 0 and d.step == -1, d
    # Layer 1's output is layer 2's input, but a scalar on it cancels in layer 2's input norm: layer 2's keys
    # agree, and the difference first shows in layer 3's (through layer 2's residual stream).
    assert d.values["layer"] == 3 and "layer 3" in d.cause


def test_a_mutation_in_the_acceptance_rule_is_named(monkeypatch, tiny_dir):
    acceptor = type(variants.semantics("transformers").sampler.start(4, 0.9))
    accept = acceptor.__call__

    def generous(self, step, input_canvas, noise, bound):
        return accept(self, step, input_canvas, noise, bound * 10)

    monkeypatch.setattr(acceptor, "__call__", generous)
    report = crosscheck("transformers", tiny_dir, canvases=1)
    d = _first_divergence(report)
    assert d.stage == "acceptance" and d.step >= 0 and d.peer_token >= 0, d
    assert "our loop accepted" in d.cause
    assert report.generation[0].teacher_forced["worst_ratio"] <= 1  # the forward is not blamed


def test_a_mutation_in_the_commit_rule_is_named(monkeypatch, tiny_dir):
    commit = type(variants.semantics("transformers").commit)
    monkeypatch.setattr(commit, "__call__", lambda self, draft, canvas, stopped: np.asarray(canvas, dtype=np.int64))
    d = _first_divergence(crosscheck("transformers", tiny_dir, canvases=1))
    assert d.stage == "commit" and d.step == -1 and d.canvas == 0, d


def test_a_mutation_in_the_stopping_rule_is_named(monkeypatch, tiny_dir):
    class NeverStops:
        def reset(self):
            pass

        def __call__(self, draft, entropies, *args, **kwargs):
            return np.zeros(np.asarray(draft).shape[0], dtype=bool)

    history = type(variants.semantics("transformers").stop_history)
    monkeypatch.setattr(history, "make", lambda self, *args, **kwargs: NeverStops())
    report = crosscheck("transformers", tiny_dir, canvases=1)
    early = report.generation[1]  # loose stopping: transformers stops canvas 0 after its first step
    assert early.divergence is not None and early.divergence.stage == "stopping", early.divergence
    assert "our loop went on to step 1 of canvas 0" in early.divergence.cause


# ------------------------------------------------------------------------------ random configs: AGREE
@st.composite
def tiny_configs(draw):
    """A small random config with each feature the verdict must survive: a sliding window below the canvas
    length, full layers whose per-layer override leaves a key out (the layer keeps text_config's value),
    two or more experts per token; weights redrawn (or transformers' own initialisation), self-conditioning
    as drawn (not contractive)."""
    C = draw(st.integers(6, 12))
    kinds = [SLIDING] + draw(st.lists(st.sampled_from([SLIDING, FULL]), max_size=2)) + [FULL]
    # one entry for every full layer (transformers refuses full layers of different shapes), one key left out
    entry = draw(st.one_of(st.fixed_dictionaries({"head_dim": st.sampled_from([8, 16])}),
                           st.fixed_dictionaries({"num_key_value_heads": st.sampled_from([1, 2])})))
    experts = draw(st.integers(2, 4))
    spec = TinySpec(vocab_size=48, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                    layer_types=kinds, num_attention_heads=draw(st.sampled_from([2, 4])),
                    num_key_value_heads=draw(st.sampled_from([1, 2])), head_dim=8, num_experts=experts,
                    top_k_experts=draw(st.integers(2, experts)), sliding_window=draw(st.integers(2, C - 1)),
                    canvas_length=C, final_norm_gain=draw(st.sampled_from([3.0, 6.0])),
                    per_layer_config={i: dict(entry) for i, kind in enumerate(kinds) if kind == FULL})
    return spec, draw(st.integers(0, 2 ** 16)), draw(st.booleans()), draw(st.integers(6, 12))


@pytest.mark.slow
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tiny_configs())
def test_random_configs_agree_with_every_peer(tmp_path_factory, case):
    spec, seed, randomise, steps = case
    directory = write_checkpoint(tmp_path_factory.mktemp("random") / "model", spec, seed, randomise=randomise,
                                 generation_config={"max_denoising_steps": steps, "t_min": 0.4, "t_max": 0.8,
                                                    "stability_threshold": 1, "confidence_threshold": 0.005})
    import importlib.util

    peers = ["transformers", "diffusers"] + (["mlx-vlm"] if importlib.util.find_spec("mlx_vlm") else [])
    for peer in peers:  # mlx-vlm is the optional extra: checked where installed
        report = crosscheck(peer, directory, canvases=2)
        assert report.agree, report.to_text()
        assert all(g.teacher_forced["calls"] > 0 and g.sampler["canvases"] >= 1 for g in report.generation)


# ------------------------------------------------------------------------------ mlx-vlm's config mapping
def test_mlx_vlm_reads_per_layer_overrides_as_transformers_does(tmp_path):
    text = {"layer_types": [SLIDING, FULL, SLIDING, FULL], "head_dim": 16, "num_key_value_heads": 2,
            "per_layer_config": {"1": {"num_key_value_heads": 1}, "3": {"num_key_value_heads": 1}}}
    assert full_layer_shape(text) == (16, 1)  # head_dim missing: text_config's
    assert full_layer_shape({**text, "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 32}}}) == (32, 2)
    with pytest.raises(PeerUnavailable, match="different"):  # layer 3 has no entry: it keeps (16, 2)
        full_layer_shape({**text, "per_layer_config": {"1": {"head_dim": 32}}})
    with pytest.raises(PeerUnavailable, match="sliding layer"):
        full_layer_shape({**text, "per_layer_config": {"0": {"head_dim": 32}}})
    assert full_layer_shape({**text, "per_layer_config": {}}) == (16, 2)  # transformers drops no-op entries
    assert full_layer_shape({"layer_types": [SLIDING, FULL], "head_dim": 16, "num_key_value_heads": 2}) == (512, 2)
    assert full_layer_shape({"layer_types": [SLIDING], "head_dim": 16, "per_layer_config": {}}) is None

    spec = TinySpec(layer_types=[SLIDING, SLIDING, FULL], sliding_window=3, canvas_length=12,
                    per_layer_config={2: {"num_key_value_heads": 1}})
    source = write_checkpoint(tmp_path / "m", spec, 0, tokenizer=False)
    copy, adaptations = adapt_checkpoint(source, str(tmp_path / "work"))
    with open(os.path.join(copy, "config.json"), encoding="utf-8") as f:
        adapted = json.load(f)["text_config"]
    assert (adapted["global_head_dim"], adapted["num_global_key_value_heads"]) == (16, 1)
    assert any("missing keys falling back" in a for a in adaptations)
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        assert "global_head_dim" not in json.load(f)["text_config"]  # the user's directory is untouched


def test_missing_peer_is_a_setup_error_with_the_install_command(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_mlx(name, *args, **kwargs):
        if name.startswith("mlx"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlx)
    with pytest.raises(PeerUnavailable, match=r'pip install -e "\.\[mlx\]"'):
        crosscheck("mlx-vlm")
    assert main(["crosscheck", "mlx-vlm"]) == 2
    assert 'pip install -e ".[mlx]"' in capsys.readouterr().err


def test_cli_json_report_and_usage_errors(capsys, tiny_dir, tmp_path):
    assert main(["crosscheck", "transformers", "-m", tiny_dir, "--canvases", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["agree"] and data["peer"] == "transformers" and len(data["forward"]) == 4
    with pytest.raises(SystemExit) as exc:
        main(["crosscheck", "sglang"])
    assert exc.value.code == 2
    assert main(["crosscheck", "transformers", "-m", str(tmp_path)]) == 2  # no config.json there
    assert "transformers-layout" in capsys.readouterr().err
