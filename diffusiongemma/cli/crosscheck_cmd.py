"""The ``crosscheck`` subcommand; it lives with the cross-check package (``diffusiongemma/crosscheck/cli.py``)."""

from diffusiongemma.crosscheck.cli import register, run  # noqa: F401
