"""``diffusiongemma crosscheck``: the runnable peers (transformers, mlx-vlm, diffusers) against the reference.

The test extra installs transformers and diffusers, so their checks never skip. mlx-vlm is the ``mlx`` extra
(1.1 GB; 5 minutes to install cleanly on two cores, too much for every CI run): its checks run when it is
installed, ``pip install -e ".[mlx]" && python -m pytest -q tests/test_crosscheck.py`` (the README's
"Cross-checking other implementations" section). Each peer runs on the tiny random checkpoint that
``crosscheck`` builds itself.
The checks that must be able to fail are exercised by breaking one side on purpose: a perturbed peer
forward, our loop run with the wrong semantics for a peer, a missing peer.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from diffusiongemma.cli.main import main
from diffusiongemma.crosscheck import PeerUnavailable, crosscheck, peer_module
from diffusiongemma.crosscheck import common
from diffusiongemma.crosscheck.tiny import write_tiny_checkpoint


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


def test_every_peer_agrees_with_the_reference_and_its_own_semantics(report):
    assert [r.name for r in report.forward] == ["prefill", "self-conditioning", "after commit", "image id in context"]
    for row in report.forward:
        assert row.ok or (row.probe and report.peer == "mlx-vlm"), row
        assert 0 < row.tolerance < 1e-2 * max(1.0, row.max_abs_value)
    assert report.generation and all(g.draws == "replayed" for g in report.generation)
    for g in report.generation:
        assert g.ok, (g.label, g.divergence)
        assert g.peer_tokens and g.canvases
    assert report.agree and report.exit_code == 0
    assert "result: AGREE (exit 0)" in report.to_text()


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
    assert d is not None and d.position >= 0 and d.cause


def test_compare_runs_names_a_stopping_difference():
    C, V = 4, 8
    canvas, logits = np.zeros((1, C), np.int64), np.zeros((1, C, V), np.float32)
    peer = common.PeerRun(tokens=[1, 2, 3, 4], calls=[(0, 0, canvas, logits), (0, 1, canvas, logits)],
                          steps_per_canvas=[2])
    ours = [(0, 0, canvas, logits)]
    _, divergence = common.compare_runs(peer, ours, [1, 2, 3, 4], C, 1e-3)
    assert divergence is not None and divergence.cause.startswith("stopping")
    moved = canvas.copy()
    moved[0, 2] = 5
    _, divergence = common.compare_runs(peer, [(0, 0, canvas, logits), (0, 1, moved, logits)], [1, 2, 3, 4], C, 1e-3)
    assert (divergence.step, divergence.position, divergence.our_token) == (1, 2, 5)
    assert "sampler decision" in divergence.cause or "near tie" in divergence.cause


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
