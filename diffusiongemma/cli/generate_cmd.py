"""The ``generate`` subcommand: text from a checkpoint by block diffusion, with the live view, progress bars,
the stop reason, and a ``--json`` record of the run (per-step data for ``diffusiongemma plot``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .argtypes import non_negative_float, positive_float, positive_int, seed

BACKENDS = ["auto", "reference", "cpu", "gpu", "gpu-sim"]  # other backends are appended here by their modules
SEMANTICS_NAMES = ("transformers", "jax", "llama.cpp", "vllm", "mlx-vlm", "diffusers")  # reference.semantics.SEMANTICS
VIEWS = ("auto", "live", "plain")
DTYPES = ("float32", "bfloat16")  # reference.primitives.compute_dtype's names
# the end of a bfloat16 run's timing line: what it promises against other backends (README, SPEC §10.3)
BF16_TIMING = "bfloat16 agrees call by call across backends, free runs part; "


class UsageError(ValueError):
    """A command-line value that argparse cannot check by itself (the message names the option)."""


def shipped_defaults() -> dict:
    """The shipped model's ``generation_config.json`` (shown in ``--help``), or {} when unreadable."""
    try:  # the shipped model's folder (checkpoint.default_model_dir) without importing the reference for --help
        from importlib import resources

        with open(os.path.join(str(resources.files("diffusiongemma") / "assets" / "tiny-kjv"),
                               "generation_config.json"), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def register(commands, formatter) -> None:
    """Add ``generate`` to the ``diffusiongemma`` subparsers."""
    shipped = shipped_defaults()

    def from_checkpoint(key: str) -> str:
        value = shipped.get(key) if key != "entropy_bound" else (shipped.get("sampler_config") or {}).get(key)
        return f"(default: the checkpoint's generation_config.json; shipped model: {value})"

    gen = commands.add_parser(
        "generate", help="generate text by block diffusion", formatter_class=formatter,
        description="Generate text after a prompt by block diffusion: canvases of C tokens, each denoised "
                    "from random tokens in up to N steps, committed, encoded, and followed by the next.",
        epilog="Exit status: 0 done, 2 bad arguments or a failing checkpoint, 130 interrupted (Ctrl-C).")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt text; '-' reads it from standard input (one trailing newline dropped), or use -p")
    gen.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT", default=None,
                     help="the prompt text (instead of the positional argument; '-' reads standard input)")
    gen.add_argument("-m", "--model", default=None, metavar="PATH",
                     help="checkpoint directory (transformers or converted) or GGUF file on this machine; "
                          "nothing is downloaded (default: the shipped tiny-kjv model)")
    gen.add_argument("--backend", choices=BACKENDS, default="auto",
                     help="auto: the fastest one usable here (gpu when CuPy sees a GPU, else cpu when the compiled "
                          "extension imports, else reference; in float32 the same tokens for a seed), printed with the "
                          "timings; reference (NumPy), cpu (compiled fast path), gpu (CuPy), gpu-sim (the CUDA "
                          "kernels on the CPU, checked)")
    gen.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="float32: the float32 run (transformers loaded in float32); bfloat16: upstream's bfloat16 "
                          "run, as transformers computes it when loaded with dtype=torch.bfloat16 (weights and "
                          "activations rounded to bfloat16 where it rounds, docs/SPEC.md §10.1), on every backend: "
                          "half the weight memory, tensor cores on a GPU. float32 runs give the same tokens on "
                          "every backend; bfloat16 runs agree call by call (what crosscheck --dtype bfloat16 "
                          "checks: the same roundings up to rare one-ulp flips of float32 sums taken in another "
                          "order) and their free runs part")
    gen.add_argument("--semantics", choices=SEMANTICS_NAMES, default="transformers",
                     help="run the loop with another implementation's stage choices (docs/PEERS.md); "
                          "other than transformers, they run on the reference (--backend auto picks it; cpu and "
                          "gpu are refused)")
    gen.add_argument("-n", "--max-new-tokens", type=positive_int, default=None, metavar="N",
                     help="new tokens to generate, rounded up to whole canvases " + from_checkpoint("max_new_tokens"))
    gen.add_argument("--max-length", type=positive_int, default=None, metavar="L",
                     help="also stop once prompt + output reach L tokens (transformers' max_length)")
    gen.add_argument("--steps", type=positive_int, default=None,
                     help="most denoising steps per canvas " + from_checkpoint("max_denoising_steps"))
    gen.add_argument("--seed", type=seed, default=None,
                     help="seed of the draw source (Philox), in [0, 2**64); default: a random seed, printed on "
                          "stderr and in --json so that the run can be repeated")
    gen.add_argument("--entropy-bound", type=positive_float, default=None, metavar="NATS",
                     help="acceptance entropy bound " + from_checkpoint("entropy_bound"))
    temps = gen.add_mutually_exclusive_group()
    temps.add_argument("--temp", type=non_negative_float, default=None, metavar="T",
                       help="one temperature for every step: sets t_min = T and t_max = the next float above T, "
                            "so the linear schedule t_min + (t_max - t_min) * n/N is T at every step; "
                            "--temp 0 is --greedy")
    temps.add_argument("--t-min", type=non_negative_float, default=None,
                       help="temperature schedule minimum " + from_checkpoint("t_min"))
    gen.add_argument("--t-max", type=non_negative_float, default=None,
                     help="temperature schedule maximum (first step) " + from_checkpoint("t_max"))
    gen.add_argument("--greedy", action="store_true",
                     help="argmax proposals (temperature 0, as mlx-vlm's default and diffusers' BlockRefinement "
                          "at temperature 0): each position proposes its most likely token instead of a "
                          "categorical draw; acceptance, self-conditioning and stopping keep the temperature "
                          "schedule, and rejected positions are still renoised from the seed. Runs on the "
                          "reference (--backend auto picks it)")
    gen.add_argument("--threads", type=positive_int, default=None, metavar="N",
                     help="BLAS and OpenMP threads, 1 to the cores this process may use (default: the cores free "
                          "at start, unless OMP_NUM_THREADS or another thread variable is set; the reference's BLAS "
                          "never takes more than the cores free at the start of the run)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at EOS: the run's eos_token_id is set to none, so only the token budget "
                          "or --max-length ends it")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the checkpoint's chat template and print only the reply (the "
                          "templated prompt is in --json as prompt_text)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, ids, stop_reason, seed, timings, per-step data) instead of "
                          "text; never mixed with terminal codes")
    gen.add_argument("--view", choices=VIEWS, default="auto",
                     help="live: redraw the canvas in place while denoising (auto: when the output is a terminal; "
                          "with --json, only on stderr and only when it is a terminal)")
    gen.add_argument("--frame-time", type=non_negative_float, default=0.08, metavar="S",
                     help="live view: each frame stays at least S seconds; faster steps are dropped")
    gen.add_argument("--view-wait", action="store_true",
                     help="live view: show every step, waiting out the frame time (slows the run down)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bars on stderr (default: when stderr is a terminal and the live view is off)")
    gen.set_defaults(handler=run)


