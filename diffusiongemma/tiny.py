"""Tiny DiffusionGemma models: the one factory used by the tests, examples, benchmarks and ``crosscheck``.

    spec = TinySpec()                                   # SPEC §14's tiny config
    hf = tiny_model(spec, seed=0)                       # transformers model, every norm/scale/scalar redrawn
    path = write_checkpoint("DIR", spec, seed=0)        # weights + config (+ tokenizer, generation config)
    config = make_config(); tensors = random_tensors(config, seed=0)   # the same, NumPy only (no torch)

Why redraw: the initial values of a fresh model hide bugs. With every norm weight equal to one, ``x * w``
cannot be told from ``x * (1 + w)``; with equal encoder and decoder layer scalars, one cannot be told from
the other. So (``perturbation``) every 1-D tensor becomes ``1 + 0.3 N(0, 1)``, every matrix
``0.08 N(0, 1)``, and every layer scalar (the encoder's and the decoder's independently) ``U(0.5, 1.5)``.
The rule is written once, here; the transformers model draws it with torch's generator (``randomise_``),
the NumPy tensors with NumPy's (``random_tensors``), so each keeps its historical values for a seed.

``tiny_model(..., randomise=False)`` keeps transformers' own random initialisation instead (what a fresh
``from_config`` model a user brings looks like).

torch, transformers and tokenizers are imported only by the functions that need them; ``make_config`` and
``random_tensors`` need only NumPy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2

__all__ = ["SLIDING", "FULL", "PAD_ID", "EOS_ID", "BOS_ID", "TinySpec", "hf_config", "perturbation",
           "randomise_", "tiny_model", "save_tiny", "write_word_tokenizer", "write_checkpoint", "make_config",
           "random_tensors"]


@dataclass
class TinySpec:
    """The shape of a tiny DiffusionGemma (defaults: SPEC §14's config)."""

    vocab_size: int = 128  # V; ids 0 pad, 1 eos, 2 bos; V-1, V-2, V-3 the image placeholder, boi, eoi
    hidden_size: int = 64  # H
    intermediate_size: int = 96  # dense MLP and self-conditioning MLP width
    moe_intermediate_size: int = 32  # width of one expert
    layer_types: list = field(default_factory=lambda: [SLIDING, SLIDING, FULL, SLIDING, FULL])  # last: FULL
    num_attention_heads: int = 4  # query heads, every layer
    num_key_value_heads: int = 2  # KV heads of the sliding layers (and of full layers a per-layer entry omits)
    num_global_key_value_heads: int = 1  # KV heads of the full layers (they use K = V)
    head_dim: int = 16  # head size of the sliding layers (and of full layers a per-layer entry omits)
    global_head_dim: int = 32  # head size of the full layers
    num_experts: int = 4  # experts of each mixture-of-experts block
    top_k_experts: int = 2  # experts each token is routed to
    sliding_window: int = 8  # W: a sliding layer's canvas sees the last W - 1 cached keys
    canvas_length: int = 16  # C: tokens per canvas
    partial_rotary_factor: float = 0.25  # share of a full layer's head that is rotated (proportional RoPE)
    final_norm_gain: float = 1.0  # multiplies the final norm weight after the redraw (about 25: peaked logits)
    # {layer index: {"head_dim": d, "num_key_value_heads": g}} written as transformers' per_layer_config;
    # a key left out means the layer keeps text_config's value. None: every full layer gets
    # global_head_dim / num_global_key_value_heads (transformers' own conversion).
    per_layer_config: dict | None = None


def hf_config(spec: TinySpec | None = None):
    """The ``transformers.DiffusionGemmaConfig`` of ``spec``, with a one-layer 16-wide vision tower (without
    one, transformers would build its ~550M default)."""
    from transformers import DiffusionGemmaConfig

    spec = spec or TinySpec()
    V = spec.vocab_size
    text = dict(
        vocab_size=V, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=len(spec.layer_types),
        layer_types=list(spec.layer_types), num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim, num_experts=spec.num_experts,
        top_k_experts=spec.top_k_experts, sliding_window=spec.sliding_window,
        rope_parameters={SLIDING: dict(rope_type="default", rope_theta=1e4),
                         FULL: dict(rope_type="proportional", partial_rotary_factor=spec.partial_rotary_factor,
                                    rope_theta=1e6)},
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, use_bidirectional_attention="vision",
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID)
    if spec.per_layer_config is None:
        text.update(num_global_key_value_heads=spec.num_global_key_value_heads, global_head_dim=spec.global_head_dim)
    else:
        text["per_layer_config"] = {int(k): dict(v) for k, v in spec.per_layer_config.items()}
    return DiffusionGemmaConfig(
        canvas_length=spec.canvas_length, image_token_id=V - 1, boi_token_id=V - 2, eoi_token_id=V - 3,
        text_config=text,
        vision_config=dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=8))


