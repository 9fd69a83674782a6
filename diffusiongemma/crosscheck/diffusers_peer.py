"""Peer adapter: diffusers' ``DiffusionGemmaPipeline`` with ``EntropyBoundScheduler`` or
``BlockRefinementScheduler``, on the transformers model.

Forward: the pipeline has no forward of its own (it calls the transformers model), so the forward rows
are transformers' and this adapter reuses the transformers peer for them.

Adaptations (in memory, on the loaded model object; the checkpoint is never touched):

* With transformers >= 5.24 the pipeline fails in its first block:
  ``create_diffusion_decoder_attention_mask() got an unexpected keyword argument 'past_key_values'``
  (transformers renamed the argument ``cache``; its other entry points still accept the old name through a
  deprecation shim, this static method does not). The adapter wraps that one method on the loaded
  decoder to rename the keyword.
* The pipeline takes text and a processor with ``apply_chat_template``; the adapter passes a small
  processor that returns the cross-check's prompt ids unchanged (no template), so both sides see the same
  ids.

Random draws: the pipeline and both schedulers draw through ``torch.randint`` / ``torch.multinomial``
with the pipeline's generator; the adapter records them in our draw order (canvas, then per step the
categorical draw and the renoise ids) and replays them into our loop: exact comparison.
Semantics on our side: ``diffusers`` (EntropyBound) or ``diffusers`` with the block-refinement switches.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from . import transformers_peer
from .common import ForwardInputs, PeerRun, PeerUnavailable, TorchDrawRecorder

NAME = "diffusers"
SEMANTICS = "diffusers"
INSTALL = 'pip install -e ".[diffusers]"   (diffusers; it runs on the transformers model)'


def version() -> str:
    transformers_peer.version()
    try:
        from importlib.metadata import version as dist_version

        from diffusers import DiffusionGemmaPipeline  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"diffusers is not installed or has no DiffusionGemmaPipeline ({exc}); "
                              f"install with: {INSTALL}") from None
    return dist_version("diffusers")


class _PromptProcessor:
    """The processor the pipeline calls: returns fixed prompt ids, decodes to id strings."""

    def __init__(self, ids: np.ndarray, eos_token_id: int | None):
        self.ids, self.eos_token_id = ids, eos_token_id

    def apply_chat_template(self, messages, **kwargs):
        import torch

        ids = torch.tensor(self.ids)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batch_decode(self, sequences, **kwargs):
        return [" ".join(str(int(t)) for t in row) for row in sequences]


class Peer:
    """The pipeline on a transformers checkpoint."""

    name = NAME
    semantics = SEMANTICS

    def __init__(self, model_dir: str, workdir: str, dtype: str = "float32"):
        """dtype: "float32", or "bfloat16" (the transformers model loaded with dtype=torch.bfloat16)."""
        version()
        self.hf = transformers_peer.Peer(model_dir, workdir, dtype=dtype)
        self.model = self.hf.model
        self.adaptations = list(self.hf.adaptations)
        self.defects: list[str] = []
        decoder = self.model.model.decoder
        original = type(decoder).create_diffusion_decoder_attention_mask
        if "past_key_values" not in inspect.signature(original).parameters:
            def renamed(*args, past_key_values=None, **kwargs):
                if past_key_values is not None:
                    kwargs["cache"] = past_key_values
                return original(*args, **kwargs)

            decoder.create_diffusion_decoder_attention_mask = renamed
            self.adaptations.append("decoder.create_diffusion_decoder_attention_mask wrapped on the loaded model to "
                                    "rename past_key_values= to cache= (transformers 5.24 renamed it; the pipeline "
                                    "fails without this)")
            self.defects.append("diffusers 0.42.1 + transformers 5.24: the pipeline raises TypeError "
                                "(unexpected keyword 'past_key_values') in create_diffusion_decoder_attention_mask")
        self.adaptations.append("prompt ids passed through a processor stand-in (no chat template)")

    def forward(self, x: ForwardInputs) -> dict[str, np.ndarray]:
        return self.hf.forward(x)

    def generate(self, prompt: np.ndarray, settings: Any, seed: int, options: dict) -> PeerRun:
        """The pipeline with ``options['scheduler']`` ("entropy-bound" or "block-refinement",
        ``options.get('threshold', 0.95)``), recording draws and decoder calls."""
        import torch
        from diffusers import BlockRefinementScheduler, DiffusionGemmaPipeline, EntropyBoundScheduler

        model = self.model
        B, C = prompt.shape[0], int(model.config.canvas_length)
        if options.get("scheduler", "entropy-bound") == "block-refinement":
            scheduler = BlockRefinementScheduler(threshold=float(options.get("threshold", 0.95)))
        else:
            scheduler = EntropyBoundScheduler(entropy_bound=settings.entropy_bound, t_max=settings.t_max,
                                              t_min=settings.t_min)
        eos = settings.eos_token_id[0] if settings.eos_token_id else None
        pipe = DiffusionGemmaPipeline(model=model, scheduler=scheduler, processor=_PromptProcessor(prompt, eos))
        pipe.set_progress_bar_config(disable=True)
        run = PeerRun(tokens=[])
        with TorchDrawRecorder(model, run, B, C):
            out = pipe(prompt="(ids given by the processor stand-in)", gen_length=settings.max_new_tokens,
                       num_inference_steps=settings.max_denoising_steps, temperature=0.0,
                       stability_threshold=settings.stability_threshold if settings.stability_threshold is not None else 1,
                       confidence_threshold=settings.confidence_threshold if settings.stability_threshold is not None
                       else None, eos_token_id=eos, generator=torch.Generator().manual_seed(seed), output_type="seq")
        run.tokens = [int(t) for t in out.sequences.numpy()[0]]
        return run
