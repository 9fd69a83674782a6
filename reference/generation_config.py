"""Settings of a generation run: ``GenerationConfig``, with transformers' names, defaults and file layout.

``GenerationConfig`` mirrors transformers 5.24.0 ``DiffusionGemmaGenerationConfig`` for the text path (SPEC
§8): the token budget, the denoising-step count and temperature schedule, the entropy bound of the sampler,
the stable-and-confident stopping rule, and the EOS/pad ids. It reads and writes ``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError

__all__ = ["GenerationConfig", "DEFAULT_MAX_NEW_TOKENS", "SAMPLER_CLASS_NAME"]

DEFAULT_MAX_NEW_TOKENS = 256  # transformers lets max_length take over only while max_new_tokens has this value
SAMPLER_CLASS_NAME = "EntropyBoundSamplerConfig"  # the only sampler transformers knows
# generation_config.json keys that transformers accepts but that do not change the text-only reference loop.
_IGNORED_KEYS = frozenset({"return_dict_in_generate", "cache_config", "disable_compile", "bos_token_id",
                           "_commit_hash", "_from_model_config", "transformers_version"})


# ================================================================================================ configuration
@dataclass(frozen=True)
class GenerationConfig:
    """Settings of ``generate``, with transformers' ``DiffusionGemmaGenerationConfig`` names and defaults.

    Build it directly, with ``from_dict`` / ``from_pretrained`` (a checkpoint's ``generation_config.json``),
    or derive one with ``replace(**changes)``. Every value is checked on construction; a bad one raises
    ``ConfigError`` naming the field and the value.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # tokens to generate; rounded up to whole canvases, never truncated
    max_length: int | None = None  # total length bound (prompt, cache included, + new); takes over only while
    #                                max_new_tokens is 256, and once set also stops when the output reaches it
    max_denoising_steps: int = 48  # N: most denoising steps per canvas; also the schedule's denominator
    entropy_bound: float = 0.1  # β of the acceptance rule (JSON: sampler_config.entropy_bound)
    t_min: float | None = 0.4  # temperature of the (never reached) step 0; None with t_max: no schedule
    t_max: float | None = 0.8  # temperature of the first step; must exceed t_min
    stability_threshold: int | None = 1  # s: the draft must repeat over s+1 steps (0: no stability needed);
    #                                      None (or confidence None): no adaptive stopping, always N steps
    confidence_threshold: float | None = 0.005  # γ: stop needs mean entropy < γ (nats, strict)
    eos_token_id: tuple[int, ...] = ()  # ids that end a row (an int or a list is accepted); () = none
    pad_token_id: int | None = None  # id written after EOS; None disables every pad rewrite

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens, minimum=1))
        set_("max_length", _integer("max_length", self.max_length, minimum=1, optional=True))
        set_("max_denoising_steps", _integer("max_denoising_steps", self.max_denoising_steps, minimum=1))
        set_("entropy_bound", _real("entropy_bound", self.entropy_bound, positive=True))
        set_("t_min", _real("t_min", self.t_min, positive=False, optional=True))
        set_("t_max", _real("t_max", self.t_max, positive=False, optional=True))
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            raise ConfigError(f"t_max ({self.t_max!r}) must be greater than t_min ({self.t_min!r})")
        set_("stability_threshold", _integer("stability_threshold", self.stability_threshold, minimum=0,
                                             optional=True))
        set_("confidence_threshold", _real("confidence_threshold", self.confidence_threshold, positive=True,
                                           optional=True))
        set_("eos_token_id", _token_ids("eos_token_id", self.eos_token_id))
        set_("pad_token_id", _integer("pad_token_id", self.pad_token_id, minimum=0, optional=True))

    # -------------------------------------------------------------------------------------------- derived
    @property
    def uses_temperature(self) -> bool:
        """True when the linear temperature schedule applies (transformers needs both t_min and t_max)."""
        return self.t_min is not None and self.t_max is not None

    @property
    def uses_adaptive_stopping(self) -> bool:
        """True when the stable-and-confident rule exists (both thresholds set), enabling early exit."""
        return self.stability_threshold is not None and self.confidence_threshold is not None

    def replace(self, **changes: Any) -> "GenerationConfig":
        """A copy with some fields changed (validated). Raises ``ConfigError`` for an unknown field."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"unknown generation setting(s) {unknown}; known: {sorted(names)}")
        return dataclasses.replace(self, **changes)

    # -------------------------------------------------------------------------------------------- files
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GenerationConfig":
        """Read transformers' ``generation_config.json`` layout.

        The entropy bound lives in ``sampler_config = {"_cls_name": "EntropyBoundSamplerConfig",
        "entropy_bound": ...}``. A null value means "not set", so the default applies (transformers fills
        unset fields from its global defaults). Keys transformers accepts but the reference does not need
        (``return_dict_in_generate``, ``bos_token_id``, metadata...) are ignored; ``cache_implementation``
        must be absent, null or "dynamic" (other caches change the numbers; SPEC §8.5). Any other key raises
        ``ConfigError``, as transformers does.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a generation config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"entropy_bound"}
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
        return cls(**values)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read ``generation_config.json`` from a checkpoint directory (or that file itself).

        Raises ``FileNotFoundError`` when the file is missing and ``ConfigError`` for invalid JSON or values.
        """
        file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else os.fspath(path)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no generation config at {file!r}")
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{file!r} is not valid JSON: {error}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The transformers ``generation_config.json`` layout (``from_dict`` reads it back unchanged)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "max_denoising_steps": self.max_denoising_steps,
            "sampler_config": {"_cls_name": SAMPLER_CLASS_NAME, "entropy_bound": self.entropy_bound},
            "t_min": self.t_min,
            "t_max": self.t_max,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "eos_token_id": list(self.eos_token_id) if self.eos_token_id else None,
            "pad_token_id": self.pad_token_id,
        }
        if self.max_length is not None:
            out["max_length"] = self.max_length
        return out


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


def _integer(name: str, value: Any, minimum: int, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _real(name: str, value: Any, positive: bool, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, np.ndarray)):
        raise ConfigError(f"{name} must be an integer or a list of integers, got {value!r}")
    return tuple(_integer(name, item, minimum=0) for item in items)
