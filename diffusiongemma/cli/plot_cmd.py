"""The ``plot`` subcommand: pictures of the denoising of one run (``diffusiongemma.plot``), from the JSON of
``generate --json`` or from a trace written by ``diffusiongemma trace``."""

from __future__ import annotations

import os


def register(commands, formatter) -> None:
    """Add ``plot`` to the ``diffusiongemma`` subparsers."""
    from diffusiongemma.plot import FIGURES

    plot = commands.add_parser(
        "plot", help="draw the denoising of a run (entropy/acceptance heatmaps, commit order, schedule)",
        formatter_class=formatter,
        description="Draw the denoising of one run: per-position entropy and acceptance by step, the step at "
                    "which each position settled, tokens accepted per step, the temperature schedule. The run "
                    "is a file written by `diffusiongemma generate --json > run.json` or by `diffusiongemma "
                    "trace -o run.trace`. Needs matplotlib (pip install -e \".[plot]\"), except for the HTML "
                    "animation.",
        epilog="Examples: diffusiongemma plot run.json -o denoising.png; diffusiongemma plot run.trace "
               "--figure entropy -o entropy.svg; diffusiongemma plot run.json -o run.html (an animation)")
    plot.add_argument("run", metavar="RUN", help="a generate --json output file, a trace file, or '-' for generate "
                                                 "--json output on standard input")
    plot.add_argument("-o", "--output", required=True,
                      help="file to write: .png, .svg or .pdf for a figure, .html for the step-by-step animation")
    plot.add_argument("--figure", choices=FIGURES, default="summary",
                      help="which figure (summary: all of them in one picture)")
    plot.add_argument("-m", "--model", default=None, metavar="DIR",
                      help="checkpoint whose tokenizer decodes the animation's tokens (default: the run's model "
                           "when recorded in the JSON, else the shipped model)")
    plot.set_defaults(handler=run)


def run(args) -> int:
    import sys

    from diffusiongemma import plot
    from diffusiongemma.reference.support.errors import InputError

    from .checks import check_writable, write_aside

    extension = os.path.splitext(args.output)[1].lower()
    if extension not in (".png", ".svg", ".pdf", ".html"):
        raise InputError(f"-o/--output {args.output!r}: give a .png, .svg, .pdf or .html file name")
    check_writable(args.output, "-o/--output")
    run_json = None
    if args.run == "-":
        import json

        try:
            run_json = json.loads(sys.stdin.buffer.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"standard input is not a generate --json record ({exc})") from None
        record = plot.DenoisingRecord.from_json(run_json, where="standard input")
    else:
        record = plot.load_record(args.run)
    if extension == ".html":
        decode, vocab_size = _decoder(args, run_json)
        name = "standard input" if args.run == "-" else os.path.basename(args.run)
        plot.check_token_ids(record, vocab_size, "standard input" if args.run == "-" else args.run)
        page = plot.animation_html(record, decode, title=f"diffusiongemma: {name}")

        def write(target: str) -> None:
            with open(target, "w", encoding="utf-8") as f:
                f.write(page)
        write_aside(args.output, "-o/--output", write, "the animation")
    else:
        fig = plot.figure(record, args.figure)
        write_aside(args.output, "-o/--output", lambda target: plot.save_figure(fig, target), "the figure")
    print(f"wrote {args.output}: {len(record.canvases)} canvas(es), "
          f"{sum(c.steps for c in record.canvases)} steps", file=sys.stderr)
    return 0


def _decoder(args, run_json=None):
    """(token id -> text, vocabulary size) with the tokenizer of --model, of the run's model (JSON) or of the
    shipped model."""
    import json

    from diffusiongemma.checkpoint import default_model_dir, load_text_side

    path = args.model
    if path is None and run_json is not None:
        path = run_json.get("model") if isinstance(run_json, dict) else None
    elif path is None:
        try:
            with open(args.run, encoding="utf-8") as f:
                path = json.load(f).get("model")
        except (OSError, ValueError, AttributeError):
            path = None
    side = load_text_side(path or default_model_dir())
    cache: dict[int, str] = {}

    def decode(token: int) -> str:
        if token not in cache:
            cache[token] = side.decode([token], skip_special_tokens=False)
        return cache[token]
    return decode, side.tokenizer.get_vocab_size(with_added_tokens=True)
