"""Weights kept in a quantized storage type, and the float32 values they stand for.

The specification computes in float32 only. A GGUF file may store a matrix as llama.cpp's Q8_0: each row
cut into blocks of 32 consecutive values, each block 32 int8 values and one float16 scale, the weight being
``value * scale``. That product is exact in float32 (at most 8 + 11 significant bits), so a Q8_0 matrix
has one float32 matrix it stands for, bit for bit the one the ``gguf`` package's ``dequantize`` returns.

Readers hand a ``Q8_0Tensor`` over only when a caller asks them to keep quantized matrices
(``load_checkpoint(path, keep_quantized=True)``; the CPU fast path does, for its routed experts); every
other tensor, and every tensor of every other caller, is float32 as always. ``widen`` gives the float32
array of either kind.

bfloat16 is the other storage type a backend may compute on directly: a checkpoint that stores bfloat16
(a converted directory written with ``--dtype bfloat16``, a GGUF file's BF16 tensors) hands its matrices
over as numpy arrays of ``ml_dtypes.bfloat16`` when asked (``load_checkpoint(path, keep_bf16=True)``).
A bfloat16 value is the top 16 bits of a float32, so widening is exact and a bfloat16 matrix, too, stands
for one float32 matrix, bit for bit (``widen``; ``is_bfloat16`` tells the kind).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from .errors import CheckpointError

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # numpy's bfloat16 (ml_dtypes), as safetensors reads BF16

__all__ = ["BFLOAT16", "Q8_0_BLOCK", "Q8_0_BLOCK_BYTES", "Q8_0Tensor", "is_bfloat16", "widen"]

Q8_0_BLOCK = 32  # values per block (along the last axis)
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK  # a float16 scale, then the int8 values (llama.cpp's block_q8_0)


@dataclass(frozen=True, eq=False)
class Q8_0Tensor:
    """A matrix (or a stack of them) in llama.cpp's Q8_0 type, kept quantized."""

    values: np.ndarray  # int8 (..., N, K), K a multiple of 32: the quantized weights
    scales: np.ndarray  # float16 (..., N, K // 32): the scale of each block of 32 consecutive values of a row

    def __post_init__(self):
        v, s = self.values, self.scales
        if v.dtype != np.int8 or s.dtype != np.float16:
            raise CheckpointError(f"Q8_0Tensor: values must be int8 and scales float16, got {v.dtype} / {s.dtype}")
        if v.ndim < 1 or v.shape[-1] % Q8_0_BLOCK or s.shape != v.shape[:-1] + (v.shape[-1] // Q8_0_BLOCK,):
            raise CheckpointError(f"Q8_0Tensor: values {v.shape} need a last axis that is a multiple of "
                                  f"{Q8_0_BLOCK} and scales of shape {v.shape[:-1] + (v.shape[-1] // Q8_0_BLOCK,)}, "
                                  f"got {s.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the matrix it stands for."""
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: int8 values and float16 scales (34 bytes per 32 weights, as in the file)."""
        return int(self.values.nbytes + self.scales.nbytes)

    @classmethod
    def from_blocks(cls, blocks: np.ndarray, shape: Sequence[int]) -> "Q8_0Tensor":
        """From the file's bytes: uint8 of ``shape[:-1] + (shape[-1] // 32 * 34,)``, each block a little-endian
        float16 scale followed by 32 int8 values. Copies."""
        shape = tuple(int(n) for n in shape)
        n_blocks = shape[-1] // Q8_0_BLOCK
        raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(shape[:-1] + (n_blocks, Q8_0_BLOCK_BYTES))
        scales = np.ascontiguousarray(raw[..., :2]).view("<f2").reshape(shape[:-1] + (n_blocks,))
        values = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(shape)
        return cls(values=values, scales=scales.astype(np.float16))

    @classmethod
    def concatenate(cls, parts: Sequence["Q8_0Tensor"], axis: int) -> "Q8_0Tensor":
        """Stack along an axis other than the last (blocks run along the last axis and stay whole)."""
        ndim = parts[0].values.ndim
        if axis % ndim == ndim - 1:
            raise ValueError("Q8_0Tensor.concatenate: the last axis holds the blocks and cannot be joined")
        return cls(values=np.concatenate([p.values for p in parts], axis=axis),
                   scales=np.concatenate([p.scales for p in parts], axis=axis))

    def dequantize(self) -> np.ndarray:
        """The float32 matrix (..., N, K): ``values * scale`` of each block, exact."""
        v = self.values.astype(np.float32).reshape(self.scales.shape + (Q8_0_BLOCK,))
        return (v * self.scales.astype(np.float32)[..., None]).reshape(self.shape)


def is_bfloat16(tensor) -> bool:
    """Whether ``tensor`` is a numpy array of bfloat16 (kept bfloat16 by ``load_checkpoint(keep_bf16=True)``)."""
    return isinstance(tensor, np.ndarray) and tensor.dtype == BFLOAT16


def widen(tensor) -> np.ndarray:
    """The float32 values of ``tensor``: a ``Q8_0Tensor`` dequantized, anything else (bfloat16 included:
    exactly) as a float32 array."""
    if isinstance(tensor, Q8_0Tensor):
        return tensor.dequantize()
    return np.asarray(tensor, dtype=np.float32)
