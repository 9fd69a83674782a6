"""Reading model configurations: a transformers ``config.json`` (``DiffusionGemmaConfig`` or its text
config) and the project's own ``diffusiongemma.json``, as the plain field values of ``ModelConfig``.

Upstream behaviours reproduced (transformers 5.24.0, ``configuration_diffusion_gemma.py``):

* ``layer_types`` defaults to five sliding layers then one full layer, repeating; a last layer that is not
  full is forced to full upstream (with a warning). We refuse such a config instead (``config_checks``):
  silently changing the architecture of a checkpoint hides a broken file.
* Full-attention layers take their head dim and KV-head count from ``per_layer_config`` (5.15+; a key an
  entry leaves out keeps the text config's value; its keys are layer indices, which ``save_pretrained``
  zero-pads to a common width: "05" for layer 5 of 30) or, in older files, from ``global_head_dim``
  (default 512) and ``num_global_key_value_heads``.
* ``final_logit_softcapping`` is a class attribute upstream (30.0) that ``save_pretrained`` does not always
  write; absent means 30.0.
* ``canvas_length`` lives in the top-level config (default 256).
* ``tie_word_embeddings`` (top level and text config) defaults to true upstream; it must be absent or
  ``true`` here (``false`` cannot be honoured: there is no separate output projection; any other value,
  ``null`` included, is refused, where upstream would take its truthiness and leave a null untied).
* A JSON object that repeats a key (``{"3": {...}, "3": {...}}``) is refused naming the key and where it is
  (``json`` would keep the last one silently); so is a ``per_layer_config`` key that is not ASCII digits
  ("٣" or "³" are digits to Python's isdigit, not layer indices).
* ``rope_parameters`` absent or null takes upstream's defaults; any other value must be a non-empty object
  (``0``, ``[]`` or ``{}`` are refused rather than read as "absent").
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

from .config_checks import MAX_LAYERS
from .errors import ConfigError

SAMPLER_CLASS_NAME = "EntropyBoundSamplerConfig"  # the only sampler transformers knows


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_config_fields(data: Mapping[str, Any], field_names: Sequence[str]) -> dict[str, Any]:
    """The fields of the project's own ``model_config`` object (``ModelConfig.to_dict``'s layout), checked
    for unknown keys and container types; rope settings as plain dicts."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"model_config must be an object, got {type(data).__name__}: {data!r:.80}")
    known = set(field_names)
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"unknown ModelConfig field(s): {sorted(unknown)}")
    data = dict(data)
    rope_raw = data.get("rope_parameters", {})
    if not isinstance(rope_raw, Mapping):
        raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {rope_raw!r:.80}")
    rope_fields = {"rope_type", "rope_theta", "partial_rotary_factor"}
    data["rope_parameters"] = {}
    for kind, params in rope_raw.items():
        if not isinstance(params, Mapping):
            raise ConfigError(f"rope_parameters[{kind!r}] must be an object, got {params!r:.80}")
        if set(params) - rope_fields or "rope_type" not in params or "rope_theta" not in params:
            raise ConfigError(f"rope_parameters[{kind!r}] must have rope_type, rope_theta and optionally "
                              f"partial_rotary_factor, got fields {sorted(params)}")
        data["rope_parameters"][kind] = dict(params)
    for key in ("layer_types", "layer_head_dim", "layer_num_key_value_heads", "eos_token_id"):
        if key in data:
            if not isinstance(data[key], (list, tuple)):
                raise ConfigError(f"{key} must be a list, got {data[key]!r:.80}")
            data[key] = list(data[key])
    return data



def per_layer_overrides(per_layer: Any, n_layers: int) -> dict[int, Any]:
    """``per_layer_config`` as {layer index: entry}. transformers 5.15+ writes the keys as layer indices
    zero-padded to a common width ("05", "11", ..., "29" for 30 layers: ``save_pretrained`` of a
    ``DiffusionGemmaConfig``), older writers and hand-made files as plain "5" or JSON integers; every
    spelling of one index means that layer. Raises ``ConfigError`` for a value that is not an object, a key
    that is not a non-negative integer, an index outside [0, n_layers), or two keys naming one layer."""
    if not isinstance(per_layer, Mapping):
        raise ConfigError(f"per_layer_config must be an object, got {per_layer!r:.80}")
    out: dict[int, Any] = {}
    for key, entry in per_layer.items():
        text_key = str(key).strip()
        if isinstance(key, bool) or not (text_key.isascii() and text_key.isdigit()):
            raise ConfigError(f"per_layer_config key {key!r} is not a layer index (ASCII digits 0-9)")
        index = int(text_key)
        if index >= n_layers:
            raise ConfigError(f"per_layer_config key {key!r} names layer {index}, but the model has "
                              f"{n_layers} layers (0..{n_layers - 1})")
        if index in out:
            raise ConfigError(f"per_layer_config names layer {index} twice (key {key!r})")
        out[index] = entry
    return out


