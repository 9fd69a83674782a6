"""The attention of a bfloat16 run on tensor cores (``dg_attention_bf16``, fast/gpu/cuda/attention_bf16.cu) on
cuda-sim, against the reference's ``attend(..., dtype=BFLOAT16)`` (reference/layers.py; SPEC §10.1) fed the same
bfloat16 values through the model's visibility rules (reference/masks.py), and its compile checks.

The bound. The kernel and the reference round at the same four places (the scores, the softmax's weights, the
output; the inputs are bfloat16 already) but add in different orders, so a rounding may land on either side of a
boundary that the exact value lies close to. The test follows each quantity through an interval, in float64,
around the exact values of the bfloat16 inputs (u = 2^-23 is float32's relative rounding error bound):

1. Score s = bf16(q . k): the float32 sum of d exact products in any order is within
   e_s = (2 d16 + 16) u sum_c |q_c k_c| of the exact dot product (d16: d rounded up to 16, the zero-padded
   depth of the mma; the argument of tests/test_gpu_bf16.py for ``dg_gemm_bf16``), so s lies in
   [bf16(dot - e_s), bf16(dot + e_s)] (rounding is monotone). An invisible key's score is -inf.
2. Weight w = exp(s - m) / sum_t exp(s_t - m), in float32, before its rounding: the softmax is increasing in its
   own score and decreasing in the others, so over the score intervals the exact weight lies in
   [E_lo / (E_lo + sum_others E_hi), E_hi / (E_hi + sum_others E_lo)] with E = exp(s - M). The kernel computes
   it with a running maximum and sum (rescaled once per tile of 32 keys), the reference in one pass; either is
   within a relative delta = (2 T + 256) u of the exact value of its own scores (T additions of positive terms,
   T / 32 rescales, 2 ulp per expf and per product, and |s - m| u <= 52 u for the rounding of the exponent's
   argument, |s - m| <= 104 before expf underflows), plus an absolute 2^-140 for underflowing terms. The
   rounded weight p lies between the roundings of the interval's ends moved by that error.
3. Output o = bf16(sum_t p_t v_t): with each p_t anywhere in its interval the exact sum lies in
   [sum_t min(p_lo v, p_hi v), sum_t max(p_lo v, p_hi v)], and the float32 sum in any order of T' (T rounded up
   to the 32-key tile) exact products is within e_o = (2 T' + 16) u sum_t p_hi |v_t| of it; o lies between the
   roundings of the ends moved by e_o. A query that sees no key gets exact zeros.

The reference's own output must lie in the same interval (it is one more order of the same sums: a check of the
bound itself), and kernel and reference agree exactly for nearly every output. Each check is shown to fail on
a mutated copy of the kernel (unrounded scores or weights, a window off by one, a skipped tile...).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from diffusiongemma.fast.gpu import build as cb
from diffusiongemma.fast.gpu import launch as gl
from diffusiongemma.fast.gpu.attention_bounds import interval  # shared with benchmarks/bench_attention_bf16.py
from diffusiongemma.fast.gpu.sim import KernelCheckError, KernelLibrary, SimDevice
from diffusiongemma.reference.layers import attend
from diffusiongemma.reference.masks import decoder_visibility, encoder_visibility
from diffusiongemma.reference.primitives import BFLOAT16, round_to
from tests.gpu_kernel_helpers import mutated, nvrtc_or_skip

SOURCE = os.path.join(cb.CUDA_DIR, "attention_bf16.cu")
f32, f64, i64, i32, u8 = np.float32, np.float64, np.int64, np.int32, np.uint8


def library(text: str | None = None) -> KernelLibrary:
    """The kernel's own source (with its headers) compiled for cuda-sim: ``text`` replaces it when given."""
    return KernelLibrary.from_source(text if text is not None else cb.assemble(SOURCE))


def bf16(x) -> np.ndarray:
    return round_to(np.asarray(x, f32), BFLOAT16)


