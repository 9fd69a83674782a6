"""diffusiongemma: the executable specification of Google's DiffusionGemma.

Subpackages:
    diffusiongemma.reference          pure-NumPy definition of the model and the sampler
    diffusiongemma.fast               compiled paths with the same interfaces (Cython CPU, CuPy GPU)
    diffusiongemma.weights_converter  transformers checkpoints -> the project's weight format
"""

__version__ = "0.1.0"
