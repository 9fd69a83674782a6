"""The compiled categorical draws at their edges: exact id equality with the reference's inverse-CDF rule.

``reference.sampling.categorical_from_uniform`` defines the draw on a row of float32 probabilities p: the
cumulative sums Q_v = p_0 + ... + p_v accumulated left to right in float64, total Q_{V-1}, and the first v
with Q_v > u * total (else the last id of nonzero probability). The CPU pass (``_kernels.sample_rows``) and
the GPU pass (``dg_sample_rows``, run here on cuda-sim) sum the row in other associations (8 lanes per block
of 2048 on the CPU; per-lane sums, warp trees and warp scans per chunk of 1024 on the GPU), which differ from
Q in the last bits. Random uniforms almost never land where that matters, so these tests aim at it: every
uniform below is computed from the row itself, so that u * total falls

* between a block's (chunk's) sum as the kernel forms it and the sequential cumulative sum at the same
  boundary (``between_sum_and_scan``),
* exactly on a step of the reference's CDF, and one ulp to either side (``on_cdf_step``),
* just below the total, and in the gap between the kernel's total and the reference's (``below_total``),

on rows built to make those gaps exist (a few large probabilities and many tiny ones, so float64 sums round):
zero-probability ids between mass, whole blocks masked with -inf, ties, near one-hot rows, temperature
extremes, vocabularies of 1, 2^k +- 1 around the block sizes, and one of 262,144 entries.

The draw compared is the kernel's, on the kernel's own probabilities (the row it writes): the reference's rule
applied to that row must give the same id, for every uniform, and the id never has probability 0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusiongemma.fast import _kernels
from diffusiongemma.fast.gpu import gpu_available
from diffusiongemma.fast.sampling import FusedSampler
from diffusiongemma.reference.sampling import categorical_from_uniform

CPU_BLOCK = _kernels.SAMPLING_BLOCK  # 2048
GPU_CHUNK = 1024  # DG_SAMPLE_CHUNK of fast/gpu/cuda/common.cuh (checked in test_gpu_partial_sums_model)
LAST_U = np.nextafter(1.0, 0.0)

VOCABS = (1, 2, 3, 7, 9, 31, 33, 1023, 1025, 2047, 2049, 4095, 4097, 6145)
TEMPERATURES = (None, 1e-3, 0.05, 1.0, 1e3, 1e6)
KINDS = ("tiny_masses", "zeros_between_mass", "masked_blocks", "ties", "near_one_hot", "gap_at_end")


# ------------------------------------------------------------------------------------------------ rows
def build_logits(kind: str, V: int, seed: int) -> np.ndarray:
    """One row of float32 logits of ``kind``; every kind mixes probabilities ~1 with ones ~1e-13 (logit
    gaps of ~30), so that float64 sums of the probabilities round and different associations disagree."""
    rng = np.random.default_rng(seed)
    big = rng.uniform(0.0, 3.0, V)
    tiny = rng.uniform(-34.0, -26.0, V)
    z = np.where(rng.random(V) < 0.02, big, tiny)
    if kind == "zeros_between_mass":  # excluded ids interleaved with mass, every block boundary included
        z[rng.random(V) < 0.5] = -np.inf
        for b in range(0, V, GPU_CHUNK):
            z[max(0, b - 2):b + 2] = -np.inf
    elif kind == "masked_blocks":  # whole blocks and chunks of -inf, mass on either side
        for b0 in range(0, V, GPU_CHUNK):
            if (b0 // GPU_CHUNK) % 3 == 1:
                z[b0:b0 + GPU_CHUNK] = -np.inf
        z[V // 2:] = np.where(rng.random(V - V // 2) < 0.5, -np.inf, z[V // 2:])
    elif kind == "ties":  # few distinct values, repeated
        values = np.concatenate([rng.uniform(0, 2, 3), rng.uniform(-33, -27, 3)])
        z = values[rng.integers(0, len(values), V)]
    elif kind == "near_one_hot":  # one id holds nearly all the mass, the rest is tiny or excluded
        z = np.where(rng.random(V) < 0.3, -np.inf, tiny)
        z[rng.integers(0, V)] = 5.0
    elif kind == "gap_at_end":  # tiny masses first, then nothing from the middle of the row on
        z = tiny.copy()
        z[rng.integers(0, V, max(1, V // 100))] = 0.0
        z[max(1, V // 2):] = -np.inf
    if not np.isfinite(z).any():  # a row needs one finite logit to define a distribution
        z[rng.integers(0, V)] = 0.0
    return z.astype(np.float32)[None]


# ------------------------------------------------------------------------------------------------ partial sums
def reference_cdf(p: np.ndarray) -> np.ndarray:
    return np.cumsum(p, dtype=np.float64)


def cpu_block_sums(p: np.ndarray) -> np.ndarray:
    """The CPU pass's running sum at the end of each block: 8 interleaved float64 lanes per block (a tail
    into lane 0), a fixed tree over the lanes, the blocks in order (``dg_row_pass2``)."""
    run, out = 0.0, []
    for b0 in range(0, len(p), CPU_BLOCK):
        blk = p[b0:b0 + CPU_BLOCK].astype(np.float64)
        m = len(blk) // 8 * 8
        acc = list(np.cumsum(blk[:m].reshape(-1, 8), axis=0)[-1]) if m else [0.0] * 8
        for x in blk[m:]:
            acc[0] += x
        run += ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
        out.append(run)
    return np.array(out)


def gpu_chunk_sums(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The GPU pass's sums: per chunk of 1024, 32 lanes each summing a stride of 32 in float64, a butterfly
    over the lanes (``dg_warp_sum_d``, lane 0's value), the chunks in order; and, inside each chunk, the
    running value after each group of 32 (Hillis-Steele warp scans added to a running base). Returns
    (running chunk-sum total at each chunk end, running scan value at each group end).

    Every sum is formed in the kernel's order, vectorised across chunks and groups only (zeros pad the row
    to whole chunks: adding 0.0 to a non-negative float64 changes nothing; the padding's groups are
    dropped), so a vocabulary of 262,144 takes milliseconds."""
    n = len(p)
    n_chunks = -(-n // GPU_CHUNK)
    padded = np.zeros(n_chunks * GPU_CHUNK)
    padded[:n] = p
    strided = padded.reshape(n_chunks, GPU_CHUNK // 32, 32)  # [chunk, k // 32, lane = k % 32]
    lanes = np.zeros((n_chunks, 32))
    for r in range(GPU_CHUNK // 32):  # each lane adds its values in index order
        lanes = lanes + strided[:, r, :]
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, np.arange(32) ^ o]
    chunk_run = np.cumsum(lanes[:, 0])  # base += lane 0's value, chunk after chunk
    scans = padded.reshape(-1, 32)  # one row per group of 32
    for o in (1, 2, 4, 8, 16):
        scans = np.concatenate([scans[:, :o], scans[:, o:] + scans[:, :-o]], axis=1)
    totals = scans[:, 31].reshape(n_chunks, GPU_CHUNK // 32)
    starts = np.concatenate([[0.0], chunk_run[:-1]])
    group_run = [np.cumsum(np.concatenate([[starts[c]], totals[c]]))[1:] for c in range(n_chunks)]
    return chunk_run, np.concatenate(group_run)[:-(-n // 32)]


def _around(targets, total: float, ulps: int = 2) -> set:
    """Uniforms whose u * total lands on or next to each target (u in [0, 1))."""
    out = set()
    for t in targets:
        if not np.isfinite(t) or total <= 0:
            continue
        u = min(max(t / total, 0.0), LAST_U)
        for _ in range(ulps):
            u = np.nextafter(u, 0.0)
        for _ in range(2 * ulps + 1):
            if 0.0 <= u < 1.0:
                out.add(float(u))
            u = np.nextafter(u, 2.0)
    return out


def _between(a: float, b: float) -> list:
    lo, hi = min(a, b), max(a, b)
    return [lo, hi, lo + (hi - lo) / 2, np.nextafter(hi, 0.0), np.nextafter(lo, 2.0)]


def between_sum_and_scan(p: np.ndarray) -> set:
    """u * total between a block's (chunk's) sum as a kernel forms it and the sequential CDF there."""
    Q = reference_cdf(p)
    total = Q[-1]
    targets = []
    ends = np.minimum(np.arange(CPU_BLOCK, len(p) + CPU_BLOCK, CPU_BLOCK), len(p)) - 1
    for est, e in zip(cpu_block_sums(p), ends):
        targets += _between(est, Q[e])
    chunk_run, group_run = gpu_chunk_sums(p)
    ends = np.minimum(np.arange(GPU_CHUNK, len(p) + GPU_CHUNK, GPU_CHUNK), len(p)) - 1
    for est, e in zip(chunk_run, ends):
        targets += _between(est, Q[e])
    group_ends = np.concatenate([np.arange(c0, min(c0 + GPU_CHUNK, len(p)), 32) + 31
                                 for c0 in range(0, len(p), GPU_CHUNK)])
    for est, e in zip(group_run, np.minimum(group_ends, len(p) - 1)):
        if est != Q[e]:
            targets += _between(est, Q[e])
    return _around(targets, total, 1)


def on_cdf_step(p: np.ndarray, rng: np.random.Generator, n: int = 12) -> set:
    """u * total exactly on (and one ulp around) steps of the reference's CDF: the steps of the first ids
    of mass after each block and chunk boundary, the last step, and some at random."""
    Q = reference_cdf(p)
    nz = np.flatnonzero(p > 0)
    picks = set(rng.choice(nz, min(n, len(nz)), replace=False).tolist()) | {int(nz[0]), int(nz[-1])}
    for size in (CPU_BLOCK, GPU_CHUNK, 32):  # the ids of mass on either side of every boundary b0
        at = np.searchsorted(nz, np.arange(size, len(p), size), side="left")  # first index with nz >= b0
        picks |= set(nz[at[at < len(nz)]].tolist()) | set(nz[at[at > 0] - 1].tolist())
    targets = [Q[v] for v in picks] + [Q[v - 1] for v in picks if v > 0]
    return _around(targets, Q[-1], 1)


def below_total(p: np.ndarray) -> set:
    """u just below 1, u * total just below the reference's total, and in the gap to the kernels' totals."""
    Q = reference_cdf(p)
    total = Q[-1]
    targets = [total, np.nextafter(total, 0.0)]
    targets += _between(cpu_block_sums(p)[-1], total)
    targets += _between(gpu_chunk_sums(p)[0][-1], total)
    out = _around(targets, total, 2)
    u = 1.0
    for _ in range(4):
        u = np.nextafter(u, 0.0)
        out.add(float(u))
    return out


STRATEGIES = ("between_sum_and_scan", "on_cdf_step", "below_total")


def edge_uniforms(strategy: str, p: np.ndarray, seed: int) -> np.ndarray:
    if strategy == "between_sum_and_scan":
        u = between_sum_and_scan(p)
    elif strategy == "on_cdf_step":
        u = on_cdf_step(p, np.random.default_rng(seed))
    else:
        u = below_total(p)
    return np.array(sorted(u), dtype=np.float64)


# ------------------------------------------------------------------------------------------------ the kernels
def cpu_draws(z: np.ndarray, temp, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities the CPU pass writes for row z (1, V), its draw for each uniform)."""
    R = len(u)
    logits = np.ascontiguousarray(np.broadcast_to(z, (R, z.shape[1])), dtype=np.float32)[None]
    probs = np.empty_like(logits)
    result = FusedSampler()(logits, np.array([0]), None if temp is None else np.float32(temp), u[None], probs)
    assert (probs[0] == probs[0, :1]).all(), "the pass wrote different probabilities for copies of one row"
    return probs[0, 0], result.sampled[0]


_SIM = {}


def sim_device():
    if "device" not in _SIM:
        from diffusiongemma.fast.gpu.sim import SimDevice

        _SIM["device"] = SimDevice(checks=False)
    return _SIM["device"]


#: Most elements of one launch's (rows x V) buffer in ``gpu_draws`` (16 MiB of float32): a test on a GPU draws
#: any number of uniforms on a large vocabulary in launches of at most this size, never one (uniforms x V)
#: broadcast (V = 262,144 and ~10^5 edge uniforms would be ~10^11 bytes on the host and on the device).
GPU_CHUNK_ELEMENTS = 1 << 22


def gpu_draws(z: np.ndarray, temp, u: np.ndarray, device=None,
              chunk_elements: int = GPU_CHUNK_ELEMENTS) -> tuple[np.ndarray, np.ndarray]:
    """As ``cpu_draws`` for ``dg_sample_rows`` on cuda-sim, or on ``device``: one launch row per uniform, all
    reading copies of z (no soft-cap), in launches of at most ``chunk_elements`` logits. The row is uploaded
    once and copied on the device; that every row of each launch got the same probabilities is checked on
    the device, and only the first row's probabilities and the draws come back."""
    from diffusiongemma.fast.gpu import launch as gl

    device = device or sim_device()
    xp = device.xp
    V = z.shape[1]
    u = np.asarray(u, dtype=np.float64)
    rows_per_launch = max(1, min(len(u), chunk_elements // V))
    row = device.to_device(np.ascontiguousarray(z, dtype=np.float32))  # (1, V)
    buf = device.empty((rows_per_launch, V), np.float32)
    index = device.to_device(np.arange(rows_per_launch, dtype=np.int32))
    argmax, sampled = device.zeros(rows_per_launch, np.int64), device.zeros(rows_per_launch, np.int64)
    entropy, flags = device.zeros(rows_per_launch, np.float32), device.zeros(rows_per_launch, np.int32)
    draws, first = np.empty(len(u), dtype=np.int64), None
    for start in range(0, len(u), rows_per_launch):
        n = min(rows_per_launch, len(u) - start)
        buf[:n] = row
        device.launch(gl.sample_rows(buf[:n], index[:n], 0.0, 0.0 if temp is None else float(np.float32(temp)),
                                     device.to_device(u[start:start + n]), argmax[:n], entropy[:n], sampled[:n],
                                     flags[:n]))
        ok = xp.logical_and(xp.all(flags[:n] == 0), xp.all(buf[:n] == buf[:1]))
        assert bool(device.to_host(ok)), "a flagged row, or different probabilities for copies of one row"
        if first is None:
            first = device.to_host(buf[0])
        draws[start:start + n] = device.to_host(sampled[:n])
    return first, draws


def assert_reference_draws(probs: np.ndarray, u: np.ndarray, got: np.ndarray, what: str) -> None:
    """The reference's draw for each uniform on one row (its (1, S) form: the row's CDF is formed once)."""
    expected = categorical_from_uniform(probs[None], np.asarray(u, dtype=np.float64)[None])[0]
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (f"{what}: {bad.size} of {len(u)} edge draws differ from the reference, e.g. u={u[bad[0]]!r} "
                           f"-> {int(got[bad[0]])} (p={float(probs[got[bad[0]]])!r}), reference "
                           f"{int(expected[bad[0]])}")
    assert (probs[got] > 0).all(), f"{what}: a draw of probability 0"


# ------------------------------------------------------------------------------------------------ tests
edge_cases = st.tuples(st.sampled_from(KINDS), st.sampled_from(VOCABS), st.sampled_from(TEMPERATURES),
                       st.sampled_from(STRATEGIES), st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edge_cases)
def test_cpu_draws_equal_the_reference_at_the_edges(case):
    kind, V, temp, strategy, seed = case
    z = build_logits(kind, V, seed)
    probs, _ = cpu_draws(z, temp, np.array([0.5]))
    u = edge_uniforms(strategy, probs, seed)
    probs, got = cpu_draws(z, temp, u)
    assert_reference_draws(probs, u, got, f"CPU {kind} V={V} T={temp} {strategy}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edge_cases)
def test_gpu_draws_equal_the_reference_at_the_edges(case):
    kind, V, temp, strategy, seed = case
    z = build_logits(kind, V, seed)
    probs, _ = gpu_draws(z, temp, np.array([0.5]))
    u = edge_uniforms(strategy, probs, seed)
    probs, got = gpu_draws(z, temp, u)
    assert_reference_draws(probs, u, got, f"cuda-sim {kind} V={V} T={temp} {strategy}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tiny_masses", "gap_at_end"])
def test_large_vocabulary_edges(kind):
    """V = 262,144 (the released models' vocabulary): 128 blocks, 256 chunks; a few edge uniforms each."""
    V = 262144
    z = build_logits(kind, V, 5)
    probs, _ = cpu_draws(z, 1.0, np.array([0.5]))
    rng = np.random.default_rng(1)
    u = np.concatenate([edge_uniforms(s, probs, 3) for s in STRATEGIES])
    u = np.unique(np.concatenate([u[rng.choice(len(u), min(len(u), 24), replace=False)], [LAST_U]]))
    cprobs, got = cpu_draws(z, 1.0, u)
    assert_reference_draws(cprobs, u, got, f"CPU {kind} V={V}")
    gprobs, got = gpu_draws(z, 1.0, u[:8])
    assert_reference_draws(gprobs, u[:8], got, f"cuda-sim {kind} V={V}")


#: What one real-GPU edge test may hold at once: device bytes (``CountingDevice`` limit) and host bytes
#: (tracemalloc peak). Checked on the CPU by ``test_the_real_gpu_edge_test_fits_in_a_few_megabytes``.
REAL_GPU_DEVICE_LIMIT = 64 * 2**20
REAL_GPU_HOST_LIMIT = 512 * 2**20


def _real_gpu_draws(kind, device=None, take=None):
    """On a GPU (``-m gpu``, benchmarks/gpu_check.sh): every strategy on each row kind, V = 4097 and 262,144,
    every edge uniform (~10^5 at V = 262,144: launches of at most ``GPU_CHUNK_ELEMENTS`` logits, seconds in
    all). ``device``/``take``: the CPU check of its sizes runs the same code on cuda-sim with ``take`` of the
    uniforms (a seeded choice)."""
    if device is None:
        from diffusiongemma.fast.gpu.device import CupyDevice

        device = CupyDevice("cuda")
    for V in (4097, 262144):
        z = build_logits(kind, V, 7)
        probs, _ = gpu_draws(z, 1.0, np.array([0.5]), device)
        u = np.concatenate([edge_uniforms(s, probs, 7) for s in STRATEGIES])
        if take is not None:
            u = np.random.default_rng(V).choice(u, min(take, len(u)), replace=False)
        probs, got = gpu_draws(z, 1.0, u, device)
        assert_reference_draws(probs, u, got, f"{getattr(device, 'name', 'GPU')} {kind} V={V}")


def test_the_real_gpu_edge_test_fits_in_a_few_megabytes():
    """The GPU-only test above, run on cuda-sim with an allocation-limited device and traced host memory:
    its device arrays and host arrays stay bounded whatever the number of uniforms (the broadcast it used to
    make needed ~120 GB on each side at V = 262,144). Twice the uniforms must not need more memory."""
    import tracemalloc

    from diffusiongemma.fast.gpu.counting import CountingDevice

    peaks = []
    for take in (16, 48):
        device = CountingDevice(sim_device(), limit_bytes=REAL_GPU_DEVICE_LIMIT)
        tracemalloc.start()
        try:
            _real_gpu_draws("tiny_masses", device, take=take)
            host_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert host_peak < REAL_GPU_HOST_LIMIT, f"{host_peak / 2**20:.0f} MiB of host memory at once"
        peaks.append(device.peak_live_bytes)
    assert 0 < peaks[0] <= REAL_GPU_DEVICE_LIMIT
    assert peaks[1] == peaks[0], f"device memory grows with the number of uniforms: {peaks}"


GPU_OK, GPU_REASON = gpu_available()
if GPU_OK:  # collected only where a GPU is (as tests/test_gpu_equivalence.py): never a skip elsewhere
    test_real_gpu_draws_equal_the_reference_at_the_edges = pytest.mark.gpu(
        pytest.mark.parametrize("kind", KINDS)(_real_gpu_draws))
else:
    print(f"the real-GPU edge draws are not collected (cuda-sim runs the same cases): {GPU_REASON}")


def test_the_issue_row_never_draws_an_excluded_id():
    """Rows of 4096 with tiny masses in block 0 and -inf from id 2048 on: every u in the gap between the
    lane sum of block 0 and its sequential sum drew id 2048 (probability 0)."""
    rng = np.random.default_rng(0)
    for seed in range(4):
        z = np.full((1, 4096), -np.inf, dtype=np.float32)
        z[0, :2048] = rng.uniform(-34, -26, 2048)
        z[0, rng.integers(0, 2048, 20)] = 0.0
        probs, _ = cpu_draws(z, None, np.array([0.5]))
        u = np.array(sorted(below_total(probs) | between_sum_and_scan(probs)))
        probs, got = cpu_draws(z, None, u)
        assert (got < 2048).all()
        assert_reference_draws(probs, u, got, "CPU issue row")


def test_the_edge_strategies_reach_the_gaps():
    """The strategies do aim at rounding gaps: on these rows the kernels' block and chunk sums differ
    from the sequential CDF, so the uniforms above are not all ordinary ones."""
    hits = 0
    for kind in KINDS:
        z = build_logits(kind, 4097, 1)
        probs, _ = cpu_draws(z, 1.0, np.array([0.5]))
        Q = reference_cdf(probs)
        ends = np.minimum(np.arange(CPU_BLOCK, 4097 + CPU_BLOCK, CPU_BLOCK), 4097) - 1
        hits += int(np.any(cpu_block_sums(probs) != Q[ends]))
        ends = np.minimum(np.arange(GPU_CHUNK, 4097 + GPU_CHUNK, GPU_CHUNK), 4097) - 1
        hits += int(np.any(gpu_chunk_sums(probs)[0] != Q[ends]))
    assert hits >= len(KINDS)


def test_gpu_partial_sums_model():
    """The chunk size the GPU model above assumes is the kernels' own."""
    from diffusiongemma.fast.gpu import launch as gl

    assert gl.const("DG_SAMPLE_CHUNK") == GPU_CHUNK


def test_the_gpu_fallback_passes_every_simulator_check():
    """The draws that take the sequential fallback (u = 0, u just below 1, targets between the chunk sums and
    the CDF) under cuda-sim's bounds, race, divergence and schedule checks."""
    from diffusiongemma.fast.gpu.sim import SimDevice

    z = build_logits("gap_at_end", 2049, 3)
    probs, _ = gpu_draws(z, None, np.array([0.5]))
    u = np.array(sorted(below_total(probs) | {0.0}))[:6]
    probs, got = gpu_draws(z, None, u, SimDevice(checks=True))
    assert_reference_draws(probs, u, got, "cuda-sim (checked)")