# ------------------------------------------------------------------------------------------------ cases
class Case:
    """One call of ``gl.attention_bf16`` as the GPU model makes it (fast/gpu/model.py ``_GpuKeys.attend``) and
    the same call as the reference model makes ``attend``: the encoder (causal, a window on sliding layers)
    over a cache written by earlier chunks and the chunk's own keys, or the decoder (bidirectional, no window)
    over the retained cache and the canvas.

    N query rows of S tokens, nh query heads over g KV heads of dim d. The cache holds ``past`` positions of
    each of its B_c rows (``pad[b]`` left-padding positions not real); ``ring`` > 0 keeps only the last ``ring``
    positions in slots ``p mod ring`` (a sliding layer's cache, W - 1 slots), else position p sits in slot p;
    ``extra_slots`` empty slots (position -1) follow. ``rows``: the cache row of each query row (None: row n).
    ``poison``: the kernel's cache holds NaN and inf in its empty slots and at padding positions (a GPU cache is
    not cleared), where the reference's holds the finite values it computed.
    """

    def __init__(self, rng, *, N=2, S=5, nh=4, g=2, d=32, past=0, ring=0, extra_slots=0, decoder=False,
                 window=0, pad=None, rows=None, scale=1.0, B_c=None, poison=False):
        self.N, self.S, self.nh, self.g, self.d, self.decoder, self.poison = N, S, nh, g, d, decoder, poison
        self.window = 0 if decoder else window
        self.causal = not decoder
        B_c = B_c or N
        self.rows = None if rows is None else np.asarray(rows, i32)
        self.pad = np.zeros(B_c, i64) if pad is None else np.asarray(pad, i64)
        kept = np.arange(max(0, past - ring), past) if ring else np.arange(past)
        slots = (ring if ring else past) + extra_slots
        self.slot_pos = np.full(slots, -1, i64)
        self.slot_pos[kept % ring if ring else kept] = kept
        self.n_cache = slots
        P = past + S + 3                                     # the real-flag table covers every position
        self.cache_real = (np.arange(P)[None, :] >= self.pad[:, None]).astype(u8)
        sd = scale * d ** -0.25                              # scores of standard deviation ~ scale^2
        self.cache_k = bf16(rng.standard_normal((B_c, g, slots, d)) * sd)
        self.cache_v = bf16(rng.standard_normal((B_c, g, slots, d)))
        self.q = bf16(rng.standard_normal((N, S, nh, d)) * sd)
        self.q_pos = past + np.arange(S, dtype=i64)
        self.new_k = bf16(rng.standard_normal((N, g, S, d)) * sd)
        self.new_v = bf16(rng.standard_normal((N, g, S, d)))
        crow = np.arange(N) if self.rows is None else self.rows
        if decoder:
            self.new_real = np.ones((N, S), u8)              # the canvas is all real
        else:
            self.new_real = (self.q_pos[None, :] >= self.pad[crow][:, None]).astype(u8)

    def launch_args(self, dev, out) -> tuple:
        up = dev.to_device
        cache = self.n_cache > 0
        cache_k, cache_v = self.cache_k.copy(), self.cache_v.copy()
        if self.poison:
            unused = (self.slot_pos[None, :] < 0) | (self.cache_real[:, np.clip(self.slot_pos, 0, None)] == 0)
            cache_k[np.broadcast_to(unused[:, None, :], cache_k.shape[:3])] = np.inf
            cache_v[np.broadcast_to(unused[:, None, :], cache_v.shape[:3])] = np.nan
        return (up(self.q), up(self.q_pos), up(cache_k) if cache else None, up(cache_v) if cache else None,
                None if self.rows is None or not cache else up(self.rows), self.n_cache,
                up(self.slot_pos) if cache else None, up(self.cache_real) if cache else None, up(self.new_k),
                up(self.new_v), up(self.q_pos), up(self.new_real), self.window, self.causal, out)

    def reference_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """keys, values (N, g, T, d) and visible (N, S or 1, T) as the reference model builds them."""
        crow = np.arange(self.N) if self.rows is None else self.rows
        keys = np.concatenate([self.cache_k[crow], self.new_k], axis=2)
        values = np.concatenate([self.cache_v[crow], self.new_v], axis=2)
        pos = self.slot_pos
        cache_is_real = (pos >= 0)[None, :] & (self.cache_real[crow][:, np.clip(pos, 0, None)] != 0)
        if self.decoder:
            visible = decoder_visibility(cache_is_real, self.S)
        else:
            key_pos = np.concatenate([pos, self.q_pos])
            key_real = np.concatenate([cache_is_real, self.new_real != 0], axis=1)
            visible = encoder_visibility(self.q_pos, key_pos, key_real, self.window or None)
        return keys, values, visible


