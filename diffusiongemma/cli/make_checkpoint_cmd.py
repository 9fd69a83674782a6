"""The ``make-checkpoint`` subcommand: a random-weight checkpoint at the released shape, in transformers'
layout (``diffusiongemma.released``, imported when the command runs)."""

from __future__ import annotations

import argparse

# (option, ReleasedShape field, what it is): the widths a test or a port author may narrow
WIDTHS = (
    ("--vocab-size", "vocab_size", "vocabulary (released 262,144; at least 4,096)"),
    ("--hidden-size", "hidden_size", "hidden size (released 2,816)"),
    ("--intermediate-size", "intermediate_size", "dense and self-conditioning MLP width (released 2,112)"),
    ("--moe-intermediate-size", "moe_intermediate_size", "one expert's width (released 704)"),
    ("--num-experts", "num_experts", "experts per layer (released 128)"),
    ("--top-k-experts", "top_k_experts", "experts per token (released 8)"),
    ("--num-attention-heads", "num_attention_heads", "query heads (released 16)"),
    ("--num-key-value-heads", "num_key_value_heads", "KV heads of the sliding layers (released 8)"),
    ("--num-global-key-value-heads", "num_global_key_value_heads", "KV heads of the full layers (released 2)"),
    ("--head-dim", "head_dim", "head size of the sliding layers (released 256)"),
    ("--global-head-dim", "global_head_dim", "head size of the full layers (released 512)"),
    ("--sliding-window", "sliding_window", "sliding window (released 1,024)"),
    ("--canvas-length", "canvas_length", "canvas length (released 256)"),
)


def register(commands, formatter) -> None:
    """Add ``make-checkpoint`` to the ``diffusiongemma`` subparsers."""
    from diffusiongemma.weights_converter.cli import accept_negative_sizes, parse_size

    from .argtypes import positive_int, seed

    sub = commands.add_parser(
        "make-checkpoint", formatter_class=formatter,
        help="write a random-weight checkpoint at the released shape (any number of layers) for testing loaders",
        description="Write a DiffusionGemma checkpoint with random weights at the released shape of "
                    "google/diffusiongemma-26B-A4B-it (vocabulary 262,144, hidden 2,816, 128 experts of 704 with "
                    "top 8, heads of 256 / 512, window 1,024, canvas 256) in transformers' layout: config.json "
                    "from transformers' own config class, sharded safetensors, generation config and a tokenizer. "
                    "Any number of layers in the released pattern (five sliding, one full; the last one full); "
                    "--scale or the width options make narrower models. Weights are written tensor by tensor, so "
                    "the full 30-layer checkpoint (50.5 GB in bfloat16) needs little memory. Needs transformers.",
        epilog="Examples: diffusiongemma make-checkpoint released-2L --layers 2; diffusiongemma make-checkpoint "
               "small --layers 12 --scale 64 --dtype float32 --gguf q8_0. Exit status: 0 written, 2 a bad option "
               "(the message names it; nothing is written), 130 interrupted (nothing is left at OUT).")
    sub.add_argument("out", metavar="OUT", help="the folder to create (it must not exist, unless --force)")
    sub.add_argument("--layers", type=positive_int, default=30, metavar="N",
                     help="number of layers, in the released pattern (the released model has 30)")
    sub.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="storage dtype of the weights (both hold the same values: every weight is a bfloat16 "
                          "number)")
    sub.add_argument("--seed", type=seed, default=0, help="seed of the weights, in [0, 2**64) (default: 0)")
    sub.add_argument("--scale", type=positive_int, default=1, metavar="N",
                     help="divide every width (vocabulary, hidden, MLP, experts, heads' sizes, window, canvas) by N, "
                          "keeping the head counts and the layer pattern")
    widths = sub.add_argument_group("widths", "each overrides the released (or --scale'd) value")
    for option, field, what in WIDTHS:
        widths.add_argument(option, dest=field, type=positive_int, default=None, metavar="N", help=what)
    sub.add_argument("--gguf", choices=("f32", "f16", "q8_0"), default=None,
                     help="also write OUT/model-TYPE.gguf through the project's GGUF converter (which loads the "
                          "model in float32 memory: for narrow or short models)")
    sub.add_argument("--shard-size", type=parse_size, default="5GB", metavar="SIZE",
                     help="maximum tensor bytes per safetensors file, e.g. 5GB or 500MiB")
    sub.add_argument("--force", action="store_true",
                     help="replace OUT if it is a DiffusionGemma checkpoint folder (or empty)")
    sub.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on stderr (default: only when stderr is a terminal)")
    accept_negative_sizes(sub).set_defaults(handler=run)


def run(args) -> int:
    from diffusiongemma.released import make_checkpoint
    from diffusiongemma.weights_converter.cli import show_progress

    overrides = {field: getattr(args, field) for _, field, _ in WIDTHS if getattr(args, field) is not None}
    made = make_checkpoint(args.out, layers=args.layers, dtype=args.dtype, seed=args.seed, scale=args.scale,
                           gguf=args.gguf, shard_size=args.shard_size, force=args.force,
                           progress=show_progress(args.progress), **overrides)
    print(made)
    return 0
