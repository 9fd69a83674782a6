"""Convert transformers DiffusionGemma checkpoints to the project's weight format.

    convert(src, dst, dtype="float32", shard_size=...) -> ConversionSummary   (also: diffusiongemma-convert)
    load_transformers_checkpoint(src) -> (ModelConfig, {name: float32 array})

Modules: ``names`` (the HF <-> project name map), ``source`` (reading a transformers directory
tensor by tensor), ``writer`` (storage casts, shards, atomic output), ``conversion`` (the plan that
accounts for every tensor, and the two entry points), ``cli`` (argparse front end).
"""

if __name__ != "diffusiongemma.weights_converter":  # e.g. ``import weights_converter`` from the repository root
    raise ImportError(f"this package is diffusiongemma.weights_converter; import it under that name (it was imported as "
                      f"{__name__!r}, which would make a second copy of every class)")


import os

_LAZY = ("DEFAULT_SHARD_SIZE", "ConversionSummary", "convert", "load_transformers_checkpoint")


def __getattr__(name: str):
    # the conversion module (NumPy, the reference) is imported on first use, so that the command line's start-up
    # stays light and a Ctrl-C during it is handled by ``cli.main``
    if name in _LAZY:
        from . import conversion

        return getattr(conversion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_transformers_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _is_gguf_file(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def _read_gguf(path: str, keep_quantized: bool = False, keep_bf16: bool = False, mapped: bool = False):
    # imports the gguf package only when a GGUF file is read
    if mapped:  # the weight store over the file's mapping (reference.support.weight_store)
        from .gguf import open_gguf_checkpoint

        return open_gguf_checkpoint(path)
    from .gguf import load_gguf_checkpoint

    return load_gguf_checkpoint(path, keep_quantized=keep_quantized, keep_bf16=keep_bf16)


def _read_transformers(path: str, keep_quantized: bool = False, keep_bf16: bool = False, mapped: bool = False):
    # safetensors here hold no quantized type; bfloat16 ones stay bfloat16 with keep_bf16
    if mapped:
        from .conversion import open_transformers_checkpoint

        return open_transformers_checkpoint(path)
    from .conversion import load_transformers_checkpoint

    return load_transformers_checkpoint(path, keep_bf16=keep_bf16)


# The formats ``reference.weights.load_checkpoint`` reads through the converter: (name, matches, read),
# read(path, keep_quantized=False, keep_bf16=False),
# declared as entry points of the group ``diffusiongemma.checkpoint_readers`` in setup.py.
TRANSFORMERS_READER = ("a transformers checkpoint directory (config.json + safetensors)", _is_transformers_dir,
                       _read_transformers)
GGUF_READER = ("a llama.cpp GGUF file (architecture diffusion-gemma)", _is_gguf_file, _read_gguf)

__all__ = ["DEFAULT_SHARD_SIZE", "ConversionSummary", "convert", "load_transformers_checkpoint"]
