"""Checking settings: every field of ``ModelConfig`` and ``GenerationConfig`` for its type and range, with
an error that names the field and the value (checks run when a config is built, whatever built it).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_LAYERS = 4096  # most transformer blocks a config may declare (released models have at most ~130)
MAX_POSITIONS = 2**31 - 1  # most positions a model may declare: positions are int32 in llama.cpp and the kernels
RMS_NORM_EPS_MAX = 0.01  # the largest rms_norm_eps accepted; released models use 1e-6 (Gemma) to 1e-5 (Llama)
# the smallest final_logit_softcapping accepted (released models use 30): a cap c squeezes every logit into
# (-c, c), so below this the sampler's probabilities are uniform to within 0.2%, and logits / c overflows float32
# once a logit exceeds 3.4e35 (at 1e-45, any logit above 5e-7 does: a NumPy overflow warning, then ties)
SOFTCAP_MIN = 1e-3
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as a float, refused with ``ConfigError`` naming ``name`` unless it is a real number (not a bool)
    that stays finite, and with ``positive`` non-zero, once rounded to float32.

    Every backend computes in float32 (transformers' numerics), so a setting such as ``1e308`` that Python
    holds as finite would become ``inf`` on the first use, and ``1e-50`` would become 0; both are refused
    here, by name, instead of surfacing later as NaN logits or a RuntimeWarning. Used for the configuration
    files' real-valued fields and the command line's ``--temp`` / ``--entropy-bound``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r:.80}")
    value = float(value)
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ConfigError(f"{name} must be a finite float32 number (|value| <= {FLOAT32_MAX:.6g}), got {value!r}")
    if positive and value > 0 and np.float32(value) == 0:
        raise ConfigError(f"{name}={value!r} is below float32's smallest positive number and would become 0")
    return value


def check_model_config(config: Any, SLIDING: str, FULL: str, RopeParameters: type) -> None:
    """Raise ``ConfigError`` for the first ``ModelConfig`` field of the wrong type or range, or for fields
    that disagree (per-layer lists of the wrong length, a KV-head count that does not divide the query
    heads, a sliding last layer, a rope setting that is not supported).

    Sizes are bounded before anything is allocated from them: ``max_position_embeddings`` by
    ``MAX_POSITIONS``, ``canvas_length`` and ``sliding_window`` by ``max_position_embeddings`` (a canvas must
    fit in the positions; a window as long as every sequence already is full attention). Real values must
    stay finite in float32 (``check_float32``); ``rms_norm_eps`` must lie in (0, ``RMS_NORM_EPS_MAX``]."""
    LAYER_TYPES = (SLIDING, FULL)
    positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "sliding_window", "num_experts",
                "top_k_experts", "canvas_length", "max_position_embeddings"]
    for name in positive:
        value = getattr(config, name)
        if not _is_int(value) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    for name in ("pad_token_id", "bos_token_id"):
        if not _is_int(getattr(config, name)):
            raise ConfigError(f"{name} must be an integer, got {getattr(config, name)!r}")
    for name in ("rms_norm_eps", "final_logit_softcapping"):
        if not _is_real(getattr(config, name)):
            raise ConfigError(f"{name} must be a number, got {getattr(config, name)!r}")
        check_float32(name, getattr(config, name), positive=True)
    if config.num_hidden_layers > MAX_LAYERS:
        raise ConfigError(f"num_hidden_layers must be at most {MAX_LAYERS}, got {config.num_hidden_layers}")
    if config.max_position_embeddings > MAX_POSITIONS:
        raise ConfigError(f"max_position_embeddings must be at most {MAX_POSITIONS} (int32 positions), "
                          f"got {config.max_position_embeddings}")
    for name in ("canvas_length", "sliding_window"):
        if getattr(config, name) > config.max_position_embeddings:
            raise ConfigError(f"{name} must be at most max_position_embeddings={config.max_position_embeddings}, "
                              f"got {getattr(config, name)}")
    if not isinstance(config.hidden_activation, str):
        raise ConfigError(f"hidden_activation must be a string, got {config.hidden_activation!r}")
    n = config.num_hidden_layers
    for name, check, what in (("layer_types", lambda v: isinstance(v, str), "a string"),
                              ("layer_head_dim", _is_int, "an integer"),
                              ("layer_num_key_value_heads", _is_int, "an integer"),
                              ("eos_token_id", _is_int, "an integer")):
        value = getattr(config, name)
        if not isinstance(value, tuple):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        for i, item in enumerate(value):
            if not check(item):
                raise ConfigError(f"{name}[{i}] must be {what}, got {item!r}")
    if not isinstance(config.rope_parameters, Mapping):
        raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {config.rope_parameters!r}")
    for kind, rope in config.rope_parameters.items():
        if not isinstance(rope, RopeParameters):
            raise ConfigError(f"rope_parameters[{kind!r}] must be RopeParameters, got {rope!r}")
        if not isinstance(rope.rope_type, str):
            raise ConfigError(f"rope_parameters[{kind!r}].rope_type must be a string, got {rope.rope_type!r}")
        for field_name in ("rope_theta", "partial_rotary_factor"):
            if not _is_real(getattr(rope, field_name)):
                raise ConfigError(f"rope_parameters[{kind!r}].{field_name} must be a number, "
                                  f"got {getattr(rope, field_name)!r}")
            check_float32(f"rope_parameters[{kind!r}].{field_name}", getattr(rope, field_name), positive=True)
    for name in ("layer_types", "layer_head_dim", "layer_num_key_value_heads"):
        if len(getattr(config, name)) != n:
            raise ConfigError(f"{name} must have num_hidden_layers={n} entries, "
                              f"got {len(getattr(config, name))}: {getattr(config, name)!r}")
    for i, kind in enumerate(config.layer_types):
        if kind not in LAYER_TYPES:
            raise ConfigError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {kind!r}")
    if config.layer_types[-1] != FULL:
        raise ConfigError(f"layer_types[-1] (the last layer) must be {FULL!r}, got "
                          f"{config.layer_types[-1]!r}; transformers would silently rewrite it")
    for i, (d, g) in enumerate(zip(config.layer_head_dim, config.layer_num_key_value_heads)):
        if d <= 0 or d % 2:
            raise ConfigError(f"head_dim of layer {i} must be a positive even integer, got {d!r}")
        if g <= 0 or config.num_attention_heads % g:
            raise ConfigError(f"num_key_value_heads of layer {i} ({g}) must divide "
                              f"num_attention_heads ({config.num_attention_heads})")
    if config.top_k_experts > config.num_experts:
        raise ConfigError(f"top_k_experts ({config.top_k_experts}) must not exceed "
                          f"num_experts ({config.num_experts})")
    if config.sliding_window < 2 and SLIDING in config.layer_types:
        raise ConfigError(f"sliding_window must be at least 2, got {config.sliding_window}")
    for kind in set(config.layer_types):
        if kind not in config.rope_parameters:
            raise ConfigError(f"rope_parameters has no entry for layer type {kind!r}")
    for kind, rope in config.rope_parameters.items():
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
    if config.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"hidden_activation {config.hidden_activation!r} is not supported "
                          "(only 'gelu_pytorch_tanh')")
    if not 0 < config.rms_norm_eps <= RMS_NORM_EPS_MAX:
        raise ConfigError(f"rms_norm_eps must be in (0, {RMS_NORM_EPS_MAX}] (released models use 1e-6 to 1e-5; "
                          f"a larger epsilon swamps the activations' mean square), got {config.rms_norm_eps!r}")
    if not config.final_logit_softcapping > 0:
        raise ConfigError(f"final_logit_softcapping must be > 0, got {config.final_logit_softcapping!r}")
    if config.final_logit_softcapping < SOFTCAP_MIN:
        raise ConfigError(f"final_logit_softcapping must be at least {SOFTCAP_MIN:g} (released models use 30; a "
                          "smaller cap squeezes every logit into (-cap, cap), leaving the sampler uniform "
                          f"probabilities, and dividing by it overflows float32), got {config.final_logit_softcapping!r}")
    if not 0 <= config.pad_token_id < config.vocab_size:
        raise ConfigError(f"pad_token_id {config.pad_token_id!r} is outside [0, vocab_size={config.vocab_size})")



def check_integer(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def check_real(name: str, value: Any, positive: bool, optional: bool = False) -> float | None:
    """``value`` as a float: a real number finite in float32 (``check_float32``), > 0 with ``positive``, else
    >= 0; None passes with ``optional``. Raises ``ConfigError`` naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    check_float32(name, value, positive=positive)
    if positive and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def check_token_id_list(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, np.ndarray)):
        raise ConfigError(f"{name} must be an integer or a list of integers, got {value!r}")
    return tuple(check_integer(name, item, minimum=0) for item in items)
