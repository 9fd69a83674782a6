"""The ``crosscheck`` subcommand: run another DiffusionGemma implementation and the reference side by side.

    diffusiongemma crosscheck mlx-vlm                 tiny random checkpoint, text report
    diffusiongemma crosscheck diffusers --json        the same report as one JSON object
    diffusiongemma crosscheck transformers -m DIR     any transformers-layout checkpoint

Exit status: 0 the peer agrees with the reference, 1 it differs (the report says where and why), 2 a usage
or setup error (unknown peer, peer not installed: the message has the install command, bad checkpoint).
"""

from __future__ import annotations

import argparse
import sys


def register(commands, formatter=argparse.HelpFormatter) -> None:
    """Add ``crosscheck`` to the ``diffusiongemma`` subparsers."""
    from diffusiongemma.cli.argtypes import positive_int, seed

    from . import PEERS

    parser = commands.add_parser("crosscheck", help="compare another implementation with the reference",
                                 formatter_class=formatter,
                                 description="Run another DiffusionGemma implementation and the reference on the "
                                             "same weights and inputs and report side by side: forward logits, "
                                             "generation token by token (the peer's draws replayed into our loop "
                                             "run with that peer's semantics), adaptations, defects "
                                             "(docs/PEERS.md). Exit status: 0 agree, 1 differ, 2 usage or setup "
                                             "error.")
    parser.add_argument("peer", choices=PEERS + ("llama.cpp",), help="the implementation to check")
    parser.add_argument("-m", "--model", default=None, metavar="DIR",
                        help="transformers-layout checkpoint directory (default: a tiny random checkpoint built "
                             "in a temporary directory, with every norm weight and scalar randomised)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed of the inputs and of the peer's random stream, in [0, 2**64)")
    parser.add_argument("--canvases", type=positive_int, default=2, help="canvases generated per sampler configuration")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32 (default), or bfloat16 (transformers and diffusers): the peer loaded with "
                             "dtype=torch.bfloat16 against the reference's bfloat16 run, each stage on the peer's "
                             "own input to it, judged against a correct bfloat16 run that sums in another order "
                             "(docs/SPEC.md §10.3)")
    from .llama_cpp_peer import add_arguments as add_llama_cpp_arguments  # llama.cpp: an external binary

    add_llama_cpp_arguments(parser)
    parser.set_defaults(handler=run)


def run(args) -> int:
    from . import BF16_PEERS

    if args.dtype != "float32" and args.peer not in BF16_PEERS:
        print(f"diffusiongemma crosscheck: error: --dtype {args.dtype} is defined for the "
              f"{' and '.join(BF16_PEERS)} peers only (not {args.peer})", file=sys.stderr)
        return 2
    if args.peer == "llama.cpp":
        from .llama_cpp_peer import run as run_llama_cpp

        return run_llama_cpp(args)
    from . import PeerUnavailable, crosscheck

    if args.canvases < 1:
        print("diffusiongemma crosscheck: error: --canvases must be >= 1", file=sys.stderr)
        return 2
    try:
        report = crosscheck(args.peer, args.model, seed=args.seed, canvases=args.canvases, dtype=args.dtype)
    except PeerUnavailable as exc:
        print(f"diffusiongemma crosscheck: error: {exc}", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.to_text())
    return report.exit_code