def perturbation(name: str, shape: tuple, normal: Callable, uniform: Callable, matrix_scale: float = 0.08):
    """The redrawn value of tensor ``name`` of ``shape``: layer scalars ``0.5 + U(0, 1)``, 1-D tensors
    ``1 + 0.3 N(0, 1)``, matrices ``matrix_scale N(0, 1)``. ``normal(shape)`` / ``uniform(shape)`` draw
    standard normal / U(0, 1) values from the caller's generator (NumPy or torch)."""
    if name.endswith("layer_scalar"):
        return 0.5 + uniform(shape)
    if len(shape) == 1:
        return 1.0 + 0.3 * normal(shape)
    return matrix_scale * normal(shape)


def randomise_(model: Any, seed: int = 0, final_norm_gain: float = 1.0, self_conditioning_gain: float = 1.0) -> None:
    """Redraw every text parameter and layer scalar of a transformers model in place (``perturbation``).

    final_norm_gain multiplies the decoder's final norm weight; self_conditioning_gain the
    self-conditioning output projection (below 1 makes the self-conditioning feedback contractive).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(shape):
        return torch.randn(shape, generator=gen)

    def uniform(shape):
        return torch.rand(shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" not in name:
                p.copy_(perturbation(name, tuple(p.shape), normal, uniform))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(perturbation(name, tuple(b.shape), normal, uniform))
        if final_norm_gain != 1.0:
            model.model.decoder.norm.weight.mul_(final_norm_gain)
        if self_conditioning_gain != 1.0:
            model.model.decoder.self_conditioning.down_proj.weight.mul_(self_conditioning_gain)


def tiny_model(spec: TinySpec | None = None, seed: int = 0, *, randomise: bool = True,
               self_conditioning_gain: float = 1.0):
    """A float32 eager ``DiffusionGemmaForBlockDiffusion`` in eval mode; ``torch.manual_seed(seed)`` first.

    randomise: redraw every norm weight, scale and layer scalar (``randomise_``); False keeps transformers'
    default initialisation (norm weights one, layer scalars one).
    """
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    spec = spec or TinySpec()
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                         attn_implementation="eager")
    model.eval()
    if randomise:
        randomise_(model, seed=seed, final_norm_gain=spec.final_norm_gain,
                   self_conditioning_gain=self_conditioning_gain)
    elif spec.final_norm_gain != 1.0:
        with torch.no_grad():
            model.model.decoder.norm.weight.mul_(spec.final_norm_gain)
    return model


def save_tiny(model: Any, path: str | os.PathLike) -> str:
    """``save_pretrained`` into ``path``; returns it as a string."""
    model.save_pretrained(path)
    return str(path)


def write_word_tokenizer(directory: str | os.PathLike, vocab_size: int) -> None:
    """A word-level ``tokenizer.json`` (+ ``tokenizer_config.json``): ``<pad> <eos> <bos> t3 ... t{V-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<pad>", "<eos>", "<bos>"] + [f"t{i}" for i in range(3, vocab_size)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(names[:3])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
                   "bos_token": "<bos>", "model_max_length": 4096}, f, indent=2)


