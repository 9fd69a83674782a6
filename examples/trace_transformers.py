"""Record a golden trace from transformers itself: the real ``DiffusionGemmaForBlockDiffusion`` running its
own ``generate``, observed through hooks, with torch's random draws kept so that another implementation
can replay them.

    python examples/trace_transformers.py --model DIR --prompt "And God said" --seed 0 -o hf.trace
    diffusiongemma trace --model DIR --replay hf.trace -o ours.trace     # our run, replaying torch's draws
    diffusiongemma compare hf.trace ours.trace                          # 0: same run; 1: first divergence

(``--model`` defaults to the shipped tiny-kjv model, which is a transformers checkpoint.) The model runs in
float32 with eager attention, the setting in which the reference is checked against transformers.

How each traced value is obtained (transformers 5.24.0; nothing in transformers is changed, only observed):

* encoder keys/values: a forward hook on ``model.model.encoder`` reads the ``DynamicCache`` it filled
  (``cache.layers[l].keys / .values``: what each layer retains);
* decoder input: the output of ``model.model.decoder.self_conditioning`` (embedding + self-conditioning
  signal after the outer norm); layer outputs: forward hooks on ``model.model.decoder.layers[l]``;
* logits: ``model.forward`` (which ``generate`` calls as its decoder) is wrapped; its ``logits`` are the
  soft-capped float32 values the sampler receives;
* temperature: the ``LinearTemperatureScheduleLogitsProcessor`` call is observed and its schedule
  evaluated on the same float32 ``cur_step`` tensor;
* sampled ids and the initial/renoise canvases: ``torch.multinomial`` and ``torch.randint`` are wrapped
  (kept as the draw tape: a ``randint`` right after a ``multinomial`` is a renoise draw, otherwise an
  initial canvas);
* acceptance mask: ``EntropyBoundSampler.accept_canvas`` is observed (its ``accepted_token_mask``);
* draft, renoised canvas, finished rows: the outputs of ``_denoising_step`` (frozen rows included); the
  sampler's entropies are those of the self-conditioning logits it returns (the processed logits, frozen
  rows keeping their previous ones), computed with ``torch.distributions.Categorical`` as transformers does;
* committed canvas and ended rows: the outputs of ``_finalize_canvas``.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from typing import Any

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.generate import GenerationConfig
from diffusiongemma.trace import DEFAULT_TOP_K, TraceRecorder, layers_by_default


def hf_generate_kwargs(config: GenerationConfig) -> dict[str, Any]:
    """Our ``GenerationConfig`` as keyword arguments of transformers' ``generate`` (same meaning)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kwargs = dict(max_new_tokens=config.max_new_tokens, max_denoising_steps=config.max_denoising_steps,
                  sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(config.entropy_bound)),
                  t_min=config.t_min, t_max=config.t_max, stability_threshold=config.stability_threshold,
                  confidence_threshold=config.confidence_threshold,
                  eos_token_id=list(config.eos_token_id) or None, pad_token_id=config.pad_token_id)
    if config.max_length is not None:
        kwargs["max_length"] = config.max_length
    return kwargs


@contextmanager
def _patched(owner: Any, name: str, replacement: Any):
    """Set ``owner.name = replacement`` for the duration of the block (restored even on error)."""
    had = name in vars(owner)
    saved = vars(owner).get(name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, saved)
        else:
            delattr(owner, name)