def run(case: Case, lib: KernelLibrary | None = None, dev=None) -> np.ndarray:
    """The kernel's output (N, S, nh * d) on ``dev`` (default: cuda-sim with ``lib``, every launch checked:
    bounds, races, divergence, and the same output in two thread orders); it starts as NaN, so an output the
    kernel does not write shows."""
    dev = dev or SimDevice(library=lib or library())
    out = dev.to_device(np.full((case.N, case.S, case.nh * case.d), np.nan, f32))
    dev.launch(gl.attention_bf16(*case.launch_args(dev, out)))
    return dev.to_host(out)


# ------------------------------------------------------------------------------------------------ the bound
def check(case: Case, got: np.ndarray, agree: float = 0.97) -> None:
    """Raise AssertionError unless ``got`` is within the bound of the docstring (and the reference too)."""
    keys, values, visible = case.reference_inputs()
    ref = attend(case.q, keys, values, visible, dtype=BFLOAT16)
    lo, hi = interval(case.q, keys, values, visible)
    assert np.all((lo <= ref) & (ref <= hi)), "the reference itself is outside the bound: the bound is wrong"
    assert not np.isnan(got).any(), f"{np.count_nonzero(np.isnan(got))} outputs NaN (unwritten, or NaN reached them)"
    assert np.array_equal(bf16(got), got), "outputs are not bfloat16 values"
    outside = ~((lo <= got) & (got <= hi))
    assert not outside.any(), (f"{np.count_nonzero(outside)} of {got.size} outputs outside the bound, first at "
                               f"{np.argwhere(outside)[0]}: {got[outside][:3]} not in [{lo[outside][:3]}, "
                               f"{hi[outside][:3]}] (reference {ref[outside][:3]})")
    unseen = ~visible.any(-1)                                                   # (N, S or 1)
    unseen = np.broadcast_to(unseen, got.shape[:2])
    assert np.all(got[unseen] == 0.0), "a query that sees no key must get zeros"
    same = np.count_nonzero(got == ref) / max(got.size, 1)
    assert same >= agree, f"only {same:.1%} of the outputs equal the reference's"


