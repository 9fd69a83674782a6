"""``diffusiongemma crosscheck transformers --dtype bfloat16``: the verdict from the measured null distribution
(``crosscheck.bf16_stages``, docs/SPEC.md §10.3).

Held to it both ways:

* AGREE on correct bfloat16 runs: transformers itself on the shipped model, its bfloat16 copy and tiny configs
  with every norm, scale and layer scalar redrawn, exact router ties included;
* DIFFER, naming the stage, for each single-rounding departure from SPEC §10.1 made in transformers' bfloat16
  run (``MUTATIONS``, patched into transformers' module for the duration of a test). Each mutation first proves
  itself: it moves the logits of a decoder call on the checkpoint its test uses.

The null itself is checked too: the reference in another summation order really sums in another order (it
parts from the reference on some values), and a correct run stays within it.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from diffusiongemma.crosscheck import crosscheck  # noqa: E402
from diffusiongemma.crosscheck import bf16_null, bf16_stages  # noqa: E402
from diffusiongemma.crosscheck.tiny import BF16_SPEC, write_tiny_checkpoint  # noqa: E402
from diffusiongemma.tiny import FULL, SLIDING, TinySpec  # noqa: E402

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "diffusiongemma", "assets",
                       "tiny-kjv")

# randomised tiny configs (every norm weight, scale and layer scalar redrawn by diffusiongemma.tiny), seed each
RANDOM_CONFIGS = {
    "sqrt(H) no bf16 number, all experts": (BF16_SPEC, 1),
    "sliding+full, top-2 of 4 (ties)": (TinySpec(final_norm_gain=6.0), 2),
    "full only, top-3 of 6": (TinySpec(layer_types=[FULL, FULL], num_experts=6, top_k_experts=3,
                                       final_norm_gain=6.0), 3),
    "window 4, top-2 of 8, soft-cap": (TinySpec(final_norm_gain=25.0, layer_types=[SLIDING, FULL, SLIDING, FULL],
                                                sliding_window=4, num_experts=8, top_k_experts=2), 4),
    "H 48, top-1 of 4": (TinySpec(hidden_size=48, top_k_experts=1, final_norm_gain=6.0), 5),
    "H 80, 3 layers, top-2 of 6": (TinySpec(hidden_size=80, layer_types=[SLIDING, SLIDING, FULL], num_experts=6,
                                            final_norm_gain=6.0), 6),
}


def upstream():
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma

    return modeling_diffusion_gemma


# ================================================================================ the departures (SPEC §10.1)
def f32_embedding_scale(self, input_ids):  # B1: the float32 sqrt(H), not the scale cast to bfloat16
    return nn.Embedding.forward(self, input_ids) * self.scalar_embed_scale


def f32_self_conditioning_sum(self, inputs_embeds, signal):  # B8: inputs_embeds + sc_signal kept and normed in f32
    normed = self.pre_norm(signal)
    sc = self.down_proj(self.act_fn(self.gate_proj(normed)) * self.up_proj(normed))
    return self.post_norm(inputs_embeds.float() + sc.float()).to(inputs_embeds.dtype)


def f32_weights_before_v(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kw):
    g = upstream()  # B5: the softmax weights not cast back to bfloat16 before the product with V
    keys, values = g.repeat_kv(key, module.num_key_value_groups), g.repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(weights, values.float()).to(query.dtype).transpose(1, 2).contiguous(), weights


def rounded_expert_sum(self, hidden_states, top_k_index, top_k_weights):  # B6: rounded after each expert's add
    out = None
    for k in range(top_k_index.shape[1]):
        y = _EXPERTS(self, hidden_states, top_k_index[:, k:k + 1], top_k_weights[:, k:k + 1])
        out = y if out is None else out + y
    return out


def bf16_router_softmax(self, hidden_states):  # B6: the router's softmax in bfloat16, not float32
    h = self.norm(hidden_states) * self.scale * self.scalar_root_size
    probs = nn.functional.softmax(self.proj(h), dim=-1).float()
    weights, index = torch.topk(probs, k=self.config.top_k_experts, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights * self.per_expert_scale[index], index


def f32_rope_tables(self, x, position_ids, layer_type):  # B4: the cos/sin tables not cast to bfloat16
    freqs = position_ids[..., None].float() * getattr(self, f"{layer_type}_inv_freq").float()
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def f32_rotation(x, cos, sin, unsqueeze_dim=1):  # B4: the rotation in float32, rounded once
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (x.float() * cos + upstream().rotate_half(x).float() * sin).to(x.dtype)


def rounded_final_norm(self, hidden_states):  # B9/B2: the normalised value rounded before the weight's product
    normed = self._norm(hidden_states.float()).to(hidden_states.dtype)
    return (normed * self.weight).to(hidden_states.dtype)


def unrounded_gelu(self, x):  # B3: the GELU of the gate projection not rounded before the product with up
    return self.down_proj((self.act_fn(self.gate_proj(x).float()) * self.up_proj(x).float()).to(x.dtype))


def unrounded_norms(self, hidden_states):  # B2: every weighted norm rounds its normalised value, then the product
    normed = self._norm(hidden_states.float()).to(hidden_states.dtype)
    return (normed * self.weight).to(hidden_states.dtype) if self.with_scale else normed


def unrounded_lm_head(self, x):  # B9: the output projection kept float32
    return nn.functional.linear(x.float(), self.weight.float())


_EXPERTS = None  # transformers' own experts forward, kept before it is patched

# name: (patches {module attribute: replacement} or the decoder's final norm, the stage the verdict must name,
# what its cause must say). The checkpoint: a random tiny config with H = 48, top-2 of 4 experts.
MUTATIONS = {
    "embedding scale float32 (B1)": ({"DiffusionGemmaTextScaledWordEmbedding.forward": f32_embedding_scale},
                                     "bf16 encoder input", "B1 embedding"),
    "self-conditioning sum float32 (B8)": ({"DiffusionGemmaSelfConditioning.forward": f32_self_conditioning_sum},
                                           "bf16 decoder input", "B8 self-conditioning"),
    "attention weights float32 before V (B5)": ({"eager_attention_forward": f32_weights_before_v},
                                                "bf16 encoder layer 0", "attention block: SPEC §10.1 B2-B5"),
    "expert sum rounded per expert (B6)": ({"DiffusionGemmaTextExperts.forward": rounded_expert_sum},
                                           "bf16 encoder layer 0", "experts: SPEC §10.1 B6"),
    "router softmax in bfloat16 (B6)": ({"DiffusionGemmaTextRouter.forward": bf16_router_softmax},
                                        "bf16 encoder layer 0", "router: SPEC §10.1 B6"),
    "final norm rounded before its weight (B9)": ({"final_norm": rounded_final_norm}, "bf16 output",
                                                  "B9 final norm"),
    "RoPE tables and rotation float32 (B4)": ({"DiffusionGemmaTextRotaryEmbedding.forward": f32_rope_tables,
                                               "apply_rotary_pos_emb": f32_rotation},
                                              "bf16 encoder layer 0", "attention block: SPEC §10.1 B2-B5"),
    "GELU not rounded before the product with up (B3)": ({"DiffusionGemmaText4MLP.forward": unrounded_gelu},
                                                         "bf16 encoder layer 0", "dense MLP: SPEC §10.1 B2/B3"),
    "every weighted norm rounded before its weight (B2)": ({"DiffusionGemmaRMSNorm.forward": unrounded_norms},
                                                           "bf16 encoder layer 0", "attention block: SPEC §10.1 B2"),
    "output projection kept float32 (B9)": ({"lm_head": unrounded_lm_head}, "bf16 output", "B9 final norm"),
}
MUTATION_SPEC = TinySpec(hidden_size=48, final_norm_gain=6.0)  # sqrt(48) is no bfloat16 number (B1 shows)


def apply_mutation(name: str, monkeypatch) -> None:
    """Patch transformers' module (or one module of every model loaded from now on) for ``name``."""
    global _EXPERTS
    g = upstream()
    _EXPERTS = g.DiffusionGemmaTextExperts.forward if _EXPERTS is None else _EXPERTS
    for target, replacement in MUTATIONS[name][0].items():
        if target in ("final_norm", "lm_head"):  # one module of the model: patched on every model loaded from now on
            load = g.DiffusionGemmaForBlockDiffusion.from_pretrained.__func__

            def loading(cls, *args, target=target, replacement=replacement, **kw):
                loaded = load(cls, *args, **kw)
                module = loaded.model.decoder.norm if target == "final_norm" else loaded.lm_head
                module.forward = types.MethodType(replacement, module)
                return loaded

            monkeypatch.setattr(g.DiffusionGemmaForBlockDiffusion, "from_pretrained", classmethod(loading))
            continue
        owner, _, attr = target.rpartition(".")
        monkeypatch.setattr(getattr(g, owner) if owner else g, attr, replacement)


