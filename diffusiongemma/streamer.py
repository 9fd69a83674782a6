"""Streamers with transformers' interface, driven by our ``generate`` through its callback.

transformers' DiffusionGemma ``generate(..., streamer=s)`` calls ``s.put(prompt_ids)`` once, ``s.put_draft(
value=argmax_canvas)`` after every denoising step (when the streamer has ``put_draft``), ``s.put(canvas)``
after every committed canvas and ``s.end()`` at the end (transformers 5.24.0,
``generation_diffusion_gemma.py``). ``StreamerCallback(s)`` turns those calls into a generation callback, so
code written for transformers' streamers runs on this project's ``generate``, on every backend::

    from transformers import TextDiffusionStreamer             # or diffusiongemma.streamer's own class
    generate(model, ids, callback=StreamerCallback(TextDiffusionStreamer(tokenizer)))

    on_prompt(ids)   -> streamer.put(ids)            (B, P) int64
    on_step(info)    -> streamer.put_draft(value=info.draft)   (B, C) int64, the argmax draft
    on_canvas(info)  -> streamer.put(info.tokens)    (B, C) int64, after the EOS/pad rules
    on_end(result)   -> streamer.end()

Arrays are NumPy (transformers passes CPU torch tensors); the streamers only use ``.shape``, indexing and
``.tolist()``, which both have. A streamer that asks for logits (``_takes_logits = True``) is refused: the
callback sees drafts, not logits.

``TextStreamer`` and ``TextDiffusionStreamer`` below behave as transformers' classes of those names (same
text printed, in the same pieces, with the same terminal codes), for users without transformers: they
decode with a ``tokenizers.Tokenizer``, this project's ``checkpoint.TextSide`` or a transformers tokenizer.
"""

from __future__ import annotations

import sys
import time
import unicodedata
from typing import Any

from diffusiongemma.reference.support.errors import InputError

__all__ = ["StreamerCallback", "TextStreamer", "TextDiffusionStreamer"]

SAVE_CURSOR, RESTORE_AND_CLEAR = "\x1b7", "\x1b8\x1b[J"  # DEC save cursor; restore it and clear below
YELLOW, RESET = "\x1b[33m", "\x1b[0m"


class StreamerCallback:
    """A generation callback feeding a transformers-style streamer (``put``, ``end``, optional
    ``put_draft``). Raises ``InputError`` for an object without ``put``/``end`` or one that takes logits."""

    def __init__(self, streamer: Any):
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise InputError(f"a streamer needs put() and end() methods; {type(streamer).__name__} lacks them")
        if getattr(streamer, "_takes_logits", False):
            raise InputError(f"{type(streamer).__name__} asks for logits (_takes_logits); this generate hands "
                             "streamers the argmax drafts only")
        self.streamer = streamer
        self._drafts = callable(getattr(streamer, "put_draft", None))

    def on_prompt(self, input_ids) -> None:
        self.streamer.put(input_ids)

    def on_step(self, info) -> None:
        if self._drafts:
            self.streamer.put_draft(value=info.draft)

    def on_canvas(self, info) -> None:
        self.streamer.put(info.tokens)

    def on_end(self, result) -> None:
        self.streamer.end()


def _decoder(tokenizer: Any, decode_kwargs: dict):
    """ids (list of int) -> text, for a tokenizers.Tokenizer, a TextSide or a transformers tokenizer."""
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "decode"):  # tokenizers.Tokenizer
        skip = decode_kwargs.get("skip_special_tokens", False)
        return lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip)
    return lambda ids: tokenizer.decode([int(i) for i in ids], **decode_kwargs)


def _rows(value) -> list[int]:
    """A (1, n) or (n,) array of ids as a list; ValueError for more than one row (as transformers)."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) > 1:
        if shape[0] > 1:
            raise ValueError("TextStreamer only supports batch size 1")
        value = value[0]
    return [int(i) for i in (value.tolist() if hasattr(value, "tolist") else value)]


class TextStreamer:
    """Prints committed text to ``stream`` (default stdout) as soon as whole words are known.

    tokenizer: decodes ids (see the module docstring). skip_prompt: do not print the first ``put`` (the
    prompt). decode_kwargs: passed to the tokenizer's ``decode`` (e.g. ``skip_special_tokens=True``).
    The text is re-decoded from a running id list so that multi-byte characters and leading spaces come out
    right; a piece is printed when it ends in a newline (then the list restarts from its last id), when its
    last character is CJK, when it holds only letters, marks, digits and spaces, or else up to its last space.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, stream=None, **decode_kwargs: Any):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.stream = stream
        self._decode = _decoder(tokenizer, decode_kwargs)
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def put(self, value) -> None:
        ids = _rows(value)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(ids)
        text = self._decode(self.token_cache)
        pending = text[self.print_len:]
        if text.endswith("\n"):
            printable = pending
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(self._decode(self.token_cache))
        elif text and _is_cjk(ord(text[-1])):
            printable = pending
            self.print_len += len(printable)
        elif all(c.isspace() or unicodedata.category(c)[0] in "LMN" for c in pending):
            printable = pending
            self.print_len += len(printable)
        else:
            printable = text[self.print_len:text.rfind(" ") + 1]
            self.print_len += len(printable)
        self.on_finalized_text(printable)

    def end(self) -> None:
        printable = ""
        if self.token_cache:
            printable = self._decode(self.token_cache)[self.print_len:]
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(printable, stream_end=True)

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(text)
        stream.flush()

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Print ``text``; a newline too at the end of the stream. Override to send text elsewhere."""
        self._write(text + ("\n" if stream_end else ""))


class TextDiffusionStreamer(TextStreamer):
    """``TextStreamer`` plus drafts: each ``put_draft`` prints the decoded draft in yellow after saving the
    cursor position, and the next draft, ``put`` or ``end`` first restores the cursor and clears the old
    draft. sleep_time: seconds to pause after each draft, to watch it."""

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, sleep_time: float | None = None, stream=None,
                 **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, stream=stream, **decode_kwargs)
        self._has_draft = False
        self._takes_logits = False
        self.sleep_time = sleep_time

    def _clear_draft(self) -> None:
        if self._has_draft:
            self._write(RESTORE_AND_CLEAR)
            self._has_draft = False

    def put_draft(self, value, **kwargs: Any) -> None:
        self._clear_draft()
        text = self._decode(_rows(value))
        self._write(SAVE_CURSOR)
        self._write(f"{YELLOW}{text}{RESET}")
        self._has_draft = True
        if self.sleep_time is not None:
            time.sleep(self.sleep_time)

    def put(self, value) -> None:
        self._clear_draft()
        super().put(value)

    def end(self) -> None:
        self._clear_draft()
        super().end()


def _is_cjk(cp: int) -> bool:
    """True for a code point in the CJK Unified Ideographs blocks (and compatibility ideographs)."""
    return any(lo <= cp <= hi for lo, hi in (
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))
