"""The diffusiongemma command line.

    diffusiongemma generate "And God said"            generate with the shipped tiny model
    diffusiongemma generate -m DIR --chat "Hi"        any checkpoint (transformers, converted or GGUF)
    echo "And God said" | diffusiongemma generate -   the prompt from standard input
    diffusiongemma convert SRC DST                    same as diffusiongemma-convert
    diffusiongemma trace --prompt "Hi" -o run.trace   record a golden trace (docs/TRACE_FORMAT.md)
    diffusiongemma compare a.trace b.trace            first tensor at which two traces differ
    diffusiongemma plot run.json -o denoising.png     pictures of the denoising of a run
    diffusiongemma crosscheck transformers            another implementation beside the reference
    diffusiongemma make-checkpoint DIR --layers 2     random weights at the released shape (testing loaders)

Exit status: 0 success, 1 a divergence (compare, crosscheck) or a rejected conversion (convert), 2 a bad
argument or input (the message names it), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# The subcommands: (module under diffusiongemma.cli, its commands). Each module has ``register(commands,
# formatter)``, which adds its subparsers and sets ``handler`` (a function of the parsed arguments returning
# the exit status); a handler that sets ``takes_argv`` also receives the raw arguments after its name
# (``args.argv``). A new subcommand is one more row here.
SUBCOMMANDS: list[tuple[str, tuple[str, ...]]] = [
    ("generate_cmd", ("generate",)),
    ("convert_cmd", ("convert",)),
    ("trace_cmd", ("trace", "compare")),
    ("plot_cmd", ("plot",)),
    ("crosscheck_cmd", ("crosscheck",)),
    ("make_checkpoint_cmd", ("make-checkpoint",)),
]
# Each command's line in ``diffusiongemma --help``, the same as its module registers (tests/test_cli_flags.py
# checks that): the top-level help, ``--version`` and a bad command name are answered without importing the
# command modules, which import NumPy, the reference and ml_dtypes (a 2-4 s start); only the command that
# runs is registered in full.
SUMMARIES: dict[str, str] = {
    "generate": "generate text by block diffusion",
    "convert": "convert a checkpoint to the project's format or to GGUF (the same as diffusiongemma-convert)",
    "trace": "record a golden trace of one generation run",
    "compare": "find the first tensor at which two traces differ",
    "plot": "draw the denoising of a run (entropy/acceptance heatmaps, commit order, schedule)",
    "crosscheck": "compare another implementation with the reference",
    "make-checkpoint": "write a random-weight checkpoint at the released shape (any number of layers) for testing loaders",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that a bad argument is one line naming it and one line of hint, without the
    usage block (``diffusiongemma generate: error: argument -n/--max-new-tokens: expected a positive integer,
    got 0``). Subcommands' parsers are of this class too (argparse makes them of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (``(default: X)``), except for switches, unset (None) defaults and help
    texts that already say what the default is."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class TopHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``HelpFormatter`` keeping the line breaks of the command list above."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser. With ``argv``, only the command it names (its first word that is not an option:
    the top level has no option taking a value) is registered in full, the others as their help line alone,
    so that parsing ``argv`` imports only what that command needs; without, every command in full."""
    from diffusiongemma import __version__

    parser = ArgumentParser(prog="diffusiongemma", description=__doc__, formatter_class=TopHelpFormatter)
    parser.add_argument("--version", action="version", version=f"diffusiongemma {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = None if argv is None else next((a for a in argv if a == "--" or not a.startswith("-")), None)
    for module, names in SUBCOMMANDS:
        if argv is None or named in names or any(name not in SUMMARIES for name in names):
            importlib.import_module(f"{__package__}.{module}").register(commands, HelpFormatter)
        else:
            for name in names:
                commands.add_parser(name, help=SUMMARIES[name], add_help=False)
    choices = commands.choices  # registration order may differ from the table's: list the commands in its order
    commands.choices = {name: choices[name] for _, names in SUBCOMMANDS for name in names}
    order = {name: i for i, name in enumerate(commands.choices)}
    commands._choices_actions.sort(key=lambda action: order[action.dest])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from .argtypes import join_signed_values

    argv = sys.argv[1:] if argv is None else list(argv)
    command = "diffusiongemma"
    try:
        parser = build_parser(argv)  # the command named in argv only
        argv = join_signed_values(parser, argv)  # `--entropy-bound -inf`: a value, refused by the option's type
        args = parser.parse_args(argv)  # importing the package sized the threads (diffusiongemma/threads.py)
        command = f"diffusiongemma {args.command}"
        if getattr(args, "threads", None) is not None:  # --threads N wins over the sizing and the environment
            from diffusiongemma.threads import check_thread_count, configure

            configure(threads=check_thread_count(args.threads, "--threads"))  # above the usable cores: refused
        if getattr(args, "takes_argv", False):
            args.argv = argv[argv.index(args.command) + 1:]  # the top level has no options taking values
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `diffusiongemma generate ... | head -c 20`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError, RuntimeError, ImportError) as exc:  # the project's errors are ValueErrors
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
