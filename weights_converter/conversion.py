"""Convert a transformers DiffusionGemma checkpoint to the project's format.

Two entry points share one plan:

* ``convert(src, dst, dtype, shard_size)`` writes a converted checkpoint directory (streaming:
  one source tensor in memory at a time, plus the output shard being filled);
* ``load_transformers_checkpoint(src)`` returns the same tensors in memory as float32, for
  ``Model.from_pretrained`` on a transformers directory.

The plan (``plan_conversion``) accounts for every tensor of the source before any data is read:
each is used, a tied copy (checked equal to its source while streaming, then dropped), or skipped
on purpose (vision); a missing, unknown or wrongly shaped tensor raises ``CheckpointError``
naming the tensor and both shapes. See ``names.py`` for the name map.

Upstream behaviour reproduced: transformers 5.24.0 loads the same tensors into
``DiffusionGemmaForBlockDiffusion`` (the decoder's text weights are shared with the encoder, the
output projection is the embedding, and the two layer-scalar buffers are separate).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.errors import CheckpointError, InputError
from diffusiongemma.reference.support.checkpoint_io import (BFLOAT16, FORMAT_NAME, FORMAT_VERSION, INDEX_FILE,
                                                            STORAGE_DTYPES, to_float32)
from diffusiongemma.reference.weights import expected_shapes

from .names import TIED_GROUP, hf_name, project_name, skipped_group, tied_source
from .source import CONFIG_FILE, SourceTensor, TransformersCheckpoint
from .summary import DEFAULT_SHARD_SIZE, ConversionSummary
from .writer import ShardWriter, atomic_directory, check_destination, check_free_space, to_storage, write_error


# Files copied next to the weights when the source has them (source name -> destination name).
SIDE_FILES = {
    "tokenizer.json": "tokenizer.json",
    "tokenizer_config.json": "tokenizer_config.json",
    "special_tokens_map.json": "special_tokens_map.json",
    "chat_template.jinja": "chat_template.jinja",
    "chat_template.json": "chat_template.json",
    "generation_config.json": "generation_config.json",
    CONFIG_FILE: "transformers_config.json",
}


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ConversionPlan:
    """What to read for each project tensor, decided from headers alone."""

    checkpoint: TransformersCheckpoint
    sources: dict[str, SourceTensor]  # project name -> source tensor, in expected_shapes (file) order
    tied_copies: dict[str, list[SourceTensor]]  # HF key of a used tensor -> its tied copies in the file
    skipped: dict[str, int]  # summary group -> number of tensors skipped on purpose (tied copies included)


def plan_conversion(checkpoint: TransformersCheckpoint) -> ConversionPlan:
    """Classify every tensor of ``checkpoint`` and check names and shapes against its config.

    Raises ``CheckpointError`` naming the transformers key (and the project name and both shapes
    where they apply) for an unknown tensor, a missing tensor (the encoder layer scalars
    included), a wrongly shaped tensor, or a tied copy whose source is absent or shaped
    differently.
    """
    config = checkpoint.config
    expected = expected_shapes(config)
    sources: dict[str, SourceTensor] = {}
    tied: dict[str, list[SourceTensor]] = {}
    skipped: Counter[str] = Counter()
    unknown: list[str] = []
    for key, tensor in checkpoint.tensors.items():
        group = skipped_group(key)
        if group is not None:
            skipped[group] += 1
            continue
        source_key = tied_source(key)
        if source_key is not None:
            tied.setdefault(source_key, []).append(tensor)
            continue
        name = project_name(key)
        if name is None or name not in expected:
            unknown.append(key)
            continue
        if tensor.shape != expected[name]:
            raise CheckpointError(f"tensor {key!r} ({name}) has shape {tensor.shape}, but config.json "
                                  f"implies {expected[name]}")
        sources[name] = tensor
    if unknown:
        raise CheckpointError(_describe_unknown(sorted(unknown), config))
    missing = [name for name in expected if name not in sources]
    if missing:
        more = f" and {len(missing) - 1} more: {[hf_name(n) for n in missing[1:6]]}" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {hf_name(missing[0])!r} ({missing[0]}, expected shape "
                              f"{expected[missing[0]]}){more}")
    used_keys = {tensor.name: tensor for tensor in sources.values()}
    for source_key, copies in tied.items():
        for copy in copies:
            if source_key not in used_keys:
                raise CheckpointError(f"tensor {copy.name!r} is a tied copy of {source_key!r}, which this "
                                      "checkpoint does not hold for this config")
            if copy.shape != used_keys[source_key].shape:
                raise CheckpointError(f"tied tensor {copy.name!r} has shape {copy.shape}, but its source "
                                      f"{source_key!r} has shape {used_keys[source_key].shape}")
        skipped[TIED_GROUP] += len(copies)
    ordered = {name: sources[name] for name in expected}
    return ConversionPlan(checkpoint=checkpoint, sources=ordered, tied_copies=tied, skipped=dict(skipped))


def _describe_unknown(keys: list[str], config: ModelConfig) -> str:
    """An error message for tensors no rule accounts for, with a hint for the common cases."""
    key = keys[0]
    name = project_name(key)
    message = f"unknown tensor {key!r}"
    if name is not None:
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is not None and layer >= config.num_hidden_layers:
            message += f" (layer {layer}, but config.json has num_hidden_layers={config.num_hidden_layers})"
        elif layer is not None and name.endswith(".v_proj"):
            message += f" (layer {layer} is {config.layer_types[layer]}, which has no v_proj: values reuse the keys)"
        else:
            message += f" (would be {name!r}, which this config does not have)"
    else:
        message += " (not part of the DiffusionGemma text model, a tied copy, or the vision tower)"
    if len(keys) > 1:
        message += f"; {len(keys) - 1} more unknown: {keys[1:6]}"
    return message


# ---------------------------------------------------------------------------------------------- stream
def iter_source_tensors(plan: ConversionPlan, progress: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(project name, array as stored in the source)`` in ``plan.sources`` order.

    One tensor is read at a time (plus, briefly, each of its tied copies, which are compared bit
    for bit and raise ``CheckpointError`` if they differ). ``progress`` shows a tqdm bar over the
    tensors read.
    """
    total = len(plan.sources) + sum(len(c) for c in plan.tied_copies.values())
    if progress:
        from tqdm.auto import tqdm  # only for a bar: loading a checkpoint without one skips tqdm's ~80 ms import

        bar = tqdm(total=total, unit="tensor", desc="converting", leave=False)
    else:
        bar = _NoBar()
    try:
        for name, tensor in plan.sources.items():
            array = plan.checkpoint.read(tensor.name)
            for copy in plan.tied_copies.get(tensor.name, ()):
                _check_tied_copy(plan.checkpoint.read(copy.name), array, copy.name, tensor.name)
                bar.update()
            bar.update()
            yield name, array
            del array  # drop this generator's reference before reading the next tensor
    finally:
        bar.close()


