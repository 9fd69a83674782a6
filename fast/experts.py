"""The routed experts of the CPU fast path: weights packed once into panels, products on our own kernel.

A canvas of S tokens sends S * top_k rows to E experts, so each expert's two products have S * top_k / E
rows (8-32 for the shapes the benchmarks run; 16 for the real model's 256-token canvas, top 8 of 128) for a
weight matrix of (2 I, H) and (H, I). A general BLAS packs that matrix into its own layout on every call,
which costs as much as the arithmetic at these row counts. Here each expert's matrices are packed once, at
load, into panels of 32 output columns (``pack_panels``: (N, K) -> (ceil(N/32), K, 32)), and
``_kernels.expert_ffn`` runs every expert of a layer in one parallel loop on the register tiles of
``fast/panel_gemm.h`` (AVX-512, AVX2 + FMA or portable C, the same bits on each).

Q8_0 experts (a GGUF file's ``*_exps`` stored as Q8_0, loaded with ``keep_quantized``) stay quantized:
int8 panels with one float32 scale per block of 32 values of k (``pack_q8_0_panels``): 1.125 bytes a
weight, 3.56x fewer than float32 (the file's float16 scales widened once, at load). The kernel widens
``_kernels.PANEL_CHUNK`` (256) values of k of a panel at a time into a small buffer and runs the float32
tile on it, so its result is the float32 path's on the dequantized weights, bit for bit.

bfloat16 experts (a checkpoint that stores bfloat16, loaded with ``keep_bf16``) stay bfloat16 the same way:
panels of the float32 layout with 2-byte entries, each chunk widened (a 16-bit shift, exact) before the
float32 tile runs on it: half the bytes of float32, and the float32 path's result on the widened weights,
bit for bit (``reference.support.quantized.is_bfloat16``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from diffusiongemma.reference.support.quantized import BFLOAT16, Q8_0Tensor, is_bfloat16, widen

from . import _kernels

__all__ = ["PANEL", "ExpertPanels", "ExpertRows", "pack_panels", "pack_q8_0_panels", "unpack_panels"]

PANEL = _kernels.PANEL  # output columns of one panel (32)


def pack_panels(w: np.ndarray) -> np.ndarray:
    """(..., N, K) -> (..., ceil(N/32), K, 32) C-contiguous, panel p holding rows 32p..32p+31 of w as
    columns (zeros past N). float32 for float32 input; int8 (Q8_0 values) and bfloat16 input keep their type."""
    *lead, N, K = w.shape
    lead, whole = tuple(lead), N // PANEL
    P = -(-N // PANEL)
    out = np.empty(lead + (P, K, PANEL), dtype=w.dtype)  # one copy of w (loading holds w and this only)
    out[..., :whole, :, :] = np.swapaxes(w[..., :whole * PANEL, :].reshape(lead + (whole, PANEL, K)), -1, -2)
    if whole < P:  # the last, partial panel: zeros past N
        out[..., whole, :, :] = 0
        out[..., whole, :, :N - whole * PANEL] = np.swapaxes(w[..., whole * PANEL:, :], -1, -2)
    return out


def unpack_panels(panels: np.ndarray, N: int) -> np.ndarray:
    """The inverse of ``pack_panels``: (..., P, K, 32) -> (..., N, K)."""
    *lead, P, K, width = panels.shape
    return np.swapaxes(panels, -1, -2).reshape(tuple(lead) + (P * width, K))[..., :N, :]


def pack_q8_0_panels(w: Q8_0Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 (..., N, K) as (int8 panels (..., P, K, 32), float32 scales (..., P, K/32, 32))."""
    return pack_panels(w.values), pack_panels(w.scales.astype(np.float32))