@pytest.fixture(autouse=True)
def _no_grad_one_thread():
    """No autograd, and one thread for torch and BLAS: the tiny models' products are far too small to share,
    and on a loaded machine spinning thread pools make a cross-check ten times slower (conftest puts the
    thread counts back after each test)."""
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    with torch.no_grad(), threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {"shipped": SHIPPED, "mutations": write_tiny_checkpoint(root / "h48", MUTATION_SPEC, 7)}


def decoder_logits(path: str) -> np.ndarray:
    """Transformers' bfloat16 logits of a self-conditioned decoder call after a prompt (the mutation's proof)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_denoise, hf_encode

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.bfloat16,
                                                            attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    V, C = model.config.text_config.vocab_size, model.config.canvas_length
    cache = hf_cache(model)
    hf_encode(model, cache, rng.integers(3, V - 3, (1, 20)))
    canvas = rng.integers(3, V - 3, (1, C))
    first = hf_denoise(model, cache, canvas)
    return hf_denoise(model, cache, canvas, first / np.float32(0.8))


# ================================================================================ the null
def test_another_summation_order_parts_only_by_rounding_flips(checkpoints):
    from diffusiongemma.reference import Model

    model = Model.from_pretrained(checkpoints["shipped"], dtype="bfloat16")
    ids = np.random.default_rng(1).integers(3, 4000, (1, 40))
    mine = model.encode(ids, model.new_cache(1))
    for kind in bf16_null.KINDS:
        with bf16_null.summation_order(kind):
            other = model.encode(ids, model.new_cache(1))
        size, share = bf16_null.deviation(mine, other)
        assert 0 < share < 0.5 and size < 8, (kind, size, share)  # another order: some flips, no systematic change
    with pytest.raises(ValueError, match="unknown summation order"):
        with bf16_null.summation_order("sideways"):
            pass
    again = model.encode(ids, model.new_cache(1))  # the reference's own functions are back
    assert np.array_equal(again, mine)


def test_the_rule_counts_calls_not_one_ratio():
    stats = bf16_stages.StageStats(peer=[(30.0, 0.01)] + [(0.5, 0.0)] * 9, null=[[(0.4, 0.0), (0.0, 0.0)]] * 10,
                                   where=[(0, i) for i in range(10)])
    assert bf16_stages.beyond(stats)[0] and bf16_stages.judge(stats) is None  # one amplified flip: agree
    stats.peer = [(0.6, 0.05)] * 10  # every call: 5 % of the values moved by less than an ulp
    verdict = bf16_stages.judge(stats)
    assert verdict is not None and verdict["beyond"] == 10 and verdict["first"] == (0, 0)
    one = bf16_stages.StageStats(peer=[(1.1, 0.035)], null=[[(0.0, 0.0), (0.0, 0.0)]], where=[(0, 0)])
    assert bf16_stages.beyond(one) == [True] and bf16_stages.judge(one) is None  # one call never decides


def test_router_ties_take_the_peers_choice_only_across_a_tie():
    probs = np.array([[0.4, 0.2, 0.2, 0.2],  # an exact three-way tie at the 2nd place
                      [0.4, 0.3, 0.3 * (1 + 2 ** -7), 0.0],  # a near tie (one bfloat16 ulp of a router logit)
                      [0.5, 0.3, 0.2, 0.0],  # no tie: the peer's other choice is a real difference
                      [0.5, 0.3, 0.2, 0.0]], dtype=np.float32)
    peer = np.array([[0, 3], [0, 1], [0, 2], [0, 1]])
    replay = bf16_stages.ReplayTies(peer)
    chosen = replay(probs, 2)
    assert chosen[0].tolist() == [0, 3] and chosen[1].tolist() == [0, 1]  # replayed
    assert set(chosen[2].tolist()) == {0, 1} and set(chosen[3].tolist()) == {0, 1}  # ours kept
    assert replay.exact == {0} and replay.near == {1}
    assert bf16_stages.ReplayTies(None)(probs, 2).shape == (4, 2)  # no peer choice recorded: ours


# ================================================================================ correct runs agree
def assert_agrees(report) -> None:
    text = report.to_text()
    assert report.exit_code == 0, text
    header = text.splitlines()[1]
    assert text.startswith("crosscheck transformers") and header.startswith("verdict rule:")
    assert "beyond" in header and "no false alarm on" in header  # the rule and its measured false alarms
    for g in report.generation:
        tf = g.teacher_forced
        assert tf["calls"] > 0 and tf["encodes"] > 0 and "decoder layer 0" in tf["stages"], tf
        assert g.sampler["steps"] == tf["calls"]


@pytest.mark.slow
def test_transformers_agrees_on_the_shipped_model(checkpoints):
    assert_agrees(crosscheck("transformers", checkpoints["shipped"], dtype="bfloat16"))


@pytest.mark.slow
def test_transformers_agrees_on_the_shipped_models_bfloat16_copy(tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(SHIPPED, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    for name in os.listdir(SHIPPED):
        if name.startswith(("generation", "tokenizer")):
            (tmp_path / "bf16" / name).write_bytes(open(os.path.join(SHIPPED, name), "rb").read())
    assert_agrees(crosscheck("transformers", tmp_path / "bf16", dtype="bfloat16"))


@pytest.mark.parametrize("config", list(RANDOM_CONFIGS))
def test_transformers_agrees_on_randomised_tiny_configs(config, tmp_path):
    spec, seed = RANDOM_CONFIGS[config]
    report = crosscheck("transformers", write_tiny_checkpoint(tmp_path / "m", spec, seed), seed=seed,
                        dtype="bfloat16")
    assert_agrees(report)


# ================================================================================ departures differ
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_single_rounding_departure_differs_with_its_stage_named(mutation, checkpoints, monkeypatch):
    _, stage, says = MUTATIONS[mutation]
    path = checkpoints["mutations"]
    before = decoder_logits(path)
    apply_mutation(mutation, monkeypatch)
    after = decoder_logits(path)
    assert np.max(np.abs(after - before)) > 0, "the mutation does not move the logits on this checkpoint"
    report = crosscheck("transformers", path, dtype="bfloat16")  # two canvases: two encodes to judge
    text = report.to_text()
    assert report.exit_code == 1 and "result: DIFFER" in text, text
    found = [g.divergence for g in report.generation if g.divergence is not None]
    assert found and all(d.stage == stage for d in found), (mutation, [d.stage for d in found])
    assert all(says in d.cause for d in found), [d.cause for d in found]


# ================================================================================ usage
def test_the_bfloat16_tiny_model_makes_the_embedding_scale_visible():
    assert BF16_SPEC.hidden_size ** 0.5 != 6.9375 and MUTATION_SPEC.hidden_size ** 0.5 != 6.9375


def test_bfloat16_is_for_the_tapped_peers_only_and_other_dtypes_are_usage_errors(capsys):
    from diffusiongemma.cli.main import main
    from diffusiongemma.crosscheck import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="transformers and diffusers peers only"):
        crosscheck("mlx-vlm", dtype="bfloat16")
    assert main(["crosscheck", "mlx-vlm", "--dtype", "bfloat16"]) == 2
    assert "--dtype bfloat16 is defined for the transformers and diffusers peers only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["crosscheck", "transformers", "--dtype", "float16"])
    assert exit_info.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


# ================================================================================ other peers' bfloat16 runs
@pytest.mark.slow
def test_diffusers_bfloat16_run_departs_at_the_self_conditioning_cast(checkpoints):
    """diffusers' pipeline on transformers' bfloat16 model passes the scheduler's float32 logits as the
    self-conditioning input, where transformers' generate casts them to bfloat16 first (SPEC §10.1 B8): the
    decoder input departs on nearly every self-conditioned call, and the report says why."""
    pytest.importorskip("diffusers")
    report = crosscheck("diffusers", checkpoints["mutations"], dtype="bfloat16", canvases=1)
    assert report.exit_code == 1
    for g in report.generation:
        assert g.divergence is not None and g.divergence.stage == "bf16 decoder input", g.divergence
        assert any("no bfloat16 numbers" in n and "B8" in n for n in g.notes), g.notes


def test_a_bfloat16_generate_says_what_it_promises_on_its_timing_line(capsys):
    from diffusiongemma.cli.main import main

    assert main(["generate", "And God said", "--seed", "1", "--dtype", "bfloat16", "--backend", "reference",
                 "-n", "4"]) == 0
    timing = [line for line in capsys.readouterr().err.splitlines() if "tokens/s" in line]
    assert timing and "bfloat16 agrees call by call across backends, free runs part" in timing[0], timing
