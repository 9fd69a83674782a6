"""Commit stages: what a finished canvas commits, and what an end token does to it and to the output.

The spec (transformers) commits the argmax draft (``ARGMAX``) and keeps the EOS and pads after it when a pad
id is set (``TRANSFORMERS_EOS``: ``sampling.finalize_canvas``). Every canvas has C positions in every
variant: mlx-vlm's shorter last canvas is not reproduced (its ``Semantics.note`` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..sampling import finalize_canvas
from ..stages import CommitArgmax, TransformersEos


# ------------------------------------------------------------------------------------------ what is committed
@dataclass(frozen=True)
class CommitSampled:
    """The last step's sampled-and-renoised canvas."""

    name: ClassVar[str] = "sampled"
    source: ClassVar[str] = "JAX sample_next_canvas returns the last SampleFromPredictions canvas"

    def __call__(self, draft: np.ndarray, canvas: np.ndarray, stopped: np.ndarray) -> np.ndarray:
        return np.asarray(canvas, dtype=np.int64)


@dataclass(frozen=True)
class CommitSampledUnlessStopped:
    """The sampled canvas, except for rows the stopping rule ended (those commit the argmax)."""

    name: ClassVar[str] = "sampled-unless-stopped"
    source: ClassVar[str] = ("diffusers DiffusionGemmaPipeline appends scheduler prev_sample; rows frozen by "
                             "the stopping rule get the argmax")

    def __call__(self, draft: np.ndarray, canvas: np.ndarray, stopped: np.ndarray) -> np.ndarray:
        return np.where(np.asarray(stopped, dtype=bool)[:, None], draft, canvas).astype(np.int64)


# ------------------------------------------------------------------------------------------ end tokens
def llama_cpp_cut(canvas: list[int], eos_token_ids, repeats: int = 6) -> int:
    """Where llama.cpp's diffusion CLI cuts one denoised canvas (``trim_canvas``): at the first end id, or
    earlier at the first i with i + 1 < that cut from which ``canvas[j] == canvas[j + s]`` holds ``repeats``
    times in a row for j = i, i + s, i + 2s, ... (stride s = 1 or 2, j + s inside the canvas, possibly past
    the end id). So a stride-1 loop is 7 equal tokens, and a stride-2 loop compares one parity only: every
    other token equal over 13 positions. Returns the number of tokens kept."""
    eos = set(int(t) for t in eos_token_ids)
    n = len(canvas)
    cut = next((i for i, t in enumerate(canvas) if int(t) in eos), n)
    for i in range(max(cut - 1, 0)):
        for stride in (1, 2):
            equal, j = 0, i
            while j + stride < n and canvas[j] == canvas[j + stride]:
                equal, j = equal + 1, j + stride
            if equal >= repeats:
                return i
    return cut


@dataclass(frozen=True)
class EosRule:
    """An end-token rule: ``finalize`` rewrites a committed canvas and says which rows ended; ``trim`` cuts
    the generated ids (one row) to what the implementation reports.

    pad: "spec" (the generation config's pad id), "zero" (pad id 0 when none is set: JAX always pads with
    0) or "none" (nothing is rewritten). ids: "all" EOS ids end a row, or only the "first" (diffusers).
    cut: the output cut after the run: "none", "before" the first EOS (excluded), "after" it (included),
    "before-or-loop" (llama.cpp: each canvas before its first EOS or the start of a repetition loop,
    ``llama_cpp_cut``).
    """

    name: str
    source: str
    pad: str = "spec"
    ids: str = "all"
    cut: str = "none"
    limit_to_budget: bool = False  # the output also ends at max_new_tokens (mlx-vlm)

    def finalize(self, tokens: np.ndarray, finished_before: np.ndarray, eos_token_ids, pad_token_id,
                 forced: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens to append (B, C) int64, finished (B,) bool) for a committed canvas."""
        eos = tuple(eos_token_ids)
        eos = eos[:1] if self.ids == "first" else eos
        if self.pad == "spec":
            return finalize_canvas(tokens, finished_before, eos, pad_token_id, forced)
        if self.pad == "zero":
            return finalize_canvas(tokens, finished_before, eos, 0 if pad_token_id is None else pad_token_id, forced)
        tokens = np.array(tokens, dtype=np.int64, copy=True)
        hit = np.isin(tokens, np.asarray(eos, dtype=np.int64)).any(axis=-1) if eos else np.zeros(len(tokens), bool)
        if self.cut == "before-or-loop":  # llama.cpp stops after a canvas it cuts, at an end id or at a loop
            hit = hit | np.array([llama_cpp_cut(row.tolist(), eos) < tokens.shape[1] for row in tokens], dtype=bool)
        finished = np.asarray(finished_before, dtype=bool) | hit
        if forced is not None:
            finished = finished | np.asarray(forced, dtype=bool)
        return tokens, finished

    def trim(self, new_tokens: list[int], eos_token_ids, max_new_tokens: int,
             canvas_length: int | None = None) -> list[int]:
        """The generated tokens the implementation reports, from the committed canvases (one row).

        "before-or-loop" cuts canvas by canvas when ``canvas_length`` is given (llama.cpp trims each block and
        stops at the first one it cuts), else treats the whole row as one canvas (``llama_cpp_cut``)."""
        eos = set(int(t) for t in eos_token_ids)
        row = [int(t) for t in new_tokens]
        if self.cut == "before-or-loop":
            size = canvas_length or max(len(row), 1)
            kept: list[int] = []
            for start in range(0, len(row), size):
                canvas = row[start:start + size]
                cut = llama_cpp_cut(canvas, eos)
                kept += canvas[:cut]
                if cut < len(canvas):
                    break
            row = kept
        elif self.cut != "none":
            first = next((i for i, t in enumerate(row) if t in eos), None)
            if first is not None:
                row = row[:first + 1] if self.cut == "after" else row[:first]
        if self.limit_to_budget:
            row = row[:max_new_tokens]
        return row


TRANSFORMERS_EOS = TransformersEos()
JAX_EOS = EosRule("jax", "JAX _truncate_canvas_at_stop_tokens: PAD=0 after the first end token, end token kept",
                  pad="zero")
STOP_EXCLUDED_EOS = EosRule("stop-excluded", "mlx-vlm: emission stops at the first EOS id, which is not emitted; "
                                             "also stops at max_new_tokens", pad="none", cut="before",
                            limit_to_budget=True)
LLAMA_CPP_EOS = EosRule("llama.cpp", "llama.cpp trim_canvas, per canvas: cut at the first EOG (excluded) or where "
                                     "6 equal pairs at stride 1 or 2 start", pad="none", cut="before-or-loop")
FIRST_ID_EOS = EosRule("first-id-only", "diffusers: only the tokenizer's single eos_token_id ends a row; no "
                                        "rewrite", pad="none", ids="first")
CUT_AFTER_EOS = EosRule("cut-after", "vLLM server stop handling [I]: the output ends after the first EOS, no pad",
                        pad="none", cut="after")


ARGMAX, SAMPLED, SAMPLED_UNLESS_STOPPED = CommitArgmax(), CommitSampled(), CommitSampledUnlessStopped()
COMMITS = {s.name: s for s in (ARGMAX, SAMPLED, SAMPLED_UNLESS_STOPPED)}
EOS_RULES = {s.name: s for s in (TRANSFORMERS_EOS, JAX_EOS, STOP_EXCLUDED_EOS, LLAMA_CPP_EOS, FIRST_ID_EOS,
                                 CUT_AFTER_EOS)}
