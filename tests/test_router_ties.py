"""The router's top-K among exactly equal probabilities (SPEC trap T25).

transformers routes with ``torch.topk``, whose order among equal values torch leaves undefined; its CPU
kernel returns whatever libstdc++'s selection leaves in front. The reference keeps the lower expert index
(``layers.lower_index_top_k``), every backend with it; ``variants.router.torch_cpu_top_k`` reproduces
torch's CPU order, so that a model with tied router rows can still be checked against transformers, and
the cross-check reports such a tie as undefined upstream instead of a difference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffusiongemma.reference import Model
from diffusiongemma.reference.layers import lower_index_top_k
from diffusiongemma.reference.variants.router import ROUTER_TOP_K, boundary_ties, torch_cpu_top_k

SIZES = [(E, K) for E in (2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128)
         for K in (1, 2, 3, 4, 6, 8) if K <= E]  # E up to 128 and K up to 8; 64 K <= E takes partial_sort


def _tie_rows(rng, E: int, rows: int) -> np.ndarray:
    """Float32 rows with many exact ties: 1 to 4 distinct levels, and some rows of softmax probabilities."""
    levels = rng.integers(0, rng.integers(1, 5, size=(rows, 1)), size=(rows, E)).astype(np.float32)
    probs = torch.softmax(torch.from_numpy(levels[: rows // 2]), dim=-1).numpy()
    return np.concatenate([levels[rows // 2:], probs])


@pytest.mark.parametrize("E, K", SIZES)
def test_torch_cpu_order_is_reproduced_exactly(E, K):
    """What torch 2.13 returns on the CPU, tie patterns and all, in the sizes the model uses."""
    x = _tie_rows(np.random.default_rng(E * 10 + K), E, 48)
    expected = torch.topk(torch.from_numpy(x), K).indices.numpy()
    np.testing.assert_array_equal(torch_cpu_top_k(x, K), expected)
    ours = lower_index_top_k(x, K)  # same values as torch's, in the reference's order
    np.testing.assert_array_equal(np.take_along_axis(x, ours, -1), torch.topk(torch.from_numpy(x), K).values.numpy())


def test_the_rules_differ_only_on_ties_at_the_boundary():
    row = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
    assert lower_index_top_k(row, 2).tolist() == [[0, 1]]
    assert torch_cpu_top_k(row, 2).tolist() == [[1, 2]] == torch.topk(torch.from_numpy(row), 2).indices.tolist()
    assert torch_cpu_top_k(np.ones((1, 8), np.float32), 2).tolist() == [[6, 5]]
    assert boundary_ties(row, 2).tolist() == [True]
    assert boundary_ties(row, 3).tolist() == [False]  # 1, 1, 1 | 0: the tie is inside the kept set
    assert set(ROUTER_TOP_K) == {"lower-index", "torch-cpu"}
    rng = np.random.default_rng(3)
    distinct = rng.permutation(64).astype(np.float32).reshape(4, 16)  # no ties: every rule agrees
    assert not boundary_ties(distinct, 4).any()
    np.testing.assert_array_equal(torch_cpu_top_k(distinct, 4), lower_index_top_k(distinct, 4))


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    """A tiny transformers model with 8 experts whose router rows are all equal: every token ties all 8
    experts, and the kept pair is decided by the tie rule alone (their per-expert scales differ)."""
    from tests.hf_tiny import TinySpec, save_tiny, tiny_model

    hf = tiny_model(TinySpec(num_experts=8), seed=0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "router.proj" in name:
                p[:] = p[:1].clone()
    return hf, save_tiny(hf, tmp_path_factory.mktemp("tied") / "hf")


def _denoise(model, prompt, canvas):
    cache = model.new_cache(1)
    model.encode(prompt, cache)
    return np.asarray(model.denoise(canvas, cache), dtype=np.float64)


def test_tied_router_rows_against_transformers(tied_checkpoint):
    """transformers keeps torch's CPU order; the reference reproduces it with ``torch_cpu_top_k`` and differs by
    whole logits with its own rule; the compiled CPU path and the GPU kernels (on cuda-sim) keep the
    reference's rule."""
    from diffusiongemma import fast
    from diffusiongemma.fast import gpu
    from tests.hf_oracle import hf_cache, hf_denoise, hf_encode

    hf, path = tied_checkpoint
    rng = np.random.default_rng(0)
    prompt, canvas = rng.integers(3, 120, (1, 5)), rng.integers(0, 128, (1, 16))
    cache = hf_cache(hf)
    hf_encode(hf, cache, prompt)
    theirs = hf_denoise(hf, cache, canvas)
    ours = Model.from_pretrained(path)
    lower = _denoise(ours, prompt, canvas)
    assert np.max(np.abs(lower - theirs)) > 0.5  # the tie rule decides which experts run
    ours.router_top_k = torch_cpu_top_k
    assert np.max(np.abs(_denoise(ours, prompt, canvas) - theirs)) < 2e-4
    for backend in (fast.Model.from_pretrained(path), gpu.Model.from_pretrained(path, device="cuda-sim")):
        assert np.max(np.abs(_denoise(backend, prompt, canvas) - lower)) < 2e-4


def test_crosscheck_reports_an_exact_router_tie_as_undefined_upstream(tied_checkpoint):
    from diffusiongemma.crosscheck import crosscheck

    report = crosscheck("transformers", tied_checkpoint[1], canvases=1)
    rows = [r for r in report.forward if not r.probe]
    assert rows and all(r.max_abs_diff > r.tolerance and r.undefined_upstream for r in rows)
    assert all(g.divergence is None and any("undefined upstream" in n for n in g.notes) for g in report.generation)
    assert report.agree and "undefined upstream" in report.to_text() and "DIFFER" not in report.to_text()


def test_a_tie_does_not_excuse_a_difference_it_does_not_explain(tied_checkpoint):
    """Only a difference that torch's CPU order removes is called undefined upstream; a peer that is off by
    more, with the same ties in the inputs, still differs."""
    from diffusiongemma.crosscheck import _forward_router_ties, _TieWatch, _with_router
    from diffusiongemma.crosscheck.common import forward_inputs, forward_rows, reference_forward

    model = Model.from_pretrained(tied_checkpoint[1])
    watch = _TieWatch()
    x = forward_inputs(model.config, 0, 0.8)
    ours = reference_forward(_with_router(model, watch), x)
    assert watch.rows > 0
    torch_order = reference_forward(_with_router(model, torch_cpu_top_k), x)
    tol = {name: 1e-4 for name in ours}
    for shift, explained in ((0.0, True), (0.5, False)):
        peer = {name: z + np.float32(shift) for name, z in torch_order.items()}
        rows = forward_rows(ours, peer, tol)
        _forward_router_ties(rows, watch, model, x, peer)
        assert all(bool(r.undefined_upstream) == explained and r.ok == explained for r in rows if not r.probe)
