"""Settings of a generation run: ``GenerationConfig``, with transformers' names, defaults and file layout.

``GenerationConfig`` mirrors transformers 5.24.0 ``DiffusionGemmaGenerationConfig`` for the text path (SPEC
§8): the token budget, the denoising-step count and temperature schedule, the entropy bound of the sampler,
the stable-and-confident stopping rule, and the EOS/pad ids. Its fields are checked when it is built
(``support/config_checks.py``); ``generation_config.json`` is read by ``support/config_io.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .support import config_io
from .support.config_checks import check_integer, check_real, check_token_id_list
from .support.errors import ConfigError

__all__ = ["GenerationConfig", "DEFAULT_MAX_NEW_TOKENS", "SAMPLER_CLASS_NAME"]

DEFAULT_MAX_NEW_TOKENS = 256  # transformers lets max_length take over only while max_new_tokens has this value
SAMPLER_CLASS_NAME = config_io.SAMPLER_CLASS_NAME  # "EntropyBoundSamplerConfig", the only sampler transformers knows


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
        set_("max_new_tokens", check_integer("max_new_tokens", self.max_new_tokens, minimum=1))
        set_("max_length", check_integer("max_length", self.max_length, minimum=1, optional=True))
        set_("max_denoising_steps", check_integer("max_denoising_steps", self.max_denoising_steps, minimum=1))
        set_("entropy_bound", check_real("entropy_bound", self.entropy_bound, positive=True))
        set_("t_min", check_real("t_min", self.t_min, positive=False, optional=True))
        set_("t_max", check_real("t_max", self.t_max, positive=False, optional=True))
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            raise ConfigError(f"t_max ({self.t_max!r}) must be greater than t_min ({self.t_min!r})")
        set_("stability_threshold", check_integer("stability_threshold", self.stability_threshold, minimum=0,
                                             optional=True))
        if self.stability_threshold is not None and self.stability_threshold > self.max_denoising_steps:
            # a draft can repeat over at most N steps of a canvas, so a larger s never stops early: s = N says
            # the same, and the rule keeps s drafts (s * batch * canvas int64s), so a huge s would fill memory
            raise ConfigError(f"stability_threshold must be at most max_denoising_steps={self.max_denoising_steps} "
                              f"(a draft cannot repeat over more steps than a canvas has), "
                              f"got {self.stability_threshold}")
        set_("confidence_threshold", check_real("confidence_threshold", self.confidence_threshold, positive=True,
                                           optional=True))
        set_("eos_token_id", check_token_id_list("eos_token_id", self.eos_token_id))
        set_("pad_token_id", check_integer("pad_token_id", self.pad_token_id, minimum=0, optional=True))

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
        """Read transformers' ``generation_config.json`` layout (``support/config_io.generation_config_fields``
        says which keys are read, ignored or refused). Raises ``ConfigError`` naming the key."""
        return cls(**config_io.generation_config_fields(data, [f.name for f in dataclasses.fields(cls)]))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read ``generation_config.json`` from a checkpoint directory (or that file itself).

        Raises ``FileNotFoundError`` when the file is missing and ``ConfigError`` for invalid JSON or values
        (naming the file).
        """
        data = config_io.read_generation_config_json(path)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else os.fspath(path)
            raise ConfigError(f"{file}: {exc}") from None

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


