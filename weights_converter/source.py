"""Reading a transformers checkpoint directory one tensor at a time.

A transformers checkpoint (``save_pretrained``) is ``config.json`` plus either one
``model.safetensors`` or several shards listed in ``model.safetensors.index.json``
(``{"weight_map": {tensor: file}}``). As in transformers, a single ``model.safetensors`` is
preferred when both are present.

Memory: ``TransformersCheckpoint.open`` reads only the safetensors headers (names, shapes,
dtypes). ``read`` opens the file afresh for every tensor: safetensors memory-maps the whole file,
and the pages a read touches stay in the process's resident set while the file is open, so
keeping a 5 GB shard open while walking its tensors would make the peak the shard, not the tensor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401  (registers the "bfloat16" numpy dtype that safetensors returns)
import numpy as np
from safetensors import SafetensorError, safe_open

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.support.config_io import load_json_object
from diffusiongemma.reference.support.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tag -> bytes per element, for the dtypes a DiffusionGemma checkpoint may use.
SUPPORTED_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor lives and what its header says (no data)."""

    name: str  # the transformers key, e.g. "model.decoder.layers.0.self_attn.q_proj.weight"
    path: str  # the safetensors file that holds it
    shape: tuple[int, ...]
    dtype: str  # safetensors tag: "F32", "BF16" or "F16"

    @property
    def nbytes(self) -> int:
        """Size of the stored data in bytes."""
        return math.prod(self.shape) * SUPPORTED_DTYPES[self.dtype]


@dataclass(frozen=True)
class TransformersCheckpoint:
    """The header-level view of a transformers DiffusionGemma checkpoint directory."""

    path: str  # the directory
    config: ModelConfig  # parsed and validated from config.json
    raw_config: dict[str, Any]  # config.json as written
    files: tuple[str, ...]  # safetensors file names (relative to ``path``) in index order
    tensors: dict[str, SourceTensor]  # every tensor in those files, by transformers key

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TransformersCheckpoint":
        """Read ``config.json`` and every safetensors header under ``path``.

        Raises ``CheckpointError`` when the directory, the config file or a weight file is
        missing, a file is unreadable or truncated, the shard index disagrees with the files, a
        name appears twice, or a tensor has a dtype other than F32/BF16/F16; ``ConfigError`` when
        ``config.json`` is not a valid DiffusionGemma config (see ``ModelConfig.from_transformers``).
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory (expected a transformers checkpoint directory)")
        raw_config, config = _read_config(path)
        files = _weight_files(path)
        tensors: dict[str, SourceTensor] = {}
        for filename, listed in files.items():
            scanned = _scan_header(os.path.join(path, filename))
            for tensor in scanned:
                if tensor.name in tensors:
                    raise CheckpointError(f"tensor {tensor.name!r} appears twice: in "
                                          f"{os.path.basename(tensors[tensor.name].path)} and {filename}")
                if listed is not None and tensor.name not in listed:
                    raise CheckpointError(f"{filename}: holds tensor {tensor.name!r}, which {INDEX_FILE} "
                                          "does not list for this file")
                tensors[tensor.name] = tensor
            if listed is not None:
                absent = sorted(listed - {t.name for t in scanned})
                if absent:
                    raise CheckpointError(f"{INDEX_FILE} lists tensor {absent[0]!r} in {filename}, "
                                          f"but the file does not hold it ({len(absent)} such tensor(s))")
        return cls(path=path, config=config, raw_config=raw_config, files=tuple(files), tensors=tensors)

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` as stored: float32, bfloat16 (ml_dtypes) or float16, C-contiguous.

        Opens the file for this one read (see the module docstring). Raises ``CheckpointError``
        when the file cannot be read or the stored tensor disagrees with its header.
        """
        tensor = self.tensors[name]
        try:
            with safe_open(tensor.path, framework="numpy") as f:
                array = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{tensor.path}: cannot read tensor {name!r} ({exc})") from exc
        if tuple(array.shape) != tensor.shape:
            raise CheckpointError(f"{tensor.path}: tensor {name!r} read with shape {tuple(array.shape)}, "
                                  f"header says {tensor.shape}")
        return np.ascontiguousarray(array)


def _read_config(path: str) -> tuple[dict[str, Any], ModelConfig]:
    """Parse ``config.json``; errors name the file and the offending field."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path}: {CONFIG_FILE} is missing (not a transformers checkpoint directory)")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = load_json_object(f, config_path)  # a key given twice: refused by name
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") == "diffusiongemma":
        raise CheckpointError(f"{path}: already in the diffusiongemma format; nothing to convert")
    try:
        config = ModelConfig.from_transformers(raw)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from exc
    except (TypeError, ValueError) as exc:  # e.g. a field of the wrong JSON type
        raise ConfigError(f"{config_path}: invalid value ({exc})") from exc
    return raw, config  # (ModelConfig also refuses untied embeddings)


def _weight_files(path: str) -> dict[str, set[str] | None]:
    """Weight file name -> the tensor names the index lists for it (``None``: no index)."""
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return {SINGLE_FILE: None}
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        found = [n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if os.path.exists(os.path.join(path, n))]
        hint = f" (found {found[0]}: only safetensors checkpoints are supported)" if found else ""
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} is present{hint}")
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path}: not a valid shard index ({exc})") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: 'weight_map' (tensor name -> file) is missing or empty")
    files: dict[str, set[str]] = {}
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or os.path.basename(filename) != filename:
            raise CheckpointError(f"{index_path}: tensor {name!r} maps to {filename!r}, not a file name")
        files.setdefault(filename, set()).add(name)
    for filename in files:
        if not os.path.isfile(os.path.join(path, filename)):
            raise CheckpointError(f"{path}: shard {filename} listed in {INDEX_FILE} is missing")
    return files


def _scan_header(file_path: str) -> list[SourceTensor]:
    """Names, shapes and dtypes of the tensors in one safetensors file (reads the header only)."""
    try:
        with safe_open(file_path, framework="numpy") as f:
            entries = []
            for name in f.keys():
                view = f.get_slice(name)
                entries.append((name, tuple(view.get_shape()), view.get_dtype()))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file_path}: unreadable or truncated safetensors file ({exc})") from exc
    tensors = []
    for name, shape, dtype in entries:
        if dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{file_path}: tensor {name!r} has dtype {dtype}; expected one of "
                                  f"{sorted(SUPPORTED_DTYPES)}")
        tensors.append(SourceTensor(name=name, path=file_path, shape=shape, dtype=dtype))
    return tensors
