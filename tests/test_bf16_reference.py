"""The reference's bfloat16 run (``Model(..., dtype="bfloat16")``, docs/SPEC.md §10.1) against the one it
defines: transformers 5.24.0 loaded with ``dtype=torch.bfloat16`` and eager attention on the CPU.

Every tiny model here has every norm weight, scale and layer scalar redrawn (``diffusiongemma.tiny``) and
its weights rounded to bfloat16 before it is saved, so transformers' bfloat16 and float32 runs and ours
read the same values. Three levels:

* each rounding point (SPEC B1-B9), one module at a time: transformers' own bfloat16 module and the
  reference's function on the same bfloat16 inputs agree bit for bit but for rare one-ulp flips of float32
  sums taken in another order;
* whole calls, teacher-forced (prompt encode, decoder step without and with self-conditioning, incremental
  encode, second canvas, each call on transformers' own cache and inputs): max |ours - transformers bf16|
  against max |transformers bf16 - transformers fp32| on the same inputs. The ratio is 0 on most calls; a
  one-ulp flip that a near-tied top-K choice later amplifies can lift one call above 1/8. Transformers is
  not one bfloat16 run on the CPU either: with oneDNN off (``other_kernel``: torch's own matrix product,
  another order of the same float32 sums) its run parts from its oneDNN run by more than 1/8 on about as
  many calls as ours does. So a call above 1/8 must be within 1/8 of that other run, or within 1/4 with
  transformers' expert choices replayed. The float32 reference scores about 1 (it models the float32
  run), and a misplaced rounding lifts the median above 1/8;
* free runs with transformers' draws replayed: the share of seeds whose tokens agree (information, printed;
  the assertion is only that the bfloat16 run agrees more often than the float32 one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusiongemma.crosscheck.bf16_teacher import (CONFIGS, SEEDS, load_three, other_ratio, ratio,
                                                  ratio_to_other, save_bf16_valued, teacher_forced_ratios)
from diffusiongemma.reference import ConfigError, Model
from diffusiongemma.reference import model as model_module
from diffusiongemma.reference.layers import attend, experts, route
from diffusiongemma.reference.primitives import (BFLOAT16, FLOAT32, apply_rope, compute_dtype, embed,
                                                 gated_mlp, rms_norm, rope_cos_sin, round_to)
from diffusiongemma.reference.variants.router import torch_cpu_top_k
from diffusiongemma.tiny import FULL, TinySpec

ULP = 2.0 ** -7  # bfloat16's spacing between 1 and 2

@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# ------------------------------------------------------------------------------------------ the dtype itself
def test_round_to_is_the_identity_in_float32_and_torchs_cast_in_bfloat16():
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5e-3, 3.0e38, np.inf, 0.1], dtype=np.float32)
    assert round_to(x, FLOAT32) is x
    assert round_to(x, np.dtype(np.float64)) is x  # a float64 twin never rounds
    expected = torch.tensor(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(round_to(x, BFLOAT16), expected)  # nearest, ties to even
    assert round_to(x, BFLOAT16)[0] == 1.0 and round_to(x, BFLOAT16)[1] == 1 + 2 ** -6


def test_dtype_names_and_errors(tmp_path):
    assert compute_dtype(None) == FLOAT32 and compute_dtype("bfloat16") == BFLOAT16 == compute_dtype(BFLOAT16)
    for bad in ("float16", "bf16", 3, np.float64):
        with pytest.raises(ConfigError, match="is not supported"):
            compute_dtype(bad)
    with pytest.raises(ConfigError, match="'float16'"):
        Model.from_pretrained(tmp_path / "does-not-matter", dtype="float16")  # refused before reading files


def test_bfloat16_weights_and_cache_hold_bfloat16_values(tmp_path):
    path = save_bf16_valued(TinySpec(hidden_size=48), 0, tmp_path / "m")
    wide = Model.from_pretrained(path)
    ours = Model.from_pretrained(path, dtype="bfloat16")
    assert ours.dtype == BFLOAT16 and wide.dtype == FLOAT32
    for name, t in ours.tensors.items():
        assert t.dtype == np.float32 and np.array_equal(t, round_to(t, BFLOAT16)), name
        assert np.array_equal(t, wide.tensors[name]), name  # bfloat16-valued weights: rounding is exact
    cache = ours.new_cache(1)
    ours.encode(np.arange(3, 15)[None], cache)
    for k, v in zip(cache.keys, cache.values):
        assert np.array_equal(k, round_to(k, BFLOAT16)) and np.array_equal(v, round_to(v, BFLOAT16))


# ------------------------------------------------------------------------------------------ each rounding point
def assert_bitwise_but_rare_flips(ours: np.ndarray, theirs, what: str, share: float = 0.01) -> None:
    theirs = theirs.detach().float().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    differ = ours != theirs
    scale = np.maximum(np.abs(theirs), np.float32(2 ** -126))
    assert differ.mean() <= share, f"{what}: {differ.sum()} of {differ.size} values differ"
    assert np.all(np.abs(ours - theirs)[differ] <= ULP * scale[differ]), f"{what}: a difference beyond one ulp"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers bf16, reference bf16) on the config whose sqrt(H) is no bfloat16 number."""
    b16, _, ours = load_three(save_bf16_valued(TinySpec(hidden_size=48), 3, tmp_path_factory.mktemp("pair") / "m"))
    return b16, ours


