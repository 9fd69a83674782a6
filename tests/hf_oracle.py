"""Run the pieces of a transformers DiffusionGemma the way ``generate`` does, returning NumPy arrays.

Used by the parity tests as the ground truth (the functions the cross-check uses, under the tests' names): encoder prefill into a ``DynamicCache`` (its per-layer
keys/values are the golden cache), decoder calls at explicit positions, soft-capped logits.
"""

from __future__ import annotations

import numpy as np

from diffusiongemma.crosscheck import transformers_peer
from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_encode  # noqa: F401  (the tests' names)


def hf_denoise(model, cache, canvas: np.ndarray, sc_logits: np.ndarray | None = None,
               full_mask: np.ndarray | None = None) -> np.ndarray:
    """Soft-capped float32 decoder logits (B, C, V) for ``canvas`` at positions L .. L+C-1."""
    return transformers_peer.hf_denoise(model, cache, canvas, sc_logits, full_mask)


def hf_cache_arrays(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (keys, values), each (B, g, T_l, d)."""
    return [(layer.keys.numpy().copy(), layer.values.numpy().copy()) for layer in cache.layers]


def max_diff_report(rows: list[tuple[str, np.ndarray, np.ndarray]]) -> tuple[float, str]:
    """llm.c-style table: one line per golden tensor with its max |diff|; returns (worst, text)."""
    lines, worst = [], 0.0
    for name, ours, golden in rows:
        assert ours.shape == golden.shape, f"{name}: shape {ours.shape} != golden {golden.shape}"
        diff = float(np.max(np.abs(ours.astype(np.float64) - golden))) if ours.size else 0.0
        worst = max(worst, diff)
        lines.append(f"{name:<32} shape={str(golden.shape):<18} max|diff|={diff:.3e} "
                     f"max|golden|={float(np.max(np.abs(golden))) if golden.size else 0.0:.3e}")
    return worst, "\n".join(lines)
