"""diffusiongemma: the executable specification of Google's DiffusionGemma.

Subpackages (folder in the repository -> import path):
    reference/                 diffusiongemma.reference          the pure-NumPy definition of model and sampler
    fast/                      diffusiongemma.fast               compiled paths with the same interfaces
    fast/gpu/                  diffusiongemma.fast.gpu           CuPy + CUDA kernels for NVIDIA GPUs
    weights_converter/         diffusiongemma.weights_converter  transformers / GGUF checkpoints -> the project's format
    diffusiongemma/trace/      diffusiongemma.trace              golden traces: record, store, compare
    diffusiongemma/cli/        diffusiongemma.cli                the ``diffusiongemma`` command
Modules of the root: ``checkpoint`` (checkpoint directories, tokenizer, chat template, the shipped model in
``assets/``), ``threads`` (BLAS and OpenMP sized to the free cores, applied when the package is imported),
``torch_replay`` (torch's CPU generator replayed in NumPy, for the tests).
"""

__version__ = "0.1.0"

from . import threads as _threads

_threads.configure()  # BLAS and OpenMP on the free cores, passive waits; a user's OMP_NUM_THREADS etc. wins (threads.py)
