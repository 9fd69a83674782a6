"""argparse value types shared by the subcommands; each rejects bad text with a message naming it."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (NaN and infinities are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


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
    """A finite number > 0 (NaN and infinities are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
