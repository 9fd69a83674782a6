"""Helpers shared by the GPU kernel tests (tests/test_gpu_bf16.py, test_gpu_attention_bf16.py,
test_gpu_experts_bf16.py, test_gpu_equivalence.py): bfloat16 operands, the accumulation bound of a bfloat16
product, kernel mutations, the NVRTC requirement of the compile checks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
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