def record_transformers_trace(hf_model, input_ids: np.ndarray, generation_config: GenerationConfig, *,
                              seed: int = 0, attention_mask: np.ndarray | None = None, layers: bool = False,
                              logits: str = "auto", top_k: int = DEFAULT_TOP_K) -> TraceRecorder:
    """Run ``hf_model.generate`` on ``input_ids`` (B, P) with torch seeded by ``seed`` and return the finished
    ``TraceRecorder`` (call ``.save(path)``). ``attention_mask`` (B, P) 0/1 needs a model with sdpa attention
    (transformers 5.24.0's eager path fails on masked generate). Every patch and hook is removed on return.
    """
    import torch
    import transformers
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as hf_generation

    recorder = TraceRecorder(layers=layers, logits=logits, top_k=top_k,
                             producer=f"transformers {transformers.__version__} (torch {torch.__version__})")
    config = ModelConfig.from_transformers(hf_model.config.to_dict())
    ids = np.asarray(input_ids, dtype=np.int64)
    recorder.begin_run(config, generation_config, ids, attention_mask)
    recorder.header["draws"].update(source=f"torch {torch.__version__} global RNG", seed=int(seed))
    C = config.canvas_length
    tape: list[tuple[str, np.ndarray]] = []
    pending: dict[str, Any] = {}  # what the current step's patched calls saw
    state = {"encodes": 0, "canvas_open": False}
    randint, multinomial = torch.randint, torch.multinomial
    accept, schedule = hf_generation.EntropyBoundSampler.accept_canvas, \
        hf_generation.LinearTemperatureScheduleLogitsProcessor.__call__
    forward, denoising_step, finalize = hf_model.forward, hf_model._denoising_step, hf_model._finalize_canvas

    def numpy(tensor):
        return tensor.detach().cpu().numpy().copy()

    def traced_randint(*args, **kwargs):
        out = randint(*args, **kwargs)
        kind = "renoise" if tape and tape[-1][0] == "categorical" else "canvas"
        tape.append((kind, numpy(out).astype(np.int64)))
        return out

    def traced_multinomial(probs, num_samples, *args, **kwargs):
        out = multinomial(probs, num_samples, *args, **kwargs)
        sampled = numpy(out).astype(np.int64).reshape(ids.shape[0], C)
        tape.append(("categorical", sampled))
        pending["sampled"] = sampled
        return out

    def traced_accept(self, *args, **kwargs):
        out = accept(self, *args, **kwargs)
        pending["accepted"] = numpy(self.accepted_token_mask).astype(bool)
        return out

    def traced_schedule(self, input_ids, scores, cur_step):
        fraction = cur_step / self.max_denoising_steps  # float32 tensor, as in the processor
        pending["temperature"] = np.float32(numpy(self.t_min + (self.t_max - self.t_min) * fraction))
        return schedule(self, input_ids, scores, cur_step)

    def traced_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        recorder.logits(numpy(out.logits).astype(np.float32))
        return out

    def traced_denoising_step(**kwargs):
        if not state["canvas_open"]:
            recorder.begin_canvas(numpy(kwargs["current_canvas"]))
            state["canvas_open"] = True
        recorder.begin_step(~numpy(kwargs["finished_denoising"]).astype(bool))
        pending.clear()
        canvas, draft, sc_logits, finished = denoising_step(**kwargs)
        entropies = torch.distributions.Categorical(logits=sc_logits.float()).entropy()
        recorder.end_step(temperature=pending.get("temperature"), draft=numpy(draft), sampled=pending["sampled"],
                          entropies=numpy(entropies), accepted=pending["accepted"], canvas=numpy(canvas),
                          finished=numpy(finished))
        return canvas, draft, sc_logits, finished

    def traced_finalize(**kwargs):
        sequences, ended = finalize(**kwargs)
        recorder.commit(numpy(sequences[:, -C:]), numpy(ended))
        state["canvas_open"] = False
        return sequences, ended

    def before_encoder(module, args, kwargs):
        mask = attention_mask if state["encodes"] == 0 else None
        recorder.begin_encode(numpy(kwargs["input_ids"]), mask)
        state["encodes"] += 1

    def after_encoder(module, args, kwargs, output):
        for layer, entry in enumerate(output.cache.layers):
            recorder.encoder_kv(layer, numpy(entry.keys), numpy(entry.values))
        recorder.end_encode()

    decoder = hf_model.model.decoder
    hooks = [hf_model.model.encoder.register_forward_pre_hook(before_encoder, with_kwargs=True),
             hf_model.model.encoder.register_forward_hook(after_encoder, with_kwargs=True),
             decoder.self_conditioning.register_forward_hook(lambda m, a, out: recorder.decoder_input(numpy(out)))]
    if layers:
        for l, module in enumerate(decoder.layers):
            hooks.append(module.register_forward_hook(
                lambda m, a, out, l=l: recorder.decoder_layer(l, numpy(out))))
    try:
        with _patched(torch, "randint", traced_randint), _patched(torch, "multinomial", traced_multinomial), \
                _patched(hf_generation.EntropyBoundSampler, "accept_canvas", traced_accept), \
                _patched(hf_generation.LinearTemperatureScheduleLogitsProcessor, "__call__", traced_schedule), \
                _patched(hf_model, "forward", traced_forward), \
                _patched(hf_model, "_denoising_step", traced_denoising_step), \
                _patched(hf_model, "_finalize_canvas", traced_finalize):
            torch.manual_seed(seed)
            extra = {} if attention_mask is None else {"attention_mask": torch.tensor(np.asarray(attention_mask))}
            with torch.no_grad():
                out = hf_model.generate(torch.tensor(ids), **extra, **hf_generate_kwargs(generation_config))
    finally:
        for hook in hooks:
            hook.remove()
    recorder.end_run(numpy(out.sequences), tape=tape)
    return recorder


# ------------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="transformers checkpoint directory (default: shipped tiny-kjv)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer.json)")
    source.add_argument("--prompt-ids", help="prompt token ids, e.g. 2,818,7")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before generate")
    parser.add_argument("-o", "--output", required=True, help="trace file to write")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="max denoising steps per canvas")
    parser.add_argument("--layers", action=argparse.BooleanOptionalAction, default=None,
                        help="record decoder layer outputs (default: small models only)")
    parser.add_argument("--logits", choices=("auto", "full", "topk"), default="auto")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    args = parser.parse_args(argv)

    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.checkpoint import default_model_dir, load_text_side

    path = args.model or default_model_dir()
    hf_model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    if args.prompt_ids is not None:
        ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    else:
        ids = load_text_side(path).encode(args.prompt)
    if not ids:
        parser.error("the prompt is empty")
    config = ModelConfig.from_transformers(hf_model.config.to_dict())
    try:
        settings = GenerationConfig.from_pretrained(path)
    except FileNotFoundError:
        settings = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    changes = {"max_new_tokens": args.max_new_tokens, "max_denoising_steps": args.steps}
    settings = settings.replace(**{k: v for k, v in changes.items() if v is not None})
    layers = layers_by_default(config) if args.layers is None else args.layers
    recorder = record_transformers_trace(hf_model, np.array([ids], dtype=np.int64), settings, seed=args.seed,
                                         layers=layers, logits=args.logits, top_k=args.top_k)
    recorder.save(args.output)
    print(f"wrote {args.output}: {len(recorder.entries)} tensors, {len(recorder.header['draws']['tape'])} draws, "
          f"layer outputs {'on' if layers else 'off'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
