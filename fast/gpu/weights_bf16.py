"""The GPU model's weights in a bfloat16 run (``fast.gpu.Model(..., dtype="bfloat16")``, SPEC §10.1).

Every tensor is first rounded to bfloat16, as the reference's bfloat16 model rounds it on load
(``reference.model.Model``: ``round_to(tensor, BFLOAT16)``; upstream ``from_pretrained(dtype=torch.bfloat16)``).
Then, in ``fast.weights.pack``'s layout:

* the matrices the model multiplies by (fused q/k/v, o_proj, the dense MLP's gate/up and down, the
  self-conditioning MLP's, the router, the experts, and the tied embedding table, which is the embedding,
  the output projection and the self-conditioning soft embedding at once) stay on the device as bfloat16
  bits, ``uint16`` arrays in the checkpoint's (out, in) layout (the experts (E, 2*I_e, H) and (E, H, I_e)):
  ``dg_gemm_bf16``'s and ``dg_embed``'s operands, half the bytes of float32;
* the vectors (norm weights, ``router.scale``, ``per_expert_scale``) are float32 arrays holding bfloat16
  values, read by the float32 kernels of a bfloat16 run; the layer scalars are float32 scalars of bfloat16
  values.

No float32 copy of any matrix is kept on the device.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from diffusiongemma.reference.config import ModelConfig
from diffusiongemma.reference.primitives import BFLOAT16
from diffusiongemma.reference.support.quantized import is_bfloat16, widen

from ..weights import LayerWeights, PackedWeights, pack

__all__ = ["pack_bf16", "bits_to_float32", "float32_to_bits", "MATRIX_FIELDS", "weight_bytes"]

#: ``LayerWeights`` fields held as bfloat16 bits in a bfloat16 run (besides the model-wide ``embed_tokens``,
#: ``sc_gate_up`` and ``sc_down``).
MATRIX_FIELDS = ("qkv", "o_proj", "mlp_gate_up", "mlp_down", "router", "expert_gate_up", "expert_down")


def float32_to_bits(array: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16, C-contiguous) of a float32 array, rounded to nearest even."""
    return np.ascontiguousarray(np.asarray(array, np.float32).astype(BFLOAT16).view(np.uint16))


def bits_to_float32(bits: Any, xp: Any = np) -> Any:
    """The float32 values of bfloat16 bits (exact), with the array module ``xp`` (NumPy or CuPy)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


class _Host:
    """A float32 host array ``pack`` handed over, uploaded once its field is known."""

    def __init__(self, array: np.ndarray):
        self.array = array


def pack_bf16(config: ModelConfig, tensors: Mapping[str, Any], upload: Callable[[np.ndarray], Any]) -> PackedWeights:
    """``fast.weights.pack``'s layout of ``tensors`` (checked, float32 / bfloat16 / Q8_0) rounded to bfloat16,
    matrices as bfloat16 bits and the rest as bf16-valued float32 (see the module notes); ``upload`` copies a
    host array to the device."""
    rounded = _RoundedBf16(tensors)  # each tensor rounded as pack reads it: the host holds one at a time

    def put(array: np.ndarray) -> Any:
        if array.dtype == BFLOAT16:  # a matrix pack keeps bfloat16 (keep_bf16)
            return upload(np.ascontiguousarray(array).view(np.uint16))
        return _Host(array)  # float32: a vector, or a matrix pack widens (router, embedding)

    def experts(gate_up: np.ndarray, down: np.ndarray) -> tuple:
        return upload(gate_up.view(np.uint16)), upload(down.view(np.uint16))

    packed = pack(config, rounded, upload=put, experts=experts, keep_bf16=True, keep_bf16_embedding=True)

    def device(value: Any, bits: bool) -> Any:
        if not isinstance(value, _Host):
            return value
        return upload(float32_to_bits(value.array) if bits else np.ascontiguousarray(value.array, np.float32))

    packed.embed_tokens = device(packed.embed_tokens, True)
    packed.final_norm = device(packed.final_norm, False)
    packed.sc_pre_norm = device(packed.sc_pre_norm, False)
    for w in packed.layers:
        w.expert_gate_up, w.expert_down = w.experts
        w.experts = None
        for name, value in vars(w).items():
            if isinstance(value, _Host):
                setattr(w, name, device(value, name in MATRIX_FIELDS))
    return packed


class _RoundedBf16(Mapping):
    """``tensors`` with each value rounded to bfloat16 when read (a bfloat16 array as it is, a view of a mapped
    file included: no copy); ``fast.weights.StoreArrays`` of a store is read the same way."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        value = self.tensors[name]
        return value if is_bfloat16(value) else np.ascontiguousarray(widen(value).astype(BFLOAT16))

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def weight_bytes(packed: Any) -> int:
    """Bytes of every device array a model holds as weights (``embed_tokens``, the norms, each layer's
    ``LayerWeights`` arrays): what the dtype changes."""
    arrays = [packed.embed_tokens, packed.final_norm, packed.sc_pre_norm, packed.sc_gate_up, packed.sc_down]
    for w in packed.layers:
        arrays += [v for v in vars(w).values() if hasattr(v, "nbytes") and getattr(v, "ndim", 0) > 0]
    return int(sum(a.nbytes for a in arrays if a is not None))
