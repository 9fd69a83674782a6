"""Random DiffusionGemma weights for tests and benchmarks (no transformers needed).

``random_tensors`` follows the perturbations of SPEC §14: every 1-D tensor ``1 + 0.3 N(0, 1)``, every
matrix ``0.08 N(0, 1)``, encoder and decoder layer scalars drawn independently from U(0.5, 1.5), so that
``x * w`` cannot pass for ``x * (1 + w)`` nor the encoder scalar for the decoder's.
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.reference.config import FULL, SLIDING, ModelConfig, RopeParameters
from diffusiongemma.reference.weights import expected_shapes

__all__ = ["random_tensors", "make_config"]


def random_tensors(config: ModelConfig, seed: int = 0, *, final_norm_gain: float = 1.0,
                   self_conditioning_gain: float = 1.0, matrix_scale: float = 0.08) -> dict[str, np.ndarray]:
    """A full set of float32 tensors for ``config`` under the project's names.

    final_norm_gain multiplies the final norm weight (about 25 makes the logits peaked, SPEC §14).
    self_conditioning_gain multiplies ``self_conditioning.down_proj``: a small value (1e-3) makes the
    self-conditioning feedback contractive, so that float32 rounding differences do not grow from one
    denoising step to the next (with the default random weights they grow about fourfold per step).
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("layer_scalar"):
            tensors[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        elif len(shape) == 1:
            tensors[name] = (1.0 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (matrix_scale * rng.standard_normal(shape)).astype(np.float32)
    tensors["final_norm"] *= np.float32(final_norm_gain)
    tensors["self_conditioning.down_proj"] *= np.float32(self_conditioning_gain)
    return tensors


def make_config(*, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 96,
                moe_intermediate_size: int = 32, layer_types: str = "SSFSF", num_attention_heads: int = 4,
                sliding_head_dim: int = 16, sliding_kv_heads: int = 2, full_head_dim: int = 32,
                full_kv_heads: int = 1, sliding_window: int = 8, num_experts: int = 4, top_k_experts: int = 2,
                canvas_length: int = 16, partial_rotary_factor: float = 0.25) -> ModelConfig:
    """A ModelConfig from compact knobs; ``layer_types`` is a string of 'S' / 'F'. Defaults: SPEC §14."""
    kinds = tuple(SLIDING if c == "S" else FULL for c in layer_types)
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=len(kinds),
        num_attention_heads=num_attention_heads, layer_types=kinds,
        layer_head_dim=tuple(sliding_head_dim if k == SLIDING else full_head_dim for k in kinds),
        layer_num_key_value_heads=tuple(sliding_kv_heads if k == SLIDING else full_kv_heads for k in kinds),
        sliding_window=sliding_window,
        rope_parameters={SLIDING: RopeParameters("default", 1e4),
                         FULL: RopeParameters("proportional", 1e6, partial_rotary_factor)},
        num_experts=num_experts, top_k_experts=top_k_experts, canvas_length=canvas_length,
    )