def bf16(shape, seed, scale=1.0):
    return torch.tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale).bfloat16()


def test_b1_embedding_and_b2_norms(pair):
    hf, ours = pair
    ids = torch.tensor(np.random.default_rng(0).integers(0, 128, (2, 9)))
    e = hf.model.decoder.embed_tokens
    assert float(e.embed_scale.to(e.weight.dtype)) == float(round_to(np.float32(48 ** 0.5), BFLOAT16)) == 6.9375
    assert_bitwise_but_rare_flips(embed(ids.numpy(), ours.tensors["embed_tokens"], ours.config.embed_scale, BFLOAT16),
                                  e(ids), "B1 embedding", share=0)
    x = bf16((2, 9, 48), 1, 3.0)
    layer = hf.model.decoder.layers[0]
    assert_bitwise_but_rare_flips(rms_norm(x.float().numpy(), ours.layers[0]["input_layernorm"], 1e-6, BFLOAT16),
                                  layer.input_layernorm(x), "B2 weighted norm", share=0)
    assert_bitwise_but_rare_flips(rms_norm(x.float().numpy(), None, 1e-6, BFLOAT16), layer.router.norm(x),
                                  "B2 weightless norm", share=0)


def test_b3_mlp_b4_rope_and_b5_attention(pair):
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as upstream

    hf, ours = pair
    layer, w = hf.model.decoder.layers[2], ours.layers[2]  # a full layer: head dim 32, proportional RoPE
    x = bf16((1, 7, 48), 2)
    assert_bitwise_but_rare_flips(gated_mlp(x.float().numpy(), w["mlp.gate_proj"], w["mlp.up_proj"],
                                            w["mlp.down_proj"], BFLOAT16), layer.mlp(x), "B3 gated MLP")
    positions = torch.arange(40, 47)[None]
    cos_t, sin_t = hf.model.decoder.rotary_emb(x, positions, FULL)
    cos, sin = rope_cos_sin(positions.numpy(), ours._omega[FULL], BFLOAT16)
    assert_bitwise_but_rare_flips(cos, cos_t, "B4 cos table", share=0)
    assert_bitwise_but_rare_flips(sin, sin_t, "B4 sin table", share=0)
    q = bf16((1, 7, 4, 32), 3, 2.0)
    assert_bitwise_but_rare_flips(apply_rope(q.float().numpy(), cos, sin, BFLOAT16),
                                  upstream.apply_rotary_pos_emb(q, cos_t, sin_t, unsqueeze_dim=2), "B4 rotation", share=0)
    keys, values = bf16((1, 1, 11, 32), 4, 3.0), bf16((1, 1, 11, 32), 5)
    visible = np.ones((1, 7, 11), dtype=bool)
    visible[0, :, :2] = False
    mask = torch.where(torch.tensor(visible)[:, None], 0.0, torch.finfo(torch.bfloat16).min).bfloat16()
    theirs, _ = upstream.eager_attention_forward(layer.self_attn, q.transpose(1, 2), keys, values, mask, scaling=1.0)
    mine = attend(q.float().numpy(), keys.float().numpy(), values.float().numpy(), visible, BFLOAT16)
    assert_bitwise_but_rare_flips(mine, theirs.reshape(1, 7, -1), "B5 attention")


def test_b6_router_and_experts(pair):
    hf, ours = pair
    layer, w = hf.model.decoder.layers[1], ours.layers[1]
    h = bf16((24, 48), 6, 2.0)
    _, weights_t, index_t = layer.router(h)
    index, weights = route(h.float().numpy(), w, ours.config, torch_cpu_top_k, dtype=BFLOAT16)
    np.testing.assert_array_equal(index, index_t.numpy())
    assert weights.dtype == np.float32 and weights_t.dtype == torch.float32  # B6: the weights stay float32
    np.testing.assert_allclose(weights, weights_t.numpy(), rtol=2e-6, atol=0)  # NumPy's softmax vs torch's
    x = layer.pre_feedforward_layernorm_2(h)
    theirs = layer.experts(x, index_t, weights_t)  # grouped_mm_experts_forward, transformers' CPU default
    assert hf.config.text_config._experts_implementation == "grouped_mm"
    mine = experts(x.float().numpy(), index_t.numpy(), weights_t.numpy(), w, BFLOAT16)
    assert_bitwise_but_rare_flips(mine, theirs, "B6 experts (float32 sum, rounded once)")


