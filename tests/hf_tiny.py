"""Tiny randomised transformers DiffusionGemma models for cross-checking (SPEC §14).

The default initialisation hides bugs (all-ones norms cannot tell ``x*w`` from ``x*(1+w)``, equal
encoder/decoder layer scalars cannot tell which one is used), so every 1-D parameter is redrawn
as ``1 + 0.3*N(0,1)``, every matrix as ``0.08*N(0,1)``, and the encoder and decoder layer scalars
independently from U(0.5, 1.5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class TinySpec:
    """Knobs of a tiny DiffusionGemma; defaults are SPEC §14's config."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 96
    moe_intermediate_size: int = 32
    layer_types: list = field(default_factory=lambda: [SLIDING, SLIDING, FULL, SLIDING, FULL])
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_global_key_value_heads: int = 1
    head_dim: int = 16
    global_head_dim: int = 32
    num_experts: int = 4
    top_k_experts: int = 2
    sliding_window: int = 8
    canvas_length: int = 16
    partial_rotary_factor: float = 0.25
    final_norm_gain: float = 1.0  # multiply the final norm weight (about 25 makes logits peaked)


def hf_config(spec: TinySpec | None = None):
    """A ``transformers.DiffusionGemmaConfig`` for ``spec`` (with a tiny vision tower)."""
    from transformers import DiffusionGemmaConfig

    spec = spec or TinySpec()
    V = spec.vocab_size
    return DiffusionGemmaConfig(
        canvas_length=spec.canvas_length, image_token_id=V - 1, boi_token_id=V - 2, eoi_token_id=V - 3,
        text_config=dict(
            vocab_size=V, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=len(spec.layer_types),
            layer_types=list(spec.layer_types), num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            num_global_key_value_heads=spec.num_global_key_value_heads,
            head_dim=spec.head_dim, global_head_dim=spec.global_head_dim, num_experts=spec.num_experts,
            top_k_experts=spec.top_k_experts, sliding_window=spec.sliding_window,
            rope_parameters={SLIDING: dict(rope_type="default", rope_theta=1e4),
                             FULL: dict(rope_type="proportional",
                                        partial_rotary_factor=spec.partial_rotary_factor, rope_theta=1e6)},
            final_logit_softcapping=30.0, rms_norm_eps=1e-6, use_bidirectional_attention="vision",
            pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=8, global_head_dim=8),
    )


def randomise_(model, seed: int = 0, final_norm_gain: float = 1.0) -> None:
    """Redraw every text parameter and layer scalar in place (SPEC §14 perturbations)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        if final_norm_gain != 1.0:
            model.model.decoder.norm.weight.mul_(final_norm_gain)


def tiny_model(spec: TinySpec | None = None, seed: int = 0):
    """A randomised fp32 eager ``DiffusionGemmaForBlockDiffusion`` in eval mode."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    spec = spec or TinySpec()
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                         attn_implementation="eager")
    model.eval()
    randomise_(model, seed=seed, final_norm_gain=spec.final_norm_gain)
    return model


def save_tiny(model, path: str | os.PathLike) -> str:
    """``save_pretrained`` into ``path`` and return it (the converter reads this)."""
    model.save_pretrained(path)
    return str(path)
