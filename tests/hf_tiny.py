"""The tests' name for the package's tiny-model factory (``diffusiongemma.tiny``: SPEC §14's config and
its perturbations); kept so that ``from tests.hf_tiny import ...`` reads as before."""

from diffusiongemma.tiny import (FULL, SLIDING, TinySpec, hf_config, randomise_, save_tiny,  # noqa: F401
                                 tiny_model, write_checkpoint)