class _NoBar:
    """What ``iter_source_tensors`` advances when no bar is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _check_tied_copy(copy: np.ndarray, source: np.ndarray, copy_key: str, source_key: str) -> None:
    """Raise ``CheckpointError`` unless ``copy`` holds exactly the values of ``source``."""
    if copy.dtype == source.dtype:  # compare bit patterns (NaN-safe, +0/-0 distinct)
        uint = np.dtype(f"u{copy.dtype.itemsize}")
        differ = copy.view(uint) != source.view(uint)
    else:
        a, b = to_float32(copy, copy_key), to_float32(source, source_key)
        differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    count = int(np.count_nonzero(differ))
    if count:
        raise CheckpointError(f"tensor {copy_key!r} differs from {source_key!r} in {count} of {copy.size} values; "
                              "transformers ties them, so they must be equal (an untied checkpoint is not supported)")


# ---------------------------------------------------------------------------------------------- convert
def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "float32",
            shard_size: int = DEFAULT_SHARD_SIZE, *, force: bool = False,
            progress: bool = True) -> ConversionSummary:
    """Convert the transformers checkpoint directory ``src`` (or a ``.gguf`` file, see ``gguf.py``) into ``dst``.

    ``dtype`` is the storage dtype ("float32" or "bfloat16", see ``writer.to_storage``);
    ``shard_size`` bounds the tensor bytes per output file; ``force`` allows replacing an existing
    converted checkpoint at ``dst``; ``progress`` shows a tqdm bar over tensors.

    Reads one tensor at a time; peak memory is about the largest tensor (source and output copy)
    plus one output shard. Output is written into a temporary sibling and renamed into place, so
    on any error (``KeyboardInterrupt`` included) no ``dst`` is left behind.

    Raises ``InputError`` (bad ``dtype``/``shard_size``), ``FileExistsError`` /
    ``FileNotFoundError`` (``dst`` exists without ``force``, or its parent is missing),
    ``ConfigError`` (bad ``config.json``) or ``CheckpointError`` (bad, missing, unknown or
    misshapen tensors, differing tied copies, NaN/inf weights, unreadable files), and
    ``writer.WriteError`` (an ``OSError``) naming the file when the disk is full or a file-size limit
    is hit, or up front when the destination's file system has less free space than the output needs;
    the partial output is removed then too. Replacing with ``force`` is atomic (``writer.atomic_directory``).
    """
    if os.path.isfile(src) and os.fspath(src).lower().endswith(".gguf"):  # a llama.cpp file: gguf.py
        from .gguf import convert_gguf

        return convert_gguf(src, dst, dtype, shard_size, force=force, progress=progress)
    if dtype not in STORAGE_DTYPES:
        raise InputError(f"dtype must be one of {STORAGE_DTYPES}, got {dtype!r}")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
        raise InputError(f"shard_size must be a positive number of bytes, got {shard_size!r}")
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if src == dst:
        raise InputError(f"source and destination are the same directory: {src}")
    check_destination(dst, force)  # fail before reading anything
    plan = plan_conversion(TransformersCheckpoint.open(src))
    check_free_space(dst, sum(int(np.prod(t.shape)) for t in plan.sources.values()) * (4 if dtype == "float32" else 2))
    source_bytes: Counter[str] = Counter()
    with atomic_directory(dst, force=force) as tmp:
        writer = ShardWriter(tmp, shard_size)
        for name, array in iter_source_tensors(plan, progress=progress):
            source_bytes[plan.sources[name].dtype] += array.nbytes
            writer.add(name, to_storage(array, dtype, _label(plan, name)))
            del array  # let the source copy go before the next read
        weight_map = writer.close()
        copied = _copy_side_files(src, tmp)
        parameter_count = sum(int(np.prod(t.shape)) for t in plan.sources.values())
        index = _index(plan, dtype, weight_map, parameter_count)
        index["file_digests"] = dict(writer.digests)  # lets readers detect files of another conversion
        index_path = os.path.join(tmp, INDEX_FILE)
        try:
            with open(index_path, "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
        except OSError as exc:
            raise write_error(index_path, exc) from exc
    itemsize = 4 if dtype == "float32" else 2
    return ConversionSummary(source=src, destination=dst, dtype=dtype, num_tensors=len(weight_map),
                             parameter_count=parameter_count, source_bytes=dict(source_bytes),
                             output_bytes={dtype: parameter_count * itemsize}, skipped=dict(plan.skipped),
                             files=tuple(writer.files), copied=tuple(copied))


def _label(plan: ConversionPlan, name: str) -> str:
    """How errors name a tensor: its transformers key, then the project name."""
    return f"{plan.sources[name].name} ({name})"


def _copy_side_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer, chat template, generation config and config.json when present."""
    copied = []
    for source_name, dest_name in SIDE_FILES.items():
        path = os.path.join(src, source_name)
        if os.path.isfile(path):
            try:
                shutil.copyfile(path, os.path.join(dst, dest_name))
            except OSError as exc:
                raise write_error(os.path.join(dst, dest_name), exc) from exc
            copied.append(dest_name)
    return copied


