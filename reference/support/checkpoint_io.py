"""Reading checkpoints: the project's converted format, and the registry of other formats' readers.

A converted checkpoint is a directory::

    diffusiongemma.json        format marker, version, storage dtype, ModelConfig, tensor -> file index
    weights-00001.safetensors  tensors under the names of ``reference/weights.py`` (float32 or bfloat16),
                               one or more files
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json  (copied if present)

Reading widens bfloat16 to float32 exactly (the bf16 bit pattern is the top half of a float32). Every
tensor is checked against ``weights.expected_shapes`` and for finiteness before any backend uses it.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype used by safetensors)
import numpy as np
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from ..weights import LAYER_TENSORS, expected_shapes
from .quantized import Q8_0Tensor
from .errors import CheckpointError, ConfigError
from .weight_store import (MappedFile, StoredTensor, WeightStore, check_finite, safetensors_header,  # noqa: F401
                           safetensors_tensor)

FORMAT_NAME = "diffusiongemma"
FORMAT_VERSION = 1
INDEX_FILE = "diffusiongemma.json"
STORAGE_DTYPES = ("float32", "bfloat16")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

def to_float32(array: np.ndarray, name: str = "tensor") -> np.ndarray:
    """Widen a float32/bfloat16/float16 array to float32 (exact for all three)."""
    if array.dtype == np.float32:
        return array
    if array.dtype in (BFLOAT16, np.float16):
        return array.astype(np.float32)
    raise CheckpointError(f"{name}: unsupported dtype {array.dtype} (expected float32, bfloat16 or float16)")


def check_tensors(tensors: Mapping[str, np.ndarray], config: ModelConfig, finite: bool = True) -> None:
    """Raise ``CheckpointError`` unless ``tensors`` holds exactly the expected names and shapes.

    With ``finite`` (the default; every ``Model`` constructor uses it) every tensor must also hold only
    finite values (``check_finite``), so that no backend ever runs on NaN or infinite weights. A
    ``weight_store.WeightStore`` checks its own tensors' values, each the first time it is read
    (``WeightStore.checked``), so here only its names and shapes are checked.
    """
    expected = expected_shapes(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"(expected shape {expected[missing[0]]} for {missing[0]!r})")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise CheckpointError(f"unknown tensor(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape) if isinstance(tensors[name], Q8_0Tensor) else tuple(np.shape(tensors[name]))
        if got != shape:
            raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape}")
    if finite and not isinstance(tensors, WeightStore):
        for name in expected:
            check_finite(tensors[name], name, "refusing to run on it")


def is_converted_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory in the project's format."""
    return os.path.isfile(os.path.join(path, INDEX_FILE))


def read_index(path: str | os.PathLike, name: str | os.PathLike | None = None) -> dict:
    """Parse and validate ``diffusiongemma.json`` of a converted checkpoint directory.

    ``path`` names the directory in messages; ``name`` (default: the same) is where it is read from
    (``load_converted`` reads through a pinned directory handle). Raises ``CheckpointError`` naming the
    file and the field: not UTF-8 JSON, not an object, wrong format or version, unknown dtype, no
    ``model_config`` object, no ``weight_map`` object, a ``weight_map`` value that is not a plain file name,
    ``file_digests`` that is not an object of strings.
    """
    index_path = os.path.join(path, INDEX_FILE)
    try:
        with open(os.path.join(path if name is None else name, INDEX_FILE), encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        if name is not None and os.fspath(name) != os.fspath(path) and os.path.isfile(index_path):
            # read through a handle of a directory that a replace has since moved aside and is deleting
            raise CheckpointChanged(f"{path}: a replace is in progress (the checkpoint was replaced while it was "
                                    "being read); read it again") from None
        raise CheckpointError(f"{path}: not a converted diffusiongemma checkpoint ({INDEX_FILE} is missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_path}: not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(index, dict):
        raise CheckpointError(f"{index_path}: expected a JSON object, got {type(index).__name__}")
    if index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{index_path}: 'format' must be {FORMAT_NAME!r}, got {index.get('format')!r}")
    if index.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{index_path}: format_version {index.get('format_version')!r} is not supported "
                              f"(this version reads {FORMAT_VERSION})")
    if index.get("dtype") not in STORAGE_DTYPES:
        raise CheckpointError(f"{index_path}: dtype must be one of {STORAGE_DTYPES}, got {index.get('dtype')!r}")
    if not isinstance(index.get("model_config"), dict):
        raise CheckpointError(f"{index_path}: 'model_config' (the ModelConfig object) is missing or not an "
                              f"object, got {type(index.get('model_config')).__name__}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: 'weight_map' (tensor name -> file) is missing or not an object")
    for tensor, filename in weight_map.items():
        if not isinstance(filename, str) or not filename or os.path.basename(filename) != filename:
            raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] must be a file name in the directory, "
                                  f"got {filename!r}")
    digests = index.get("file_digests", {})
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise CheckpointError(f"{index_path}: 'file_digests' must map file names to digest strings")
    return index


