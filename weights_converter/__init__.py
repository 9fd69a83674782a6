"""Convert transformers DiffusionGemma checkpoints to the project's weight format.

    convert(src, dst, dtype="float32", shard_size=...) -> ConversionSummary   (also: diffusiongemma-convert)
    load_transformers_checkpoint(src) -> (ModelConfig, {name: float32 array})

Modules: ``names`` (the HF <-> project name map), ``source`` (reading a transformers directory
tensor by tensor), ``writer`` (storage casts, shards, atomic output), ``conversion`` (the plan that
accounts for every tensor, and the two entry points), ``cli`` (argparse front end).
"""

from .conversion import DEFAULT_SHARD_SIZE, ConversionSummary, convert, load_transformers_checkpoint

__all__ = ["DEFAULT_SHARD_SIZE", "ConversionSummary", "convert", "load_transformers_checkpoint"]
