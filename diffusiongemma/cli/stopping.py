"""Why a run stopped, as the command line reports it (text on stderr, ``stop_reason`` in ``--json``).

A row of a run ends for one of three reasons (SPEC §8.1-8.2), named as ``GenerationResult.stop_reasons``
names them:

* ``"eos"``: an EOS id appeared in committed canvas k (the rest of the output is pad);
* ``"max_length"``: the output reached the ``max_length`` the user set (transformers' MaxLengthCriteria);
* ``"max_new_tokens"``: the token budget's canvases were all made (ceil(max_new_tokens / C) of them).

``k`` is the 0-based canvas index, as in ``CanvasInfo.canvas_index``.
"""

from __future__ import annotations

from typing import Any

REASONS = ("eos", "max_length", "max_new_tokens")


def stop_reason(result: Any, row: int = 0) -> dict:
    """``{"reason": ..., "canvas": k}`` for ``row`` of ``result`` (a ``GenerationResult``: its
    ``stop_reasons``, filled by the generation loop of every backend)."""
    found = result.stop_reasons[row]
    reason = str(found["reason"])
    if reason not in REASONS:
        raise ValueError(f"unknown stop reason {reason!r} in the generation result")
    return {"reason": reason, "canvas": int(found["canvas"])}


def describe(reason: dict, settings: Any, planned_canvases: int, canvas_length: int) -> str:
    """One line for people, e.g. ``stopped: EOS in canvas 2 of 8``; canvases are counted from 1 here."""
    k = reason["canvas"] + 1
    if reason["reason"] == "eos":
        return f"stopped: EOS in canvas {k} of {planned_canvases}"
    if reason["reason"] == "max_length":
        return f"stopped: length limit (max_length {settings.max_length}) after canvas {k}"
    return (f"stopped: token budget ({settings.max_new_tokens} new tokens = {planned_canvases} canvas"
            f"{'es' if planned_canvases != 1 else ''} of {canvas_length}) used up")
