"""The pure-NumPy reference implementation of DiffusionGemma (the project's specification).

Read it top to bottom: ``config`` -> ``weights`` -> ``primitives`` -> ``masks`` -> ``cache`` -> ``layers`` ->
``model`` (encoder and decoder) -> ``sampling`` -> ``draws`` -> ``generate`` (the block-diffusion loop), and
``noising`` (the forward process and training loss).
"""

from .config import ModelConfig, RopeParameters
from .draws import DrawSource, RecordingDraws, ReplayDraws, ReplayError, SeededDraws
from .errors import CheckpointError, ConfigError, InputError, SamplingError
from .generate import CanvasInfo, GenerationCallback, GenerationConfig, GenerationResult, StepInfo, generate
from .model import Model

__all__ = ["ModelConfig", "RopeParameters", "DrawSource", "RecordingDraws", "ReplayDraws", "ReplayError",
           "SeededDraws", "CheckpointError", "ConfigError", "InputError", "SamplingError", "CanvasInfo",
           "GenerationCallback", "GenerationConfig", "GenerationResult", "StepInfo", "generate", "Model"]
