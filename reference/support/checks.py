"""Input checks: the arrays and settings a model call or a generation run receives, refused with a
message that names the argument and the value before anything is computed.

They compute nothing of the model. Every backend shares them, so that the same bad input gives the same
error on the reference, the CPU fast path and the GPU.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from ..draws import DrawSource, SeededDraws
from ..generation_config import GenerationConfig
from .errors import ConfigError, InputError
from .logits import check_logits
from .observer import readonly


def as_array(name: str, value: Any) -> np.ndarray:
    """``np.asarray(value)``, with a ragged nested list (rows of different lengths, which NumPy refuses with its
    own ValueError) refused as ``InputError`` naming ``name`` and the row lengths."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        lengths = None
        try:
            lengths = [len(row) for row in value]
        except TypeError:
            pass
        if lengths is not None and len(set(lengths)) > 1:
            shown = ", ".join(str(n) for n in lengths[:8]) + (", ..." if len(lengths) > 8 else "")
            raise InputError(f"{name} has rows of different lengths ({shown}); pad them to one length (left "
                             "padding, with an attention_mask of 0 over the pads)") from None
        raise InputError(f"{name} is not an array of numbers ({exc})") from None


def check_model(model: Any) -> Any:
    """Refuse (``InputError``) what is not a loaded model: None, a checkpoint path (str or ``os.PathLike``:
    say to load it with ``Model.from_pretrained``), or an object without ``config.vocab_size`` and
    ``config.canvas_length``. Returns ``model``."""
    if isinstance(model, (str, bytes, os.PathLike)):
        raise InputError(f"model is the path {os.fsdecode(model)!r}, not a model: pass a loaded model, e.g. "
                         f"Model.from_pretrained({os.fsdecode(model)!r})")
    config = getattr(model, "config", None)
    if model is None or not all(hasattr(config, field) for field in ("vocab_size", "canvas_length")):
        raise InputError(f"model must be a loaded DiffusionGemma model (Model.from_pretrained(path)), got "
                         f"{'None' if model is None else type(model).__name__}")
    return model


