"""The ``convert`` subcommand: ``diffusiongemma convert SRC DST`` is ``diffusiongemma-convert SRC DST``, with
the same options (its parser is reused, so ``convert --help`` lists them) and exit statuses."""

from __future__ import annotations


def register(commands, formatter) -> None:
    """Add ``convert`` to the ``diffusiongemma`` subparsers."""
    from diffusiongemma.weights_converter.cli import accept_negative_sizes, build_parser

    converter = build_parser()
    sub = commands.add_parser("convert", parents=[converter], conflict_handler="resolve", formatter_class=formatter,
                              help="convert a checkpoint to the project's format or to GGUF (the same as diffusiongemma-convert)",
                              description=converter.description,
                              epilog="Exit status: 0 converted, 1 the input or the destination was rejected (the "
                                     "message names it), 130 interrupted; no partial destination is left behind.")
    accept_negative_sizes(sub).set_defaults(handler=run, takes_argv=True)  # --shard-size -1MB: parse_size's message


def run(args) -> int:
    from diffusiongemma.weights_converter.cli import main as convert_main

    return convert_main(args.argv)
