"""Peer adapter: transformers 5.24.0 ``DiffusionGemmaForBlockDiffusion`` (the ground truth).

Forward: the encoder into a ``DynamicCache``, the decoder at explicit positions, ``lm_head`` and the final
soft-cap, as ``generate`` calls them (``hf_cache`` / ``hf_encode`` / ``hf_denoise``; the benchmarks use them
too); ``layer_outputs`` gives every decoder layer's output, to localise a difference. Generation: ``model.generate`` with torch's RNG seeded; every
``torch.randint`` / ``torch.multinomial`` result is recorded (their order is the draw contract, SPEC §8.3)
and replayed into our loop, so sampler decisions are compared exactly; every decoder call is kept with its
inputs (canvas, self-conditioning logits), with the ids its encoder was given and the cache it read. Semantics on our side:
``transformers``. No adaptation is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .common import ForwardInputs, PeerRun, PeerUnavailable, TorchDrawRecorder, run_forward

NAME = "transformers"
SEMANTICS = "transformers"
INSTALL = 'pip install -e ".[test]"   (torch 2.13.0 CPU, transformers 5.24.0)'


def hf_cache(model):
    """An empty ``DynamicCache`` for a transformers DiffusionGemma."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config.text_config)


def hf_encode(model, cache, ids: np.ndarray, full_mask: np.ndarray | None = None) -> np.ndarray:
    """Encode ``ids`` (B, n) into ``cache`` at the next positions, as ``generate`` does; returns the encoder's
    last hidden state. ``full_mask`` (B, L + n): the attention mask of everything encoded so far."""
    import torch

    past = cache.get_seq_length()
    extra = {} if full_mask is None else {"attention_mask": torch.tensor(full_mask, dtype=torch.long)}
    with torch.no_grad():
        out = model.model.encoder.language_model(input_ids=torch.tensor(ids), cache=cache,
                                                 position_ids=torch.arange(past, past + ids.shape[1])[None], **extra)
    return out.last_hidden_state.float().numpy()


def hf_denoise(model, cache, canvas: np.ndarray, sc: np.ndarray | None = None,
               full_mask: np.ndarray | None = None) -> np.ndarray:
    """Soft-capped float32 logits (B, C, V) of one decoder pass over ``canvas`` at positions L .. L + C - 1,
    with self-conditioning input ``sc`` (B, C, V) or None; ``full_mask`` (B, L + C): the decoder mask.
    ``sc`` is cast to the embedding dtype first, as ``generate`` does (``processed_logits.to(embeddings_dtype)``:
    a no-op in float32, bfloat16 logits for a bfloat16 model)."""
    import torch

    L, C = cache.get_seq_length(), canvas.shape[1]
    embeddings_dtype = model.model.decoder.embed_tokens.weight.dtype
    extra = {} if sc is None else {"self_conditioning_logits": torch.tensor(sc).to(embeddings_dtype)}
    if full_mask is not None:
        extra["decoder_attention_mask"] = torch.tensor(full_mask, dtype=torch.long)
    with torch.no_grad():
        out = model.model.decoder(decoder_input_ids=torch.tensor(canvas), cache=cache,
                                  decoder_position_ids=torch.arange(L, L + C)[None], **extra)
        logits = model.lm_head(out.last_hidden_state).float()
        cap = model.config.text_config.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
    return logits.numpy()


def version() -> str:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise PeerUnavailable(f"transformers/torch are not installed ({exc}); install with: {INSTALL}") from None
    return f"{transformers.__version__} (torch {torch.__version__})"


class Peer:
    """A loaded transformers checkpoint."""

    name = NAME
    semantics = SEMANTICS

    def __init__(self, model_dir: str, workdir: str, dtype: str = "float32"):
        """dtype: "float32" (the reference's default run) or "bfloat16" (upstream's bfloat16 run, SPEC §10)."""
        version()
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        if dtype not in ("float32", "bfloat16"):
            raise PeerUnavailable(f"transformers is cross-checked in float32 or bfloat16, not {dtype!r}")
        try:
            self.model = DiffusionGemmaForBlockDiffusion.from_pretrained(
                model_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
        except Exception as exc:  # transformers raises many kinds on a bad directory
            raise PeerUnavailable(f"transformers cannot load {model_dir!r}: {exc}") from None
        self.adaptations: list[str] = [
            "loaded in float32 with eager attention (the reference computes in float32)" if dtype == "float32" else
            "loaded in bfloat16 with eager attention (dtype=torch.bfloat16, eager_attention_forward: the run the "
            "reference's bfloat16 run reproduces, SPEC §10)"]
        self.defects: list[str] = []

    # -------------------------------------------------------------------------------------- forward
    def _cache(self):
        return hf_cache(self.model)

    def _encode(self, cache, ids: np.ndarray) -> None:
        hf_encode(self.model, cache, ids)

    def _denoise(self, cache, canvas: np.ndarray, sc: np.ndarray | None) -> np.ndarray:
        return hf_denoise(self.model, cache, canvas, sc)

    def layer_outputs(self, contexts: list, canvas: np.ndarray, sc: np.ndarray | None) -> list[np.ndarray]:
        """[decoder input (after self-conditioning), output of decoder layer 0, 1, ...] for ``canvas`` after
        encoding ``contexts`` (each (1, n) int64), as float32 arrays (1, C, H)."""
        cache = self._cache()
        for ids in contexts:
            self._encode(cache, np.asarray(ids))
        decoder, out = self.model.model.decoder, []
        hooks = [decoder.self_conditioning.register_forward_hook(lambda m, a, o: out.append(o))]
        hooks += [layer.register_forward_hook(lambda m, a, o: out.append(o[0] if isinstance(o, tuple) else o))
                  for layer in decoder.layers]
        try:
            self._denoise(cache, canvas, sc)
        finally:
            for hook in hooks:
                hook.remove()
        return [t.detach().float().numpy() for t in out]

    def forward(self, x: ForwardInputs) -> dict[str, np.ndarray]:
        def encode(cache, ids):
            self._encode(cache, ids)
            return cache

        return run_forward(x, self._cache, encode, self._denoise)

    # -------------------------------------------------------------------------------------- generation
    def generate(self, prompt: np.ndarray, settings: Any, seed: int, options: dict) -> PeerRun:
        """``model.generate`` with ``settings`` (our GenerationConfig), recording draws and decoder calls."""
        import torch

        model = self.model
        B, C = prompt.shape[0], int(model.config.canvas_length)
        run = PeerRun(tokens=[])
        kwargs = dict(max_new_tokens=settings.max_new_tokens, max_denoising_steps=settings.max_denoising_steps,
                      t_min=settings.t_min, t_max=settings.t_max, stability_threshold=settings.stability_threshold,
                      confidence_threshold=settings.confidence_threshold,
                      eos_token_id=list(settings.eos_token_id) or None, pad_token_id=settings.pad_token_id)
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound)
        with TorchDrawRecorder(model, run, B, C):
            torch.manual_seed(seed)
            out = model.generate(torch.tensor(prompt), **kwargs)
        run.tokens = [int(t) for t in out.sequences.numpy()[0, prompt.shape[1]:]]
        return run
