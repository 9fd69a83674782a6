"""The ``trace`` and ``compare`` subcommands: record a golden trace of one generation run, and find the
first tensor at which two traces part (file format: docs/TRACE_FORMAT.md).

    diffusiongemma trace --prompt "And God said" --seed 0 -o ref.trace          the shipped tiny model
    diffusiongemma trace --model DIR --prompt-ids 2,818,7 --steps 4 -o ref.trace
    diffusiongemma trace --model DIR --replay other.trace -o ours.trace         same prompt, settings, draws
    diffusiongemma compare ref.trace port.trace [--atol 2e-4] [--rtol 1e-4] [--only forward|sampler|all] [--full | --summary]

``compare`` exits with status 0 when every compared tensor agrees, 1 when a tolerance is exceeded (a
divergence), and 2 when the files cannot be compared (unreadable, another model, other settings).
"""

from __future__ import annotations

import argparse
import os
import sys

from .argtypes import non_negative_float, positive_int, seed, token_ids

COMMANDS = ("trace", "compare")

TRACE_BACKENDS = ("reference", "cpu")  # the GPU path is not traced yet (its arrays live on the device)


def register(commands, formatter=argparse.HelpFormatter) -> None:
    """Register ``trace`` and ``compare`` on the ``diffusiongemma`` subparsers."""
    from diffusiongemma.trace import DEFAULT_ATOL, DEFAULT_RTOL, DEFAULT_TOP_K

    trace = commands.add_parser("trace", help="record a golden trace of one generation run", formatter_class=formatter,
                                description="Record every intermediate of one generation run (encoder K/V, "
                                            "per-step decoder input, layer outputs, logits, sampler state, "
                                            "committed canvases, random draws) into a trace file.")
    trace.add_argument("-m", "--model", default=None, help="checkpoint directory (default: the shipped tiny-kjv model)")
    source = trace.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer, as `generate` does)")
    source.add_argument("--prompt-ids", type=token_ids, help="prompt token ids, e.g. 2,818,7")
    source.add_argument("--replay", metavar="TRACE",
                        help="rerun another trace's run: its prompt ids, generation settings and random draws")
    trace.add_argument("-o", "--output", required=True,
                       help="trace file to write (safetensors); checked for writability before the run")
    trace.add_argument("--seed", type=seed, default=None,
                       help="seed of the draw source (Philox; default 0, so that a trace is reproducible as is)")
    trace.add_argument("-n", "--max-new-tokens", type=positive_int, default=None,
                       help="tokens to generate (default: the checkpoint's generation_config.json)")
    trace.add_argument("--steps", type=positive_int, default=None, help="max denoising steps per canvas")
    trace.add_argument("--ignore-eos", action="store_true",
                       help="do not stop at EOS (the run's eos_token_id set to none), as generate --ignore-eos")
    trace.add_argument("--layers", action=argparse.BooleanOptionalAction, default=None,
                       help="record every decoder layer's output per step (default: only when one step's layer "
                            "outputs fit in 16 MiB, i.e. small models)")
    trace.add_argument("--logits", choices=("auto", "full", "topk"), default="auto",
                       help="full logits, or top-k values/ids + log-sum-exp + entropy per position "
                            "(auto: full up to a vocabulary of 8192)")
    trace.add_argument("--top-k", type=positive_int, default=DEFAULT_TOP_K, help="K of --logits topk")
    trace.add_argument("--backend", choices=TRACE_BACKENDS, default="reference",
                       help="reference (NumPy) or the compiled fast path (recorded around its generate)")
    trace.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bars on stderr (default: when stderr is a terminal)")
    trace.add_argument("--threads", type=positive_int, default=None, metavar="N",
                       help="BLAS and OpenMP threads (default: the cores free at start, unless OMP_NUM_THREADS or "
                            "another thread variable is set)")
    trace.set_defaults(handler=run_trace)

    compare = commands.add_parser("compare", help="find the first tensor at which two traces differ",
                                  formatter_class=formatter,
                                  description="Compare two traces tensor by tensor in run order. Exit status: 0 "
                                              "all agree, 1 a tolerance is exceeded, 2 the files cannot be compared.")
    compare.add_argument("a", help="first trace (the reference side: rtol scales with its values)")
    compare.add_argument("b", help="second trace")
    compare.add_argument("--atol", type=non_negative_float, default=DEFAULT_ATOL,
                         help="absolute tolerance on float tensors (float32 noise of two implementations is "
                              "~1e-5..1e-4, semantic errors are ~1e-1)")
    compare.add_argument("--rtol", type=non_negative_float, default=DEFAULT_RTOL,
                         help="relative tolerance, times |a|")
    compare.add_argument("--only", choices=("forward", "sampler", "all"), default="all",
                         help="forward: the model's tensors (encoder K/V, decoder input, layer outputs, logits); "
                              "sampler: the loop's (draft, draws, acceptance, canvases, stopping, commits, "
                              "output); all (default): both. See docs/TRACE_FORMAT.md, 'Golden traces'")
    listing = compare.add_mutually_exclusive_group()
    listing.add_argument("--full", action="store_true",
                         help="list every compared tensor (default: only the first differing tensors, with the "
                              "two before the first divergence, then the result)")
    listing.add_argument("--summary", action="store_true", help="print only the result, no tensor table")
    compare.set_defaults(handler=run_compare)


def run_compare(args) -> int:
    from diffusiongemma.trace import Trace, compare_traces, format_report

    with Trace(args.a) as a, Trace(args.b) as b:
        comparison = compare_traces(a, b, atol=args.atol, rtol=args.rtol, only=args.only)
        print(format_report(comparison, table="full" if args.full else "none" if args.summary else "short"))
    return 0 if comparison.ok else 1


