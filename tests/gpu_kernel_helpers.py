"""Helpers shared by the GPU kernel tests (tests/test_gpu_bf16.py, test_gpu_attention_bf16.py,
test_gpu_experts_bf16.py, test_gpu_equivalence.py): bfloat16 operands, the accumulation bound of a bfloat16
product, kernel mutations, the NVRTC requirement of the compile checks, and the float32 experts' launch sequence.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.reference.primitives import BFLOAT16, round_to


def random_bf16(rng: np.random.Generator, shape: tuple, scale: float = 1.0) -> np.ndarray:
    """float32 holding bfloat16 values: standard normal times ``scale``, rounded to nearest even."""
    return round_to((rng.standard_normal(shape) * scale).astype(np.float32), BFLOAT16)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16, contiguous) of ``x`` rounded to nearest even: a bfloat16 device operand."""
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(BFLOAT16).view(np.uint16))


def accumulation_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|float32 sum - exact| <= (2K + 16) 2^-23 sum_k |a_mk| |b_nk| for a (M, K) @ b (N, K).T of bfloat16 values
    (float64, per output element): the products are exact, K float32 additions in any order, one more per ``mma``
    for its accumulator input and 16 to spare (the derivation is tests/test_gpu_bf16.py's module docstring)."""
    return (2 * a.shape[1] + 16) * 2.0 ** -23 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T)


def mutated(text: str, old: str, new: str, name: str) -> str:
    """``text`` (an assembled kernel source) with its one occurrence of ``old`` replaced by ``new``; fails the test
    when ``old`` is not there exactly once (the kernel changed and the mutation ``name`` must follow it)."""
    assert text.count(old) == 1, f"mutation {name!r} no longer applies: update it with the kernel"
    return text.replace(old, new)


def nvrtc_or_skip() -> None:
    """Fail when no libnvrtc loads (the test extra installs nvidia-cuda-nvrtc-cu12), or skip where the caller
    set DIFFUSIONGEMMA_SKIP_CUDA_COMPILE=1."""
    if cb.load_nvrtc() is None:
        if os.environ.get(cb.SKIP_ENV) == "1":
            pytest.skip(f"no libnvrtc and {cb.SKIP_ENV}=1")
        pytest.fail("no libnvrtc loads (the test extra installs nvidia-cuda-nvrtc-cu12)")


def float32_expert_launches(d, x, indices, weights, gate_up, down, num_experts: int):
    """The float32 routed experts as the GPU path has always launched them (fast/gpu/model.py, now
    ``experts.expert_mix(..., bf16=False)``), written out launch by launch on device ``d``: group the tokens by
    expert, gather their rows, the gate/up grouped GEMM, the gated GELU, the down grouped GEMM, the weighted
    combination. Device arrays: x (N, H) float32, indices (N, K) int64, weights (N, K) float32, gate_up
    (E, 2 I_e, H) and down (E, H, I_e) float32. Returns the device arrays out (N, H) and offsets (E + 1,) of the
    groups."""
    N, H = x.shape
    K, E, I_e = indices.shape[1], num_experts, down.shape[2]
    tiles, rows = gl.moe_rows(N, K, E)
    offsets, row_token = d.empty((E + 1,), np.int32), d.empty((rows,), np.int32)
    choice_row, tile_expert = d.empty((N, K), np.int32), d.empty((tiles,), np.int32)
    d.launch(gl.group_experts(indices, E, offsets, row_token, choice_row, tile_expert))
    xg = d.empty((rows, H), np.float32)
    d.launch(gl.gather_rows(x, row_token, xg))
    gu = d.zeros((rows, 2 * I_e), np.float32)
    d.launch(gl.grouped_gemm_nt(xg, gate_up, tile_expert, gu))
    act = d.empty((rows, I_e), np.float32)
    d.launch(gl.gated_gelu(gu, act))
    yo = d.empty((rows, H), np.float32)
    d.launch(gl.grouped_gemm_nt(act, down, tile_expert, yo))
    out = d.empty((N, H), np.float32)
    d.launch(gl.combine_experts(yo, indices, choice_row, weights, out))
    return out, offsets
