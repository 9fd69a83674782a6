"""Naming the layer behind NaN or infinite logits on the GPU path, after the fact.

The GPU's decoder runs without per-layer finiteness checks (they would cost a device-to-host read per layer
and step); the sampling kernel flags a position whose logits hold NaN or +inf, and the step raises the
reference's ``SamplingError``. The CPU paths check every block and say which layer output first went
non-finite and which weight or cache entry explains it (``reference.support.diagnosis``). To give the same
answer, ``diagnose`` copies this model's weights and cache to the host once the fault is known and re-runs
the decoder pass on the reference model, whose ``NonFiniteError`` then names the layer. It costs a host copy
of the weights, only on that error path; when the host cannot hold it, or the host pass stays finite (a
fault the re-run does not reproduce), the device's error is kept, with a note saying so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from diffusiongemma.reference.support.checks import available_memory
from diffusiongemma.reference.support.errors import CheckpointError, NonFiniteError
from diffusiongemma.reference.weights import expected_shapes

from ..weights import LAYER_TENSOR_NAMES
from .weights_bf16 import bits_to_float32

__all__ = ["host_tensors", "diagnose"]



def host_tensors(model: Any) -> dict[str, np.ndarray]:
    """The project's named tensors (``reference.weights``) of a GPU model, copied from its packed layout
    (``fast.weights.pack``) to float32 host arrays in the checkpoint's shapes (a bfloat16 model's bfloat16 bits
    widened, exactly)."""
    config = model.config

    def host(array: Any) -> np.ndarray:
        value = model.device.to_host(array)
        return bits_to_float32(value) if value.dtype == np.uint16 else value

    I_sc = model.sc_down.shape[1]
    sc_gate_up = host(model.sc_gate_up)
    out = {"embed_tokens": host(model.embed_tokens), "final_norm": host(model.final_norm),
           "self_conditioning.pre_norm": host(model.sc_pre_norm), "self_conditioning.gate_proj": sc_gate_up[:I_sc],
           "self_conditioning.up_proj": sc_gate_up[I_sc:], "self_conditioning.down_proj": host(model.sc_down)}
    for l, w in enumerate(model.layers):
        p = f"layers.{l}."
        nq, nk = config.num_attention_heads * w.head_dim, w.num_kv_heads * w.head_dim
        qkv = host(w.qkv)
        out[p + "q_proj"], out[p + "k_proj"] = qkv[:nq], qkv[nq:nq + nk]
        if w.sliding:
            out[p + "v_proj"] = qkv[nq + nk:]
        gate_up = host(w.mlp_gate_up)
        I_d = gate_up.shape[0] // 2
        out[p + "mlp.gate_proj"], out[p + "mlp.up_proj"] = gate_up[:I_d], gate_up[I_d:]
        for field, name in LAYER_TENSOR_NAMES.items():
            value = getattr(w, field)
            out[p + name] = np.asarray(value if isinstance(value, (np.generic, float)) else host(value), np.float32)
    shapes = expected_shapes(config)
    return {name: np.ascontiguousarray(value, dtype=np.float32).reshape(shapes[name]) for name, value in out.items()}


def diagnose(model: Any, error: Exception, canvas: np.ndarray, cache: Any) -> Exception:
    """The error to raise for ``error``, the device's "logits hold NaN/+inf" of a decoder pass over ``canvas``
    (B, C) int ids with ``cache`` (a ``GpuKVCache``): the reference's ``NonFiniteError`` for the same pass on
    host copies of the weights and cache (the first layer output that is not finite, and the weight or cache
    entry behind it, or float32 overflow), followed by the device's message; ``error`` with a note when the
    host cannot hold the copy or its pass stays finite."""
    from diffusiongemma.reference.model import Model as ReferenceModel

    weights = sum(int(np.prod(shape)) for shape in expected_shapes(model.config).values()) * 4
    free = available_memory()
    if free is not None and 2 * weights > free:
        return type(error)(f"{error} (the layer was not looked for: a host copy of the weights, {weights:,} bytes, "
                           f"does not fit in the {free:,} bytes of free memory)")
    try:
        reference = ReferenceModel(model.config, host_tensors(model), dtype=getattr(model, "dtype", "float32"))
        with np.errstate(all="ignore"):  # the overflow is expected: the NonFiniteError reports it
            reference.denoise(np.asarray(canvas, dtype=np.int64), cache.to_reference())
    except CheckpointError as found:  # a weight changed on the device after the model was built
        return NonFiniteError(f"the model's weights are no longer finite: {found} (found on the host after the GPU "
                              f"flagged: {error})")
    except NonFiniteError as found:
        return NonFiniteError(f"{found} (found by re-running the decoder pass on the host after the GPU flagged it: "
                              f"{error})")
    except MemoryError:
        return type(error)(f"{error} (the layer was not looked for: the host ran out of memory)")
    return type(error)(f"{error} (a re-run of the decoder pass on the host stayed finite: the fault is not in the "
                       "weights or the cache)")