def transformers_fields(config: Mapping[str, Any], SLIDING: str, FULL: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a transformers ``config.json`` dict (``diffusion_gemma`` or its text
    config), with upstream's defaults.

    Raises ``ConfigError`` naming the field for unsupported or inconsistent values, e.g.
    ``use_bidirectional_attention="all"`` (a non-causal encoder with a halved window: not the released
    setting, not implemented here), ``tie_word_embeddings=False`` or ``attention_bias=True``.
    """
    LAYER_TYPES = (SLIDING, FULL)
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
    if not _is_int(n_layers) or n_layers <= 0:
        raise ConfigError(f"num_hidden_layers must be a positive integer, got {n_layers!r}")
    if n_layers > MAX_LAYERS:  # before the per-layer lists are built from it
        raise ConfigError(f"num_hidden_layers must be at most {MAX_LAYERS}, got {n_layers}")
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
    per_layer = per_layer_overrides(per_layer, len(layer_types))
    layer_head_dim, layer_kv = [], []
    for i in range(len(layer_types)):
        over = per_layer.get(i) or {}
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

    rope_raw = text.get("rope_parameters")
    if rope_raw is None:  # only an absent (or null) setting takes upstream's defaults; 0, [] or {} are errors
        rope_raw = {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
    if not isinstance(rope_raw, Mapping) or not rope_raw:
        raise ConfigError(f"rope_parameters must be an object (layer type -> settings), got {rope_raw!r:.80}")
    rope = {}
    for kind, params in rope_raw.items():
        if kind not in LAYER_TYPES:
            raise ConfigError(f"rope_parameters has an unknown layer type {kind!r}")
        if not isinstance(params, Mapping):
            raise ConfigError(f"rope_parameters[{kind!r}] must be an object, got {params!r}")
        if params.get("factor", 1.0) not in (1, 1.0):
            raise ConfigError(f"rope_parameters[{kind!r}].factor={params['factor']!r} is not supported (only 1)")
        rope[kind] = dict(
            rope_type=params.get("rope_type", "default"),
            rope_theta=number(f"rope_parameters[{kind!r}].rope_theta", params.get("rope_theta", 10_000.0)),
            partial_rotary_factor=number(f"rope_parameters[{kind!r}].partial_rotary_factor",
                                         params.get("partial_rotary_factor", 1.0)))
    for where, holder in (("tie_word_embeddings", config), ("text_config.tie_word_embeddings", text)):
        value = holder.get("tie_word_embeddings")
        if value is None and "tie_word_embeddings" in holder:  # upstream reads null as false: untied
            raise ConfigError(f"{where} must be true or false (DiffusionGemma needs true), got null; leave it out "
                              "or write true")
        if value is False:
            raise ConfigError(f"{where}=False is not supported: DiffusionGemma ties the output projection "
                              "and the encoder to the decoder's embedding table")
        if value is not None and value is not True:  # JSON true/false only: "8", 1 or NaN are no answer
            raise ConfigError(f"{where} must be true or false (DiffusionGemma needs true), got {value!r:.80}")
    if text.get("attention_bias"):
        raise ConfigError("attention_bias=True is not supported (DiffusionGemma has no biases)")
    eos = get("eos_token_id", 1)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return dict(
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


class _JSONObject(dict):
    """A decoded JSON object that remembers the keys it was given more than once (as paths below it)."""

    __slots__ = ("repeated",)


def _object_pairs(pairs: list) -> _JSONObject:
    """``json``'s ``object_pairs_hook``: the object, with ``repeated`` listing every key given twice in it or
    in an object below it, as a dotted path (objects are decoded innermost first)."""
    out = _JSONObject()
    out.repeated = []
    for key, value in pairs:
        if key in out:
            out.repeated.append(key)
        out[key] = value
        for inner in (value if isinstance(value, list) else [value]):
            if isinstance(inner, _JSONObject):
                out.repeated.extend(f"{key}.{sub}" for sub in inner.repeated)
    return out


def load_json_object(f, path: str | os.PathLike) -> Any:
    """``json.load(f)``, refusing with ``ConfigError`` naming ``path`` and the key a JSON object that gives one
    key twice (``json`` would silently keep the last value, which another reader may not)."""
    data = json.load(f, object_pairs_hook=_object_pairs)
    if isinstance(data, _JSONObject) and data.repeated:
        raise ConfigError(f"{path}: the key {data.repeated[0]} is given twice in one JSON object; which value "
                          "is meant is ambiguous, so give it once")
    return _plain(data)


def _plain(value: Any) -> Any:
    """``value`` with every ``_JSONObject`` turned back into a plain dict."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def read_config_json(path: str | os.PathLike) -> tuple[dict, bool]:
    """(the JSON object, True when it is the project's ``diffusiongemma.json``) of a config file: for the
    project's file its ``model_config`` object, else the transformers config itself. A key repeated inside
    one JSON object is refused by name (``load_json_object``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = load_json_object(f, path)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if "model_config" in data and data.get("format") == "diffusiongemma":
        return data["model_config"], True
    return data, False


# generation_config.json keys that transformers accepts but that do not change the text-only reference loop.
_IGNORED_KEYS = frozenset({"return_dict_in_generate", "cache_config", "disable_compile", "bos_token_id",
                           "_commit_hash", "_from_model_config", "transformers_version"})


def _sampler_entropy_bound(value: Any) -> float | None:
    """The entropy bound inside a serialised ``sampler_config`` (None when unset)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"sampler_config must be an object, got {value!r}")
    cls_name = value.get("_cls_name", SAMPLER_CLASS_NAME)
    if cls_name != SAMPLER_CLASS_NAME:
        raise ConfigError(f"sampler_config._cls_name {cls_name!r} is not supported; only {SAMPLER_CLASS_NAME!r}")
    unknown = sorted(set(value) - {"_cls_name", "entropy_bound"})
    if unknown:
        raise ConfigError(f"unknown sampler_config key(s) {unknown}")
    return value.get("entropy_bound")


