"""The model configuration and its validation.

``ModelConfig`` holds exactly the numbers the text model needs, under the upstream
(`transformers` ``DiffusionGemmaTextConfig`` / ``DiffusionGemmaConfig``) field names. It is read
from a transformers ``config.json`` of ``model_type`` ``diffusion_gemma`` (the whole multimodal
config, or its ``text_config``) or from the project's own converted-checkpoint config.

Upstream behaviours reproduced (transformers 5.24.0, ``configuration_diffusion_gemma.py``):

* ``layer_types`` defaults to five sliding layers then one full layer, repeating; a last layer
  that is not full is forced to full upstream (with a warning). We refuse such a config instead:
  silently changing the architecture of a checkpoint hides a broken file.
* Full-attention layers take their head dim and KV-head count from ``per_layer_config`` (5.15+)
  or, in older files, from ``global_head_dim`` (default 512) and ``num_global_key_value_heads``.
* ``final_logit_softcapping`` is a class attribute upstream (30.0) that ``save_pretrained`` does
  not always write; absent means 30.0.
* ``canvas_length`` lives in the top-level config (default 256).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        import numpy as np

        return float(np.float32(math.sqrt(self.hidden_size)))

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "sliding_window", "num_experts",
                    "top_k_experts", "canvas_length", "max_position_embeddings"]
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("pad_token_id", "bos_token_id"):
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("rms_norm_eps", "final_logit_softcapping"):
            if not _is_real(getattr(self, name)):
                raise ConfigError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not isinstance(self.hidden_activation, str):
            raise ConfigError(f"hidden_activation must be a string, got {self.hidden_activation!r}")
        n = self.num_hidden_layers
        for name, check, what in (("layer_types", lambda v: isinstance(v, str), "a string"),
                                  ("layer_head_dim", _is_int, "an integer"),
                                  ("layer_num_key_value_heads", _is_int, "an integer"),
                                  ("eos_token_id", _is_int, "an integer")):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise ConfigError(f"{name} must be a list, got {value!r}")
            for i, item in enumerate(value):
                if not check(item):
                    raise ConfigError(f"{name}[{i}] must be {what}, got {item!r}")
        if not isinstance(self.rope_parameters, Mapping):
            raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {self.rope_parameters!r}")
        for kind, rope in self.rope_parameters.items():
            if not isinstance(rope, RopeParameters):
                raise ConfigError(f"rope_parameters[{kind!r}] must be RopeParameters, got {rope!r}")
            if not isinstance(rope.rope_type, str):
                raise ConfigError(f"rope_parameters[{kind!r}].rope_type must be a string, got {rope.rope_type!r}")
            for field_name in ("rope_theta", "partial_rotary_factor"):
                if not _is_real(getattr(rope, field_name)):
                    raise ConfigError(f"rope_parameters[{kind!r}].{field_name} must be a number, "
                                      f"got {getattr(rope, field_name)!r}")
        for name in ("layer_types", "layer_head_dim", "layer_num_key_value_heads"):
            if len(getattr(self, name)) != n:
                raise ConfigError(f"{name} must have num_hidden_layers={n} entries, "
                                  f"got {len(getattr(self, name))}: {getattr(self, name)!r}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {kind!r}")
        if self.layer_types[-1] != FULL:
            raise ConfigError(f"layer_types[-1] (the last layer) must be {FULL!r}, got "
                              f"{self.layer_types[-1]!r}; transformers would silently rewrite it")
        for i, (d, g) in enumerate(zip(self.layer_head_dim, self.layer_num_key_value_heads)):
            if d <= 0 or d % 2:
                raise ConfigError(f"head_dim of layer {i} must be a positive even integer, got {d!r}")
            if g <= 0 or self.num_attention_heads % g:
                raise ConfigError(f"num_key_value_heads of layer {i} ({g}) must divide "
                                  f"num_attention_heads ({self.num_attention_heads})")
        if self.top_k_experts > self.num_experts:
            raise ConfigError(f"top_k_experts ({self.top_k_experts}) must not exceed "
                              f"num_experts ({self.num_experts})")
        if self.sliding_window < 2 and SLIDING in self.layer_types:
            raise ConfigError(f"sliding_window must be at least 2, got {self.sliding_window}")
        for kind in set(self.layer_types):
            if kind not in self.rope_parameters:
                raise ConfigError(f"rope_parameters has no entry for layer type {kind!r}")
        for kind, rope in self.rope_parameters.items():
            if rope.rope_type not in ("default", "proportional"):
                raise ConfigError(f"rope_parameters[{kind!r}].rope_type {rope.rope_type!r} is not "
                                  "supported (only 'default' and 'proportional')")
            if not rope.rope_theta > 0:
                raise ConfigError(f"rope_parameters[{kind!r}].rope_theta must be > 0, got {rope.rope_theta!r}")
            if rope.rope_type == "default" and rope.partial_rotary_factor != 1.0:
                raise ConfigError(f"rope_parameters[{kind!r}].partial_rotary_factor={rope.partial_rotary_factor!r} "
                                  "with rope_type 'default' is not supported (upstream would rotate a shorter "
                                  "vector than the head); use rope_type 'proportional'")
            if not 0.0 < rope.partial_rotary_factor <= 1.0:
                raise ConfigError(f"rope_parameters[{kind!r}].partial_rotary_factor must be in (0, 1], "
                                  f"got {rope.partial_rotary_factor!r}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"hidden_activation {self.hidden_activation!r} is not supported "
                              "(only 'gelu_pytorch_tanh')")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.final_logit_softcapping > 0:
            raise ConfigError(f"final_logit_softcapping must be > 0, got {self.final_logit_softcapping!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id!r} is outside [0, vocab_size={self.vocab_size})")

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
        if not isinstance(data, Mapping):
            raise ConfigError(f"model_config must be an object, got {type(data).__name__}: {data!r:.80}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {sorted(unknown)}")
        data = dict(data)
        rope_raw = data.get("rope_parameters", {})
        if not isinstance(rope_raw, Mapping):
            raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {rope_raw!r:.80}")
        rope_fields = {f.name for f in dataclasses.fields(RopeParameters)}
        data["rope_parameters"] = {}
        for kind, params in rope_raw.items():
            if not isinstance(params, Mapping):
                raise ConfigError(f"rope_parameters[{kind!r}] must be an object, got {params!r:.80}")
            if set(params) - rope_fields or "rope_type" not in params or "rope_theta" not in params:
                raise ConfigError(f"rope_parameters[{kind!r}] must have rope_type, rope_theta and optionally "
                                  f"partial_rotary_factor, got fields {sorted(params)}")
            data["rope_parameters"][kind] = RopeParameters(**params)
        for key in ("layer_types", "layer_head_dim", "layer_num_key_value_heads", "eos_token_id"):
            if key in data:
                if not isinstance(data[key], (list, tuple)):
                    raise ConfigError(f"{key} must be a list, got {data[key]!r:.80}")
                data[key] = tuple(data[key])
        return cls(**data)

    @classmethod
    def from_transformers(cls, config: Mapping[str, Any]) -> "ModelConfig":
        """Build from a transformers ``config.json`` dict (``diffusion_gemma`` or its text config).

        Raises ``ConfigError`` naming the field for unsupported or inconsistent values, e.g.
        ``use_bidirectional_attention="all"`` (a non-causal encoder with a halved window: not the
        released setting, not implemented here), a KV-head count that does not divide the query
        heads, or a last layer that is sliding.
        """
        model_type = config.get("model_type")
        if model_type == "diffusion_gemma":
            text = config.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError("config.json of model_type 'diffusion_gemma' has no text_config object")
            canvas_length = config.get("canvas_length", 256)
        elif model_type == "diffusion_gemma_text":
            text, canvas_length = config, config.get("canvas_length", 256)
        else:
            raise ConfigError(f"model_type must be 'diffusion_gemma' (or 'diffusion_gemma_text'), got {model_type!r}")

        def get(name, default):
            value = text.get(name, default)
            return default if value is None else value

        def number(where, value):
            if not _is_real(value):
                raise ConfigError(f"config.json: {where} must be a number, got {value!r:.80}")
            return float(value)

        bidir = text.get("use_bidirectional_attention")
        if bidir not in (None, "vision"):
            raise ConfigError(f"use_bidirectional_attention={bidir!r} is not supported: only None or 'vision' "
                              "(causal text encoder, the released setting)")
        n_layers = get("num_hidden_layers", 30)
        if not isinstance(n_layers, int) or n_layers <= 0:
            raise ConfigError(f"num_hidden_layers must be a positive integer, got {n_layers!r}")
        layer_types = text.get("layer_types")
        if layer_types is None:  # upstream default: every sixth layer is full
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"layer_types must be a list, got {layer_types!r:.80}")
        layer_types = tuple(layer_types)

        n_heads = get("num_attention_heads", 8)
        head_dim = get("head_dim", 256)
        n_kv = get("num_key_value_heads", 4)
        per_layer = text.get("per_layer_config")
        if per_layer is None:
            overrides: dict[str, Any] = {"head_dim": get("global_head_dim", 512)}
            if text.get("num_global_key_value_heads") is not None:
                overrides["num_key_value_heads"] = text["num_global_key_value_heads"]
            per_layer = {str(i): overrides for i, t in enumerate(layer_types) if t == FULL}
        elif not isinstance(per_layer, Mapping):
            raise ConfigError(f"per_layer_config must be an object, got {per_layer!r}")
        layer_head_dim, layer_kv = [], []
        for i in range(len(layer_types)):
            over = per_layer.get(str(i), per_layer.get(i, {})) or {}
            if not isinstance(over, Mapping):
                raise ConfigError(f"per_layer_config[{i}] must be an object, got {over!r:.80}")
            for key, value in over.items():
                if key in ("head_dim", "num_key_value_heads") and not _is_int(value):
                    raise ConfigError(f"per_layer_config[{i}].{key} must be an integer, got {value!r}")
            unknown = set(over) - {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ConfigError(f"per_layer_config[{i}] has unsupported field(s) {sorted(unknown)}")
            layer_head_dim.append(over.get("head_dim", head_dim))
            layer_kv.append(over.get("num_key_value_heads", n_kv))

        rope_raw = text.get("rope_parameters") or {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        if not isinstance(rope_raw, Mapping):
            raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {rope_raw!r:.80}")
        rope = {}
        for kind, params in rope_raw.items():
            if kind not in LAYER_TYPES:
                raise ConfigError(f"rope_parameters has an unknown layer type {kind!r}")
            if not isinstance(params, Mapping):
                raise ConfigError(f"rope_parameters[{kind!r}] must be an object, got {params!r}")
            if params.get("factor", 1.0) not in (1, 1.0):
                raise ConfigError(f"rope_parameters[{kind!r}].factor={params['factor']!r} is not supported (only 1)")
            rope[kind] = RopeParameters(
                rope_type=params.get("rope_type", "default"),
                rope_theta=number(f"rope_parameters[{kind!r}].rope_theta", params.get("rope_theta", 10_000.0)),
                partial_rotary_factor=number(f"rope_parameters[{kind!r}].partial_rotary_factor",
                                             params.get("partial_rotary_factor", 1.0)))
        for where, value in (("tie_word_embeddings", config.get("tie_word_embeddings")),
                             ("text_config.tie_word_embeddings", text.get("tie_word_embeddings"))):
            if value is False:
                raise ConfigError(f"{where}=False is not supported: DiffusionGemma ties the output projection "
                                  "and the encoder to the decoder's embedding table")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias=True is not supported (DiffusionGemma has no biases)")
        eos = get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            vocab_size=get("vocab_size", 262_144),
            hidden_size=get("hidden_size", 2304),
            intermediate_size=get("intermediate_size", 9216),
            moe_intermediate_size=text.get("moe_intermediate_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            layer_types=layer_types,
            layer_head_dim=tuple(layer_head_dim),
            layer_num_key_value_heads=tuple(layer_kv),
            sliding_window=get("sliding_window", 512),
            rope_parameters=rope,
            rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps", 1e-6)),
            hidden_activation=get("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=number("final_logit_softcapping", get("final_logit_softcapping", 30.0)),
            num_experts=text.get("num_experts"),
            top_k_experts=text.get("top_k_experts"),
            canvas_length=canvas_length,
            max_position_embeddings=get("max_position_embeddings", 131_072),
            pad_token_id=get("pad_token_id", 0),
            bos_token_id=get("bos_token_id", 2),
            eos_token_id=eos,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read a transformers ``config.json`` or the project's ``diffusiongemma.json``."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid UTF-8 JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
        if "model_config" in data and data.get("format") == "diffusiongemma":
            return cls.from_dict(data["model_config"])
        return cls.from_transformers(data)