# ================================================================================================ the run
def read_prompt(args) -> str:
    """The prompt from the argument, ``-p`` or standard input; ``UsageError`` naming the option."""
    if args.prompt is not None and args.prompt_option is not None:
        raise UsageError("the prompt was given twice: as an argument and with -p/--prompt; give one")
    text, where = ((args.prompt, "the prompt argument") if args.prompt is not None
                   else (args.prompt_option, "-p/--prompt"))
    if text is None:
        raise UsageError("no prompt: give one as an argument, with -p/--prompt, or '-' to read standard input")
    if text == "-":
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"the prompt on standard input is not valid UTF-8: byte {data[exc.start]:#04x} at "
                             f"offset {exc.start}") from None
        where = "the prompt on standard input"
        text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text  # echo's newline
    else:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # undecodable argv bytes arrive as lone surrogates
            raise UsageError(f"{where} is not valid UTF-8: byte {ord(text[exc.start]) - 0xDC00:#04x} at character "
                             f"{exc.start}") from None
    if not text.strip():
        raise UsageError(f"{where}: the prompt is empty; give some text to continue, e.g. "
                         "diffusiongemma generate \"And God said\"")
    return text


OPTIONS = {"max_new_tokens": "-n/--max-new-tokens", "max_length": "--max-length", "max_denoising_steps": "--steps",
           "entropy_bound": "--entropy-bound", "t_min": "--t-min", "t_max": "--t-max"}  # setting -> its option


