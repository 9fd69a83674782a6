"""Checks the subcommands make before a long run, so that it does not fail at the end."""

from __future__ import annotations

import os

from diffusiongemma.reference.support.errors import InputError


def check_writable(path: str, option: str) -> None:
    """Raise ``InputError`` naming ``option`` when ``path`` cannot be written: its folder is missing or not
    writable, or it is a folder. Probes by creating (and removing) a file beside it."""
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise InputError(f"{option} {path!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise InputError(f"{option} {path!r}: {folder!r} is not an existing folder")
    probe = os.path.join(folder, f".diffusiongemma-write-test-{os.getpid()}")
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise InputError(f"{option} {path!r} cannot be written: {exc.strerror or exc}") from None
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise InputError(f"{option} {path!r} exists and is not writable")
