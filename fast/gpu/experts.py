"""The routed experts of the GPU path: tokens grouped by expert, two grouped GEMMs around the gated GELU, and the
weighted combination, all on the device with no host synchronisation.

``expert_mix`` is ``reference.layers.experts`` (upstream ``DiffusionGemmaTextExperts``) on a ``fast.gpu`` device
(``CupyDevice`` or cuda-sim's ``SimDevice``), in float32 or in a bfloat16 run (SPEC §10.1 B6). The router
(``dg_router``: softmax, top-K with ties to the lower expert index as ``reference.layers.lower_index_top_k``,
renormalisation, ``per_expert_scale``) is float32 in both runs and is not part of this step: its indices and
weights come in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import launch as gl


def expert_mix(dev: Any, x: Any, indices: Any, weights: Any, gate_up: Any, down: Any, num_experts: int,
               bf16: bool = False) -> Any:
    """Weighted sum of each token's K chosen experts' gated MLPs; returns a new (N, H) float32 device array.

    dev: the device (``empty``, ``zeros``, ``launch``). x: (N, H) float32, the experts' input (the pre-FFN norm 2
    of the residual). indices: (N, K) int64 expert indices in [0, num_experts) and weights: (N, K) float32, the
    router's (``gl.router``). gate_up: (E, 2 * I_e, H), each expert's gate rows over its up rows (trap T8), and
    down: (E, H, I_e), both in the checkpoint's (out, in) layout: float32 in the float32 run, uint16 bfloat16 bits
    when ``bf16``.

    float32 (``bf16`` False): ``dg_group_experts``, ``dg_gather_rows``, ``dg_grouped_gemm_nt``, ``dg_gated_gelu``,
    ``dg_grouped_gemm_nt``, ``dg_combine_experts``: the launch sequence ``GpuOps.expert_mix`` of fast/gpu/model.py
    has always issued. bfloat16 (``bf16`` True; x holds bfloat16 values): the same grouping, the two projections
    by ``dg_grouped_gemm_bf16`` on tensor cores (float32 sums, outputs rounded to bfloat16), the GELU and its
    product with the up half rounded (``dg_gated_gelu`` bf16), and each expert's bfloat16 output times its float32
    weight summed over the K choices in float32 and rounded once (``dg_combine_experts`` bf16), as
    ``reference.layers.experts(..., dtype=BFLOAT16)``; the result holds bfloat16 values.

    Raises ``launch.LaunchError`` for operands of the wrong shape or dtype (float32 matrices in a bfloat16 run
    and the reverse included)."""
    N, H = x.shape
    K = indices.shape[1]
    E, I_e = num_experts, down.shape[2]
    matrix_dtype = np.dtype(np.uint16 if bf16 else np.float32)
    for name, w in (("gate_up", gate_up), ("down", down)):
        if np.dtype(w.dtype) != matrix_dtype:
            raise gl.LaunchError(f"expert_mix: {name} is {np.dtype(w.dtype)}, expected {matrix_dtype} in the "
                                 f"{'bfloat16' if bf16 else 'float32'} run")
    if tuple(gate_up.shape) != (E, 2 * I_e, H) or tuple(down.shape) != (E, H, I_e):
        raise gl.LaunchError(f"expert_mix: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
                             f"match ({E}, 2 * I_e, {H}) and ({E}, {H}, I_e)")
    tiles, rows = gl.moe_rows(N, K, E)
    offsets = dev.empty((E + 1,), np.int32)
    row_token = dev.empty((rows,), np.int32)
    choice_row = dev.empty((N, K), np.int32)
    tile_expert = dev.empty((tiles,), np.int32)
    dev.launch(gl.group_experts(indices, E, offsets, row_token, choice_row, tile_expert))
    xg = dev.empty((rows, H), np.float32)
    dev.launch(gl.gather_rows(x, row_token, xg))
    gu = dev.zeros((rows, 2 * I_e), np.float32)   # tiles of no expert stay zero (the GELU reads every row)
    project = gl.grouped_gemm_bf16 if bf16 else gl.grouped_gemm_nt
    dev.launch(project(xg, gate_up, tile_expert, gu))
    act = dev.empty((rows, I_e), np.float32)
    dev.launch(gl.gated_gelu(gu, act, bf16=bf16))
    yo = dev.empty((rows, H), np.float32)
    dev.launch(project(act, down, tile_expert, yo))
    out = dev.empty((N, H), np.float32)
    dev.launch(gl.combine_experts(yo, indices, choice_row, weights, out, bf16=bf16))
    return out
