"""Semantic variants: the generation loop as other DiffusionGemma implementations run it (SPEC §11).

transformers 5.24.0 is the default and the specification (SPEC §8). Other implementations make different
choices at a few stages of the same loop (docs/PEERS.md). A ``Semantics`` (``stages.py``) holds one stage object
per stage, as a sampler object holds its samplers: ``TRANSFORMERS`` is filled with the spec's own
functions, and every peer here is built from it with ``replace``. ``generate(..., semantics="jax")`` runs the one loop
with those stages, so that a porter compares an implementation with a reference that makes the same
choices, difference by difference.

One file per stage, each stage a small frozen object with a ``name`` (what ``--semantics`` reports and
``replace`` accepts as a string) and a ``source`` (where the choice comes from):

    temperature.py   temperature (T_n rounding), sc_temperature (the self-conditioning input)
    draw.py          denoiser_draw (categorical draw or argmax); peer random streams as draw sources
    acceptance.py    sampler (entropy-bound, confidence-threshold, block-refinement, auto-regressive Euler)
    stopping.py      stop_comparison (< or <=), stop_history (what "stable" compares)
    commit.py        commit (what a canvas commits), eos (end-token rule)
    window.py        canvas_window (the prompt keys a canvas query sees in a sliding layer)
    llama_cpp_draws.py, jax_draws.py   the peers' own random streams as draw sources: ``LlamaCppDraws(seed)``
                     and ``JaxDraws(seed)`` reproduce those implementations' runs from the seed alone
    router.py        not a loop stage: the router's top-K among equal probabilities, which upstream leaves
                     undefined; ``model.router_top_k = torch_cpu_top_k`` reproduces torch's CPU order (trap T25)

What the reference cannot reproduce is said where it matters (``Semantics.note``).
"""

from __future__ import annotations

from ..stages import SEMANTICS, STAGES, TRANSFORMERS, Semantics, get_semantics, register_semantics
from . import acceptance, commit, draw, stopping, temperature, window
from .jax_draws import JaxDraws
from .llama_cpp_draws import LlamaCppDraws

__all__ = ["Semantics", "SEMANTICS", "TRANSFORMERS", "STAGES", "SWITCHES", "get_semantics", "JaxDraws",
           "LlamaCppDraws"]

register_semantics(*[(field, stage) for field, choices in (
    ("commit", commit.COMMITS), ("stop_comparison", stopping.COMPARISONS), ("stop_history", stopping.HISTORIES),
    ("canvas_window", window.WINDOWS), ("temperature", temperature.TEMPERATURES),
    ("sc_temperature", temperature.SC_INPUTS), ("eos", commit.EOS_RULES),
    ("sampler", acceptance.SAMPLERS), ("denoiser_draw", draw.DRAWS)) for stage in choices.values()])

register_semantics(semantics={v.name: v for v in (
    TRANSFORMERS.replace(name="jax", commit="sampled", stop_comparison="non-strict", stop_history="input-canvas",
                         canvas_window="W-1-i", eos="jax", temperature="xla", sc_temperature="bfloat16-embedding",
                         note="JAX main @7691fd4 as it runs on float32 parameters; with random=JaxDraws(seed) its "
                              "threefry draws too; a prompt id 0 is JAX's padding (not reproduced)"),
    TRANSFORMERS.replace(name="llama.cpp", stop_history="held-counter", temperature="c-float",
                         sc_temperature="multiply-inverse", eos="llama.cpp",
                         note="PR #24423; the F16 SC embedding copy and GELU table are not reproduced"),
    TRANSFORMERS.replace(name="vllm", temperature="double", eos="cut-after",
                         note="Gumbel-max draws, top-k/top-p and the shared layer scalar are not reproduced"),
    TRANSFORMERS.replace(name="mlx-vlm", temperature="double", eos="stop-excluded",
                         sampler="confidence-threshold", denoiser_draw="argmax", threshold=0.9,
                         note="mlx-vlm 0.7.10 defaults (confidence-threshold 0.9, temperature 0); "
                              "replace(sampler='entropy-bound') for its entropy-bound sampler; its shorter last "
                              "canvas, min(C, max(remaining, 64)) without --diffusion-full-canvas, is not reproduced"),
    TRANSFORMERS.replace(name="diffusers", commit="sampled-unless-stopped", stop_history="argmax-history-min1",
                         temperature="double", eos="first-id-only",
                         note="diffusers 0.42.1 with EntropyBoundScheduler; replace(sampler='block-refinement', "
                              "temperature='none', sc_temperature='raw', denoiser_draw='argmax', threshold=0.95) "
                              "for BlockRefinementScheduler"),
)})

# stage field -> {choice name: where that choice comes from} (the table docs/SPEC.md §11 names)
SWITCHES: dict[str, dict[str, str]] = {field: {name: stage.source for name, stage in choices.items()}
                                       for field, choices in STAGES.items()}
