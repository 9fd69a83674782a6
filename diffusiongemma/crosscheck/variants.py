"""The reference's peer variants, as the cross-check uses them (one place to adapt if their home moves).

``semantics(name, **changes)`` is a variant of ``generate(semantics=...)``; ``describe`` names it with the
choices that were changed; ``trim_output`` is the variant's rule for the tokens a peer reports;
``entropy_bound`` tells whether a variant's acceptance stage is the entropy bound (then an acceptance
flip can be checked for a float32 tie against the bound).
"""

from __future__ import annotations

from typing import Any


def _registry() -> dict:
    from diffusiongemma.reference.variants import SEMANTICS

    return SEMANTICS


def semantics(name: str, **changes: Any) -> Any:
    """The named variant, with ``changes`` (stage choices) replaced."""
    base = _registry()[name]
    return base.replace(**changes) if changes else base


def describe(variant: Any) -> str:
    """``name`` or ``name with stage=choice, ...`` for the choices that differ from the named variant."""
    base = _registry().get(variant.name)
    try:
        mine, theirs = variant.switches(), (base.switches() if base is not None else {})
    except AttributeError:
        return str(variant.name)
    changed = {k: v for k, v in mine.items() if theirs.get(k) != v}
    return variant.name + ("" if not changed else " with " + ", ".join(f"{k}={v}" for k, v in changed.items()))


def is_transformers(variant: Any) -> bool:
    """True when every stage choice is transformers' own."""
    try:
        return variant.switches() == _registry()["transformers"].switches()
    except AttributeError:
        return variant is _registry()["transformers"]


def trim_output(variant: Any, new_tokens: list, eos_token_ids, max_new_tokens: int) -> list:
    """The tokens the peer would report from our committed canvases (the variant's output rule)."""
    return variant.eos.trim(new_tokens, eos_token_ids, max_new_tokens)


def entropy_bound(variant: Any) -> bool:
    """True when the variant accepts by the entropy bound (transformers' sampler)."""
    sampler = getattr(variant, "sampler", None)
    return sampler is None or "entropy" in str(getattr(sampler, "name", sampler))
