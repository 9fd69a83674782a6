"""Tests of the block-diffusion forward process and loss (reference/noising.py, TRAINING.md §9-§10).

Four layers of checks:
1. TRAINING.md §10's worked example (golden numbers computed by the spec's authors, independently);
2. the NumPy replay of torch's CPU generator against torch itself, for several seeds and sizes;
3. hypothesis properties of the pure pieces (corruption rate ~ t, kept positions keep the target,
   the loss depends on every canvas position, canvas choice is uniform and in range);
4. the training script (examples/train_tiny.py) against the reference: same draws, same layout, same
   losses on the same logits, and the training decoder geometry against plain prefix encoding with the
   real transformers model (the sliding-window trap of TRAINING.md §2.3).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiongemma.reference import noising as N
from diffusiongemma.reference.masks import training_decoder_visibility
from diffusiongemma.torch_replay import TorchCPUGenerator
from diffusiongemma.reference.support.errors import InputError

import torch  # the test extra (README) installs it
F = torch.nn.functional

ROOT = Path(__file__).resolve().parents[1]


def _load_train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


TT = _load_train_tiny()

# ----------------------------------------------------------------------------------------------------
# 1. worked example (TRAINING.md §10)

V, C, EOS = 8, 4, 1
X = np.array([[2, 5, 6, 7, 3, 4, 6, 5, 3],
              [2, 5, 4, 4, 6, 0, 0, 0, 0]])
P = np.array([3, 2])
R = np.array([6, 3])
VALID = np.array([[1] * 9, [1] * 5 + [0] * 4])
A = math.log(math.e**2 + 7) - 2
BC = math.log(math.e + 7)
LN8 = math.log(8)


def _worked_draws():
    return N.NoiseDraws(u_blk=np.array([0.75, 0.9], np.float32), u_t=np.zeros((2, 1), np.float32),
                        u_cor=np.array([[0.10, 0.60, 0.25, 0.95], [0.70, 0.05, 0.80, 0.49]], np.float32),
                        r=np.array([[4, 2, 1, 7], [3, 4, 0, 5]]), u_sc=np.array([0.3, 0.8], np.float32))


def _worked_logits():
    z = np.zeros((2, 4, V), np.float32)
    z[0, 0, 5] = 2; z[0, 1, 3] = 2; z[0, 3, 0] = 1
    z[1, 0, 4] = 2; z[1, 1, 0] = 1; z[1, 2, 6] = 2; z[1, 3, 1] = 2
    h = np.zeros((2, 9, V), np.float32)
    for i in range(8):
        h[0, i, X[0, i + 1]] = 1
    return z, h


def test_worked_example_layout_and_noise():
    nb = N.noise_batch(X, P, R, _worked_draws(), V, EOS, t=np.full((2, 1), 0.5, np.float32))
    assert nb.k.tolist() == [1, 0]
    assert nb.context_len.tolist() == [7, 2]
    assert nb.targets.tolist() == [[5, 3, 1, 1], [4, 4, 6, 1]]
    assert nb.corrupted.astype(int).tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]
    assert nb.noisy.tolist() == [[4, 3, 1, 1], [4, 4, 6, 5]]
    assert nb.self_cond.tolist() == [True, False]
    assert nb.positions.tolist() == [[7, 8, 9, 10], [2, 3, 4, 5]]
    vis = training_decoder_visibility(nb.context_len, VALID, C, 64)
    enc_full = vis["full_attention"][:, :9]
    assert np.flatnonzero(enc_full[0]).tolist() == list(range(7))
    assert np.flatnonzero(enc_full[1]).tolist() == [0, 1]
    assert vis["full_attention"][:, 9:].all()


def test_worked_example_losses():
    z, h = _worked_logits()
    y = np.array([[5, 3, 1, 1], [4, 4, 6, 1]])
    ce = N.cross_entropy(z, y)
    np.testing.assert_allclose(ce, [[A, A, LN8, BC], [A, BC, A, A]], rtol=1e-6)
    np.testing.assert_allclose(ce.mean(1), [1.4215966, 1.0683532], atol=1e-7)
    diff = N.diffusion_loss(z, y)
    assert diff == pytest.approx(1.2449749, abs=1e-7)
    # negative controls named in the spec: corrupted-only support, 1/t weighting
    corrupted = np.array([[1, 0, 1, 0], [0, 1, 0, 1]], bool)
    assert ce[corrupted].mean() != pytest.approx(diff, abs=1e-3)
    ar_tok = N.ar_loss(h, X, VALID, "token")
    ar_ex = N.ar_loss(h, X, VALID, "example")
    assert ar_tok == pytest.approx(1.5424864, abs=1e-7)
    assert ar_ex == pytest.approx(1.6767252, abs=1e-7)
    assert N.total_loss(diff, ar_tok) == pytest.approx(2.7874613, abs=2e-7)
    assert N.total_loss(diff, ar_ex) == pytest.approx(2.9217000, abs=2e-7)
    # batch of one (row 0)
    d1, a1 = N.diffusion_loss(z[:1], y[:1]), N.ar_loss(h[:1], X[:1], VALID[:1])
    assert (d1, a1) == (pytest.approx(1.4215966, abs=1e-7), pytest.approx(1.2740088, abs=1e-7))
    assert N.total_loss(d1, a1) == pytest.approx(2.6956054, abs=2e-7)
    # torch agrees independently
    assert F.cross_entropy(torch.from_numpy(z).reshape(-1, V), torch.from_numpy(y).reshape(-1)).item() == \
        pytest.approx(diff, abs=1e-6)


def test_worked_example_seeded_vector_against_torch():
    g = torch.Generator().manual_seed(1234)
    tdraw = TT.draw_noise(g, 2, C, V)
    draws = TorchCPUGenerator(1234).training_draws(2, C, V)
    for name in ("u_blk", "u_t", "u_cor", "r", "u_sc"):
        np.testing.assert_array_equal(getattr(draws, name), tdraw[name].numpy(), err_msg=name)
    # and the numbers printed in TRAINING.md §10
    np.testing.assert_allclose(draws.u_blk, [0.02897924, 0.40189856], atol=1e-8)
    np.testing.assert_allclose(draws.u_t[:, 0], [0.25984418, 0.36664134], atol=1e-8)
    assert draws.r.tolist() == [[2, 6, 3, 6], [4, 4, 2, 6]]
    nb = N.noise_batch(X, P, R, draws, V, EOS)
    assert nb.k.tolist() == [0, 0]
    np.testing.assert_allclose(nb.t[:, 0], [0.26058432, 0.36727470], atol=1e-8)
    assert nb.targets.tolist() == [[7, 3, 4, 6], [4, 4, 6, 1]]
    assert nb.corrupted.astype(int).tolist() == [[1, 0, 1, 0], [0, 1, 0, 0]]
    assert nb.noisy.tolist() == [[2, 3, 3, 6], [4, 4, 6, 1]]
    assert nb.self_cond.tolist() == [False, True]


# ----------------------------------------------------------------------------------------------------
# 2. torch CPU generator replay


@pytest.mark.parametrize("seed", [0, 1, 7, 42, 12345, 2**32 - 1])
def test_generator_replay_matches_torch(seed):
    g = torch.Generator().manual_seed(seed)
    ours = TorchCPUGenerator(seed)
    for shape, high in (((3,), None), ((5, 7), 262144), ((2, 1), None), ((4, 33), 4096), ((1000,), None),
                        ((6,), 3), ((9,), 2**28 - 1), ((9,), 2**28), ((17, 3), 2**31 + 11),
                        ((4,), 2**32 - 1)):
        if high is None:
            np.testing.assert_array_equal(ours.rand(*shape), torch.rand(*shape, generator=g).numpy())
        else:
            np.testing.assert_array_equal(ours.randint(high, shape),
                                          torch.randint(high, shape, generator=g).numpy())


def test_generator_rejects_bad_arguments():
    with pytest.raises(InputError, match="seed"):
        TorchCPUGenerator(-1)
    with pytest.raises(InputError, match="seed"):
        TorchCPUGenerator(2**32)
    with pytest.raises(InputError, match="high"):
        TorchCPUGenerator(0).randint(0, (2,))
    with pytest.raises(InputError, match="vocab"):
        TorchCPUGenerator(0).training_draws(2, 4, 0)


# ----------------------------------------------------------------------------------------------------
# 3. properties


@settings(max_examples=40, deadline=None)
@given(u=st.floats(0, 1, exclude_max=True, width=32), n=st.integers(1, 10_000))
def test_select_canvas_in_range(u, n):
    k = N.select_canvas(np.array([u], np.float32), np.array([n]))[0]
    assert 0 <= k < n
    assert k == min(int(np.float32(u) * np.float32(n)), n - 1)


def test_select_canvas_uniform_on_a_grid():
    n = 7
    u = (np.arange(2**12, dtype=np.float64) / 2**12).astype(np.float32)  # exact uniform grid
    k = N.select_canvas(u, np.full(u.shape, n))
    counts = np.bincount(k, minlength=n)
    assert counts.max() - counts.min() <= 1
    assert N.select_canvas(np.array([1 - 2**-24], np.float32), np.array([n]))[0] == n - 1


@settings(max_examples=25, deadline=None)
@given(t=st.floats(0.001, 0.999), seed=st.integers(0, 2**32 - 1))
def test_corruption_rate_follows_t(t, seed):
    rng = TorchCPUGenerator(seed)
    B, Cn, Vn = 4, 4096, 50
    y = rng.randint(Vn, (B, Cn))
    u = rng.rand(B, Cn)
    r = rng.randint(Vn, (B, Cn))
    tt = np.full((B, 1), t, np.float32)
    noisy, cor = N.corrupt(y, tt, u, r)
    # Each position is an independent Bernoulli trial, so a rate over n positions has standard deviation
    # sqrt(p (1 - p) / n) around its probability p; 6 of them bound a false failure at ~2e-9 per draw.
    # The probability of "corrupted" is P(u < t) for u on torch's 2**-24 grid: ceil(t * 2**24) / 2**24.
    # A position *changes* only when corrupted and the replacement differs from the target: p = P * (1 - 1/V),
    # a different p with its own (larger, near t = 1) standard deviation.
    n = cor.size
    p_cor = math.ceil(float(np.float32(t)) * 2**24) / 2**24
    p_change = p_cor * (1 - 1 / Vn)
    rate = cor.mean()
    assert abs(rate - p_cor) < 6 * math.sqrt(p_cor * (1 - p_cor) / n)
    assert np.array_equal(noisy[~cor], y[~cor])  # uncorrupted positions keep the target
    assert np.array_equal(noisy[cor], r[cor])  # corrupted ones hold the draw, even when equal to y
    changed = (noisy != y).mean()
    assert abs(changed - p_change) < 6 * math.sqrt(p_change * (1 - p_change) / n)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), j=st.integers(0, C - 1), b=st.integers(0, 1))
def test_loss_support_is_every_canvas_position(seed, j, b):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(2, C, V)).astype(np.float32)
    y = rng.integers(0, V, size=(2, C))
    base = N.diffusion_loss(z, y)
    assert base == pytest.approx(N.cross_entropy(z, y).mean())
    z2 = z.copy()
    z2[b, j, y[b, j]] += 1.0  # raise the target logit at one position, corrupted or not
    after = N.diffusion_loss(z2, y)
    assert after < base
    expected = (N.cross_entropy(z2[b, j], y[b, j]) - N.cross_entropy(z[b, j], y[b, j])) / (2 * C)
    assert after - base == pytest.approx(expected, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_targets_fill_and_layout(data):
    B, Cn = 3, 5
    R = np.array(data.draw(st.lists(st.integers(1, 23), min_size=B, max_size=B)))
    Pl = np.array(data.draw(st.lists(st.integers(0, 6), min_size=B, max_size=B)))
    S = int((Pl + R).max()) + 2
    x = np.zeros((B, S), np.int64)
    for b in range(B):
        x[b, :Pl[b] + R[b]] = 10 + np.arange(Pl[b] + R[b])  # token = 10 + absolute index
    n = N.num_canvases(R, Cn)
    k = np.array([data.draw(st.integers(0, int(nb) - 1)) for nb in n])
    y = N.canvas_targets(x, Pl, R, k, Cn, eos_id=1)
    for b in range(B):
        for jj in range(Cn):
            off = k[b] * Cn + jj
            assert y[b, jj] == (10 + Pl[b] + off if off < R[b] else 1)
    # only the last canvas can be filled, and a multiple of C gets no fill at all
    assert np.all((y == 1).any(1) <= ((k == n - 1) & (R % Cn != 0)))


def test_encoder_input_fill_option():
    tok, val = N.encoder_input(X, P, R, C, eos_id=EOS)
    assert np.array_equal(tok, X) and np.array_equal(val, VALID.astype(bool))
    tok, val = N.encoder_input(X, P, R, C, eos_id=EOS, append_fill=True)
    assert tok.shape == (2, 11)  # row 0: 3 + 2 canvases of 4
    assert tok[0].tolist() == X[0].tolist() + [1, 1]
    assert tok[1, :6].tolist() == [2, 5, 4, 4, 6, 1] and val[1].sum() == 6


def test_sliding_visibility_is_block_anchored():
    valid = np.ones((1, 20), bool)
    vis = training_decoder_visibility(np.array([13]), valid, 4, 8)
    assert np.flatnonzero(vis["sliding_attention"][0, :20]).tolist() == list(range(6, 13))
    assert np.flatnonzero(vis["full_attention"][0, :20]).tolist() == list(range(13))
    assert vis["sliding_attention"][0, 20:].all()


@pytest.mark.parametrize("call, match", [
    (lambda: N.num_canvases(np.array([3, 0]), 4), "at least one token"),
    (lambda: N.canvas_targets(X, P, R, np.array([2, 0]), C), "out of range"),
    (lambda: N.corrupt(np.zeros((2, 4), int), np.zeros((2,), np.float32), np.zeros((2, 4)), np.zeros((2, 4), int)),
     "t must have shape"),
    (lambda: N.ar_loss(np.zeros((1, 3, 4)), np.zeros((1, 3), int), np.ones((1, 3)), "mean"), "reduction"),
    (lambda: N.ar_loss(np.zeros((1, 3, 4)), np.zeros((1, 3), int), np.array([[1, 0, 0]])), "no valid"),
    (lambda: N.cross_entropy(np.full((1, 4), np.nan), np.array([0])), "NaN"),
    (lambda: N.cross_entropy(np.zeros((1, 4)), np.array([4])), "targets"),
    (lambda: N.NoiseDraws(np.array([1.0], np.float32), np.zeros((1, 1), np.float32),
                          np.zeros((1, 2), np.float32), np.zeros((1, 2), int), np.zeros(1, np.float32)),
     "u_blk"),
    (lambda: N.noise_batch(X, P, R, _worked_draws(), vocab=5), "vocab"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(InputError, match=match):
        call()


# ----------------------------------------------------------------------------------------------------
# 4. the training script against the reference


@pytest.mark.parametrize("seed", [0, 3, 99])
def test_train_script_noising_matches_reference(seed):
    B, Cn, Vn = 6, 8, 300
    rng = np.random.default_rng(seed)
    R = rng.integers(1, 30, size=B)
    Pl = rng.integers(1, 9, size=B)
    S = int((Pl + R).max())
    x = rng.integers(3, Vn, size=(B, S))
    valid = np.arange(S)[None, :] < (Pl + R)[:, None]
    x = np.where(valid, x, 0)
    td = TT.draw_noise(torch.Generator().manual_seed(seed), B, Cn, Vn)
    draws = TorchCPUGenerator(seed).training_draws(B, Cn, Vn)
    nb = N.noise_batch(x, Pl, R, draws, Vn)
    Rt, Pt, xt = torch.from_numpy(R), torch.from_numpy(Pl), torch.from_numpy(x)
    k = TT.select_canvas(td["u_blk"], TT.num_canvases(Rt, Cn))
    y = TT.canvas_targets(xt, Pt, Rt, k, Cn)
    t = TT.time_from_uniform(td["u_t"], N.EPS)
    noisy, cor = TT.corrupt(y, t, td["u_cor"], td["r"])
    assert k.tolist() == nb.k.tolist()
    assert y.tolist() == nb.targets.tolist()
    np.testing.assert_array_equal(t.numpy(), nb.t)
    assert noisy.tolist() == nb.noisy.tolist() and cor.tolist() == nb.corrupted.tolist()
    assert TT.self_cond_mask(td["u_sc"]).tolist() == nb.self_cond.tolist()
    masks = TT.decoder_masks(torch.from_numpy(nb.context_len), torch.from_numpy(valid), Cn, window=5)
    vis = training_decoder_visibility(nb.context_len, valid, Cn, 5)
    for name in ("full_attention", "sliding_attention"):
        m = masks[name]
        assert m.shape == (B, 1, Cn, S + Cn)
        assert np.array_equal((m == 0).numpy(), np.broadcast_to(vis[name][:, None, None, :], m.shape))


@pytest.mark.parametrize("reduction", ["token", "example"])
def test_train_script_losses_match_reference(reduction):
    rng = np.random.default_rng(5)
    B, S, Cn, Vn = 3, 11, 6, 40
    z = (30 * np.tanh(rng.normal(scale=3, size=(B, Cn, Vn)) / 30)).astype(np.float32)
    y = rng.integers(0, Vn, size=(B, Cn))
    h = rng.normal(scale=2, size=(B, S, Vn)).astype(np.float32)
    x = rng.integers(0, Vn, size=(B, S))
    valid = np.arange(S)[None, :] < np.array([[11], [4], [7]])
    d_t = TT.diffusion_loss(torch.from_numpy(z), torch.from_numpy(y)).item()
    a_t = TT.ar_loss(torch.from_numpy(h), torch.from_numpy(x), torch.from_numpy(valid), reduction).item()
    assert d_t == pytest.approx(N.diffusion_loss(z, y), rel=1e-6)
    assert a_t == pytest.approx(N.ar_loss(h, x, valid, reduction), rel=1e-6)


@pytest.fixture(scope="module")
def tiny():
    from tests.hf_tiny import TinySpec, tiny_model

    torch.set_num_threads(1)
    return tiny_model(TinySpec(vocab_size=128, canvas_length=4, sliding_window=8), seed=3)


def _prefix_logits(model, x_row, L, noisy_row, sc_logits=None, sc_on=None):
    """Inference geometry: encode exactly the L-token prefix, decode one canvas."""
    kw = {}
    if sc_logits is not None:
        kw = dict(self_conditioning_logits=sc_logits, self_conditioning_mask=sc_on)
    return model(input_ids=x_row[None, :L], decoder_input_ids=noisy_row[None], **kw).logits[0]


def test_training_forward_equals_reference_objective(tiny):
    """The training step's loss = the reference objective computed from inference-geometry logits."""
    B, Cn, Vn = 3, 4, 120
    rng = np.random.default_rng(11)
    Pl, R = np.array([13, 3, 9]), np.array([7, 4, 10])  # S = 19 > W = 8: sliding layers matter
    S = int((Pl + R).max())
    valid = np.arange(S)[None, :] < (Pl + R)[:, None]
    x = np.where(valid, rng.integers(5, Vn, size=(B, S)), 0)
    seed = 2  # draws k = [1, 0, 1] and both self-conditioning states
    draws = TorchCPUGenerator(seed).training_draws(B, Cn, Vn)
    nb = N.noise_batch(x, Pl, R, draws, Vn)
    assert nb.k.max() >= 1  # a later canvas is exercised
    assert nb.self_cond.any() and not nb.self_cond.all()
    xt = torch.from_numpy(x)
    with torch.no_grad():
        out = TT.training_forward(tiny, xt, torch.from_numpy(valid), torch.from_numpy(Pl), torch.from_numpy(R),
                                  TT.draw_noise(torch.Generator().manual_seed(seed), B, Cn, Vn))
        z = []
        for b in range(B):
            L, noisy = int(nb.context_len[b]), torch.from_numpy(nb.noisy[b])
            z1 = _prefix_logits(tiny, xt[b], L, noisy)
            z.append(_prefix_logits(tiny, xt[b], L, noisy, z1[None], torch.tensor([bool(nb.self_cond[b])])))
        z = torch.stack(z).numpy()
        enc = tiny.model.encoder(input_ids=xt, attention_mask=torch.from_numpy(valid).long())
        h = TT.softcap_logits(tiny, enc.last_hidden_state).numpy()
    diff = N.diffusion_loss(z, nb.targets)
    ar = N.ar_loss(h, x, valid)
    assert out["diff"].item() == pytest.approx(diff, abs=1e-5)
    assert out["ar"].item() == pytest.approx(ar, abs=1e-5)
    assert out["loss"].item() == pytest.approx(N.total_loss(diff, ar), abs=2e-5)


