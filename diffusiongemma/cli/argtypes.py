"""argparse value types shared by the subcommands; each rejects bad text with a message naming it."""

from __future__ import annotations

import argparse
import math

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max: every backend computes in float32
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (a subnormal); below half of it -> 0


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float32_number(text: str, positive: bool) -> float:
    """``text`` as a number that float32 holds as a finite value, > 0 with ``positive`` (not rounding to 0),
    else >= 0; ``ArgumentTypeError`` naming the text otherwise (NaN, infinities, ``1e308``, ``-1``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    bound = "> 0" if positive else ">= 0"
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
    if value > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is beyond float32's largest number ({FLOAT32_MAX:.7g}), which "
                                         "every backend computes in; give a smaller value")
    if value > 0 and value < FLOAT32_TINY / 2:
        raise argparse.ArgumentTypeError(f"{text!r} is below float32's smallest positive number ({FLOAT32_TINY:.4g}) "
                                         "and would become 0")
    return value


def non_negative_float(text: str) -> float:
    """A number >= 0 that stays finite in float32 (NaN, infinities and values above 3.4e38 are refused)."""
    return _float32_number(text, positive=False)


def join_signed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with every option that takes a value and is followed by a signed number argparse would read as
    an option (``-inf``, ``-nan``, ``-1e5``; plain ``-1`` and ``-.5`` it already reads as values) written as
    ``--option=VALUE``, so that the option's own type names what is wrong with the value instead of argparse
    saying "expected one argument". Nothing after a ``--`` is touched."""
    takes_value: set[str] = set()
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs != 0:
                takes_value.update(action.option_strings)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out.extend(argv[i:])
            break
        following = argv[i + 1] if i + 1 < len(argv) else None
        if token in takes_value and following is not None and following.startswith("-") and _is_number(following):
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def token_ids(text: str) -> list[int]:
    """Comma- or space-separated non-negative token ids, e.g. ``2,818,7``."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more non-negative token ids, got {text!r}")
    return ids


SEED_LIMIT = 2**64  # seeds are kept below 2**64 so that they print and parse as plain integers


def seed(text: str) -> int:
    """A draw-source seed: an integer in [0, 2**64)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**64), got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**64), got {value}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 that stays finite and non-zero in float32 (NaN, infinities, values above 3.4e38 or below
    float32's smallest positive number are refused)."""
    return _float32_number(text, positive=True)