def run_trace(args) -> int:
    from diffusiongemma.reference.support.replay import ReplayDraws
    from diffusiongemma.trace import TraceRecorder, layers_by_default, record_generate

    from diffusiongemma.checkpoint import default_model_dir, generate_function, load_model

    from .checks import check_writable
    from .progress import ProgressBars, without_library_progress

    check_writable(args.output, "-o/--output")  # before the run, not after it
    path = args.model or default_model_dir()
    from .generate_cmd import check_model_path

    check_model_path(path)
    model = load_model(path, args.backend)
    if args.replay is not None:
        ids, mask, settings, tape = _replayed_run(args, model.config)
        random = ReplayDraws(tape)
    else:
        ids, mask = _prompt_ids(args, path), None
        settings, random = _settings(args, path, model.config), (0 if args.seed is None else args.seed)
    layers = layers_by_default(model.config, ids.shape[0]) if args.layers is None else args.layers
    recorder = TraceRecorder(layers=layers, logits=args.logits, top_k=args.top_k,
                             producer=f"diffusiongemma {args.backend}")
    generate = generate_function(args.backend)
    show_bars = args.progress if args.progress is not None else sys.stderr.isatty()
    C = int(model.config.canvas_length)
    bars = ProgressBars(-(-settings.max_new_tokens // C), settings.max_denoising_steps) if show_bars else None
    try:
        result = record_generate(generate, model, ids, recorder, attention_mask=mask, generation_config=settings,
                                 random=random, callback=bars, **without_library_progress(generate))
    except (ValueError, ArithmeticError, RuntimeError) as exc:
        if recorder.entries:
            _save(recorder, args.output, error=f"{type(exc).__name__}: {exc}")
            print(f"diffusiongemma trace: the run failed; the part recorded so far is in {args.output}",
                  file=sys.stderr)
        raise
    finally:
        if bars is not None:
            bars.close()
    _save(recorder, args.output)
    if isinstance(random, ReplayDraws) and random.remaining:
        print(f"diffusiongemma trace: warning: {random.remaining} replayed draws were not used; this run took a "
              "shorter path than the replayed one", file=sys.stderr)
    size = os.path.getsize(args.output) / 2**20
    print(f"wrote {args.output}: {len(recorder.entries)} tensors ({size:.1f} MiB), {len(result.steps_per_canvas)} "
          f"canvas(es), steps per canvas {list(result.steps_per_canvas)}, layer outputs {'on' if layers else 'off'}, "
          f"logits {recorder.logits_mode}", file=sys.stderr)
    return 0


def _save(recorder, path: str, **kwargs) -> None:
    """``recorder.save`` with a write failure (a full disk, a folder gone) as one line naming -o/--output;
    the trace is written beside ``path`` and renamed, so nothing half-written is left."""
    from safetensors import SafetensorError

    try:
        recorder.save(path, **kwargs)
    except (SafetensorError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if "StorageFull" in reason or "code: 28" in reason:  # safetensors' wording of ENOSPC
            reason = "No space left on device"
        raise OSError(f"-o/--output {path!r}: the trace could not be written ({reason}); nothing was "
                      "written there") from None


def _prompt_ids(args, path: str):
    import numpy as np

    if args.prompt_ids is not None:
        return np.array([args.prompt_ids], dtype=np.int64)
    from diffusiongemma.checkpoint import load_text_side

    if not args.prompt.strip():
        raise ValueError("the prompt is empty; give some text, or token ids with --prompt-ids")
    ids = load_text_side(path).encode(args.prompt)
    if not ids:
        raise ValueError(f"the prompt {args.prompt!r} tokenizes to nothing")
    return np.array([ids], dtype=np.int64)


def _settings(args, path: str, model_config):
    from diffusiongemma.reference.generate import GenerationConfig

    try:
        from diffusiongemma.checkpoint import load_generation_config

        settings = load_generation_config(path)  # generation_config.json, or a GGUF's diffusion.eb_* keys
    except FileNotFoundError:
        settings = GenerationConfig(eos_token_id=model_config.eos_token_id, pad_token_id=model_config.pad_token_id)
    changes = {"max_new_tokens": args.max_new_tokens, "max_denoising_steps": args.steps}
    settings = settings.replace(**{k: v for k, v in changes.items() if v is not None})
    return settings.replace(eos_token_id=()) if args.ignore_eos else settings


def _replayed_run(args, model_config):
    """Prompt, mask, settings and draw tape of the trace given to --replay."""
    from diffusiongemma.reference.generate import GenerationConfig
    from diffusiongemma.trace import Trace, TraceError

    given = [flag for flag, value in (("--seed", args.seed), ("--max-new-tokens", args.max_new_tokens),
                                      ("--steps", args.steps), ("--ignore-eos", args.ignore_eos or None))
             if value is not None]
    if given:
        raise ValueError(f"--replay takes the prompt, settings and draws from the trace; drop {', '.join(given)}")
    with Trace(args.replay) as other:
        model = other.header["model"]
        for key in ("vocab_size", "canvas_length", "hidden_size", "num_hidden_layers"):
            if model[key] != getattr(model_config, key):
                raise TraceError(f"{args.replay} was recorded with {key} = {model[key]}, but this model has "
                                 f"{getattr(model_config, key)}")
        tape = other.draw_tape()
        if tape is None:
            raise TraceError(f"{args.replay} holds no random draws (draws.* tensors), so its run cannot be replayed")
        ids = other.get("prompt.input_ids")
        mask = other.get("prompt.attention_mask") if "prompt.attention_mask" in other.entries else None
        settings = GenerationConfig.from_dict(other.header.get("generation") or {})
    return ids, mask, settings, tape
