"""The tests' name for the NumPy half of the package's tiny-model factory (``diffusiongemma.tiny``):
random weights with SPEC §14's perturbations, no transformers needed."""

from diffusiongemma.tiny import make_config, random_tensors  # noqa: F401

__all__ = ["random_tensors", "make_config"]