def settings_for(args, path: str, model_config):
    """The checkpoint's generation settings with the command line's changes applied; ``UsageError`` naming
    the options when the result is not a valid setting."""
    from diffusiongemma.reference.support.errors import ConfigError
    from diffusiongemma.reference.generate import GenerationConfig

    try:
        from diffusiongemma.checkpoint import load_generation_config

        settings = load_generation_config(path)  # generation_config.json, or a GGUF's diffusion.eb_* keys
    except FileNotFoundError:
        settings = GenerationConfig(eos_token_id=model_config.eos_token_id, pad_token_id=model_config.pad_token_id)
    t_min, t_max = args.t_min, args.t_max
    if args.temp is not None and args.temp > 0:
        if args.t_max is not None:
            raise UsageError("--temp sets both t_min and t_max; drop --t-max")
        t_min, t_max = constant_temperature(args.temp)
    changes = {"max_new_tokens": args.max_new_tokens, "max_length": args.max_length,
               "max_denoising_steps": args.steps, "entropy_bound": args.entropy_bound, "t_min": t_min,
               "t_max": t_max}
    changes = {k: v for k, v in changes.items() if v is not None}
    try:
        settings = settings.replace(**changes)
    except ConfigError as exc:  # e.g. --t-min above the checkpoint's t_max: name the options given
        given = ", ".join(f"{OPTIONS[k]} {v}" for k, v in changes.items())
        raise UsageError(f"{given}: {exc} (the other values come from {path}/generation_config.json)") from None
    if args.ignore_eos:
        settings = settings.replace(eos_token_id=())
    return settings


def check_model_path(path: str, option: str = "-m/--model") -> None:
    """``UsageError`` for a ``--model`` that is not on this machine; a hub id (``owner/name``) is told that
    nothing is downloaded at run time."""
    if os.path.exists(path):
        return
    import re

    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) and not path.startswith("."):
        raise UsageError(f"{option} {path}: no such file or directory. It looks like a Hugging Face hub id, but "
                         "nothing is downloaded at run time: download the checkpoint first (e.g. `hf download "
                         f"{path} --local-dir DIR`) and give --model DIR")
    raise UsageError(f"{option} {path}: no such file or directory (give a checkpoint directory or a GGUF file)")


def choose_backend(requested: str, needs_reference: bool = False) -> tuple[str, str]:
    """(backend, why) for ``--backend requested``: any name but "auto" is kept; "auto" is "reference" when the
    run needs the reference's per-step compute (``--greedy``, ``--semantics``), else "gpu" when CuPy imports and
    sees a CUDA GPU, else "cpu" when the compiled fast path imports, else "reference". Every backend gives the
    reference's tokens for a seed (tests/test_fast_generate.py, tests/test_gpu_equivalence.py)."""
    if requested != "auto":
        return requested, "--backend " + requested
    if needs_reference:
        return "reference", "auto: --greedy/--semantics run on the reference"
    import importlib.util

    gpu_reason = "CuPy is not installed"
    if importlib.util.find_spec("cupy") is not None:
        try:
            from diffusiongemma.fast.gpu.device import gpu_available
        except ImportError as exc:
            gpu_reason = f"the GPU path failed to import ({one_line(exc)})"
        else:
            try:
                usable, gpu_reason = gpu_available()
            except Exception as exc:  # a broken CuPy raises what it likes on import: SyntaxError, OSError, ...
                usable, gpu_reason = False, f"CuPy failed: {one_line(exc)}"
            if gpu_reason.startswith("CuPy is not installed ("):  # it is (find_spec found it): its import failed
                gpu_reason = "CuPy failed to import (" + gpu_reason[len("CuPy is not installed ("):]
            if usable:
                return "gpu", f"auto: {gpu_reason}"
    try:
        import diffusiongemma.fast  # noqa: F401  (the compiled extension)
    except ImportError as exc:
        return "reference", f"auto: no GPU ({gpu_reason}); the compiled CPU path failed to import ({exc})"
    return "cpu", f"auto: no GPU ({gpu_reason})"


