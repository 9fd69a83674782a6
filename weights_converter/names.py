"""The name map between transformers' DiffusionGemma checkpoints and the project's format.

Every tensor in a transformers checkpoint (``DiffusionGemmaForBlockDiffusion.save_pretrained``,
transformers 5.24.0) falls into exactly one of four kinds:

* **used**: a text-model tensor, renamed to the project's name (table below);
* **tied copy**: a tensor that transformers ties to a decoder tensor (``lm_head.weight`` and every
  ``model.encoder.language_model.*`` weight except the layer scalars). ``save_pretrained`` drops
  these, but a hand-made file may hold them; the converter checks that each equals its source and
  then drops it;
* **skipped**: the vision tower and the vision embedder (``model.encoder.vision_tower.*``,
  ``model.encoder.embed_vision.*``), which text generation never uses;
* **unknown**: anything else, which is an error.

Renaming rules (HF name -> project name, ``L`` a layer index)::

    model.decoder.embed_tokens.weight                    -> embed_tokens
    model.decoder.norm.weight                            -> final_norm
    model.decoder.self_conditioning.X.weight             -> self_conditioning.X
    model.decoder.layers.L.self_attn.X.weight            -> layers.L.X     (q/k/v/o_proj, q/k_norm)
    model.decoder.layers.L.X                             -> layers.L.X     (router.scale, router.per_expert_scale,
                                                                            experts.gate_up_proj, experts.down_proj)
    model.decoder.layers.L.X.weight                      -> layers.L.X     (norms, mlp.*, router.proj)
    model.decoder.layers.L.layer_scalar                  -> layers.L.decoder_layer_scalar
    model.encoder.language_model.layers.L.layer_scalar   -> layers.L.encoder_layer_scalar

The two layer scalars are separate buffers upstream (transformers ties weights, never buffers),
so they are read separately and never assumed equal.
"""

from __future__ import annotations

import re

DECODER = "model.decoder."
ENCODER_TEXT = "model.encoder.language_model."

# Layer tensors that upstream stores as bare parameters (no ``.weight`` suffix).
BARE_LAYER_TENSORS = frozenset({"router.scale", "router.per_expert_scale", "experts.gate_up_proj",
                                "experts.down_proj"})
# Layer tensors that live under ``self_attn.`` upstream.
ATTENTION_TENSORS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})

# Skipped on purpose: HF name prefix -> group name shown in the summary.
SKIPPED_PREFIXES = {
    "model.encoder.vision_tower.": "vision_tower",
    "model.encoder.embed_vision.": "embed_vision",
}
TIED_GROUP = "tied_copies"  # summary group of checked-and-dropped tied copies

_TOP_LEVEL = {
    "embed_tokens": DECODER + "embed_tokens.weight",
    "final_norm": DECODER + "norm.weight",
}
_TOP_LEVEL_INVERSE = {hf: name for name, hf in _TOP_LEVEL.items()}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def hf_name(name: str) -> str:
    """The transformers checkpoint key that holds the project tensor ``name``.

    ``name`` is a project name such as ``"layers.3.q_proj"`` (see ``reference/weights.py``).
    Raises ``KeyError`` for a string that is not shaped like a project name.
    """
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if name.startswith("self_conditioning."):
        return DECODER + name + ".weight"
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        raise KeyError(f"{name!r} is not a diffusiongemma tensor name")
    layer, rest = match.groups()
    if rest == "encoder_layer_scalar":
        return f"{ENCODER_TEXT}layers.{layer}.layer_scalar"
    if rest == "decoder_layer_scalar":
        return f"{DECODER}layers.{layer}.layer_scalar"
    if rest in ATTENTION_TENSORS:
        return f"{DECODER}layers.{layer}.self_attn.{rest}.weight"
    if rest in BARE_LAYER_TENSORS:
        return f"{DECODER}layers.{layer}.{rest}"
    return f"{DECODER}layers.{layer}.{rest}.weight"


def project_name(hf: str) -> str | None:
    """The project name for the transformers key ``hf``, or ``None`` when no rule applies.

    The exact inverse of ``hf_name``: a candidate is parsed from ``hf`` and kept only if
    ``hf_name`` maps it back to ``hf`` (so ``router.scale.weight`` or ``layers.0.q_proj.weight``
    without ``self_attn.`` are rejected). Whether a given config has the tensor (for example
    ``v_proj`` on a full-attention layer) is checked against ``expected_shapes`` by the caller.
    """
    candidate = _parse_candidate(hf)
    if candidate is None:
        return None
    try:
        return candidate if hf_name(candidate) == hf else None
    except KeyError:
        return None


def _parse_candidate(hf: str) -> str | None:
    """Strip the upstream prefixes and suffixes from ``hf`` (unchecked; see ``project_name``)."""
    if hf in _TOP_LEVEL_INVERSE:
        return _TOP_LEVEL_INVERSE[hf]
    for prefix, role in ((ENCODER_TEXT, "encoder"), (DECODER, "decoder")):
        if hf.startswith(prefix):
            rest = hf[len(prefix):]
            break
    else:
        return None
    match = _LAYER_NAME.fullmatch(rest)
    if match is None:  # self_conditioning.X.weight
        return rest.removesuffix(".weight")
    layer, rest = match.groups()
    if rest == "layer_scalar":
        return f"layers.{layer}.{role}_layer_scalar"
    rest = rest.removeprefix("self_attn.").removesuffix(".weight")
    return f"layers.{layer}.{rest}"


def tied_source(hf: str) -> str | None:
    """For a tensor that transformers ties to a decoder tensor, that decoder tensor's key.

    ``lm_head.weight`` and ``model.encoder.language_model.{embed_tokens,norm}.weight`` map to the
    decoder embedding / final norm; ``model.encoder.language_model.layers.L.X`` maps to
    ``model.decoder.layers.L.X``, except the layer scalar (a separate, used tensor). Returns
    ``None`` for every other key.
    """
    if hf == "lm_head.weight":
        return _TOP_LEVEL["embed_tokens"]
    if not hf.startswith(ENCODER_TEXT):
        return None
    rest = hf[len(ENCODER_TEXT):]
    if rest in ("embed_tokens.weight", "norm.weight"):
        return DECODER + rest
    match = _LAYER_NAME.fullmatch(rest)
    if match and match.group(2) != "layer_scalar":
        return DECODER + rest
    return None


def skipped_group(hf: str) -> str | None:
    """The summary group (``"vision_tower"`` / ``"embed_vision"``) of a key skipped on purpose."""
    for prefix, group in SKIPPED_PREFIXES.items():
        if hf.startswith(prefix):
            return group
    return None