class CheckpointChanged(CheckpointError):
    """The checkpoint directory was replaced while it was being read (a concurrent ``convert --force``)."""


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}  # index dtype -> safetensors header dtype


def _pinned_directory(path: str) -> tuple[int | None, str]:
    """Open ``path`` once and return (descriptor, a name that keeps resolving to *that* directory).

    On Linux the name is ``/proc/self/fd/N``: every file read through it comes from the directory that
    was opened, even if another process renames a new checkpoint into ``path`` meanwhile. Elsewhere the
    name is ``path`` itself and consistency rests on the digest check of ``load_converted`` alone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None, path
    pinned = f"/proc/self/fd/{fd}"
    if os.path.isdir(pinned):
        return fd, pinned
    os.close(fd)
    return None, path


def load_converted(path: str | os.PathLike, keep_bf16: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read a converted checkpoint directory, whole.

    Returns ``(config, tensors)`` with every tensor widened to float32 (with ``keep_bf16``, a directory of
    dtype bfloat16 hands its tensors over as bfloat16 arrays instead, exact as stored), shape-checked against
    ``expected_shapes(config)`` and finite (``check_finite``). Every tensor of a listed file must be listed
    in the index and stored in the index's dtype.

    Readers and a concurrent replace (``convert(..., force=True)``, which swaps directories atomically):
    the directory is opened once and every file is read through that handle, so the result is the
    old checkpoint or the new one, never a mixture; every weight file's metadata digest must equal the
    one the index records for it (``file_digests``, written by the converter), which catches a mixture
    on systems without ``/proc/self/fd``. If the directory is replaced and deleted mid-read, the read is retried (up to 3
    times) and then fails with ``CheckpointChanged``.
    Raises ``CheckpointError`` (bad index, unreadable or truncated file, missing/unknown/misshapen
    tensor, a tensor the index does not list, a dtype other than the index's, NaN/inf values) or
    ``ConfigError`` (bad model config).
    """
    for attempt in range(3):
        try:
            return _load_converted_once(os.fspath(path), keep_bf16)
        except CheckpointChanged:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _index_and_config(path: str, base: str) -> tuple[dict, ModelConfig]:
    """``diffusiongemma.json`` of the directory ``path`` (read through ``base``) and its ``ModelConfig``."""
    index = read_index(path, base)
    try:
        return index, ModelConfig.from_dict(index["model_config"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}/{INDEX_FILE}: bad model_config ({exc})") from exc


def _names_by_file(index: dict) -> dict[str, list[str]]:
    """The index's weight map turned around: file name -> the tensor names it holds, in index order."""
    by_file: dict[str, list[str]] = {}
    for name, filename in index["weight_map"].items():
        by_file.setdefault(filename, []).append(name)
    return by_file


def _check_weight_file(file_path: str, digest: str | None, recorded: str | None, dtypes: dict[str, str],
                       names: list[str], dtype: str) -> None:
    """One weight file of a converted checkpoint against its index: the digest the index records for it
    (``CheckpointChanged`` if another), no tensor the index does not list, every listed one present and stored in
    the index's ``dtype``. ``dtypes``: the file's tensors and their safetensors dtype tags, from its header."""
    if recorded is not None and digest != recorded:
        raise CheckpointChanged(f"{file_path}: its digest {digest!r} is not the {recorded!r} that {INDEX_FILE} records: "
                                "the directory was replaced while it was being read, or mixes files of two conversions")
    extra = sorted(set(dtypes) - set(names))
    if extra:
        raise CheckpointError(f"{file_path}: holds tensor(s) {extra[:5]} that {INDEX_FILE} does "
                              "not list (a file of another conversion?)")
    want = _SAFETENSORS_DTYPES[dtype]
    for name in names:
        if name not in dtypes:
            raise CheckpointError(f"{file_path}: tensor {name!r} listed in {INDEX_FILE} is not in the file")
        if dtypes[name] != want:
            raise CheckpointError(f"{file_path}: tensor {name!r} is stored as {dtypes[name]}, but "
                                  f"{INDEX_FILE} says dtype {dtype!r} ({want})")


def open_converted(path: str | os.PathLike) -> tuple[ModelConfig, WeightStore]:
    """A converted checkpoint directory as a ``WeightStore``: every weight file mapped, nothing read but headers.

    The same checks as ``load_converted`` on everything a header says (index, digests, listed and unknown
    tensors, dtypes, names and shapes), and the same errors; values are checked finite as they are first
    read (``WeightStore.checked``). The files are opened through one handle of the directory, so the store
    maps one version of the checkpoint even if ``convert --force`` replaces it meanwhile (the mappings then
    keep the replaced files whole until the store is dropped).
    """
    path = os.fspath(path)
    fd, base = _pinned_directory(path)
    try:
        index, config = _index_and_config(path, base)
        by_file = _names_by_file(index)
        digests = index.get("file_digests", {})
        tensors: dict[str, StoredTensor] = {}
        files = []
        for filename, names in by_file.items():
            file_path = os.path.join(path, filename)
            if not os.path.isfile(os.path.join(base, filename)):
                raise CheckpointError(f"{path}: weight file {filename!r} listed in {INDEX_FILE} is missing")
            mapped = MappedFile(file_path, os.path.join(base, filename))
            files.append(mapped)
            header, metadata, _ = safetensors_header(mapped)
            _check_weight_file(file_path, metadata.get("diffusiongemma.digest"), digests.get(filename),
                               {k: e["dtype"] for k, e in header.items()}, names, index["dtype"])
            for name in names:
                tensors[name] = safetensors_tensor(mapped, header[name], f"{file_path}: {name}")
    finally:
        if fd is not None:
            os.close(fd)
    store = WeightStore(tensors, files, path)
    check_tensors(store, config)
    return config, store


def _load_converted_once(path: str, keep_bf16: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    fd, base = _pinned_directory(path)
    try:
        index, config = _index_and_config(path, base)
        return config, _read_weight_files(path, base, index, config, keep_bf16)
    finally:
        if fd is not None:
            os.close(fd)


def _read_weight_files(path: str, base: str, index: dict, config: ModelConfig,
                       keep_bf16: bool = False) -> dict[str, np.ndarray]:
    by_file = _names_by_file(index)
    digests = index.get("file_digests", {})
    tensors: dict[str, np.ndarray] = {}
    for filename, names in by_file.items():
        file_path = os.path.join(path, filename)
        if not os.path.isfile(os.path.join(base, filename)):
            if not os.path.isfile(os.path.join(base, INDEX_FILE)):
                raise CheckpointChanged(f"{path}: a replace is in progress (the checkpoint was replaced while it "
                                        f"was being read: {filename} vanished); read it again")
            raise CheckpointError(f"{path}: weight file {filename!r} listed in {INDEX_FILE} is missing")
        try:
            with safe_open(os.path.join(base, filename), framework="numpy") as f:
                _check_weight_file(file_path, (f.metadata() or {}).get("diffusiongemma.digest"), digests.get(filename),
                                   {k: f.get_slice(k).get_dtype() for k in f.keys()}, names, index["dtype"])
                for name in names:
                    array = f.get_tensor(name)
                    tensors[name] = array if keep_bf16 and array.dtype == BFLOAT16 else to_float32(array, name)
        except (SafetensorError, OSError) as exc:
            if not os.path.isfile(os.path.join(base, INDEX_FILE)):  # the directory went away under us
                raise CheckpointChanged(f"{path}: a replace is in progress (the checkpoint was replaced while it "
                                        f"was being read: {filename} vanished); read it again") from exc
            raise CheckpointError(f"{file_path}: unreadable safetensors file ({exc})") from exc
    check_tensors(tensors, config)
    return tensors


# Other file formats (a transformers directory, a llama.cpp GGUF file) are read by the converter, which
# declares its readers as entry points of the group below (setup.py); ``load_checkpoint`` finds them in the
# installed package's metadata. The specification never imports the converter; the converter builds on the
# specification.
READER_ENTRY_POINTS = "diffusiongemma.checkpoint_readers"
_READERS: list[tuple[str, Callable[[str], bool], Callable[[str], tuple]]] = []


def register_checkpoint_reader(name: str, matches: Callable[[str], bool], read: Callable[..., tuple]) -> None:
    """Teach ``load_checkpoint`` another format: ``matches(path)`` says whether ``read(path)`` applies;
    ``read(path, keep_quantized=False, keep_bf16=False)`` returns ``(config, tensors)``, float32 arrays, except
    that with ``keep_quantized`` a matrix the file stores quantized may come as a
    ``support.quantized.Q8_0Tensor``, and with ``keep_bf16`` one it stores as bfloat16 as a bfloat16 array (a
    format without such types ignores the flag; each flag is passed only when set). Registering a name again replaces that reader."""
    _READERS[:] = [r for r in _READERS if r[0] != name] + [(name, matches, read)]


def checkpoint_readers() -> list[tuple[str, Callable[[str], bool], Callable[[str], tuple]]]:
    """The registered readers, after loading the installed ones (entry points ``READER_ENTRY_POINTS``, each
    a ``(name, matches, read)`` triple) the first time."""
    if not getattr(checkpoint_readers, "loaded", False):
        from importlib.metadata import EntryPoint, entry_points

        entries = list(entry_points(group=READER_ENTRY_POINTS))
        if not entries:  # package metadata without the group (a stale egg-info in a source checkout)
            entries = [EntryPoint(name, value, READER_ENTRY_POINTS) for name, value in _INSTALLED_READERS]
        for entry in entries:
            register_checkpoint_reader(*entry.load())
        checkpoint_readers.loaded = True
    return list(_READERS)


# what setup.py declares in the group, for metadata that lacks it
_INSTALLED_READERS = (("transformers", "diffusiongemma.weights_converter:TRANSFORMERS_READER"),
                      ("gguf", "diffusiongemma.weights_converter:GGUF_READER"))


def load_checkpoint(path: str | os.PathLike, keep_quantized: bool = False,
                    keep_bf16: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, float32 tensors)`` of a checkpoint: a converted directory (read here), or any format a
    registered reader knows (the converter registers a transformers directory and a GGUF file).

    ``keep_quantized``: matrices a GGUF file stores as Q8_0 come as ``Q8_0Tensor`` (int8 values, float16
    scales) instead of float32; ``quantized.widen`` gives their exact float32 values. Only a model that
    computes on them directly asks for this (the CPU fast path, for its experts).
    ``keep_bf16``: tensors a file stores as bfloat16 (a converted directory of dtype bfloat16, a transformers
    directory's bfloat16 safetensors, a GGUF file's BF16 tensors) come as bfloat16 arrays (``ml_dtypes``; ``quantized.widen`` widens them exactly). The
    CPU fast path asks for this too; a format that stores no bfloat16 ignores it.

    Raises ``CheckpointError`` when ``path`` does not exist or is no known kind, or when its tensors are
    wrong, and ``ConfigError`` for an invalid config. Every backend's ``Model.from_pretrained`` loads
    through this.
    """
    path = os.fspath(path)
    if os.path.isdir(path) and is_converted_checkpoint(path):
        return load_converted(path, keep_bf16=keep_bf16)
    readers = checkpoint_readers()
    for _, matches, read in readers:
        if matches(path):
            options = {key: True for key, wanted in (("keep_quantized", keep_quantized), ("keep_bf16", keep_bf16))
                       if wanted}
            return read(path, **options)
    if not os.path.exists(path):
        raise CheckpointError(f"model path {path!r} does not exist")
    known = ", ".join([f"a converted diffusiongemma directory ({INDEX_FILE})"] + [name for name, _, _ in readers])
    raise CheckpointError(f"{path!r} is not a checkpoint this project reads; it reads {known}")


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, WeightStore]:
    """``(config, WeightStore)`` of a checkpoint, its weight files mapped and nothing read but headers: a
    converted directory (``open_converted``), or any format a registered reader maps (its ``read`` called with
    ``mapped=True``; the converter's transformers and GGUF readers do). Every ``Model.from_pretrained``
    loads through this, so a model never holds more of a checkpoint than the tensors it is using.

    Same errors as ``load_checkpoint``, with the values' finiteness checked as each tensor is first read.
    """
    path = os.fspath(path)
    if os.path.isdir(path) and is_converted_checkpoint(path):
        return open_converted(path)
    readers = checkpoint_readers()
    for _, matches, read in readers:
        if matches(path):
            return read(path, mapped=True)
    return load_checkpoint(path)  # raises the errors for a path no reader knows