def generation_config_fields(data: Mapping[str, Any], field_names: Sequence[str]) -> dict[str, Any]:
    """The ``GenerationConfig`` fields of transformers' ``generation_config.json`` layout.

    The entropy bound lives in ``sampler_config = {"_cls_name": "EntropyBoundSamplerConfig",
    "entropy_bound": ...}``. A null value means "not set", so the default applies (transformers fills unset
    fields from its global defaults). Keys transformers accepts but the reference does not need
    (``return_dict_in_generate``, ``bos_token_id``, metadata...) are ignored; ``cache_implementation`` must
    be absent, null or "dynamic" (other caches change the numbers; SPEC §8.5). Any other key raises
    ``ConfigError``, as transformers does.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a generation config must be a JSON object, got {type(data).__name__}")
    names = set(field_names) - {"entropy_bound"}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in _IGNORED_KEYS:
            continue
        if key == "cache_implementation":
            if value not in (None, "dynamic"):
                raise ConfigError(f"cache_implementation {value!r} is not supported: the reference reproduces "
                                  "the default dynamic cache only")
        elif key == "sampler_config":
            bound = _sampler_entropy_bound(value)
            if bound is not None:
                values["entropy_bound"] = bound
        elif key in names:
            if value is not None:
                values[key] = value
        else:
            raise ConfigError(f"unknown generation_config key {key!r}")
    return values


def read_generation_config_json(path: str | os.PathLike) -> Any:
    """The JSON object of ``generation_config.json`` in a checkpoint directory (or that file itself).

    Raises ``FileNotFoundError`` when the file is missing and ``ConfigError`` for invalid JSON.
    """
    file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else os.fspath(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no generation config at {file!r}")
    try:
        with open(file, encoding="utf-8") as f:
            data = load_json_object(f, file)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file!r} is not valid JSON: {error}") from None
    return data
