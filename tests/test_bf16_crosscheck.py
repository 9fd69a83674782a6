"""``diffusiongemma crosscheck transformers --dtype bfloat16``: transformers loaded with ``dtype=torch.bfloat16``
against the reference's bfloat16 run (docs/SPEC.md §10.1), with tolerances from that run's own error
(``crosscheck.common``: 1/3 of the bfloat16 run's error against float64 on each tensor).

The correct bfloat16 peer (transformers itself) must AGREE; the same peer with one rounding misplaced must
DIFFER with the stage named. The mutations are made in transformers' module for the duration of a test
(``monkeypatch``): the attention weights kept float32 for the product with V (a float32 softmax not cast
back), the RoPE tables kept float32 (a missing cast), and the float32 embedding scale sqrt(H) instead of the
scale cast to bfloat16 (53.066 instead of 53.0 at H = 2816; the bfloat16 tiny model has H = 48, whose sqrt
6.928 bfloat16 rounds to 6.9375).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusiongemma.cli.main import main
from diffusiongemma.crosscheck import PeerUnavailable, crosscheck
from diffusiongemma.crosscheck.tiny import BF16_SPEC


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def upstream():
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma

    return modeling_diffusion_gemma


def test_transformers_in_bfloat16_agrees_with_the_bfloat16_run():
    report = crosscheck("transformers", dtype="bfloat16", canvases=1)
    assert report.exit_code == 0, report.to_text()
    assert "bfloat16 run" in report.tolerance_note and "bfloat16" in report.adaptations[0]
    for row in report.forward:
        assert row.ok and row.tolerance > 1e-2, row  # a bfloat16 tolerance, far above float32's
    for g in report.generation:
        assert g.ok and g.teacher_forced["calls"] > 0 and g.teacher_forced["caches_compared"] > 0, g
        assert g.sampler["steps"] == g.teacher_forced["calls"]  # every sampler decision on the peer's logits
    assert "result: AGREE (exit 0)" in report.to_text()


def f32_weights_before_v(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
    g = upstream()
    keys, values = g.repeat_kv(key, module.num_key_value_groups), g.repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32)  # not cast back to bfloat16
    return torch.matmul(weights, values.float()).to(query.dtype).transpose(1, 2).contiguous(), weights


def f32_rope_tables(self, x, position_ids, layer_type):
    freqs = position_ids[..., None].float() * getattr(self, f"{layer_type}_inv_freq").float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()  # the cast to x.dtype left out


def f32_rotation(x, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (x.float() * cos + upstream().rotate_half(x).float() * sin).to(x.dtype)


def f32_embedding_scale(self, input_ids):
    return nn.Embedding.forward(self, input_ids) * self.scalar_embed_scale  # float32 sqrt(H), not bfloat16(sqrt(H))


MUTATIONS = {
    "attention weights float32 before V": {"eager_attention_forward": f32_weights_before_v},
    "RoPE tables not cast to bfloat16": {"DiffusionGemmaTextRotaryEmbedding.forward": f32_rope_tables,
                                         "apply_rotary_pos_emb": f32_rotation},
    "embedding scale float32 sqrt(H)": {"DiffusionGemmaTextScaledWordEmbedding.forward": f32_embedding_scale},
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_misplaced_rounding_in_the_peer_differs_with_the_stage_named(mutation, monkeypatch):
    g = upstream()
    for target, replacement in MUTATIONS[mutation].items():
        owner, _, name = target.rpartition(".")
        monkeypatch.setattr(getattr(g, owner) if owner else g, name, replacement)
    report = crosscheck("transformers", dtype="bfloat16", canvases=1)
    text = report.to_text()
    assert report.exit_code == 1 and "result: DIFFER" in text, text
    assert any(not row.ok for row in report.forward if not row.probe), text
    worst = max(row.max_abs_diff / row.tolerance for row in report.forward if not row.probe)
    assert worst > 1.5, text  # measured 2.7-5.5 on seeds 0-3; the correct peer stays below 0.9
    stages = [d.stage for d in (row.divergence for row in report.generation) if d is not None]
    assert stages and all(s == "cache/context" for s in stages), text  # the encoder's cache already differs
    assert "DIFFER at stage cache/context" in text and "layer" in text


def test_the_bfloat16_tiny_model_makes_the_embedding_scale_visible():
    assert BF16_SPEC.hidden_size ** 0.5 != 6.9375 and BF16_SPEC.top_k_experts == BF16_SPEC.num_experts


def test_bfloat16_is_for_transformers_only_and_other_dtypes_are_usage_errors(capsys):
    with pytest.raises(PeerUnavailable, match="transformers peer only"):
        crosscheck("diffusers", dtype="bfloat16")
    assert main(["crosscheck", "mlx-vlm", "--dtype", "bfloat16"]) == 2
    assert "--dtype bfloat16 is defined for the transformers peer only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["crosscheck", "transformers", "--dtype", "float16"])
    assert exit_info.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err
