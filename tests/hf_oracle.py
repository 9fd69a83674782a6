"""Run the pieces of a transformers DiffusionGemma the way ``generate`` does, returning NumPy arrays.

Used by the cross-check tests as the ground truth: encoder prefill into a ``DynamicCache`` (its per-layer
keys/values are the golden cache), decoder calls at explicit positions, soft-capped logits.
"""

from __future__ import annotations

import numpy as np


def hf_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.text_config)


def hf_encode(model, cache, ids: np.ndarray, full_mask: np.ndarray | None = None) -> np.ndarray:
    """Encode ``ids`` (B, n) into ``cache``; ``full_mask`` (B, L + n) covers everything encoded so far."""
    import torch

    past = cache.get_seq_length()
    positions = torch.arange(past, past + ids.shape[1])[None]
    kwargs = {}
    if full_mask is not None:
        kwargs["attention_mask"] = torch.tensor(full_mask, dtype=torch.long)
    with torch.no_grad():
        out = model.model.encoder.language_model(input_ids=torch.tensor(ids), cache=cache,
                                                 position_ids=positions, **kwargs)
    return out.last_hidden_state.numpy()


def hf_denoise(model, cache, canvas: np.ndarray, sc_logits: np.ndarray | None = None,
               full_mask: np.ndarray | None = None) -> np.ndarray:
    """Soft-capped float32 decoder logits (B, C, V) for ``canvas`` at positions L .. L+C-1.

    ``full_mask`` (B, L + C): the 2-D decoder attention mask ``generate`` builds (1 = real).
    """
    import torch

    L, C = cache.get_seq_length(), canvas.shape[1]
    kwargs = {}
    if sc_logits is not None:
        kwargs["self_conditioning_logits"] = torch.tensor(sc_logits)
    if full_mask is not None:
        kwargs["decoder_attention_mask"] = torch.tensor(full_mask, dtype=torch.long)
    with torch.no_grad():
        out = model.model.decoder(decoder_input_ids=torch.tensor(canvas), cache=cache,
                                  decoder_position_ids=torch.arange(L, L + C)[None], **kwargs)
        logits = model.lm_head(out.last_hidden_state).float()
        cap = model.config.text_config.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
    return logits.numpy()


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
