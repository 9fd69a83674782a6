"""The pure-NumPy reference implementation of DiffusionGemma: the project's specification.

Read it top to bottom, as one canvas travels (docs/SPEC.md is the map and the math):

    config             the model's settings, with the upstream config field names      SPEC §2.1
    weights            every tensor's name and shape                                    §5
    primitives         RMSNorm, RoPE, GELU, soft-cap, embeddings                        §3
    masks              which key each query sees: encoder, decoder, training             §6.1, §7.3
    cache              the encoder's KV cache                                           §6.2
    layers             attention, dense MLP, router and experts of one block            §4
    model              the causal encoder (prefill) and the bidirectional decoder       §6, §7
    sampling           the stages of one denoising step, as functions                   §8.6-§8.8
    step               one denoising step on one screen, no hooks (the reading path)     §0.9, §8.2
    draws              the random-draw contract                                         §8.3
    generation_config  ``GenerationConfig``                                             §2.2
    stages             the loop's stages as objects, and ``Semantics`` (one per stage)  §8.6, §11
    generate           the one block-diffusion loop, and the reference's denoising step §8.1, §8.2
    noising            the forward (noising) process and the training loss              §15

Beside the specification:

    support/           the rails that keep a run honest but compute nothing: input checks, logit checks,
                       non-finite diagnosis, config and checkpoint I/O, record/replay, the observer
    variants/          the other implementations' stage choices (``generate(semantics="jax")``)  §11
"""

if __name__ != "diffusiongemma.reference":  # e.g. ``import reference`` from the repository root
    raise ImportError(f"this package is diffusiongemma.reference; import it under that name (it was imported as "
                      f"{__name__!r}, which would make a second copy of every class). Install the project with "
                      "`pip install -e .` and run from any folder but the one that contains the clone")

from .config import ModelConfig, RopeParameters
from .draws import DrawSource, SeededDraws
from .generate import CanvasInfo, GenerationCallback, GenerationConfig, GenerationResult, StepInfo, generate
from .model import Model
from .stages import Semantics
from .support.errors import CheckpointError, ConfigError, InputError, SamplingError
from .support.replay import RecordingDraws, ReplayDraws, ReplayError
from . import variants  # registers the peers' stage choices and named semantics (``stages.SEMANTICS``)

__all__ = ["ModelConfig", "RopeParameters", "DrawSource", "RecordingDraws", "ReplayDraws", "ReplayError",
           "SeededDraws", "CheckpointError", "ConfigError", "InputError", "SamplingError", "CanvasInfo",
           "GenerationCallback", "GenerationConfig", "GenerationResult", "StepInfo", "generate", "Model",
           "Semantics", "variants"]
