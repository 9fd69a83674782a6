"""Forward-pass parity of the NumPy reference with transformers' DiffusionGemmaForBlockDiffusion (fp32).

Every checkpoint goes through ``save_pretrained`` and then our loader (``Model.from_pretrained`` on the
transformers directory, which converts in memory), so the converter's name map is exercised too.

Tolerance. Both implementations evaluate the same float32 math in different summation orders; on the
randomised tiny models (layer scalars up to 1.5, peaked logits) each one's error against a float64
evaluation of the math is ~1e-5..1e-4 (``test_float32_noise_floor`` measures it), so the two agree to
about that. We require ``ATOL`` = 2e-4 absolute on values of magnitude O(1)-O(10), far below the O(1)
differences any semantic mistake produces (``test_mutations_are_caught``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiongemma.reference.model import Model
from tests.hf_oracle import hf_cache, hf_cache_arrays, hf_denoise, hf_encode, max_diff_report
from tests.hf_tiny import FULL, SLIDING, TinySpec, save_tiny, tiny_model

ATOL = 2e-4


def load_pair(tmp_path, spec: TinySpec, seed: int = 0):
    hf = tiny_model(spec, seed=seed)
    ours = Model.from_pretrained(save_tiny(hf, tmp_path / f"hf-{seed}"))
    return hf, ours


def run_both(hf, ours, prompt: np.ndarray, n_canvases: int = 2, seed: int = 0, oracle=None):
    """Prefill, then per canvas: denoise without and with self-conditioning, then encode the canvas.

    Returns the list of (name, ours, golden) rows for the report; with ``oracle`` (a float64 twin of
    ``ours``, ``float64_twin``) the list of (name, ours, golden, exact) rows, the oracle fed the same inputs.
    """
    rng = np.random.default_rng(seed)
    V, C = ours.config.vocab_size, ours.config.canvas_length
    B = prompt.shape[0]
    cache, hc = ours.new_cache(B), hf_cache(hf)
    wide = oracle if oracle is not None else None
    wc = wide.new_cache(B) if wide is not None else None
    exact = (lambda f: f()) if wide is not None else (lambda f: None)

    def row(name, mine, golden, oracle_value=None):
        return (name, mine, golden) if wide is None else (name, mine, golden, oracle_value)

    rows = [row("encoder hidden (prefill)", ours.encode(prompt, cache), hf_encode(hf, hc, prompt),
                exact(lambda: wide.encode(prompt, wc)))]
    for l, (k, v) in enumerate(hf_cache_arrays(hc)):
        rows += [row(f"layer {l} keys", cache.keys[l], k, exact(lambda: wc.keys[l])),
                 row(f"layer {l} values", cache.values[l], v, exact(lambda: wc.values[l]))]
    for c in range(n_canvases):
        canvas = rng.integers(0, V, size=(B, C))
        first = ours.denoise(canvas, cache)
        rows.append(row(f"canvas {c} logits, no SC", first, hf_denoise(hf, hc, canvas),
                        exact(lambda: wide.denoise(canvas, wc))))
        sc = (first / np.float32(0.7)).astype(np.float32)
        rows.append(row(f"canvas {c} logits, with SC", ours.denoise(canvas, cache, sc),
                        hf_denoise(hf, hc, canvas, sc), exact(lambda: wide.denoise(canvas, wc, sc))))
        rows.append(row(f"canvas {c} encode", ours.encode(canvas, cache), hf_encode(hf, hc, canvas),
                        exact(lambda: wide.encode(canvas, wc))))
        for l, (k, v) in enumerate(hf_cache_arrays(hc)):
            rows += [row(f"  layer {l} keys after canvas {c}", cache.keys[l], k, exact(lambda: wc.keys[l])),
                     row(f"  layer {l} values after canvas {c}", cache.values[l], v, exact(lambda: wc.values[l]))]
    return rows


def float64_twin(ours: Model) -> Model:
    """The same model computing in float64: the oracle both float32 implementations are measured against."""
    wide = Model(ours.config, ours.tensors)
    wide.tensors = {k: v.astype(np.float64) for k, v in ours.tensors.items()}
    wide.layers = [{n[len(f"layers.{l}."):]: v for n, v in wide.tensors.items() if n.startswith(f"layers.{l}.")}
                   for l in range(ours.config.num_hidden_layers)]
    wide._omega = {k: v.astype(np.float64) for k, v in ours._omega.items()}
    return wide


def check_against_oracle(rows) -> tuple[bool, str]:
    """Per tensor: our float32 error against the float64 oracle must be within 3x transformers' own (plus a
    float32 epsilon of the tensor's scale), or the two must agree to ``ATOL``. A semantic mistake moves our
    values by O(0.1)-O(1) from the oracle while transformers stays at ~1e-5, so it cannot pass."""
    lines, ok = [], True
    for name, mine, golden, exact in rows:
        mine, golden, exact = (np.asarray(a, dtype=np.float64) for a in (mine, golden, exact))
        ours_err, hf_err = np.abs(mine - exact).max(), np.abs(golden - exact).max()
        eps = 8 * np.finfo(np.float32).eps * max(1.0, np.abs(exact).max())
        good = np.abs(mine - golden).max() < ATOL or ours_err <= 3 * hf_err + eps
        ok &= bool(good)
        lines.append(f"{'  ' if good else '!!'} {name:34s} ours-vs-f64 {ours_err:.2e}  transformers-vs-f64 {hf_err:.2e}")
    return ok, "\n".join(lines)


def test_spec_tiny_config_matches_transformers(tmp_path):
    """SPEC §14: the 13-token prompt (longer than W=8), two canvases of 16 (longer than W)."""
    hf, ours = load_pair(tmp_path, TinySpec())
    prompt = np.random.default_rng(1).integers(3, 125, size=(2, 13))
    worst, report = max_diff_report(run_both(hf, ours, prompt))
    print(report)
    assert worst < ATOL, f"max |diff| {worst:.3e} >= {ATOL}\n{report}"


@st.composite
def tiny_specs(draw):
    n_heads = draw(st.sampled_from([2, 4, 8]))
    kv = draw(st.sampled_from([g for g in (1, 2, 4, 8) if n_heads % g == 0]))
    gkv = draw(st.sampled_from([g for g in (1, 2, 4) if n_heads % g == 0]))
    layers = draw(st.lists(st.sampled_from([SLIDING, FULL]), min_size=0, max_size=3)) + [FULL]
    experts = draw(st.integers(1, 6))
    return TinySpec(
        vocab_size=draw(st.integers(16, 200)), hidden_size=draw(st.sampled_from([16, 32, 48])),
        intermediate_size=draw(st.sampled_from([8, 24])), moe_intermediate_size=draw(st.sampled_from([4, 16])),
        layer_types=layers, num_attention_heads=n_heads, num_key_value_heads=kv, num_global_key_value_heads=gkv,
        head_dim=draw(st.sampled_from([4, 8, 16])), global_head_dim=draw(st.sampled_from([8, 16, 32])),
        num_experts=experts, top_k_experts=draw(st.integers(1, experts)),
        sliding_window=draw(st.integers(2, 10)), canvas_length=draw(st.integers(1, 12)),
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 1.0])),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=tiny_specs(), prompt_kind=st.sampled_from(["W-1", "W", "W+1", ">2W", "short"]), seed=st.integers(0, 99))
def test_drawn_configs_match_transformers(tmp_path_factory, spec, prompt_kind, seed):
    W = spec.sliding_window
    P = {"W-1": max(W - 1, 1), "W": W, "W+1": W + 1, ">2W": 2 * W + 3, "short": 1}[prompt_kind]
    hf, ours = load_pair(tmp_path_factory.mktemp("drawn"), spec, seed)
    prompt = np.random.default_rng(seed).integers(3, spec.vocab_size - 3, size=(2, P))
    rows = run_both(hf, ours, prompt, seed=seed, oracle=float64_twin(ours))
    worst, report = max_diff_report([r[:3] for r in rows])
    if worst >= ATOL:  # deep or long runs accumulate rounding: then hold both to the float64 oracle instead
        ok, oracle_report = check_against_oracle(rows)
        assert ok, f"{spec}\nP={P}\n{report}\n{oracle_report}"


def test_left_padded_rows_match_transformers_and_solo_runs(tmp_path):
    """Padding: positions include the pads; pad keys are hidden; real rows equal their solo runs."""
    hf, ours = load_pair(tmp_path, TinySpec())
    rng = np.random.default_rng(2)
    P, pads = 13, 3
    prompt = rng.integers(3, 125, size=(2, P))
    prompt[1, :pads] = 0
    mask = np.ones((2, P), dtype=np.int64)
    mask[1, :pads] = 0
    C = ours.config.canvas_length
    canvas = rng.integers(0, 128, size=(2, C))

    cache = ours.new_cache(2)
    ours.encode(prompt, cache, mask)
    logits = ours.denoise(canvas, cache)
    hc = hf_cache(hf)
    hf_encode(hf, hc, prompt, mask)
    full = np.concatenate([mask, np.ones((2, C), dtype=np.int64)], axis=1)
    golden = hf_denoise(hf, hc, canvas, full_mask=full)
    assert np.abs(logits - golden).max() < ATOL

    # Row 1 alone, without its pads: its canvas sits 3 positions earlier, but RoPE and the window are
    # relative, so the logits agree up to float32 noise.
    solo = ours.new_cache(1)
    ours.encode(prompt[1:, pads:], solo)
    solo_logits = ours.denoise(canvas[1:], solo)
    assert np.abs(solo_logits[0] - logits[1]).max() < 1e-4

    # A second canvas after an incremental encode keeps agreeing.
    ours.encode(canvas, cache)
    hf_encode(hf, hc, canvas, full)
    canvas2 = rng.integers(0, 128, size=(2, C))
    full2 = np.concatenate([full, np.ones((2, C), dtype=np.int64)], axis=1)
    assert np.abs(ours.denoise(canvas2, cache) - hf_denoise(hf, hc, canvas2, full_mask=full2)).max() < ATOL


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_equals_one_shot(tmp_path, chunk):
    hf = tiny_model(TinySpec())
    ours = Model.from_pretrained(save_tiny(hf, tmp_path / "hf"))
    prompt = np.random.default_rng(3).integers(3, 125, size=(2, 40))
    one = ours.new_cache(2)
    ours.encode(prompt, one)
    chunked = ours.new_cache(2)
    for start in range(0, 40, chunk):
        ours.encode(prompt[:, start:start + chunk], chunked)
    assert chunked.length == one.length == 40
    for l in range(ours.config.num_hidden_layers):
        assert chunked.keys[l].shape == one.keys[l].shape
        np.testing.assert_allclose(chunked.keys[l], one.keys[l], atol=1e-4)  # BLAS blocking differs by chunk size
        np.testing.assert_allclose(chunked.values[l], one.values[l], atol=1e-4)
    canvas = np.random.default_rng(4).integers(0, 128, size=(2, 16))
    np.testing.assert_allclose(ours.denoise(canvas, chunked), ours.denoise(canvas, one), atol=ATOL)


def test_denoise_leaves_cache_bit_identical(tmp_path):
    _, ours = load_pair(tmp_path, TinySpec())
    cache = ours.new_cache(2)
    ours.encode(np.random.default_rng(5).integers(3, 125, size=(2, 11)), cache)
    before = cache.copy()
    canvas = np.random.default_rng(6).integers(0, 128, size=(2, 16))
    logits = ours.denoise(canvas, cache)
    ours.denoise(canvas, cache, logits)
    assert cache.length == before.length
    assert np.array_equal(cache.is_real, before.is_real)
    for l in range(ours.config.num_hidden_layers):
        assert np.array_equal(cache.keys[l], before.keys[l]) and np.array_equal(cache.values[l], before.values[l])


def test_sliding_layers_retain_window_minus_one(tmp_path):
    _, ours = load_pair(tmp_path, TinySpec())
    cache = ours.new_cache(1)
    ours.encode(np.arange(3, 16)[None], cache)
    W = ours.config.sliding_window
    for l, kind in enumerate(ours.config.layer_types):
        expected = W - 1 if kind == SLIDING else 13
        assert cache.keys[l].shape[2] == expected, (l, kind, cache.keys[l].shape)
        assert list(cache.positions(l)) == list(range(13 - expected, 13))


def test_float32_noise_floor(tmp_path):
    """Justifies ATOL: our float32 error against a float64 evaluation is of the same size as transformers'."""
    hf, ours = load_pair(tmp_path, TinySpec())
    wide = float64_twin(ours)
    prompt = np.random.default_rng(7).integers(3, 125, size=(2, 13))
    canvas = np.random.default_rng(8).integers(0, 128, size=(2, 16))
    c32, c64, hc = ours.new_cache(2), wide.new_cache(2), hf_cache(hf)
    ours.encode(prompt, c32), wide.encode(prompt, c64), hf_encode(hf, hc, prompt)
    exact = wide.denoise(canvas, c64)
    ours_err = np.abs(ours.denoise(canvas, c32) - exact).max()
    hf_err = np.abs(hf_denoise(hf, hc, canvas) - exact).max()
    print(f"float64 oracle: ours {ours_err:.2e}, transformers {hf_err:.2e}")
    assert ours_err < 3 * hf_err + 1e-6
    assert ours_err < ATOL / 2


def test_bfloat16_checkpoint_widens_exactly(tmp_path):
    """A bf16 checkpoint loads widened exactly; computing in float32 matches transformers run on the
    same weights upcast to float32 (SPEC §10: the upcast is exact)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    tiny_model(TinySpec()).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # Reload upcast: the bf16-rounded weights in float32. (Casting the live model back instead would keep
    # bf16-rounded RoPE frequency buffers, a different model.)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "bf16", dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    ours = Model.from_pretrained(tmp_path / "bf16")
    np.testing.assert_array_equal(ours.tensors["embed_tokens"], hf.model.decoder.embed_tokens.weight.detach().numpy())
    prompt = np.random.default_rng(9).integers(3, 125, size=(1, 13))
    worst, report = max_diff_report(run_both(hf, ours, prompt, n_canvases=1))
    assert worst < ATOL, report
