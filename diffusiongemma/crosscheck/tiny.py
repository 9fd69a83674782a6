"""The default model of ``crosscheck``: the package's tiny model (``diffusiongemma.tiny``) with a tokenizer.

Every peer reads transformers' checkpoint layout, so the default model is written in it, with a
word-level ``tokenizer.json`` for the peers that insist on one (mlx-vlm's detokenizer, diffusers'
processor). It is SPEC §14's config (sliding and full layers with different head sizes and KV heads, a
window W = 8 shorter than the cross-check's prompts, top-2 experts, a canvas of 16) with every norm weight,
scale and layer scalar redrawn, and two changes of its own:

* the final norm weight times 6 (logits up to about 15), so that stopping rules fire and early stops are
  compared too;
* the image placeholder's embedding row (also its output row, tied) is zero, so the placeholder is
  never generated; EOS's row is halved, so that runs usually span several canvases.

Its self-conditioning is left as drawn: the feedback is expansive (float32 rounding grows from one
denoising step to the next), as on a checkpoint a user brings. The verdict does not rely on a contractive
model: every step is compared on the peer's own inputs (``common.teacher_forced``).
"""

from __future__ import annotations

import os

from diffusiongemma.tiny import EOS_ID, TinySpec, tiny_model, write_checkpoint

FINAL_NORM_GAIN = 6.0
# ``crosscheck --dtype bfloat16``: the same model with hidden size 48, whose sqrt (6.928) is no bfloat16 number
# (bfloat16 rounds it to 6.9375, as it rounds 53.066 to 53.0 for H = 2816; sqrt(64) = 8 would hide the cast), and
# every token routed to all 4 experts (the router's weights, softmax and the experts' float32 sum are compared).
# Top-K routing is checked in bfloat16 too: the stage-forced verdict feeds each layer the peer's own input and
# replays the peer's choice across a router tie (bf16_stages), so a checkpoint with top-2 of 4 agrees as well
# (tests/test_crosscheck_bf16.py).
BF16_SPEC = TinySpec(final_norm_gain=FINAL_NORM_GAIN, hidden_size=48, top_k_experts=4)
GENERATION_CONFIG = {"max_new_tokens": 32, "max_denoising_steps": 12, "t_min": 0.4, "t_max": 0.8,
                     "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
                     "stability_threshold": 1, "confidence_threshold": 0.005}


def write_tiny_checkpoint(directory: str | os.PathLike, spec: TinySpec | None = None, seed: int = 0) -> str:
    """Write the default cross-check checkpoint (weights, config, generation config, tokenizer) into
    ``directory``; returns it."""
    import torch

    spec = spec or TinySpec(final_norm_gain=FINAL_NORM_GAIN)
    model = tiny_model(spec, seed)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[spec.vocab_size - 1].zero_()
        model.model.decoder.embed_tokens.weight[EOS_ID].mul_(0.5)
    return write_checkpoint(directory, spec, seed, model=model, generation_config=GENERATION_CONFIG)
