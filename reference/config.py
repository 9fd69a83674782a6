"""The model configuration: the numbers a DiffusionGemma text model is made of (SPEC §1).

``ModelConfig`` holds exactly the numbers the text model needs, under the upstream
(`transformers` ``DiffusionGemmaTextConfig`` / ``DiffusionGemmaConfig``) field names. Its fields are
checked when it is built (``support/config_checks.py``); it is read from a transformers ``config.json`` of
``model_type`` ``diffusion_gemma`` or from the project's converted checkpoint (``support/config_io.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .support import config_io
from .support.config_checks import check_model_config

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


@dataclass(frozen=True)
class RopeParameters:
    """Rotary-embedding settings of one layer type."""

    rope_type: str  # "default" (all frequencies rotate) or "proportional" (a leading share rotates)
    rope_theta: float  # base of the inverse frequencies, e.g. 1e4 (sliding) or 1e6 (full)
    partial_rotary_factor: float = 1.0  # share of the head dim that rotates (proportional: 0.25)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the DiffusionGemma text model (encoder and decoder share it)."""

    vocab_size: int = 262_144  # V: rows of the (tied) embedding table and logits width
    hidden_size: int = 2816  # H: residual stream width
    intermediate_size: int = 2112  # I_d: dense MLP width, also the self-conditioning MLP width
    moe_intermediate_size: int = 704  # I_e: width of each routed expert
    num_hidden_layers: int = 30  # N_L: transformer blocks (the same weights serve both stacks)
    num_attention_heads: int = 16  # n_h: query heads, every layer
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" or "full_attention"
    layer_head_dim: tuple[int, ...] = ()  # per layer head dim (256 sliding / 512 full in the 26B model)
    layer_num_key_value_heads: tuple[int, ...] = ()  # per layer KV heads (8 sliding / 2 full)
    sliding_window: int = 1024  # W: a sliding-layer query sees W keys (itself included)
    rope_parameters: Mapping[str, RopeParameters] = field(default_factory=dict)  # per layer type
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    hidden_activation: str = "gelu_pytorch_tanh"  # the only activation the model uses
    final_logit_softcapping: float = 30.0  # c in c*tanh(z/c) on the output logits
    num_experts: int = 128  # E: routed experts per layer
    top_k_experts: int = 8  # K: experts chosen per token
    canvas_length: int = 256  # C: tokens denoised together in one block
    max_position_embeddings: int = 131_072  # positions 0 .. this - 1 are valid (prompt, cache and canvases)
    pad_token_id: int = 0  # id written after EOS, and the id of left padding
    bos_token_id: int = 2
    eos_token_id: tuple[int, ...] = (1,)  # text-config EOS; generation uses the generation config

    # ------------------------------------------------------------------ derived views
    def is_sliding(self, layer: int) -> bool:
        """True when ``layer`` uses sliding-window attention."""
        return self.layer_types[layer] == SLIDING

    @property
    def embed_scale(self) -> float:
        """float32(sqrt(H)), the embedding multiplier before any cast to the weight dtype."""
        return float(np.float32(math.sqrt(self.hidden_size)))

    def __post_init__(self) -> None:
        check_model_config(self, SLIDING, FULL, RopeParameters)  # every field's type and range, named on failure

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``ModelConfig.from_dict`` reads it back."""
        out = dataclasses.asdict(self)
        out["rope_parameters"] = {k: dataclasses.asdict(v) for k, v in self.rope_parameters.items()}
        for key in ("layer_types", "layer_head_dim", "layer_num_key_value_heads", "eos_token_id"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of ``to_dict``. Unknown keys raise ``ConfigError``."""
        return cls._from_fields(config_io.model_config_fields(data, [f.name for f in dataclasses.fields(cls)]))

    @classmethod
    def from_transformers(cls, config: Mapping[str, Any]) -> "ModelConfig":
        """Build from a transformers ``config.json`` dict (``diffusion_gemma`` or its text config): upstream
        defaults, ``per_layer_config`` overrides and the unsupported settings are in
        ``support/config_io.transformers_fields``. Raises ``ConfigError`` naming the field."""
        return cls._from_fields(config_io.transformers_fields(config, SLIDING, FULL))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read a transformers ``config.json`` or the project's ``diffusiongemma.json``."""
        data, own = config_io.read_config_json(path)
        return cls.from_dict(data) if own else cls.from_transformers(data)

    @classmethod
    def _from_fields(cls, fields: Mapping[str, Any]) -> "ModelConfig":
        """A config from plain values: lists become tuples, rope settings ``RopeParameters``."""
        fields = dict(fields)
        fields["rope_parameters"] = {kind: RopeParameters(**params)
                                     for kind, params in fields.get("rope_parameters", {}).items()}
        for key in ("layer_types", "layer_head_dim", "layer_num_key_value_heads", "eos_token_id"):
            if key in fields:
                fields[key] = tuple(fields[key])
        return cls(**fields)
