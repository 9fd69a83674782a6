"""The pure-NumPy reference implementation of DiffusionGemma (the project's specification)."""

from .config import ModelConfig, RopeParameters
from .errors import CheckpointError, ConfigError, InputError, SamplingError