@dataclass
class ExpertPanels:
    """One layer's experts in the panel layout: float32, bfloat16 kept bfloat16, or Q8_0 kept quantized."""

    gate_up: np.ndarray  # (E, ceil(2I/32), H, 32) float32, bfloat16 or int8: [gate_proj; up_proj] rows as panels
    down: np.ndarray  # (E, ceil(H/32), I, 32) float32, bfloat16 or int8
    gate_up_scales: Any = None  # (E, ceil(2I/32), H/32, 32) float32 (Q8_0 only)
    down_scales: Any = None  # (E, ceil(H/32), I/32, 32) float32 (Q8_0 only)

    @classmethod
    def from_weights(cls, gate_up, down, keep_bf16: bool = True) -> "ExpertPanels":
        """From the checkpoint's ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I):
        float32 arrays, both ``Q8_0Tensor`` (kept quantized), or both bfloat16 arrays (kept bfloat16 unless
        ``keep_bf16`` is False). Two tensors of different kinds are both widened: the experts of a layer
        share one kind."""
        if isinstance(gate_up, Q8_0Tensor) and isinstance(down, Q8_0Tensor):
            (g, gs), (d, ds) = pack_q8_0_panels(gate_up), pack_q8_0_panels(down)
            return cls(g, d, gs, ds)
        if keep_bf16 and is_bfloat16(gate_up) and is_bfloat16(down):
            return cls(pack_panels(np.asarray(gate_up)), pack_panels(np.asarray(down)))
        return cls(pack_panels(widen(gate_up)), pack_panels(widen(down)))

    @property
    def num_experts(self) -> int:  # E
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:  # H: the gate/up products' K
        return self.gate_up.shape[2]

    @property
    def moe_intermediate_size(self) -> int:  # I: the down product's K
        return self.down.shape[2]

    @property
    def kind(self) -> str:
        if self.gate_up_scales is not None:
            return "q8_0"
        return "bfloat16" if is_bfloat16(self.gate_up) else "float32"

    @property
    def nbytes(self) -> int:
        """Bytes held (panels, scales; padding columns included)."""
        return sum(int(a.nbytes) for a in (self.gate_up, self.down, self.gate_up_scales, self.down_scales)
                   if a is not None)

    def __call__(self, grouped: np.ndarray, offsets: np.ndarray, gate_up: np.ndarray, act: np.ndarray,
                 y: np.ndarray, bf16: bool = False) -> None:
        """Every expert's gated MLP on its block of ``grouped`` rows (R, H) (``offsets``: (E + 1,)), into
        y (R, H); gate_up (R, 2I) and act (R, I) are work buffers (``_kernels.expert_ffn``). ``bf16``: the
        bfloat16 run's roundings (SPEC §10.1 B3, B6)."""
        _kernels.expert_ffn(grouped, offsets, self.gate_up, self.down, self.moe_intermediate_size,
                            gate_up, act, y, self.gate_up_scales, self.down_scales, bf16)


@dataclass
class ExpertRows:
    """One layer's experts as the checkpoint stores them, row-major, read where they lie (a mapped file): float32
    or bfloat16 arrays (E, 2I, H) and (E, H, I), or Q8_0 blocks, uint8 (E, 2I, H/32*34) and (E, H, I/32*34).

    ``_kernels.expert_ffn_rows`` gathers each chunk of 32 rows into the buffer the panel kernel widens into,
    so the result is ``ExpertPanels``' on the same weights, bit for bit, with no packed copy: the CPU path uses
    it for a checkpoint larger than its weight budget, where a layer's panels would be made again at every
    pass (``fast.model.PackedLayers``)."""

    gate_up: np.ndarray  # (E, 2I, H) float32 / bfloat16, or uint8 Q8_0 blocks (E, 2I, H/32*34)
    down: np.ndarray  # (E, H, I) float32 / bfloat16, or uint8 Q8_0 blocks (E, H, I/32*34)
    moe_intermediate_size: int  # I
    hidden_size: int  # H
    gate_up_scales: Any = None  # (never: the Q8_0 scales stay inside the blocks)
    down_scales: Any = None

    @classmethod
    def from_stored(cls, gate_up, down, bf16_run: bool = False) -> "ExpertRows":
        """From the store's two ``StoredTensor``s (``reference.support.weight_store``). The bfloat16 run rounds
        float32 or Q8_0 experts to bfloat16 first (a copy of the layer); a float16 or other quantized type is
        widened to float32 (a copy); float32, bfloat16 and Q8_0 are read in place."""
        E, two_i, H = gate_up.shape
        I = two_i // 2
        if gate_up.kind == down.kind == "q8_0" and gate_up.blocks is not None and down.blocks is not None \
                and not bf16_run:
            return cls(gate_up.blocks, down.blocks, I, H)
        g, d = gate_up.read(), down.read()
        if bf16_run:
            g, d = (a if is_bfloat16(a) else np.ascontiguousarray(widen(a).astype(BFLOAT16)) for a in (g, d))
        elif not (is_bfloat16(g) and is_bfloat16(d)):
            g, d = np.ascontiguousarray(widen(g)), np.ascontiguousarray(widen(d))
        return cls(g, d, I, H)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def kind(self) -> str:
        if self.gate_up.dtype == np.uint8:
            return "q8_0"
        return "bfloat16" if is_bfloat16(self.gate_up) else "float32"

    @property
    def nbytes(self) -> int:
        """Bytes the model holds for them: none when they are views of the mapped file, else the copy."""
        return sum(0 if a.base is not None and not a.flags.owndata and not a.flags.writeable else int(a.nbytes)
                   for a in (self.gate_up, self.down))

    def __call__(self, grouped: np.ndarray, offsets: np.ndarray, gate_up: np.ndarray, act: np.ndarray,
                 y: np.ndarray, bf16: bool = False) -> None:
        """As ``ExpertPanels.__call__``."""
        _kernels.expert_ffn_rows(grouped, offsets, self.gate_up, self.down, self.moe_intermediate_size,
                                 gate_up, act, y, bf16)
