"""Non-finite diagnosis: when a forward pass produces NaN or infinity, name the first layer output that
was not finite and the weight or cache entry that explains it (or say that float32 overflowed).

Shared by every backend, so that the same fault gives the same message.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import NonFiniteError
from .quantized import Q8_0Tensor


def first_non_finite(array: np.ndarray) -> str:
    """``"NaN at (row, position) (b, s)"`` / ``"+inf ..."`` for the first non-finite entry of (B, S, ...)."""
    array = np.asarray(array)
    where = tuple(int(i) for i in np.argwhere(~np.isfinite(array))[0])
    value = float(array[where])
    return f"{'NaN' if value != value else ('+inf' if value > 0 else '-inf')} at (row, position) {where[:2]}"


def non_finite_error(stage: str, where: str, array: np.ndarray, weights: Mapping[str, np.ndarray],
                     inputs: Mapping[str, np.ndarray] = {}) -> NonFiniteError:
    """The ``NonFiniteError`` for ``array``, the first value of the forward pass that was not finite.

    stage: "encode" or "denoise"; where: what ``array`` is ("the output of decoder layer 2"). The cause
    is looked for in what that computation read: ``inputs`` first (name -> array, e.g. the cache's keys of
    that layer), then ``weights`` (project tensor name -> array; weights are checked when a model is built,
    so a non-finite one was changed afterwards). When all are finite, float32 overflowed there. Shared by
    every backend, so that the same fault gives the same message. A ``Q8_0Tensor`` is judged by its
    scales; integer arrays (quantized values) are finite by construction and skipped, as are object arrays.
    """
    cause = None
    for kind, items in (("input", inputs), ("weight", weights)):
        for name, value in items.items():
            if isinstance(value, Q8_0Tensor):  # int8 values are finite; the scales may not be
                value = value.scales
            value = np.asarray(value)
            if value.dtype.kind in "iubO":  # integers (quantized values) are finite; an object array is no weight
                continue
            if value.size and not np.isfinite(value).all():  # float32/16, bfloat16 (ml_dtypes: kind "V")
                bad = value.reshape(-1)[~np.isfinite(value.reshape(-1))][0]
                cause = f"{kind} {name!r} holds {'NaN' if bad != bad else float(bad)}"
                break
        if cause:
            break
    if cause is None:
        cause = ("every weight and input it read is finite, so float32 overflowed there "
                 "(weights or activations too large)")
    return NonFiniteError(f"{stage}: {where} is not finite ({first_non_finite(array)}); {cause}")


def forward_fault(tensors: Mapping[str, np.ndarray], stage: str, where: str, array: np.ndarray,
                  layer: int | None, cache=None) -> NonFiniteError:
    """``non_finite_error`` for a model's forward pass, looking for the cause in what that computation read.

    tensors: the model's weights (project names); layer: the block whose output ``array`` is, or None for
    the decoder input and the logits (the tensors outside the blocks); cache: the KV cache that layer read.
    """
    if layer is None:
        names = [n for n in tensors if not n.startswith("layers.")]
    else:
        names = [n for n in tensors if n.startswith(f"layers.{layer}.")]
        if layer == 0:
            names += [n for n in tensors if not n.startswith("layers.")]
    inputs = {}
    if cache is not None and layer is not None:
        inputs = {f"cache keys of layer {layer}": cache.keys[layer],
                  f"cache values of layer {layer}": cache.values[layer]}
    return non_finite_error(stage, where, array, {n: np.asarray(tensors[n]) for n in names}, inputs)
