"""Peer adapter: mlx-vlm's ``diffusion_gemma`` model and ``stream_diffusion_generate`` on mlx's CPU device.

Adaptations (all in a temporary copy of the checkpoint, never in the user's directory):

* mlx-vlm reads the full layers' head size and KV heads only from ``text_config.global_head_dim`` /
  ``num_global_key_value_heads`` (defaulting to the 26B model's 512 / 2); transformers 5.24 writes them
  into ``per_layer_config`` instead. The copy gets the two keys from ``per_layer_config`` read as
  transformers reads it (``full_layer_shape``: a key an entry leaves out keeps ``text_config``'s value).
* The generation settings are handed to mlx-vlm explicitly (``model.config.generation_config``), so both
  sides run the same N, t_min/t_max, bound and thresholds.
* A tokenizer with mlx-vlm's ``StoppingCriteria`` and streaming detokenizer is built from the checkpoint's
  ``tokenizer.json`` (mlx-vlm's own loader wants a full processor); a checkpoint without one gets a
  word-level stand-in in the copy.

Teacher forcing: the ids given to ``diffusion_prefill_cache`` / ``diffusion_update_cache`` are the
context; the logits given to ``diffusion_self_conditioning`` are the next decoder call's self-conditioning
input.

Random draws: mlx-vlm makes every uniform draw (initial canvas, renoise) through one module function,
``_diffusion_initialize_canvas``; the adapter records its results and replays them into our loop. At
temperature 0 (its default) the proposals are argmaxes, so no categorical draw exists and the comparison
is exact. At its last step mlx-vlm breaks before renoising; that step's renoise draw cannot influence the
committed argmax, so the replay tape gets a placeholder there. With temperature > 0 mlx-vlm draws
categoricals with ``mx.random.categorical`` (Gumbel noise inside mlx), which cannot be replayed: those
settings are not compared. Semantics on our side: ``mlx-vlm`` (its confidence-threshold sampler) or
``mlx-vlm`` with ``sampler="entropy-bound"``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np

from diffusiongemma.reference.support.config_io import per_layer_overrides
from diffusiongemma.reference.support.errors import ConfigError

from .common import Call, ForwardInputs, PeerRun, PeerUnavailable, run_forward

NAME = "mlx-vlm"
SEMANTICS = "mlx-vlm"
INSTALL = 'pip install -e ".[mlx]"   (mlx[cpu] and mlx-vlm; mlx runs on the CPU on Linux)'


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        import mlx.core  # noqa: F401
        import mlx_vlm.models.diffusion_gemma  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"mlx-vlm is not installed ({exc}); install with: {INSTALL}") from None
    return f"{dist_version('mlx-vlm')} (mlx {dist_version('mlx')})"


def full_layer_shape(text: dict) -> tuple[int, int] | None:
    """(head_dim, num_key_value_heads) of the full-attention layers as transformers reads ``text_config``.

    With a ``per_layer_config`` (transformers 5.15+ writes one, ``{}`` when no layer differs), a layer's
    entry overrides ``text_config`` and a key the entry leaves out (or a layer without an entry) keeps
    ``text_config``'s value. Without one, transformers converts ``global_head_dim`` (default 512) and
    ``num_global_key_value_heads`` (default: ``text_config``'s KV heads). None when there is no full layer.
    Raises ``PeerUnavailable`` when mlx-vlm cannot express the layout (it has one shape for every full
    layer and nothing per sliding layer)."""
    types = list(text.get("layer_types") or [])
    per_layer = text.get("per_layer_config")
    head_dim, kv_heads = int(text.get("head_dim", 256)), int(text.get("num_key_value_heads", 8))
    if per_layer is None:
        if "full_attention" not in types:
            return None
        kv = text.get("num_global_key_value_heads")
        return int(text.get("global_head_dim", 512)), int(kv) if kv is not None else kv_heads
    try:  # keys as transformers writes them ("05") or plainly ("5", 5): one reading for every peer
        per_layer = per_layer_overrides(per_layer, len(types))
    except ConfigError as error:
        raise PeerUnavailable(f"text_config.{error}") from None
    shapes, sliding = {}, []
    for i, kind in enumerate(types):
        over = per_layer.get(i) or {}
        if kind == "full_attention":
            shapes[i] = (int(over.get("head_dim", head_dim)), int(over.get("num_key_value_heads", kv_heads)))
        elif over:
            sliding.append(i)
    if sliding:
        raise PeerUnavailable(f"per_layer_config overrides sliding layer(s) {sliding}; mlx-vlm reads one shape "
                              "for every sliding layer (text_config) and cannot load this checkpoint")
    distinct = sorted(set(shapes.values()))
    if len(distinct) > 1:
        raise PeerUnavailable(f"the full-attention layers have different (head_dim, num_key_value_heads) "
                              f"{distinct} in per_layer_config; mlx-vlm reads one global_head_dim / "
                              "num_global_key_value_heads for all of them and cannot load this checkpoint")
    return distinct[0] if distinct else None


def adapt_checkpoint(model_dir: str, workdir: str) -> tuple[str, list[str]]:
    """Copy the checkpoint into ``workdir`` and add what mlx-vlm needs; returns (copy, adaptations)."""
    target = os.path.join(workdir, "mlx-vlm-checkpoint")
    shutil.copytree(model_dir, target)
    done = []
    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    text = config.get("text_config", {})
    shape = full_layer_shape(text)
    if shape is not None and (text.get("global_head_dim"), text.get("num_global_key_value_heads")) != shape:
        text["global_head_dim"], text["num_global_key_value_heads"] = shape
        done.append(f"config.json (temporary copy): text_config.global_head_dim={shape[0]} and "
                    f"num_global_key_value_heads={shape[1]} set as transformers reads the full layers "
                    "(per_layer_config, missing keys falling back to text_config; mlx-vlm ignores "
                    "per_layer_config and would assume 512 / 2)")
    with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if not os.path.isfile(os.path.join(target, "tokenizer.json")) and isinstance(text.get("vocab_size"), int):
        from diffusiongemma.tiny import write_word_tokenizer

        write_word_tokenizer(target, text["vocab_size"])
        done.append("tokenizer.json (temporary copy): the checkpoint has none and mlx-vlm's generate needs one; "
                    "a word-level stand-in with one token per id (the cross-check compares ids, never text)")
    return target, done


class Peer:
    """A checkpoint loaded by mlx-vlm."""

    name = NAME
    semantics = SEMANTICS

    def __init__(self, model_dir: str, workdir: str):
        version()
        import mlx.core as mx
        from mlx_vlm.utils import load_model

        mx.set_default_device(mx.cpu)
        self.path, self.adaptations = adapt_checkpoint(model_dir, workdir)
        try:
            from pathlib import Path

            self.model = load_model(Path(self.path))
        except Exception as exc:
            raise PeerUnavailable(f"mlx-vlm cannot load {model_dir!r}: {exc}") from None
        self.defects: list[str] = []
        self.adaptations.append("run on mlx's CPU device, float32 weights as stored")

    @staticmethod
    def context_map(image_token_id: int | None, pad_token_id: int | None):
        """mlx-vlm's encoding rule for a text-only context: the image placeholder id is embedded as the pad
        id (known difference 2 in docs/PEERS.md); None when there is nothing to rewrite."""
        if image_token_id is None or pad_token_id is None:
            return None

        def rewrite(ids: np.ndarray):
            hits = np.flatnonzero(np.asarray(ids).ravel() == image_token_id)
            if hits.size == 0:
                return ids, None
            out = np.where(ids == image_token_id, pad_token_id, ids)
            return out, (f"the image placeholder id {image_token_id} at position(s) {hits.tolist()} encoded as the "
                         f"pad id {pad_token_id}, as mlx-vlm does")

        return rewrite

    # -------------------------------------------------------------------------------------- forward
    def _denoise(self, cache, canvas: np.ndarray, sc: np.ndarray | None) -> np.ndarray:
        import mlx.core as mx

        m = self.model
        masks = m.diffusion_decoder_masks(mx.array(canvas), cache, None)
        signal = None
        if sc is not None:
            signal = m.diffusion_self_conditioning(mx.array(sc), m.diffusion_prepare_self_conditioning())
        logits = m.diffusion_decoder_logits(mx.array(canvas), cache=cache, self_conditioning=signal,
                                            decoder_attention_mask=masks)
        return np.array(logits.astype(mx.float32))

    def forward(self, x: ForwardInputs) -> dict[str, np.ndarray]:
        import mlx.core as mx

        m = self.model

        def new_cache():
            return [m.make_cache(), True]

        def encode(state, ids):
            if state[1]:  # the prompt: mlx-vlm's prefill entry point
                state[0] = m.diffusion_prefill_cache(mx.array(ids), attention_mask=None, cache=state[0],
                                                     pixel_values=None, mm_token_type_ids=None,
                                                     prefill_step_size=None, chunk_prefill=False)
            else:  # a committed canvas
                state[0] = m.diffusion_update_cache(mx.array(ids), cache=state[0])
            state[1] = False
            return state

        return run_forward(x, new_cache, encode, lambda state, c, sc: self._denoise(state[0], c, sc))

    # -------------------------------------------------------------------------------------- generation
    def _tokenizer(self, eos_ids: list[int]):
        from pathlib import Path

        from mlx_vlm.tokenizer_utils import load_tokenizer
        from mlx_vlm.utils import StoppingCriteria
        from transformers import PreTrainedTokenizerFast

        file = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(file):
            raise PeerUnavailable(f"mlx-vlm generation needs a tokenizer.json in {self.path!r}")
        tok = PreTrainedTokenizerFast(tokenizer_file=file)
        tok.detokenizer = load_tokenizer(Path(self.path), return_tokenizer=False)(tok)
        tok.stopping_criteria = StoppingCriteria(list(eos_ids), tok)
        return tok

    def generate(self, prompt: np.ndarray, settings: Any, seed: int, options: dict) -> PeerRun:
        """``stream_diffusion_generate`` at temperature 0 with ``options['sampler']`` (confidence-threshold or
        entropy-bound) and ``options.get('threshold', 0.9)``; records draws and decoder calls."""
        import mlx.core as mx
        from mlx_vlm.generate import diffusion as engine

        m = self.model
        m.config.generation_config = {
            "max_new_tokens": settings.max_new_tokens, "max_denoising_steps": settings.max_denoising_steps,
            "t_min": settings.t_min, "t_max": settings.t_max,
            "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": settings.entropy_bound},
            "stability_threshold": settings.stability_threshold,
            "confidence_threshold": settings.confidence_threshold,
            "eos_token_id": list(settings.eos_token_id)}
        if settings.stability_threshold is None or settings.confidence_threshold is None:
            for key in ("stability_threshold", "confidence_threshold"):
                m.config.generation_config.pop(key)
        run = PeerRun(tokens=[])
        draw_canvas = engine._diffusion_initialize_canvas
        position = {"canvas": -1, "step": 0}

        def recording_draw(batch_size, canvas_length, vocab_size, dtype):
            out = draw_canvas(batch_size, canvas_length, vocab_size, dtype)
            run.tape.append(("renoise", np.array(out).astype(np.int64)))  # relabelled below for a canvas
            return out

        logits_fn = m.diffusion_decoder_logits
        sc_fn, prefill_fn, update_fn = (m.diffusion_self_conditioning, m.diffusion_prefill_cache,
                                        m.diffusion_update_cache)
        pending = {"sc": None}  # the logits the engine turned into the next call's self-conditioning signal

        def recording_sc(logits, *args, **kw):
            pending["sc"] = np.array(mx.array(logits).astype(mx.float32))
            return sc_fn(logits, *args, **kw)

        def recording_prefill(ids, *args, **kw):
            run.contexts.append(np.array(ids).astype(np.int64).reshape(1, -1))
            return prefill_fn(ids, *args, **kw)

        def recording_update(ids, *args, **kw):
            run.contexts.append(np.array(ids).astype(np.int64).reshape(1, -1))
            return update_fn(ids, *args, **kw)

        def recording_logits(canvas, cache=None, self_conditioning=None, decoder_attention_mask=None):
            out = logits_fn(canvas, cache=cache, self_conditioning=self_conditioning,
                            decoder_attention_mask=decoder_attention_mask)
            known = self_conditioning is None or pending["sc"] is not None
            if not known:
                run.sc_note = ("mlx-vlm built a self-conditioning signal without diffusion_self_conditioning; those "
                               "decoder calls are not teacher-forced")
            run.calls.append(Call(position["canvas"], position["step"], np.array(canvas).astype(np.int64),
                                  None if self_conditioning is None else pending["sc"],
                                  np.array(out.astype(mx.float32)), sc_known=known))
            pending["sc"] = None
            position["step"] += 1
            run.steps_per_canvas[-1] += 1
            return out

        masks_fn = m.diffusion_decoder_masks

        def new_canvas_masks(canvas, cache, mask):  # once per canvas, right after its initial draw
            initial = run.tape.pop()[1]
            if position["canvas"] >= 0:
                self._pad_last_renoise(run)
            run.tape.append(("canvas", initial))
            position["canvas"] += 1
            position["step"] = 0
            run.steps_per_canvas.append(0)
            return masks_fn(canvas, cache, mask)

        engine._diffusion_initialize_canvas = recording_draw
        m.diffusion_decoder_logits = recording_logits
        m.diffusion_decoder_masks = new_canvas_masks
        m.diffusion_self_conditioning = recording_sc
        m.diffusion_prefill_cache, m.diffusion_update_cache = recording_prefill, recording_update
        try:
            mx.random.seed(seed)
            tok = self._tokenizer(list(settings.eos_token_id))
            results = engine.stream_diffusion_generate(
                m, tok, tok, mx.array(prompt), None, None, max_tokens=settings.max_new_tokens,
                skip_special_token_ids=[], temperature=0.0, max_denoising_steps=settings.max_denoising_steps,
                diffusion_sampler=options.get("sampler", "confidence-threshold"),
                diffusion_threshold=options.get("threshold"))
            tokens = []
            for r in results:
                if r.token is not None and not r.is_draft and not r.diffusion_block_complete and r.finish_reason is None:
                    tokens.append(int(r.token))
        finally:
            engine._diffusion_initialize_canvas = draw_canvas
            for name in ("diffusion_decoder_logits", "diffusion_decoder_masks", "diffusion_self_conditioning",
                         "diffusion_prefill_cache", "diffusion_update_cache"):
                delattr(m, name)
        self._pad_last_renoise(run)
        run.tokens = tokens
        return run

    @staticmethod
    def _pad_last_renoise(run: PeerRun) -> None:
        """mlx-vlm skips the renoise draw of its last executed step when that step is cur_step 1; add a
        placeholder so that our loop (which always draws it) replays the same tape."""
        steps = run.steps_per_canvas[-1] if run.steps_per_canvas else 0
        renoises = 0
        for kind, _ in reversed(run.tape):
            if kind == "canvas":
                break
            renoises += 1
        if steps and renoises == steps - 1:
            shape = run.tape[-1][1].shape
            run.tape.append(("renoise", np.zeros(shape, dtype=np.int64)))
