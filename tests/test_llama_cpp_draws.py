"""LlamaCppDraws: llama.cpp's random stream (std::mt19937 + libstdc++'s distributions) reproduced in NumPy.

Checked three ways: against the C++ standard library itself (a tiny program compiled with g++ in tmp_path,
skipped only where no C++ compiler exists), against values stored in tests/golden/llama.cpp/ (recorded from
that program, so the check runs everywhere), and against NumPy's own MT19937 given the same state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiongemma.reference import InputError
from diffusiongemma.reference.variants.llama_cpp_draws import (DEFAULT_SEED, MT19937, LlamaCppDraws, _one_int,
                                                               first_reaching, step_draws, uniform_float,
                                                               uniform_int)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "llama.cpp", "mt19937_draws.json")

# The stream llama.cpp's diffusion_generate_entropy_bound draws: C canvas ids, then per step and position one
# float uniform and one renoise id. Floats are printed as hex (%a) so they compare bit for bit.
STREAM_CPP = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <random>
int main(int argc, char ** argv) {
    const int32_t seed = (int32_t) strtoll(argv[1], nullptr, 10);
    const int64_t V = strtoll(argv[2], nullptr, 10);
    const int C = atoi(argv[3]), steps = atoi(argv[4]);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni01(0.0f, 1.0f);
    std::uniform_int_distribution<int32_t> vocab_dist(0, (int32_t) (V - 1));
    for (int i = 0; i < C; i++) printf("%d\n", vocab_dist(rng));
    for (int s = 0; s < steps; s++)
        for (int i = 0; i < C; i++) { float u = uni01(rng); int32_t r = vocab_dist(rng); printf("%a %d\n", u, r); }
    return 0;
}
"""

