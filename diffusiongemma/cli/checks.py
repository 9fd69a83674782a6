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


def write_aside(path: str, option: str, write, what: str = "the file") -> None:
    """Write ``path`` through ``write(temporary_path)`` into a hidden file beside it, then rename it into place,
    so that a failure (a full disk, Ctrl-C) never leaves a partial file under ``path``; the hidden file is
    removed on any failure. The temporary name keeps ``path``'s extension (writers that choose the format by
    it). An ``OSError`` becomes ``InputError`` naming ``option``, the path and the cause ("no space left on
    device" for ENOSPC)."""
    folder, name = os.path.split(os.path.abspath(path))
    extension = os.path.splitext(name)[1]
    temporary = os.path.join(folder, f".{name}.partial-{os.getpid()}{extension}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException as exc:
        try:
            os.remove(temporary)
        except OSError:
            pass
        if isinstance(exc, OSError):
            reason = (exc.strerror or str(exc)).lower()
            raise InputError(f"{option} {path!r}: {what} could not be written: {reason}; nothing was written "
                             f"there") from None
        raise


def check_generate_options(args, settings, prompt_length: int, stream=None) -> None:
    """The rules ``generate`` applies to option combinations once the prompt is tokenized (so that every option
    takes effect, is refused, or is reported by name on stderr):

    * ``--max-length L`` that leaves no room after the prompt (``L <= prompt tokens``) is refused whatever
      ``-n`` says: the Python API refuses it when ``max_new_tokens`` is left at its default, and with ``-n``
      given it would stop after one canvas, output longer than L, without a word.
    * ``--entropy-bound`` under a ``--semantics`` whose sampler is not the entropy-bound one (mlx-vlm's
      confidence threshold, diffusers' block refinement) changes nothing: a warning names it.
    """
    import sys

    stream = sys.stderr if stream is None else stream
    max_length = getattr(settings, "max_length", None)
    if getattr(args, "max_length", None) is not None and max_length is not None and max_length <= prompt_length:
        raise InputError(f"--max-length {max_length} leaves no room for new tokens after the {prompt_length}-token "
                         "prompt (it counts the prompt too); give a larger --max-length, or drop it and use -n")
    semantics = getattr(args, "semantics", "transformers")
    if getattr(args, "entropy_bound", None) is None or semantics == "transformers":
        return
    from diffusiongemma.reference.variants import get_semantics

    name = get_semantics(semantics).sampler.name
    if name != "entropy-bound":
        print(f"diffusiongemma generate: warning: --entropy-bound {args.entropy_bound} has no effect under "
              f"--semantics {args.semantics}: its sampler is {name}, which does not use an entropy bound",
              file=stream)
