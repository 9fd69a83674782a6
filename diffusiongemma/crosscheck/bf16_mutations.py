"""Single-rounding departures from upstream's bfloat16 run, as patches of transformers' modules, and the tiny
configurations the bfloat16 cross-check is held to (``tests/test_crosscheck_bf16.py`` and
``benchmarks/bf16_parity.py`` use both).

``MUTATIONS``: name -> (patches, the stage the verdict must name, what its cause must say); each patch departs
from transformers 5.24.0's bfloat16 run at one rounding point of SPEC §10.1. ``apply_mutation(name,
monkeypatch)`` applies one through a ``pytest.MonkeyPatch`` (or anything with its ``setattr``), so that undoing
it is the caller's. ``RANDOM_CONFIGS``: randomised tiny configs (every norm weight, scale and layer scalar
redrawn by ``diffusiongemma.tiny``) with a seed each. Needs torch and transformers (the test extra).
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from diffusiongemma.crosscheck.tiny import BF16_SPEC
from diffusiongemma.tiny import FULL, SLIDING, TinySpec

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-kjv")

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