def check_token_ids(name: str, ids, batch_size: int, vocab_size: int) -> np.ndarray:
    """Validate a (batch, tokens) array of token ids; return it as contiguous int64.

    Raises ``InputError`` naming ``name`` for a non-2-D or non-integer array, a batch size other than
    ``batch_size`` (the cache's), or an id outside [0, vocab_size). Shared by every backend.
    """
    ids = as_array(name, ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{name} must be a 2-D integer array (batch, tokens), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if ids.shape[0] != batch_size:
        raise InputError(f"{name} has batch size {ids.shape[0]} but the cache was made for batch size {batch_size}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].ravel()[0]
        raise InputError(f"{name} holds token id {int(bad)} outside [0, vocab_size={vocab_size})")
    return np.ascontiguousarray(ids, dtype=np.int64)


def check_attention_mask(attention_mask, shape: tuple[int, int]) -> np.ndarray:
    """Validate a 0/1 attention mask of ``shape`` (None means all ones); return it as a bool array.

    Raises ``InputError`` for another shape or values other than 0 and 1. Shared by every backend.
    """
    if attention_mask is None:
        return np.ones(shape, dtype=bool)
    mask = as_array("attention_mask", attention_mask)
    if mask.shape != tuple(shape):
        raise InputError(f"attention_mask has shape {mask.shape}, expected {tuple(shape)} like input_ids")
    if not np.isin(mask, (0, 1)).all():
        raise InputError("attention_mask must hold only 0 and 1")
    return mask.astype(bool)


def check_denoise_inputs(config: ModelConfig, canvas, batch_size: int, self_conditioning_logits=None,
                         self_conditioning_mask=None) -> tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]:
    """Validate the inputs of a decoder pass once, for every backend's ``denoise``.

    canvas: (B, C) int ids with B = ``batch_size`` (the cache's) and C = ``config.canvas_length``.
    self_conditioning_logits: (B, C, V) float (host array; a device array is only shape-checked) or None.
    self_conditioning_mask: (B,) bool or None.
    Returns (ids (B, C) int64, logits float32 (or the device array as given) or None, mask (B,) bool or None).
    Raises ``InputError`` naming the argument: wrong canvas length, ids out of range, logits of the wrong
    shape, holding NaN or +inf or a position with only -inf (named by (row, position)), a mask of the wrong
    shape.
    """
    ids = check_token_ids("canvas", canvas, batch_size, config.vocab_size)
    B, C = ids.shape
    if C != config.canvas_length:
        raise InputError(f"canvas has length {C}, but this model's canvas_length is {config.canvas_length}")
    sc = self_conditioning_logits
    if sc is not None:
        expected = (B, C, config.vocab_size)
        if not hasattr(sc, "shape"):
            sc = np.asarray(sc, dtype=np.float32)
        if tuple(sc.shape) != expected:
            raise InputError(f"self_conditioning_logits has shape {tuple(sc.shape)}, expected {expected}")
        if isinstance(sc, np.ndarray):
            sc = np.ascontiguousarray(sc, dtype=np.float32)
            check_logits(sc, "self_conditioning_logits", InputError)  # NaN, +inf, a row of only -inf
    mask = self_conditioning_mask
    if mask is not None:
        if np.shape(mask) != (B,):
            raise InputError(f"self_conditioning_mask has shape {np.shape(mask)}, expected {(B,)}")
        mask = np.asarray(mask, dtype=bool)
    return ids, sc, mask


def check_positions(config: ModelConfig, start: int, count: int, what: str) -> None:
    """Refuse ``count`` tokens at positions ``start .. start + count - 1`` beyond ``max_position_embeddings``.

    Raises ``InputError`` with the numbers (the rotary tables and the trained model end there). Shared by
    every backend's ``encode`` and ``denoise`` and by the generation loop's up-front budget.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and start + count > limit:
        raise InputError(f"{what} would occupy positions {start}..{start + count - 1}, but this model has "
                         f"max_position_embeddings={limit} (positions 0..{limit - 1}); {start} are already "
                         f"used by the cache")


def run_denoiser(denoise: Denoiser, canvas: np.ndarray, cache: Any, sc_logits: np.ndarray | None,
                 shape: tuple[int, int, int]) -> np.ndarray:
    """Call a denoiser on read-only inputs and check what it returns: (B, C, V) float32 logits."""
    logits = denoise(readonly(canvas), cache, None if sc_logits is None else readonly(sc_logits))
    logits = np.asarray(logits)
    if logits.shape != shape:
        raise InputError(f"the denoiser returned logits of shape {logits.shape}, expected {shape}")
    if logits.dtype != np.float32:
        raise InputError(f"the denoiser returned {logits.dtype} logits, expected float32")
    return logits


def resolve_config(model: Any, config: GenerationConfig | None, overrides: Mapping[str, Any]) -> GenerationConfig:
    """Explicit config > ``model.generation_config`` > defaults; then keyword overrides (transformers' order)."""
    if config is None:
        config = getattr(model, "generation_config", None) or GenerationConfig()
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


def check_special_ids(config: GenerationConfig, vocab_size: int) -> None:
    """Raise ``ConfigError`` when an EOS or pad id lies outside [0, vocab_size)."""
    for name, ids in (("eos_token_id", config.eos_token_id),
                      ("pad_token_id", () if config.pad_token_id is None else (config.pad_token_id,))):
        for token in ids:
            if token >= vocab_size:
                raise ConfigError(f"{name} {token} is outside the vocabulary [0, {vocab_size})")


def check_prompt(input_ids: Any, attention_mask: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Validate the prompt (B, P) int ids in [0, V), P >= 1, and its optional (B, P) 0/1 mask.

    Returns (ids int64, mask int64 or None). Raises ``InputError`` naming the problem.
    """
    ids = as_array("input_ids", input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"input_ids must be a 2-D integer array (batch, tokens), got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"input_ids must hold at least one row and one token, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)].ravel()[0]
        raise InputError(f"input_ids holds token id {int(bad)} outside [0, vocab_size={vocab_size})")
    if attention_mask is None:
        return ids.astype(np.int64), None
    mask = as_array("attention_mask", attention_mask)
    if mask.shape != ids.shape:
        raise InputError(f"attention_mask has shape {mask.shape}, expected {ids.shape} like input_ids")
    if not np.isin(mask, (0, 1)).all():
        raise InputError("attention_mask must hold only 0 and 1")
    return ids.astype(np.int64), mask.astype(np.int64)


def check_start_canvas(canvas: Any, B: int, C: int, V: int) -> np.ndarray | None:
    """Validate a caller's first canvas (B, C) int ids in [0, V), or None. Raises ``InputError``."""
    if canvas is None:
        return None
    canvas = as_array("decoder_input_ids", canvas)
    if canvas.shape != (B, C) or not np.issubdtype(canvas.dtype, np.integer):
        raise InputError(f"decoder_input_ids must be an integer array of shape {(B, C)}, got {canvas.shape} "
                         f"{canvas.dtype}")
    if canvas.min() < 0 or canvas.max() >= V:
        raise InputError(f"decoder_input_ids holds ids outside [0, vocab_size={V})")
    return canvas.astype(np.int64)


def check_start_sc_logits(logits: Any, B: int, C: int, V: int) -> np.ndarray | None:
    """Validate a caller's first self-conditioning logits (B, C, V) float32, or None. Raises ``InputError``."""
    if logits is None:
        return None
    logits = as_array("self_conditioning_logits", logits)
    if logits.shape != (B, C, V) or logits.dtype != np.float32:
        raise InputError(f"self_conditioning_logits must be float32 of shape {(B, C, V)}, got {logits.shape} "
                         f"{logits.dtype}")
    check_logits(logits, "self_conditioning_logits", InputError)  # NaN, +inf, a position with only -inf
    return logits.copy()


def available_memory() -> int | None:
    """Bytes of memory this process could still allocate (``MemAvailable`` on Linux), None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def activation_floats_per_token(model_config: Any) -> int:
    """float32 values a forward pass keeps per token while a block runs (an estimate that bounds the fast
    paths' reused buffers and the reference's temporaries): about 10 hidden-size rows (residual, norms,
    attention output, dense and expert branches, self-conditioning), the query/key/value projections, the
    dense MLP's gate, up and activation, and per routed expert its input, gate/up, activation and output."""
    H, I = int(model_config.hidden_size), int(getattr(model_config, "intermediate_size", 0))
    Ie, K = int(getattr(model_config, "moe_intermediate_size", 0)), int(getattr(model_config, "top_k_experts", 0))
    E, n_h = int(getattr(model_config, "num_experts", 0)), int(getattr(model_config, "num_attention_heads", 1))
    d = max(int(v) for v in model_config.layer_head_dim)
    g = max(int(v) for v in model_config.layer_num_key_value_heads)
    return 10 * H + 3 * n_h * d + 4 * g * d + 3 * I + K * (2 * H + 3 * Ie) + E + 3 * K


def check_pass_memory(model_config: Any, tokens: int, what: str) -> None:
    """Refuse (``InputError`` with the estimate) a forward pass over ``tokens`` tokens (rows x positions) whose
    activations (``activation_floats_per_token``) do not fit in ``available_memory()``; ``what`` names the
    input. For a model's own ``encode``/``denoise`` called outside ``generate`` (whose ``check_budget``
    counts them with the rest of the run)."""
    needed = 4 * int(tokens) * activation_floats_per_token(model_config)
    free = available_memory()
    if free is not None and needed > free:
        raise InputError(f"{what} needs about {needed:,} bytes ({needed / 2 ** 30:.2f} GiB) of activations but "
                         f"{free:,} bytes ({free / 2 ** 30:.2f} GiB) of memory are available; pass fewer rows or "
                         "tokens at a time")


def run_memory_bytes(model_config: Any, batch_size: int, cached: int, total: int, tokens: int = 0) -> int:
    """Bytes a run adds: float32 keys and values for positions ``cached .. total - 1`` of every layer (a
    sliding layer keeps at most ``sliding_window - 1``), four (B, C, V) float32 logit-sized buffers
    (logits, processed logits, probabilities, self-conditioning input) of one denoising step, and the
    activations of its largest pass, ``tokens`` per row (``activation_floats_per_token``; the prompt's
    encode, or one canvas)."""
    C, V = int(model_config.canvas_length), int(model_config.vocab_size)
    per_position = 0  # bytes per (row, position) over the full layers
    sliding = 0  # bytes per (row, retained position) over the sliding layers
    for layer, (g, d) in enumerate(zip(model_config.layer_num_key_value_heads, model_config.layer_head_dim)):
        if model_config.is_sliding(layer):
            sliding += 2 * 4 * g * d
        else:
            per_position += 2 * 4 * g * d
    window = int(model_config.sliding_window) - 1
    grown = per_position * (total - cached) + sliding * max(0, min(total, window) - min(cached, window))
    activations = 4 * batch_size * max(int(tokens), C) * activation_floats_per_token(model_config)
    return batch_size * grown + 4 * 4 * batch_size * C * V + activations


def check_budget(model_config: Any, ids: np.ndarray, mask: np.ndarray | None, cache: Any, n_canvases: int) -> None:
    """Refuse, before anything runs, a generation that cannot fit; ``InputError`` with the numbers.

    * Positions: the cache (L), the prompt (P) and up to ``n_canvases`` canvases of C occupy positions
      0 .. L + P + n_canvases * C - 1, which must stay below ``max_position_embeddings``.
    * An ``attention_mask`` row of only zeros with an empty cache: that row has no real token.
    * Memory: the keys/values the run adds, one step's logit buffers and the activations of its largest
      pass (``run_memory_bytes``) must fit
      in the memory free where the cache lives: ``cache.device.available_memory()`` for a fast path's
      cache (host or GPU), ``available_memory()`` for any other cache of NumPy arrays.
    Checks what ``model_config`` declares (a stand-in config without these fields skips them).
    """
    B, P = ids.shape
    C = int(model_config.canvas_length)
    L = int(cache.length)
    end = L + P + n_canvases * C
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and end > limit:
        room = (limit - L - P) // C * C
        raise InputError(f"this run needs positions 0..{end - 1} ({L} cached + {P} prompt + {n_canvases} "
                         f"canvas(es) of {C}: max_new_tokens rounded up to whole canvases), but the model has "
                         f"max_position_embeddings={limit}; at most {max(room, 0)} new tokens fit after this prompt")
    if mask is not None and L == 0:
        empty = np.flatnonzero(~np.asarray(mask).astype(bool).any(axis=1))
        if empty.size:
            raise InputError(f"attention_mask row {int(empty[0])} is all zeros: that row has no real token to "
                             "generate from (give it at least one 1, or leave the row out)")
    keys = getattr(cache, "keys", None)
    probe = getattr(getattr(cache, "device", None), "available_memory", None)  # a fast cache's device
    if probe is None and isinstance(keys, list) and bool(keys) and isinstance(keys[0], np.ndarray):
        probe = available_memory  # a cache held in host memory
    if probe is not None and hasattr(model_config, "layer_head_dim"):
        needed = run_memory_bytes(model_config, B, L, L + P + (n_canvases - 1) * C, tokens=P)
        free = probe()
        if free is not None and needed > free:
            raise InputError(f"this run needs about {needed:,} bytes ({needed / 2 ** 30:.2f} GiB: KV cache, logits "
                             f"and activations for a {P}-token prompt and {n_canvases} canvas(es) of {C}, {B} "
                             f"row(s)) but {free:,} bytes "
                             f"({free / 2 ** 30:.2f} GiB) of memory are available; lower max_new_tokens or the "
                             "batch size")


def check_cache(cache: Any, batch_size: int) -> Any:
    """Refuse an object that is not a KV cache for ``batch_size`` rows (``InputError`` naming it)."""
    length, rows = getattr(cache, "length", None), getattr(cache, "batch_size", batch_size)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise InputError(f"cache must be a KV cache made by model.new_cache(batch_size), got {type(cache).__name__}")
    if rows != batch_size:
        raise InputError(f"cache holds {rows} rows but input_ids has {batch_size}")
    return cache


def check_model_cache(cache: Any, cache_type: type) -> Any:
    """Refuse a ``cache`` that is not a ``cache_type`` (the model's own ``new_cache`` class)."""
    if not isinstance(cache, cache_type):
        raise InputError(f"cache must be a {cache_type.__name__} from Model.new_cache, got {type(cache).__name__}")
    return cache


class _DuckDraws(DrawSource):
    """Any object with a draw source's three methods, as a ``DrawSource`` (so that it answers what the
    contract declares beyond them: no uniforms to share, no logits wanted)."""

    def __init__(self, source: Any):
        self.source = source

    def canvas_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.source.canvas_ids(batch_size, canvas_length, vocab_size)

    def categorical(self, probs: np.ndarray) -> np.ndarray:
        return self.source.categorical(probs)

    def renoise_ids(self, batch_size: int, canvas_length: int, vocab_size: int) -> np.ndarray:
        return self.source.renoise_ids(batch_size, canvas_length, vocab_size)


def as_draw_source(random: DrawSource | int | np.random.SeedSequence | None) -> DrawSource:
    """``generate``'s ``random`` argument as a source: None -> ``SeededDraws(0)``, an int or
    ``SeedSequence`` -> ``SeededDraws(seed)``, a ``DrawSource`` (or any object with its three methods) as
    is. Raises ``InputError`` otherwise."""
    if random is None:
        return SeededDraws(0)
    if isinstance(random, DrawSource):
        return random
    if all(callable(getattr(random, name, None)) for name in ("canvas_ids", "categorical", "renoise_ids")):
        return _DuckDraws(random)
    if isinstance(random, (int, np.integer, np.random.SeedSequence)) and not isinstance(random, bool):
        if not isinstance(random, np.random.SeedSequence) and int(random) < 0:
            raise InputError(f"random: an integer seed must be >= 0, got {int(random)}")
        return SeededDraws(random)
    raise InputError(f"random must be a DrawSource, an integer seed or None, got {type(random).__name__}")