def _index(plan: ConversionPlan, dtype: str, weight_map: dict[str, str], parameter_count: int) -> dict:
    """The ``diffusiongemma.json`` document (read back by ``reference.weights.read_index``)."""
    from diffusiongemma import __version__

    raw = plan.checkpoint.raw_config
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "parameter_count": parameter_count,
        "model_config": plan.checkpoint.config.to_dict(),
        "source": {
            "format": "transformers",
            "path": plan.checkpoint.path,
            "model_type": raw.get("model_type"),
            "architectures": raw.get("architectures"),
            "transformers_version": raw.get("transformers_version"),
            "files": list(plan.checkpoint.files),
            "dtypes": dict(Counter(t.dtype for t in plan.sources.values())),
            "skipped": dict(plan.skipped),
        },
        "converter": {"name": "diffusiongemma.weights_converter", "version": __version__},
        "weight_map": weight_map,
    }


def load_transformers_checkpoint(src: str | os.PathLike, progress: bool = False,
                                 keep_bf16: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a transformers checkpoint directory into the project's names, in memory.

    Returns ``(config, tensors)``: ``tensors`` maps every name of ``expected_shapes(config)`` to a
    C-contiguous float32 array of that shape (bfloat16/float16 sources widened exactly; with
    ``keep_bf16`` a bfloat16 source stays bfloat16, as stored). Same checks and errors as ``convert``
    (``ConfigError``, ``CheckpointError``), without writing.
    """
    plan = plan_conversion(TransformersCheckpoint.open(src))
    tensors = {name: to_storage(array, "bfloat16" if keep_bf16 and array.dtype == BFLOAT16 else "float32",
                                _label(plan, name))
               for name, array in iter_source_tensors(plan, progress)}
    return plan.checkpoint.config, tensors


def open_transformers_checkpoint(src: str | os.PathLike) -> tuple[ModelConfig, "WeightStore"]:
    """``(config, WeightStore)`` of a transformers checkpoint directory: its safetensors files mapped, nothing
    read but headers (``reference.support.weight_store``). Same plan and errors as
    ``load_transformers_checkpoint`` (names, shapes, dtypes, tied copies present); each tensor's values are
    checked finite, and each tied copy equal to its source, the first time the tensor is read."""
    from diffusiongemma.reference.support.weight_store import (MappedFile, StoredTensor, WeightStore,
                                                               safetensors_header, safetensors_tensor)

    plan = plan_conversion(TransformersCheckpoint.open(src))
    files: dict[str, tuple] = {}

    def stored(tensor: SourceTensor) -> StoredTensor:
        if tensor.path not in files:
            mapped = MappedFile(tensor.path)
            files[tensor.path] = (mapped, safetensors_header(mapped)[0])
        mapped, header = files[tensor.path]
        return safetensors_tensor(mapped, header[tensor.name], f"{tensor.path}: {tensor.name}")

    tensors = {name: stored(tensor) for name, tensor in plan.sources.items()}
    checks = {}
    for name, tensor in plan.sources.items():
        copies = [(copy.name, stored(copy)) for copy in plan.tied_copies.get(tensor.name, ())]
        if copies:
            def tied(source=tensors[name], key=tensor.name, copies=copies):
                for copy_key, copy in copies:
                    for (_, a), (_, b) in zip(copy.chunks(), source.chunks()):
                        _check_tied_copy(np.asarray(a), np.asarray(b), copy_key, key)
            checks[name] = tied
    return plan.checkpoint.config, WeightStore(tensors, [f for f, _ in files.values()], plan.checkpoint.path, checks)