def test_b8_self_conditioning_and_b9_output(pair):
    hf, ours = pair
    logits = np.random.default_rng(7).standard_normal((1, 16, 128)).astype(np.float32) * 4
    d = hf.model.decoder
    probs = torch.tensor(logits).to(torch.bfloat16).softmax(dim=-1, dtype=torch.float32).to(torch.bfloat16)
    theirs = torch.matmul(probs, d.embed_tokens.weight) * d.embed_tokens.embed_scale.to(torch.bfloat16)  # lines 1261-1264
    assert_bitwise_but_rare_flips(ours.self_conditioning_embedding(logits), theirs, "B8 soft embedding")
    h = bf16((1, 16, 48), 8, 2.0)
    raw = hf.lm_head(d.norm(h))
    assert raw.dtype == torch.bfloat16
    mine = ours.output_logits(h.float().numpy(), capped=False)
    assert_bitwise_but_rare_flips(mine, raw, "B9 output projection")
    capped = 30.0 * torch.tanh(torch.tensor(mine) / 30.0)  # line 1661: widened, then the float32 soft-cap
    np.testing.assert_allclose(ours.output_logits(h.float().numpy()), capped.numpy(), rtol=4e-6, atol=4e-6)


# ------------------------------------------------------------------------------------------ whole calls
@pytest.mark.parametrize("config", list(CONFIGS))
def test_teacher_forced_calls_reproduce_the_bfloat16_run(config, tmp_path):
    """Every call is within 1/8 of the bfloat16-float32 gap of transformers' bfloat16 run, on oneDNN or on its
    other CPU kernel, or its departure is a near-tied expert choice (within 1/4 with transformers' choices
    replayed). Transformers' two kernels themselves part by more than 1/8 on about as many calls as we do
    (benchmarks/RESULTS_bf16.md): one bfloat16 rounding of a float32 sum taken in another order, amplified."""
    spec = CONFIGS[config]
    rows = [(seed,) + r for seed in SEEDS for r in teacher_forced_ratios(spec, seed, tmp_path / f"m{seed}")]
    ratios = np.array([ratio(r[1:]) for r in rows])
    print(f"\n{config}: " + "  ".join(f"s{r[0]} {r[1]} {ratio(r[1:]):.3f} (transformers' other kernel "
                                     f"{other_ratio(r[1:]):.3f})" for r in rows))
    assert np.median(ratios) <= 1 / 8, ratios
    assert np.mean(ratios <= 1 / 8) >= 0.8, ratios
    unexplained = [r for r, q in zip(rows, ratios) if q > 1 / 8 and ratio_to_other(r[1:]) > 1 / 8]
    for seed in sorted({r[0] for r in unexplained}):  # explain each departure
        again = teacher_forced_ratios(spec, seed, tmp_path / f"r{seed}", replay=True)
        assert all(ratio(r) <= 1 / 4 for r in again), (seed, again)  # a near-tied top-K flip, amplified


def test_the_float32_reference_and_misplaced_roundings_fail_the_criterion(tmp_path, monkeypatch):
    """The criterion can fail: the float32 run scores about 1, and each misplaced rounding (attention
    weights kept float32 before V; the float32 embedding scale; a float32 self-conditioning chain) lifts
    the median ratio above 1/8 on the config whose sqrt(H) is no bfloat16 number."""
    spec = CONFIGS["sqrt(H) not bf16"]

    def float32_run(ours):
        wide = Model(ours.config, ours.tensors)
        wide.router_top_k = torch_cpu_top_k
        return wide

    f32 = [ratio(r) for seed in SEEDS
           for r in teacher_forced_ratios(spec, seed, tmp_path / f"f{seed}", float32_run, other=False)]
    assert min(f32) > 1 / 4 and np.median(f32) > 1 / 2, f32

    attend0, embed0 = model_module.attend, model_module.embed
    mutations = {
        "attention weights float32 before V": ("attend", lambda q, k, v, vis, dtype=FLOAT32:
                                               round_to(attend0(q, k, v, vis, FLOAT32), dtype)),
        "embedding scale 53.066 (float32)": ("embed", lambda ids, table, scale, dtype=FLOAT32:
                                             round_to(table[ids] * np.float32(scale), dtype)),
    }
    for name, (attr, replacement) in mutations.items():
        monkeypatch.setattr(model_module, attr, replacement)
        got = [ratio(r) for seed in SEEDS
               for r in teacher_forced_ratios(spec, seed, tmp_path / f"{attr}{seed}", other=False)]
        monkeypatch.setattr(model_module, attr, attend0 if attr == "attend" else embed0)
        assert np.median(got) > 1 / 8, (name, got)

    def float32_chain(self, logits):  # softmax of float32 logits, float32 product, rounded once at the end
        z = np.exp(logits - logits.max(-1, keepdims=True))
        return round_to((z / z.sum(-1, keepdims=True)) @ self.tensors["embed_tokens"]
                        * np.float32(self.config.embed_scale), self.dtype)

    monkeypatch.setattr(Model, "self_conditioning_embedding", float32_chain)
    got = [r for seed in SEEDS for r in teacher_forced_ratios(spec, seed, tmp_path / f"sc{seed}", other=False)]
    assert min(ratio(r) for r in got if r[0] == "self-conditioned step") > 1 / 8, got
