"""The default model of ``crosscheck``: a tiny randomised transformers checkpoint that reaches every code path.

Every peer reads transformers' checkpoint layout, so the default model is written in it (``save_pretrained``
of a ``DiffusionGemmaForBlockDiffusion``), with a word-level ``tokenizer.json`` so that peers that insist on
a tokenizer (mlx-vlm's detokenizer, diffusers' processor) have one.

What "every code path" means here (SPEC §14): sliding and full layers with different head sizes and KV
head counts (full layers use K = V), a window W = 8 shorter than the prompts the cross-check uses (so the
canvas sees only the last W-1 prompt keys), a mixture of experts with top-2 routing, self-conditioning,
and a canvas of 16. Initial values hide bugs, so every 1-D parameter (every norm weight, the router scale,
the per-expert scale) is redrawn as 1 + 0.3 N(0, 1), every matrix as 0.08 N(0, 1), and the encoder and
decoder layer scalars independently from U(0.5, 1.5): ``x * w`` cannot pass for ``x * (1 + w)``, nor
one layer scalar for the other. ``final_norm_gain`` sharpens the logits (about 25 makes them peaked, so
that stopping rules fire and generation comparisons see early stops).

``self_conditioning_gain`` scales the self-conditioning output projection. A random model's
self-conditioning feedback is expansive: in a free-running generation the float32 rounding difference
between two correct implementations (1e-4) grows about 40x per step (final_norm_gain 6) and the runs part
after three steps for no semantic reason. Scaled by 0.01 the feedback contracts (differences stay near
1e-4 over every step) while self-conditioning still moves the logits far beyond the forward tolerance, so
its code path is still checked.

Needs torch and transformers (the ``test`` extra installs them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class TinySettings:
    """Knobs of the tiny checkpoint (defaults: SPEC §14's config)."""

    vocab_size: int = 128  # V; ids 0 pad, 1 eos, 2 bos, V-3..V-1 image markers
    hidden_size: int = 64  # H
    intermediate_size: int = 96  # dense MLP and self-conditioning MLP width
    moe_intermediate_size: int = 32  # per-expert width
    layer_types: tuple = (SLIDING, SLIDING, FULL, SLIDING, FULL)  # 3 sliding, 2 full layers
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # sliding layers
    num_global_key_value_heads: int = 1  # full layers (K = V there)
    head_dim: int = 16  # sliding layers
    global_head_dim: int = 32  # full layers
    num_experts: int = 4
    top_k_experts: int = 2
    sliding_window: int = 8  # W
    canvas_length: int = 16  # C
    partial_rotary_factor: float = 0.25  # full layers' proportional RoPE
    final_norm_gain: float = 6.0  # multiplies the final norm weight (logits up to about 15)
    self_conditioning_gain: float = 0.01  # multiplies self_conditioning.down_proj (contractive feedback)
    seed: int = 0  # torch seed of the redraw


def _hf_config(s: TinySettings):
    from transformers import DiffusionGemmaConfig

    V = s.vocab_size
    return DiffusionGemmaConfig(
        canvas_length=s.canvas_length, image_token_id=V - 1, boi_token_id=V - 2, eoi_token_id=V - 3,
        text_config=dict(
            vocab_size=V, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
            moe_intermediate_size=s.moe_intermediate_size, num_hidden_layers=len(s.layer_types),
            layer_types=list(s.layer_types), num_attention_heads=s.num_attention_heads,
            num_key_value_heads=s.num_key_value_heads, num_global_key_value_heads=s.num_global_key_value_heads,
            head_dim=s.head_dim, global_head_dim=s.global_head_dim, num_experts=s.num_experts,
            top_k_experts=s.top_k_experts, sliding_window=s.sliding_window,
            rope_parameters={SLIDING: dict(rope_type="default", rope_theta=1e4),
                             FULL: dict(rope_type="proportional", partial_rotary_factor=s.partial_rotary_factor,
                                        rope_theta=1e6)},
            final_logit_softcapping=30.0, rms_norm_eps=1e-6, use_bidirectional_attention="vision",
            pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=8),
    )


def tiny_transformers_model(settings: TinySettings | None = None):
    """A randomised float32 eager ``DiffusionGemmaForBlockDiffusion`` in eval mode (see the module notes)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    s = settings or TinySettings()
    torch.manual_seed(s.seed)
    model = DiffusionGemmaForBlockDiffusion._from_config(_hf_config(s), dtype=torch.float32,
                                                         attn_implementation="eager")
    model.eval()
    gen = torch.Generator().manual_seed(s.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.08 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        if s.final_norm_gain != 1.0:
            model.model.decoder.norm.weight.mul_(s.final_norm_gain)
        # The image placeholder id never appears in generated text: its embedding row (also its output row,
        # tied) is zero, so its logit is 0 against others up to about 15. mlx-vlm encodes that id as pad
        # even without an image; the cross-check reports that with a separate probe, not by chance.
        model.model.decoder.embed_tokens.weight[s.vocab_size - 1].zero_()
        # EOS (id 1) is made less likely (its row halved), so that runs usually span several canvases.
        model.model.decoder.embed_tokens.weight[1].mul_(0.5)
        if s.self_conditioning_gain != 1.0:
            model.model.decoder.self_conditioning.down_proj.weight.mul_(s.self_conditioning_gain)
    return model


def write_word_tokenizer(directory: str | os.PathLike, vocab_size: int) -> None:
    """A word-level ``tokenizer.json`` (+ config) with tokens ``<pad> <eos> <bos> t3 ... t{V-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<pad>", "<eos>", "<bos>"] + [f"t{i}" for i in range(3, vocab_size)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(names[:3])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
                   "bos_token": "<bos>", "model_max_length": 4096}, f, indent=2)


def write_tiny_checkpoint(directory: str | os.PathLike, settings: TinySettings | None = None) -> str:
    """Write the tiny checkpoint (weights, config, generation config, tokenizer) into ``directory``.

    Returns the directory. The generation config holds transformers' defaults with EOS 1 and pad 0.
    """
    s = settings or TinySettings()
    os.makedirs(directory, exist_ok=True)
    model = tiny_transformers_model(s)
    model.save_pretrained(directory)
    write_word_tokenizer(directory, s.vocab_size)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"max_new_tokens": 32, "max_denoising_steps": 12, "t_min": 0.4, "t_max": 0.8,
                   "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
                   "stability_threshold": 1, "confidence_threshold": 0.005, "eos_token_id": [1],
                   "pad_token_id": 0}, f, indent=2)
    return str(directory)