def write_checkpoint(directory: str | os.PathLike, spec: TinySpec | None = None, seed: int = 0, *,
                     model: Any = None, generation_config: Mapping[str, Any] | None = None,
                     tokenizer: bool = True, randomise: bool = True) -> str:
    """Save a tiny checkpoint in transformers' layout into ``directory`` and return the directory.

    model: a transformers model to save (default ``tiny_model(spec, seed, randomise=randomise)``).
    generation_config: the fields of ``generation_config.json`` (None keeps what ``save_pretrained``
    writes); eos/pad default to 1/0. tokenizer: also write the word-level tokenizer (mlx-vlm and diffusers
    want one).
    """
    spec = spec or TinySpec()
    os.makedirs(directory, exist_ok=True)
    model = model if model is not None else tiny_model(spec, seed, randomise=randomise)
    model.save_pretrained(directory)
    if tokenizer:
        write_word_tokenizer(directory, spec.vocab_size)
    if generation_config is not None:
        fields = {"eos_token_id": [EOS_ID], "pad_token_id": PAD_ID, **dict(generation_config)}
        with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(fields, f, indent=2)
    return str(directory)


# ------------------------------------------------------------------------------------------ NumPy only
def make_config(*, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 96,
                moe_intermediate_size: int = 32, layer_types: str = "SSFSF", num_attention_heads: int = 4,
                sliding_head_dim: int = 16, sliding_kv_heads: int = 2, full_head_dim: int = 32,
                full_kv_heads: int = 1, sliding_window: int = 8, num_experts: int = 4, top_k_experts: int = 2,
                canvas_length: int = 16, partial_rotary_factor: float = 0.25):
    """A reference ``ModelConfig`` from compact knobs; ``layer_types`` is a string of 'S' / 'F'.
    Defaults: SPEC §14 (the same model as ``TinySpec()``)."""
    from diffusiongemma.reference import ModelConfig, RopeParameters

    kinds = tuple(SLIDING if c == "S" else FULL for c in layer_types)
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=len(kinds),
        num_attention_heads=num_attention_heads, layer_types=kinds,
        layer_head_dim=tuple(sliding_head_dim if k == SLIDING else full_head_dim for k in kinds),
        layer_num_key_value_heads=tuple(sliding_kv_heads if k == SLIDING else full_kv_heads for k in kinds),
        sliding_window=sliding_window,
        rope_parameters={SLIDING: RopeParameters("default", 1e4),
                         FULL: RopeParameters("proportional", 1e6, partial_rotary_factor)},
        num_experts=num_experts, top_k_experts=top_k_experts, canvas_length=canvas_length,
    )


def random_tensors(config: Any, seed: int = 0, *, final_norm_gain: float = 1.0, self_conditioning_gain: float = 1.0,
                   matrix_scale: float = 0.08) -> dict[str, np.ndarray]:
    """Every float32 tensor of a reference ``ModelConfig``, under the project's names, drawn by
    ``perturbation`` from ``numpy.random.default_rng(seed)``.

    final_norm_gain multiplies the final norm weight; self_conditioning_gain ``self_conditioning.down_proj``
    (1e-3 makes the self-conditioning feedback contractive: float32 rounding then stops growing from one
    denoising step to the next; with 1 it grows about fourfold per step).
    """
    from diffusiongemma.reference.weights import expected_shapes

    rng = np.random.default_rng(seed)
    tensors = {name: np.asarray(perturbation(name, shape, rng.standard_normal, rng.random, matrix_scale),
                                dtype=np.float32)
               for name, shape in expected_shapes(config).items()}
    tensors["final_norm"] *= np.float32(final_norm_gain)
    tensors["self_conditioning.down_proj"] *= np.float32(self_conditioning_gain)
    return tensors