# ------------------------------------------------------------------------------------------------ against the reference
CASES = {
    # the decoder: a canvas over a cache, every key visible, one query head per KV head, head dim 16
    "decoder r=1 d=16": dict(N=2, S=9, nh=2, g=2, d=16, past=10, decoder=True),
    # the decoder with its cache rows permuted (cache_rows), padded cache rows and grouped heads r = 4, d = 64
    "decoder rows r=4 d=64": dict(N=2, S=20, nh=8, g=2, d=64, past=37, decoder=True, rows=[1, 0], pad=[0, 6],
                                  scale=2.0),
    # an encoder chunk after a first one, r = 2, d = 32, left padding, empty slots after the cache, 9 + 7 keys
    "encoder r=2 d=32": dict(N=2, S=7, nh=4, g=2, d=32, past=9, extra_slots=3, pad=[0, 3], scale=2.0),
    # a sliding layer: ring of W - 1 = 7 slots, window 8 shorter than the chunk of 40, r = 4, d = 64
    "sliding window r=4 d=64": dict(N=2, S=40, nh=4, g=1, d=64, past=20, ring=7, window=8, pad=[0, 5], scale=2.0),
    # no cache at all (the first chunk), r = 2, d = 32: 13 keys, none a multiple of the tile
    "zero cache": dict(N=1, S=13, nh=2, g=1, d=32, scale=2.0),
    # a left-padded first chunk: row 1's 4 padding queries see no key (their own keys are padding, the rest is
    # after them) -> zeros, in a tile the other queries see
    "padding queries": dict(N=2, S=12, nh=2, g=1, d=32, pad=[0, 4], scale=2.0),
    # a padding row whose every key is padding (pad past all positions): its queries see nothing -> zeros
    "fully masked row": dict(N=2, S=6, nh=2, g=1, d=32, past=5, pad=[2, 40], scale=2.0),
    # a head dim not a multiple of 16 (a zero-padded depth) and a single query over a single key
    "d=24 one key": dict(N=1, S=1, nh=2, g=2, d=24),
    # the released head sizes: d = 256 (16 query heads over 8 KV heads) and d = 512 (r = 8), cache plus canvas
    "d=256": dict(N=1, S=20, nh=4, g=2, d=256, past=45, decoder=True, scale=3.0),
    "d=512 r=8": dict(N=1, S=3, nh=8, g=1, d=512, past=40, scale=3.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_bf16_reference(name):
    rng = np.random.default_rng(sorted(CASES).index(name))
    case = Case(rng, **CASES[name])
    got = run(case)
    check(case, got)
    if name == "fully masked row":
        assert np.all(got[1] == 0) and np.any(got[0] != 0)


@pytest.mark.parametrize("name", ["decoder rows r=4 d=64", "sliding window r=4 d=64", "padding queries"])
def test_the_cases_are_the_calls_the_float32_kernel_answers(name):
    """The same calls through ``gl.attention`` (``dg_attention``, the float32 kernel the GPU model runs and
    tests/test_gpu_equivalence.py checks against the reference model) agree with ``attend`` in float32 on the
    reference inputs built here: so the keys and visibility these tests give the reference are the model's."""
    case = Case(np.random.default_rng(sorted(CASES).index(name)), **CASES[name])
    dev = SimDevice()
    out = dev.to_device(np.full((case.N, case.S, case.nh * case.d), np.nan, f32))
    dev.launch(gl.attention(*case.launch_args(dev, out)))
    keys, values, visible = case.reference_inputs()
    np.testing.assert_allclose(dev.to_host(out), attend(case.q, keys, values, visible), rtol=1e-5, atol=1e-5)


def test_a_long_prompt_on_the_tiled_path():
    """A 330-token chunk after 40 cached positions of a sliding layer (window 64) and a 300-token first chunk
    of a full layer: 11 and 10 key tiles, several row blocks, tiles skipped by the causal mask and the window."""
    rng = np.random.default_rng(30)
    for kw in (dict(N=1, S=330, nh=4, g=2, d=32, past=40, ring=63, window=64, pad=[7], scale=2.0),
               dict(N=1, S=300, nh=2, g=1, d=64, scale=2.0)):
        case = Case(rng, **kw)
        check(case, run(case))


def test_equal_keys_and_a_score_on_a_rounding_tie():
    """Duplicate keys (equal scores, equal weights) and a score exactly halfway between two bfloat16 values
    (1 + 2^-8, rounded to the even 1): every sum here is exact in float32 in any order, so the kernel must give
    the reference's output bit for bit (rounding the score up gives another weight: 0.734375, not 0.73046875)."""
    rng = np.random.default_rng(4)
    case = Case(rng, N=1, S=2, nh=1, g=1, d=16)
    case.q[:] = 0.0
    case.q[0, :, 0, :2] = [1.0, 2.0 ** -8]
    case.new_k[:] = 0.0
    case.new_k[0, 0, 0, :2] = [1.0, 1.0]                # score 1 + 2^-8 from query 1, 1.0 from query 0
    case.new_k[0, 0, 1, :2] = [0.0, 0.0]                # score 0
    case.new_v[:] = np.arange(32, dtype=f32).reshape(1, 1, 2, 16) - 8
    got = run(case)
    keys, values, visible = case.reference_inputs()
    ref = attend(case.q, keys, values, visible, dtype=BFLOAT16)
    assert np.array_equal(got, ref)
    w = bf16(np.float32(np.e) / np.float32(np.e + 1))   # the weight of the first key after the tie went to even
    assert np.array_equal(got[0, 1], bf16(w * case.new_v[0, 0, 0] + bf16(1 - w) * case.new_v[0, 0, 1]))
    dup = Case(rng, N=1, S=4, nh=2, g=1, d=32, past=6, decoder=True, scale=3.0)
    dup.cache_k[:, :, 3:6] = dup.cache_k[:, :, 0:3]     # three pairs of equal keys
    check(dup, run(dup))


def test_empty_slots_and_padding_keys_are_not_read():
    """Values of an empty slot (position -1) or a padding position may be anything (a GPU cache is not cleared):
    inf and NaN there must not reach any output, as the reference never sees them (0 x NaN is NaN on mma)."""
    case = Case(np.random.default_rng(8), N=2, S=5, nh=4, g=2, d=32, past=9, extra_slots=4, pad=[0, 4], scale=2.0,
                poison=True)
    got = run(case)
    assert np.isfinite(got).all()
    check(case, got)


# ------------------------------------------------------------------------------------------------ the tests can fail
MUTATIONS = {
    # the scores kept in float32 (not rounded to bfloat16) in both passes
    "float32 scores": ("s[e] = vis ? dg_bf16_to_float(dg_attb_bits(sacc[i2][2 * h + e])) : -dg_inf();",
                       "s[e] = vis ? sacc[i2][2 * h + e] : -dg_inf();"),
    # the normalised weights truncated to bfloat16 instead of rounded before P V
    "weights truncated": ("dg_attb_bits(expf(s[e] - m) / l)",
                          "(unsigned short)(__float_as_uint(expf(s[e] - m) / l) >> 16)"),
    # the output left unrounded
    "float32 output": ("dg_bf16_to_float(dg_attb_bits(acc[ui][i]))", "acc[ui][i]"),
    # the sliding window one key wider, the causal mask one key narrower
    "window off by one": ("(window <= 0 || pos > qp - window);", "(window <= 0 || pos >= qp - window);"),
    "causal off by one": ("(!causal || pos <= qp) &&", "(!causal || pos < qp) &&"),
    # tiles skipped by the block's first query position instead of its last
    "tile skip": ("(!causal || pos <= qhi)", "(!causal || pos <= qlo)"),
    # the running sum not rescaled when a later tile raises the maximum
    "no rescale": ("l_run * expf(m_run - m_new)", "l_run"),
    # the values of empty slots and padding keys read (NaN there reaches the mma: 0 x NaN)
    "padding values read": ("if (c < d && kreal[tk])", "if (c < d)"),
    # the two keys of a value pair exchanged
    "value pairs": ("vt[c * VS + kp] = dg_bf16_pair(dg_attb_bits(x0), dg_attb_bits(x1));",
                    "vt[c * VS + kp] = dg_bf16_pair(dg_attb_bits(x1), dg_attb_bits(x0));"),
    # a query that sees no key: exp(-inf - -inf) = NaN instead of a zero weight
    "unseen query": ("w[e] = s[e] == -dg_inf() ? (unsigned short)0 : dg_attb_bits", "w[e] = dg_attb_bits"),
    # one row past the last written (the bounds check of cuda-sim, not the numbers, reports it)
    "row bound": ("if (grow >= rows_total || c >= d) continue;", "if (grow > rows_total || c >= d) continue;"),
}
MUTATION_CASES = (
    # a sliding layer's ring cache with empty slots and poisoned padding, a row that sees nothing
    dict(N=2, S=40, nh=4, g=2, d=32, past=20, ring=7, window=8, extra_slots=2, pad=[3, 99], scale=2.0, poison=True),
    # a first chunk of 150 tokens: 5 key tiles, 3 row blocks, maxima that grow from tile to tile; left padding,
    # so that the first 5 queries see no key in tiles that the other queries of their block see
    dict(N=1, S=150, nh=2, g=1, d=32, pad=[5], scale=2.0),
)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_checks_catch_a_broken_kernel(name):
    old, new = MUTATIONS[name]
    broken = library(mutated(cb.assemble(SOURCE), old, new, name))
    for kw in MUTATION_CASES:
        case = Case(np.random.default_rng(12), **kw)
        try:
            check(case, run(case, broken))
        except (AssertionError, KernelCheckError):
            return
    pytest.fail(f"mutation {name!r} passed every check")


# ------------------------------------------------------------------------------------------------ launch, compile
def _launch_args(N=2, S=5, nh=4, g=2, d=16, slots=7, n_cache=4, n_new=5, P=9) -> dict:
    z = np.zeros
    return dict(q=z((N, S, nh, d), f32), q_pos=z(S, i64), cache_k=z((N, g, slots, d), f32),
                cache_v=z((N, g, slots, d), f32), cache_rows=None, n_cache=n_cache, slot_pos=z(slots, i64),
                cache_real=z((N, P), u8), new_k=z((N, g, n_new, d), f32), new_v=z((N, g, n_new, d), f32),
                new_pos=z(n_new, i64), new_real=z((N, n_new), u8), window=8, causal=True, out=z((N, S, nh * d), f32))


def test_launch_builder_takes_the_float32_attention_parameters_and_checks():
    import inspect

    assert inspect.signature(gl.attention_bf16).parameters.keys() == inspect.signature(gl.attention).parameters.keys()
    launch = gl.attention_bf16(**_launch_args())
    names = [p.name for p in gl.signatures()["dg_attention_bf16"]]
    args = dict(zip(names, launch.args))
    assert args["n_cache"] == 4 and args["slots"] == 7 and args["real_stride"] == 9 and args["n_new"] == 5
    assert args["causal"] == 1 and args["window"] == 8 and args["row_tiles"] == 1
    assert launch.grid == (1, 2, 2) and launch.block == (256, 1, 1)
    assert launch.shared_mem == gl.attention_bf16_shared_bytes(1, 16)
    for bad, match in (({"n_cache": 8}, "dg_attention_bf16: n_cache=8 exceeds the 7 cache slots"),
                       ({"new_k": np.zeros((2, 2, 5, 32), f32)}, r"dg_attention_bf16: new_k has shape \(2, 2, 5, 32\)"),
                       ({"n_cache": 0, "new_k": None}, "dg_attention_bf16: no keys"),
                       ({"q": np.zeros((2, 5, 3, 16), f32), "out": np.zeros((2, 5, 48), f32)},
                        "dg_attention_bf16: 2 KV heads do not divide 3 query heads"),
                       ({"q": np.zeros((2, 5, 4, 16), np.float64)}, "dg_attention_bf16: q must be float32")):
        with pytest.raises(gl.LaunchError, match=match):
            gl.attention_bf16(**{**_launch_args(), **bad})
    with pytest.raises(gl.LaunchError, match="dg_attention_bf16: head dim 520 must be 1 to 512"):
        gl.attention_bf16_plan(10, 1, 520)
    with pytest.raises(gl.LaunchError, match="dg_attention_bf16: head dim 512 does not fit 50000 bytes"):
        gl.attention_bf16_plan(10, 1, 512, budget=50000)


@pytest.mark.parametrize("d", [16, 24, 32, 64, 128, 256, 512])
def test_launch_plan_rows_and_shared_memory(d):
    """Rows per block: as many 16-row tiles as the 8 warps' 64 output registers per thread allow (row_tiles * d16
    <= 1024), at most 8, no more than the rows need; the shared memory the kernel lays out (fits every GPU's
    opt-in)."""
    d16 = -(-d // 16) * 16
    row_tiles, smem = gl.attention_bf16_plan(4096, 2, d)
    assert row_tiles == min(8, 1024 // d16)
    assert smem == gl.attention_bf16_shared_bytes(row_tiles, d) <= gl.ATTENTION_SHARED_BUDGET
    assert gl.attention_bf16_plan(3, 2, d)[0] == 1                      # 6 rows: one row tile
    for arch in ("sm_80", "sm_86", "sm_90"):
        launch = gl.Launch("dg_attention_bf16", (1, 1, 1), (256, 1, 1), (), smem)
        gl.check_resources(launch, 0, 256, gl.SHARED_OPT_IN_LIMITS[arch], arch)


def test_the_released_layers_launch_on_cuda_sim_with_their_plans():
    """The 26B model's layers (sliding: d 256, 16 query heads over 8 KV heads; full: d 512 over 2) at a 32k-token
    prefill and a 256-token canvas: the grids and plans, and one block-sized run of each on cuda-sim (sm_86, the
    smallest opt-in limit cuda-sim enforces) through its shared-memory and launch-bound checks."""
    for S, r, d, rows in ((32768, 2, 256, 64), (32768, 8, 512, 32), (256, 2, 256, 64), (256, 8, 512, 32)):
        row_tiles, smem = gl.attention_bf16_plan(S, r, d)
        assert 16 * row_tiles == rows and -(-(S * r) // rows) <= 2 ** 31 - 1
    rng = np.random.default_rng(5)
    for kw in (dict(N=1, S=16, nh=16, g=8, d=256, past=30, decoder=True), dict(N=1, S=2, nh=16, g=2, d=512, past=33)):
        case = Case(rng, **kw, scale=2.0)
        check(case, run(case))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_to_tensor_core_mma_without_spills_and_fits_its_launches(arch):
    nvrtc_or_skip()
    text = cb.assemble(SOURCE)
    ptx = cb.nvrtc_ptx(text, arch)
    # the scores: one mma per row tile of the warp (4, unrolled) per 16 of depth (a loop the compiler may unroll
    # further); P V: 16 output tiles x 2 steps of 16 keys; every mma the bf16 -> f32 tensor-core one
    mma = re.findall(r"\bmma\.sync\.aligned\.[\w.]+", ptx)
    assert len(mma) >= 4 + 32 and set(mma) == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}, set(mma)
    assert ptx.count("shfl.sync") == 2                  # only the row statistics' max and sum, no emulation
    report = cb.compile_source(text, arch, compiler="nvrtc", name="attention_bf16.cu").kernels["dg_attention_bf16"]
    assert report.registers > 0 and not report.spills and report.stack_frame == 0   # accumulators in registers
    assert report.registers * 256 * 2 <= 65536           # __launch_bounds__(256, 2): two blocks an SM
    assert library().static_shared["dg_attention_bf16"] == report.shared_memory == 0
    for S, r, d in ((32768, 2, 256), (32768, 8, 512), (256, 8, 512), (300, 4, 64)):
        row_tiles, smem = gl.attention_bf16_plan(S, r, d)
        launch = gl.Launch("dg_attention_bf16", (1, 1, 1), (256, 1, 1), (), smem)
        gl.check_resources(launch, report.shared_memory, 1024, gl.SHARED_OPT_IN_LIMITS[arch], arch)