# The two distributions on words chosen by the caller (an engine that replays argv), to reach the edges a
# real stream almost never shows: float(w) rounding up to 2^32, and Lemire redraws.
WORDS_CPP = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <random>
struct replay {
    typedef uint32_t result_type;
    char ** w; int i;
    static constexpr result_type min() { return 0; }
    static constexpr result_type max() { return 0xFFFFFFFFu; }
    result_type operator()() { return (result_type) strtoull(w[i++], nullptr, 10); }
};
int main(int argc, char ** argv) {
    const char mode = argv[1][0];
    const int64_t V = strtoll(argv[2], nullptr, 10);
    replay g{argv + 3, 0};
    const int n = argc - 3;
    if (mode == 'f') {
        std::uniform_real_distribution<float> uni01(0.0f, 1.0f);
        while (g.i < n) printf("%a\n", uni01(g));
    } else {
        std::uniform_int_distribution<uint32_t> d(0, (uint32_t) (V - 1));
        while (g.i < n) { int before = g.i; uint32_t r = d(g); printf("%u %d\n", r, g.i - before); }
    }
    return 0;
}
"""


def _compile(tmp_path, source: str, name: str) -> str:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH; the stored-values test checks the same stream")
    src, exe = tmp_path / f"{name}.cpp", tmp_path / name
    src.write_text(source)
    subprocess.run([compiler, "-std=c++17", "-O1", "-o", str(exe), str(src)], check=True, capture_output=True)
    return str(exe)


@pytest.fixture(scope="module")
def stream_exe(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("cxx"), STREAM_CPP, "stream")


@pytest.fixture(scope="module")
def words_exe(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("cxx"), WORDS_CPP, "words")


def _cpp_stream(exe: str, seed: int, V: int, C: int, steps: int):
    lines = subprocess.run([exe, str(seed), str(V), str(C), str(steps)], check=True, capture_output=True,
                           text=True).stdout.split("\n")
    canvas = np.array([int(x) for x in lines[:C]], dtype=np.int64)
    rest = [line.split() for line in lines[C:C + C * steps]]
    u = np.array([float.fromhex(a) for a, _ in rest], dtype=np.float32).reshape(steps, C)
    renoise = np.array([int(b) for _, b in rest], dtype=np.int64).reshape(steps, C)
    return canvas, u, renoise


def _ours(seed: int, V: int, C: int, steps: int):
    engine = MT19937(seed)
    canvas = uniform_int(engine, V, C)
    pairs = [step_draws(engine, V, C) for _ in range(steps)]
    return canvas, np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


CASES = [(-1, 4096, 40, 3), (0, 4096, 40, 3), (12345, 7, 33, 2), (2**31 - 1, 262144, 20, 2),
         (4242, 1431655766, 60, 3),  # V = 2^32 / 3 + 1: a third of all renoise words are redrawn
         (7, 2**31, 25, 2), (99, 1, 5, 2)]  # 2^31: the largest int32_t vocabulary, never redrawn


@pytest.mark.parametrize("seed, V, C, steps", CASES)
def test_stream_matches_libstdcxx(stream_exe, seed, V, C, steps):
    exe = stream_exe
    want = _cpp_stream(exe, seed, V, C, steps)
    got = _ours(seed, V, C, steps)
    for name, a, b in zip(("canvas", "u", "renoise"), got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_stream_spans_several_twists(stream_exe):
    # 3 * 700 words per step: each step crosses a 624-word twist
    exe = stream_exe
    want = _cpp_stream(exe, 31337, 4096, 700, 3)
    got = _ours(31337, 4096, 700, 3)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


EDGE_WORDS = [0, 1, 255, 256, 2**24 - 1, 2**24, 2**24 + 1, 2**31, 2**32 - 129, 2**32 - 128, 2**32 - 127,
              2**32 - 2, 2**32 - 1]


def test_float_edges_match_libstdcxx(words_exe):
    exe = words_exe
    out = subprocess.run([exe, "f", "0"] + [str(w) for w in EDGE_WORDS], check=True, capture_output=True,
                         text=True).stdout.split()
    want = np.array([float.fromhex(x) for x in out], dtype=np.float32)
    got = uniform_float(np.array(EDGE_WORDS, dtype=np.uint32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got.max() < 1.0 and got[-1] == np.nextafter(np.float32(1), np.float32(0))  # rounded up, clamped


@pytest.mark.parametrize("V", [3, 7, 4096, 1431655766, 2**31 + 1, 2**32 - 1])
def test_int_redraws_match_libstdcxx(words_exe, V):
    exe = words_exe
    threshold = (2**32 - V) % V
    words = list(range(0, 2**32, 2**32 // 97))
    if V % 2:  # words whose low product bits land just below the threshold (redrawn) and on it (kept)
        inverse = pow(V, -1, 2**32)
        words += [(t * inverse) % 2**32 for t in (threshold - 1, threshold, 0) if t >= 0] * 2
    words.append(2**32 - 1)  # low bits 2^32 - V >= threshold: never redrawn, so the last draw ends here
    out = subprocess.run([exe, "i", str(V)] + [str(w) for w in words], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    want = [tuple(map(int, line.split())) for line in out if line.strip()]
    engine = _ListEngine(words)
    got = []
    while engine.remaining():
        start = engine.i
        got.append((_one_int(engine, V), engine.i - start))
    assert got == want
    if threshold > 0 and V % 2:
        assert any(n > 1 for _, n in got)  # some draw was redrawn


class _ListEngine:
    def __init__(self, words):
        self.words, self.i = list(words), 0

    def remaining(self):
        return self.i < len(self.words)

    def __call__(self):
        self.i += 1
        return self.words[self.i - 1]


def test_stored_values():
    """The streams recorded from the C++ program (tests/golden/llama.cpp/mt19937_draws.json)."""
    with open(GOLDEN) as f:
        stored = json.load(f)
    assert stored["cases"]
    for case in stored["cases"]:
        canvas, u, renoise = _ours(case["seed"], case["V"], case["C"], case["steps"])
        assert canvas.tolist() == case["canvas"]
        assert [float.hex(float(x)) for x in u.ravel()] == case["u_hex"]
        assert renoise.ravel().tolist() == case["renoise"]


def test_engine_is_the_standard_mt19937():
    # [rand.predef]: the 10000th invocation of a default-constructed mt19937 produces 4123659995
    assert MT19937(5489).words(10000)[-1] == 4123659995
    # and NumPy's MT19937 given our seeded state produces the same words
    ours = MT19937(2024)
    key = ours._state.copy()
    bit_generator = np.random.MT19937()
    bit_generator.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    assert np.array_equal(bit_generator.random_raw(3000).astype(np.uint32), ours.words(3000))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), V=st.sampled_from([2, 5, 4096, 1431655766, 2**31 + 1, 2**32 - 1]),
       C=st.integers(0, 40))
def test_vectorised_draws_equal_word_by_word(seed, V, C):
    """uniform_int / step_draws (vectorised, with redraws pushed back) equal one-word-at-a-time draws."""
    a, b = MT19937(seed), MT19937(seed)
    assert uniform_int(a, V, C).tolist() == [_one_int(b, V) for _ in range(C)]
    u, ids = step_draws(a, V, C)
    want_u, want_ids = [], []
    for _ in range(C):
        want_u.append(uniform_float(b.words(1))[0])
        want_ids.append(_one_int(b, V))
    assert np.array_equal(u, np.array(want_u, dtype=np.float32)) and ids.tolist() == want_ids
    assert np.array_equal(a.words(5), b.words(5))  # both consumed the same words


def test_seed_reduction_and_default():
    assert np.array_equal(MT19937(-1).words(10), MT19937(2**32 - 1).words(10))
    assert LlamaCppDraws().seed == DEFAULT_SEED == 2**32 - 1
    for bad in (2**32, -2**31 - 1, 1.5, True, "7"):
        with pytest.raises(InputError):
            LlamaCppDraws(bad)


def test_draw_source_contract():
    V, C = 50, 6
    probs = np.random.default_rng(0).dirichlet(np.ones(V), size=(1, C)).astype(np.float32)
    d = LlamaCppDraws(3)
    first = d.canvas_ids(1, C, V)
    sampled = d.categorical(probs)
    noise = d.renoise_ids(1, C, V)
    assert first.shape == sampled.shape == noise.shape == (1, C) and first.dtype == np.int64
    # the same numbers by hand: canvas, then (u, renoise) interleaved
    engine = MT19937(3)
    assert first[0].tolist() == [_one_int(engine, V) for _ in range(C)]
    hand_u, hand_r = [], []
    for _ in range(C):
        hand_u.append(uniform_float(engine.words(1))[0])
        hand_r.append(_one_int(engine, V))
    assert noise[0].tolist() == hand_r and np.array_equal(d.u, np.array(hand_u, np.float32))
    cum = np.cumsum(probs[0], axis=-1, dtype=np.float32)
    assert sampled[0].tolist() == [int(np.argmax(cum[i] >= hand_u[i])) for i in range(C)]
    # every block reseeds: the next canvas starts the stream over
    assert np.array_equal(d.canvas_ids(1, C, V), first)
    with pytest.raises(InputError, match="categorical first"):
        d.renoise_ids(1, C, V)
    with pytest.raises(InputError, match="batch size must be 1"):
        d.canvas_ids(2, C, V)
    with pytest.raises(InputError, match="before the block"):
        LlamaCppDraws(3).categorical(probs)


def test_first_reaching_edges():
    probs = np.array([[0.0, 0.5, 0.5], [0.25, 0.25, 0.5], [0.1, 0.1, 0.1]], dtype=np.float32)
    # cum >= u: a boundary value picks the id that reaches it; nothing reached -> the last id (V - 1)
    u = np.array([0.5, 0.25, 0.9], dtype=np.float32)
    assert first_reaching(probs, u).tolist() == [1, 0, 2]
    # a zero-probability id is skipped unless u is exactly 0 (llama.cpp's cum >= target with target 0)
    assert first_reaching(probs[:1], np.array([1e-7], np.float32)).tolist() == [1]
    assert first_reaching(probs[:1], np.array([0.0], np.float32)).tolist() == [0]