def test_trimmed_cache_would_be_wrong(tiny):
    """Negative control for §2.3: the stock (trimmed) cache cut by a 2-D mask differs once S >= W."""
    from transformers import DynamicCache

    Cn, L, S = 4, 6, 19
    x = torch.arange(5, 5 + S)[None]
    noisy = torch.tensor([[7, 9, 11, 13]])
    valid = torch.ones(1, S, dtype=torch.bool)
    pos = L + torch.arange(Cn)[None]
    with torch.no_grad():
        ref = _prefix_logits(tiny, x[0], L, noisy[0])
        enc = tiny.model.encoder(input_ids=x, attention_mask=valid.long(), cache=DynamicCache())
        good = tiny(cache=enc.cache, decoder_input_ids=noisy, decoder_position_ids=pos,
                    decoder_attention_mask=TT.decoder_masks(torch.tensor([L]), valid, Cn, 8)).logits[0]
        enc2 = tiny.model.encoder(input_ids=x, attention_mask=valid.long())  # stock cache: keeps last W-1
        keep = torch.cat([torch.arange(S) < L, torch.ones(Cn, dtype=torch.bool)])[None].long()
        cut = tiny(cache=enc2.cache, decoder_input_ids=noisy, decoder_position_ids=pos,
                   decoder_attention_mask=keep).logits[0]
    assert (good - ref).abs().max().item() < 5e-5
    assert (cut - ref).abs().max().item() > 1e-2