_GPU_ABSENT = ("CuPy is not installed", "no CUDA GPU is visible")  # auto's quiet reasons: nothing is broken


def auto_note(backend_choice: str) -> str | None:
    """The one-line note ``--backend auto`` prints when it passed over a GPU path that is installed but failed
    (CuPy raised on import, the CUDA driver answered with an error), naming why; None when it took the GPU or
    there is none to take (CuPy not installed, no GPU visible)."""
    prefix = "auto: no GPU ("
    if not backend_choice.startswith(prefix) or backend_choice[len(prefix):].startswith(_GPU_ABSENT):
        return None
    reason = backend_choice[len(prefix):].split("); ", 1)[0].removesuffix(")")
    return f"diffusiongemma generate: note: --backend auto: the GPU is not usable ({reason}); running on the CPU"


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type (unless it is the project's own or a plain RuntimeError, whose messages
    say what happened) and its message with every run of whitespace, newlines included, made one space."""
    message = " ".join(str(exc).split()) or "(no message)"
    cause = exc.__cause__
    if cause is not None and " ".join(str(cause).split()) not in message:  # e.g. CuPy's own ImportError
        message += f" ({one_line(cause)})"
    if isinstance(exc, (RuntimeError, ValueError)) and type(exc).__module__.startswith(("builtins", "diffusiongemma")):
        return message
    return f"{type(exc).__name__}: {message}"


def load_on_backend(path: str, backend: str, backend_choice: str, dtype: str, load):
    """(text side, model, backend, backend choice): ``load(path, backend, dtype=dtype)``, where a GPU that fails
    on first use (CuPy's import, the CUDA driver or runtime, compiling the kernels, copying the weights: any
    error that is not the checkpoint's own, which are ValueErrors) is a one-line error naming CuPy's message
    under ``--backend gpu``, and under ``--backend auto`` a one-line note on stderr and the CPU path instead."""
    try:
        return (*load(path, backend, dtype=dtype), backend, backend_choice)
    except (ValueError, FileNotFoundError, KeyboardInterrupt):  # the checkpoint's errors are the same on any backend
        raise
    except Exception as exc:
        if backend != "gpu":
            raise
        reason = one_line(exc)
        if not backend_choice.startswith("auto"):
            raise RuntimeError(f"--backend gpu: the GPU failed: {reason}") from None
    fallback = "cpu"
    try:
        import diffusiongemma.fast  # noqa: F401  (the compiled extension)
    except ImportError:
        fallback = "reference"
    print(f"diffusiongemma generate: note: --backend auto: the GPU failed on first use ({reason}); running on the "
          f"{'compiled CPU path' if fallback == 'cpu' else 'reference'} instead", file=sys.stderr)
    return (*load(path, fallback, dtype=dtype), fallback, f"auto: the GPU failed on first use ({reason})")


def denoising_variant(args):
    """The run's stage choices (``--semantics``), with argmax proposals for ``--greedy`` / ``--temp 0``; None
    for transformers' own loop."""
    greedy = args.greedy or args.temp == 0
    if args.semantics == "transformers" and not greedy:
        return None
    from diffusiongemma.reference.variants import get_semantics

    variant = get_semantics(args.semantics)
    if greedy:
        variant = variant.replace(name=f"{variant.name}, greedy", denoiser_draw="argmax")
    if args.backend != "reference":
        what = "--greedy (--temp 0)" if greedy else f"--semantics {args.semantics}"
        raise UsageError(f"{what} runs on the reference's per-step compute: use --backend reference")
    return variant


def constant_temperature(temp: float) -> tuple[float, float]:
    """(t_min, t_max) giving every step temperature float32(temp): the schedule needs t_max > t_min, so t_max
    is the next float64 above temp; (t_max - t_min) * n/N is then far below float32 resolution."""
    import math

    return temp, math.nextafter(temp, math.inf)


def _ids(value) -> tuple[int, ...]:
    """An id or a list of ids (or None) as a tuple."""
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def run(args) -> int:
    from diffusiongemma.checkpoint import default_model_dir, generate_function, load_checkpoint
    from diffusiongemma.plot import DenoisingLog
    from diffusiongemma.reference.generate import new_token_budget

    import numpy as np

    from diffusiongemma import threads

    from . import checks, stopping
    from .live_view import LiveCanvasView
    from .progress import CommittedText, Fanout, PrefillProgress, ProgressBars, without_library_progress

    args.backend, backend_choice = choose_backend(
        args.backend, needs_reference=args.greedy or args.temp == 0 or args.semantics != "transformers")
    if auto_note(backend_choice):
        print(auto_note(backend_choice), file=sys.stderr)
    variant = denoising_variant(args)
    prompt = read_prompt(args)
    seed_value, seed_given = (args.seed, True) if args.seed is not None else (int.from_bytes(os.urandom(4), "big"), False)
    path = args.model or default_model_dir()
    check_model_path(path)
    t0 = time.perf_counter()
    text_side, model, args.backend, backend_choice = load_on_backend(  # one version, even during a convert --force
        path, args.backend, backend_choice, args.dtype, load_checkpoint)
    settings = settings_for(args, path, model.config)
    load_seconds = time.perf_counter() - t0

    prompt_text = text_side.apply_chat_template(prompt) if args.chat else prompt
    prompt_ids = text_side.encode(prompt_text, add_special_tokens=not args.chat)
    if not prompt_ids:
        raise UsageError(f"the prompt {prompt!r} tokenizes to nothing")
    checks.check_generate_options(args, settings, len(prompt_ids))  # refused or warned by name
    C = int(model.config.canvas_length)
    planned = -(-new_token_budget(settings, len(prompt_ids)) // C)

    view_stream = None  # --json: stdout holds only the JSON; the view, if asked for, goes to a terminal stderr
    if args.json:
        view_stream = sys.stderr if args.view == "live" and sys.stderr.isatty() else None
    elif args.view == "live" or (args.view == "auto" and sys.stdout.isatty()):
        view_stream = sys.stdout
    view = None if view_stream is None else LiveCanvasView(
        text_side, "" if args.chat else prompt_text, view_stream, planned_canvases=planned, max_steps=settings.max_denoising_steps,
        eos_ids=settings.eos_token_id or _ids(getattr(model.config, "eos_token_id", None)), pad_id=settings.pad_token_id,
        frame_time=args.frame_time, wait=args.view_wait)
    show_bars = args.progress if args.progress is not None else (view is None and sys.stderr.isatty())
    bars = ProgressBars(planned, settings.max_denoising_steps) if show_bars else None
    prefill = PrefillProgress() if args.progress is not False and sys.stderr.isatty() else None
    committed = CommittedText(text_side.decode)
    log = DenoisingLog()
    first_step = _FirstStep()

    if args.backend == "reference":  # BLAS is its only parallelism: never more threads than free cores now
        capped = threads.cap_blas_to_free_cores()
        if capped is not None and args.threads is not None:
            print(f"diffusiongemma generate: note: --threads {args.threads}: {capped[1]} core"
                  f"{'s' if capped[1] != 1 else ''} free now, so the reference's BLAS runs on {capped[1]} "
                  "(a BLAS call split over busy cores waits for the slowest)", file=sys.stderr)
    generate = generate_function(args.backend)
    t1 = time.perf_counter()
    interrupted = True
    try:
        result = generate(model, np.array([prompt_ids], dtype=np.int64), generation_config=settings,
                          random=seed_value, callback=Fanout(prefill, log, committed, bars, view, first_step),
                          **without_library_progress(generate), **({} if variant is None else {"semantics": variant}))
        interrupted = False
    except KeyboardInterrupt:
        if view is None and not args.json:  # the live view leaves the committed text itself; a file gets it here
            print((prompt if not args.chat else "") + committed.text(), flush=True)
        raise
    finally:
        if prefill is not None:
            prefill.close()
        if bars is not None:
            bars.close()
        if view is not None:
            view.close(interrupted=interrupted)
    seconds = time.perf_counter() - t1

    new_ids = [int(t) for t in result.sequences[0, len(prompt_ids):]]
    pad = settings.pad_token_id
    n_real = sum(1 for t in new_ids if t != pad)
    text = text_side.decode(new_ids)
    reason = stopping.stop_reason(result)
    stop_line = stopping.describe(reason, settings, planned, C)
    rate = round(n_real / seconds, 2) if seconds > 0 else None
    if args.json:
        from diffusiongemma import __version__

        print(json.dumps({
            "prompt": prompt, "prompt_text": prompt_text, "text": text, "prompt_token_ids": prompt_ids,
            "token_ids": new_ids, "stop_reason": reason, "stop": stop_line, "seed": seed_value,
            "seed_given": seed_given, "canvases": len(result.steps_per_canvas), "planned_canvases": planned,
            "canvas_length": C, "tokens_per_forward": float(result.tokens_per_forward[0]),
            "steps_per_canvas": [int(s) for s in result.steps_per_canvas],
            "decoder_passes": int(result.forward_passes[0]) if result.forward_passes is not None else None,
            "timings": {"load_s": round(load_seconds, 4), "generate_s": round(seconds, 4), "tokens_per_s": rate,
                        "first_step_s": None if first_step.at is None else round(first_step.at - t0, 4)},
            "threads": threads.describe(), "settings": settings.to_dict(), "model": path, "backend": args.backend,
            "backend_choice": backend_choice, "dtype": args.dtype,
            "version": __version__, "denoising": log.to_json(),
        }, ensure_ascii=False))
    else:
        print(text if args.chat else prompt + text, flush=True)  # a chat prints the reply, not the template
        print(f"[{n_real} tokens in {seconds:.2f} s: {n_real / max(seconds, 1e-9):.1f} tokens/s, "
              f"{float(result.tokens_per_forward[0]):.2f} tokens per forward, "
              f"steps per canvas {list(result.steps_per_canvas)}, {BF16_TIMING if args.dtype == 'bfloat16' else ''}"
              f"backend {args.backend}{' (auto)' if backend_choice.startswith('auto') else ''}"
              f"{', bfloat16' if args.dtype == 'bfloat16' else ''}]", file=sys.stderr)
        print(f"[{stop_line}; seed {seed_value}{'' if seed_given else ' (random)'}: --seed {seed_value} repeats "
              "this run]", file=sys.stderr)
    return 0


class _FirstStep:
    """When the first denoising step ended (``time.perf_counter``): after the prompt's encoder pass and one decoder
    pass, so ``first_step_s`` in ``--json`` (from the start of loading) is the time to the first pass's result,
    reading the weights those passes used (a mapped checkpoint is not read whole before)."""

    at: float | None = None

    def on_step(self, info) -> None:
        if self.at is None:
            self.at = time.perf_counter()
