"""``diffusiongemma-convert SRC DST``: the command-line front end of ``convert``.

Exit status: 0 on success, 1 when the input or the destination is rejected (the message names
the problem), 130 on Ctrl-C. In every failing case no DST directory is left behind.
"""

from __future__ import annotations

import argparse
import re
import sys

# The heavy imports (NumPy, the reference) happen inside ``main``, so that a Ctrl-C during start-up is an
# interruption like any other: one line and exit status 130, no traceback.

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: str) -> int:
    """Bytes from ``"2GB"``, ``"500MiB"``, ``"1048576"``; raises ``argparse.ArgumentTypeError``."""
    match = re.fullmatch(r"\s*([-+]?)(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 2GB, 500MiB, 1048576)")
    size = int(float(match.group(2)) * _UNITS[(match.group(3) or "").upper()])
    if match.group(1) == "-" or size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r} (examples: 2GB, 500MiB, 1048576)")
    return size


# argparse takes any word starting with "-" for an option unless it looks like a plain negative number, so
# "--shard-size -1MB" would fail with "expected one argument"; a negative size is read as a value instead,
# and refused by ``parse_size`` with its own message.
_NEGATIVE_VALUE = re.compile(r"^-\d+(\.\d+)?\s*([KMG]i?B|B)?$", re.IGNORECASE)


def accept_negative_sizes(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let ``parser`` read "-1MB" as a value (so that ``parse_size`` names what is wrong with it)."""
    parser._negative_number_matcher = _NEGATIVE_VALUE  # argparse's own hook for negative-number values
    return parser


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line naming it and a hint, without argparse's usage block (as ``diffusiongemma``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    from diffusiongemma.reference.support.checkpoint_io import STORAGE_DTYPES

    from .summary import DEFAULT_SHARD_SIZE

    parser = _Parser(
        prog="diffusiongemma-convert",
        description="Convert a transformers DiffusionGemma checkpoint directory (config.json + "
                    "safetensors), or a llama.cpp GGUF file (architecture diffusion-gemma, any type the gguf "
                    "package dequantizes), into the diffusiongemma format; with a DST ending in .gguf, write any "
                    "checkpoint the package reads (converted, transformers or GGUF) as a llama.cpp GGUF file.")
    parser.add_argument("src", metavar="SRC", help="transformers checkpoint directory or .gguf file (for a .gguf DST, a converted "
                        "directory too)")
    parser.add_argument("dst", metavar="DST", help="output directory, or a .gguf file (see --gguf-type); must not exist unless "
                        "--force")
    parser.add_argument("--dtype", choices=STORAGE_DTYPES, default="float32",
                        help="storage dtype of the output (default: float32; bfloat16 rounds to nearest even "
                             "and keeps a bfloat16 source bit for bit)")
    parser.add_argument("--shard-size", type=parse_size, default=DEFAULT_SHARD_SIZE,
                        help="maximum tensor bytes per output file, e.g. 2GB or 500MiB (default: 2GiB); "
                             "bounds the memory used besides the largest tensor")
    parser.add_argument("--gguf-type", choices=("f32", "f16", "q8_0"), default="f32",
                        help="when DST ends in .gguf, write a llama.cpp GGUF file of this type instead "
                             "(default: f32; diffusiongemma/gguf_writer.py)")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it is an existing diffusiongemma checkpoint (or GGUF file)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: only when stderr is a terminal)")
    return accept_negative_sizes(parser)


def show_progress(option: bool | None, stream=None) -> bool:
    """``--progress`` / ``--no-progress`` when given, else whether ``stream`` (default stderr) is a terminal: a
    bar drawn into a file or a pipe is a heap of carriage returns."""
    if option is not None:
        return option
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def convert(*args, **kwargs):
    """``diffusiongemma.weights_converter.convert``, imported on first use."""
    from .conversion import convert as run

    return run(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Run the converter; prints the summary to stdout and errors to stderr; returns the exit status."""
    try:
        return _run(argv)
    except KeyboardInterrupt:  # also during start-up (imports, argument parsing)
        print("diffusiongemma-convert: interrupted; nothing was written", file=sys.stderr)
        return 130


def _run(argv: list[str] | None) -> int:
    from diffusiongemma.reference.support.errors import CheckpointError, ConfigError, InputError

    args = build_parser().parse_args(argv)
    try:
        if args.dst.lower().endswith(".gguf"):  # a llama.cpp file, not a converted directory
            from diffusiongemma.gguf_writer import write_gguf

            summary = write_gguf(args.src, args.dst, args.gguf_type, force=args.force)
        else:
            summary = convert(args.src, args.dst, dtype=args.dtype, shard_size=args.shard_size,
                              force=args.force, progress=show_progress(args.progress))
    except (CheckpointError, ConfigError, InputError, OSError) as exc:
        print(f"diffusiongemma-convert: error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
