"""The project's weight names and shapes: every tensor of a DiffusionGemma text model.

Tensor names (per layer ``l``; shapes use the notation of ``ModelConfig``; d, g = head dim and KV
heads of that layer). Encoder and decoder share every tensor except the two layer scalars:

    embed_tokens                                (V, H)   also the (tied) output projection
    final_norm                                  (H,)
    self_conditioning.pre_norm                  (H,)
    self_conditioning.gate_proj / up_proj       (I_d, H)
    self_conditioning.down_proj                 (H, I_d)
    layers.l.input_layernorm                    (H,)
    layers.l.q_proj                             (n_h*d, H)
    layers.l.k_proj                             (g*d, H)
    layers.l.v_proj                             (g*d, H)   sliding layers only (full layers use V = K_raw)
    layers.l.o_proj                             (H, n_h*d)
    layers.l.q_norm / k_norm                    (d,)
    layers.l.post_attention_layernorm           (H,)
    layers.l.pre_feedforward_layernorm          (H,)      dense branch input norm
    layers.l.mlp.gate_proj / mlp.up_proj        (I_d, H)
    layers.l.mlp.down_proj                      (H, I_d)
    layers.l.post_feedforward_layernorm_1       (H,)      dense branch output norm
    layers.l.router.proj                        (E, H)
    layers.l.router.scale                       (H,)
    layers.l.router.per_expert_scale            (E,)
    layers.l.pre_feedforward_layernorm_2        (H,)      expert input norm
    layers.l.experts.gate_up_proj               (E, 2*I_e, H)  gate rows first, then up rows
    layers.l.experts.down_proj                  (E, H, I_e)
    layers.l.post_feedforward_layernorm_2       (H,)      expert output norm
    layers.l.post_feedforward_layernorm         (H,)
    layers.l.encoder_layer_scalar               (1,)
    layers.l.decoder_layer_scalar               (1,)

Upstream: the parameters of transformers' ``DiffusionGemmaForBlockDiffusion`` text model (the converter,
``weights_converter/names.py``, maps each upstream name to these). Reading and writing a checkpoint in
this format is ``support/checkpoint_io.py``.
"""

from __future__ import annotations

from .config import ModelConfig

LAYER_TENSORS = (
    "input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
    "post_attention_layernorm", "pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "post_feedforward_layernorm_1", "router.proj", "router.scale",
    "router.per_expert_scale", "pre_feedforward_layernorm_2", "experts.gate_up_proj",
    "experts.down_proj", "post_feedforward_layernorm_2", "post_feedforward_layernorm",
    "encoder_layer_scalar", "decoder_layer_scalar",
)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the format mapped to its shape, in a fixed (file) order."""
    V, H, Id, Ie = config.vocab_size, config.hidden_size, config.intermediate_size, config.moe_intermediate_size
    E, nh = config.num_experts, config.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (V, H),
        "final_norm": (H,),
        "self_conditioning.pre_norm": (H,),
        "self_conditioning.gate_proj": (Id, H),
        "self_conditioning.up_proj": (Id, H),
        "self_conditioning.down_proj": (H, Id),
    }
    for l in range(config.num_hidden_layers):
        d, g = config.layer_head_dim[l], config.layer_num_key_value_heads[l]
        per_layer = {
            "input_layernorm": (H,), "q_proj": (nh * d, H), "k_proj": (g * d, H), "v_proj": (g * d, H),
            "o_proj": (H, nh * d), "q_norm": (d,), "k_norm": (d,), "post_attention_layernorm": (H,),
            "pre_feedforward_layernorm": (H,), "mlp.gate_proj": (Id, H), "mlp.up_proj": (Id, H),
            "mlp.down_proj": (H, Id), "post_feedforward_layernorm_1": (H,), "router.proj": (E, H),
            "router.scale": (H,), "router.per_expert_scale": (E,), "pre_feedforward_layernorm_2": (H,),
            "experts.gate_up_proj": (E, 2 * Ie, H), "experts.down_proj": (E, H, Ie),
            "post_feedforward_layernorm_2": (H,), "post_feedforward_layernorm": (H,),
            "encoder_layer_scalar": (1,), "decoder_layer_scalar": (1,),
        }
        if not config.is_sliding(l):
            del per_layer["v_proj"]
        for name in LAYER_TENSORS:
            if name in per_layer:
                shapes[f"layers.{l}.{name}"] = per_layer[name]
    return shapes
