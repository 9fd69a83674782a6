"""The pure-NumPy reference implementation of DiffusionGemma (the project's specification).

Read it top to bottom, as one canvas travels (docs/SPEC.md is the map and the math):

    config             the model's settings, with the upstream config field names (SPEC §1)
    weights            the project's tensor names and shapes, reading a converted checkpoint (§10)
    primitives         RMSNorm, RoPE, GELU, soft-cap, embeddings (§2)
    masks              which key each query sees: encoder, decoder, training (§6-§7)
    cache              the encoder's KV cache (§6)
    layers             attention, dense MLP, router and experts of one block (§3-§5)
    model              the causal encoder (prefill) and the bidirectional decoder with self-conditioning (§6-§7)
    sampling           the stages of one denoising step: temperature, entropy, draws, acceptance, renoise,
                       stopping, commit (§8)
    draws              the random-draw contract (seeded, recorded, replayed) (§9)
    generation_config  ``GenerationConfig`` (§8.1)
    observer           callbacks and the observer points a run reports to
    generate           the one block-diffusion loop, and the reference's denoising step (§8)
    semantics          the documented differences of other implementations, as selectable variants (§11)
    noising            the forward (noising) process and the training loss (TRAINING.md)
"""

from .config import ModelConfig, RopeParameters
from .draws import DrawSource, RecordingDraws, ReplayDraws, ReplayError, SeededDraws
from .errors import CheckpointError, ConfigError, InputError, SamplingError
from .generate import CanvasInfo, GenerationCallback, GenerationConfig, GenerationResult, StepInfo, generate
from .model import Model

__all__ = ["ModelConfig", "RopeParameters", "DrawSource", "RecordingDraws", "ReplayDraws", "ReplayError",
           "SeededDraws", "CheckpointError", "ConfigError", "InputError", "SamplingError", "CanvasInfo",
           "GenerationCallback", "GenerationConfig", "GenerationResult", "StepInfo", "generate", "Model"]
