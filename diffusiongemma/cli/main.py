"""The ``diffusiongemma`` command line.

    diffusiongemma generate "And God said"            generate with the shipped tiny model
    diffusiongemma generate --model DIR --chat "Hi"   any checkpoint (transformers or converted)
    diffusiongemma convert SRC DST                    same as diffusiongemma-convert
    diffusiongemma trace --prompt "Hi" -o run.trace   record a golden trace (docs/TRACE_FORMAT.md)
    diffusiongemma compare a.trace b.trace            first tensor at which two traces differ
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .argtypes import non_negative_float, positive_int
from .trace_cmd import COMMANDS as TRACE_COMMANDS
from .trace_cmd import add_commands as add_trace_commands
from .trace_cmd import run_command as run_trace_command

BACKENDS = ("reference", "cpu", "gpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusiongemma", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text by block diffusion")
    gen.add_argument("prompt", help="the prompt text (must not be empty)")
    gen.add_argument("--model", default=None, help="checkpoint directory (default: the shipped tiny-kjv model)")
    gen.add_argument("--backend", choices=BACKENDS, default="reference",
                     help="reference (NumPy), cpu (compiled fast path), gpu (CuPy)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=None, help="tokens to generate (whole canvases)")
    gen.add_argument("--steps", type=positive_int, default=None, help="max denoising steps per canvas")
    gen.add_argument("--seed", type=int, default=0, help="seed of the draw source (Philox)")
    gen.add_argument("--entropy-bound", type=non_negative_float, default=None, help="acceptance entropy bound (nats)")
    gen.add_argument("--t-min", type=non_negative_float, default=None, help="temperature schedule minimum")
    gen.add_argument("--t-max", type=non_negative_float, default=None, help="temperature schedule maximum")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument("--view", choices=("auto", "live", "plain"), default="auto",
                     help="live: redraw the canvas in place while denoising (default when stdout is a terminal)")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    conv = commands.add_parser("convert", help="convert a transformers checkpoint (see diffusiongemma-convert -h)")
    conv.add_argument("args", nargs=argparse.REMAINDER)
    add_trace_commands(commands)  # trace, compare (trace_cmd.py)
    return parser


def run_generate(args) -> int:
    from diffusiongemma.reference.generate import GenerationConfig

    from .checkpoint import default_model_dir, generate_function, load_model, load_text_side
    from .live_view import LiveCanvasView

    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text to continue, e.g. diffusiongemma generate \"And God said\"")
    path = args.model or default_model_dir()
    t0 = time.perf_counter()
    text_side = load_text_side(path)
    model = load_model(path, args.backend)
    try:
        settings = GenerationConfig.from_pretrained(path)
    except FileNotFoundError:
        settings = GenerationConfig(eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    changes = {"max_new_tokens": args.max_new_tokens, "max_denoising_steps": args.steps,
               "entropy_bound": args.entropy_bound, "t_min": args.t_min, "t_max": args.t_max}
    settings = settings.replace(**{k: v for k, v in changes.items() if v is not None})
    load_seconds = time.perf_counter() - t0

    prompt_text = text_side.apply_chat_template(args.prompt) if args.chat else args.prompt
    prompt_ids = text_side.encode(prompt_text, add_special_tokens=not args.chat)
    if not prompt_ids:
        raise ValueError(f"the prompt {args.prompt!r} tokenizes to nothing")
    live = args.view == "live" or (args.view == "auto" and not args.json and sys.stdout.isatty())
    view = LiveCanvasView(text_side, prompt_text) if live else None

    t1 = time.perf_counter()
    result = generate_function(args.backend)(
        model, np.array([prompt_ids], dtype=np.int64), generation_config=settings, random=args.seed,
        callback=view, progress=not args.no_progress and not live)
    seconds = time.perf_counter() - t1
    if view is not None:
        view.close()

    new_ids = [int(t) for t in result.sequences[0, len(prompt_ids):]]
    pad = settings.pad_token_id
    n_real = sum(1 for t in new_ids if t != pad)
    text = text_side.decode(new_ids)
    if args.json:
        print(json.dumps({
            "prompt": args.prompt, "prompt_text": prompt_text, "text": text, "prompt_token_ids": prompt_ids,
            "token_ids": new_ids, "tokens_per_forward": float(result.tokens_per_forward[0]),
            "steps_per_canvas": [int(s) for s in result.steps_per_canvas],
            "decoder_passes": int(result.forward_passes[0]) if result.forward_passes is not None else None,
            "timings": {"load_s": round(load_seconds, 4), "generate_s": round(seconds, 4),
                        "tokens_per_s": round(n_real / seconds, 2) if seconds > 0 else None},
            "settings": settings.to_dict(), "model": path, "backend": args.backend, "seed": args.seed,
        }, ensure_ascii=False))
    else:
        print(prompt_text + text)
        print(f"[{n_real} tokens in {seconds:.2f} s: {n_real / seconds:.1f} tokens/s, "
              f"{float(result.tokens_per_forward[0]):.2f} tokens per forward, "
              f"steps per canvas {list(result.steps_per_canvas)}, backend {args.backend}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert":
        from diffusiongemma.weights_converter.cli import main as convert_main

        return convert_main(args.args)
    if args.command in TRACE_COMMANDS:
        return run_trace_command(args)
    try:
        return run_generate(args)
    except (ValueError, OSError, RuntimeError) as exc:  # ConfigError/CheckpointError/InputError are ValueErrors
        print(f"diffusiongemma: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
