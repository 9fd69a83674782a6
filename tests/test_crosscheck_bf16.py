"""``diffusiongemma crosscheck transformers --dtype bfloat16``: the verdict from the measured null distribution
(``crosscheck.bf16_stages``, docs/SPEC.md §10.3).

Held to it both ways:

* AGREE on correct bfloat16 runs: transformers itself on the shipped model, its bfloat16 copy and tiny configs
  with every norm, scale and layer scalar redrawn, exact router ties included;
* DIFFER, naming the stage, for each single-rounding departure from SPEC §10.1 made in transformers' bfloat16
  run (``MUTATIONS``, patched into transformers' module for the duration of a test). Each mutation first proves
  itself: it moves the logits of a decoder call on the checkpoint its test uses.

The null itself is checked too: the reference in another summation order really sums in another order (it
parts from the reference on some values), and a correct run stays within it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import torch

from diffusiongemma.crosscheck import crosscheck
from diffusiongemma.crosscheck import bf16_null, bf16_stages
from diffusiongemma.crosscheck.tiny import BF16_SPEC, write_tiny_checkpoint

from diffusiongemma.crosscheck.bf16_mutations import (MUTATION_SPEC, MUTATIONS, RANDOM_CONFIGS, SHIPPED,
                                                       apply_mutation)


@pytest.fixture(autouse=True)
def _no_grad_one_thread():
    """No autograd, and one thread for torch and BLAS: the tiny models' products are far too small to share,
    and on a loaded machine spinning thread pools make a cross-check ten times slower (conftest puts the
    thread counts back after each test)."""
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    with torch.no_grad(), threadpool_limits(1):
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {"shipped": SHIPPED, "mutations": write_tiny_checkpoint(root / "h48", MUTATION_SPEC, 7)}


def decoder_logits(path: str) -> np.ndarray:
    """Transformers' bfloat16 logits of a self-conditioned decoder call after a prompt (the mutation's proof)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_denoise, hf_encode

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.bfloat16,
                                                            attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    V, C = model.config.text_config.vocab_size, model.config.canvas_length
    cache = hf_cache(model)
    hf_encode(model, cache, rng.integers(3, V - 3, (1, 20)))
    canvas = rng.integers(3, V - 3, (1, C))
    first = hf_denoise(model, cache, canvas)
    return hf_denoise(model, cache, canvas, first / np.float32(0.8))


# ================================================================================ the null
def test_another_summation_order_parts_only_by_rounding_flips(checkpoints):
    from diffusiongemma.reference import Model

    model = Model.from_pretrained(checkpoints["shipped"], dtype="bfloat16")
    ids = np.random.default_rng(1).integers(3, 4000, (1, 40))
    mine = model.encode(ids, model.new_cache(1))
    for kind in bf16_null.KINDS:
        with bf16_null.summation_order(kind):
            other = model.encode(ids, model.new_cache(1))
        size, share = bf16_null.deviation(mine, other)
        assert 0 < share < 0.5 and size < 8, (kind, size, share)  # another order: some flips, no systematic change
    with pytest.raises(ValueError, match="unknown summation order"):
        with bf16_null.summation_order("sideways"):
            pass
    again = model.encode(ids, model.new_cache(1))  # the reference's own functions are back
    assert np.array_equal(again, mine)


def test_the_rule_counts_calls_not_one_ratio():
    stats = bf16_stages.StageStats(peer=[(30.0, 0.01)] + [(0.5, 0.0)] * 9, null=[[(0.4, 0.0), (0.0, 0.0)]] * 10,
                                   where=[(0, i) for i in range(10)])
    assert bf16_stages.beyond(stats)[0] and bf16_stages.judge(stats) is None  # one amplified flip: agree
    stats.peer = [(0.6, 0.05)] * 10  # every call: 5 % of the values moved by less than an ulp
    verdict = bf16_stages.judge(stats)
    assert verdict is not None and verdict["beyond"] == 10 and verdict["first"] == (0, 0)
    one = bf16_stages.StageStats(peer=[(1.1, 0.035)], null=[[(0.0, 0.0), (0.0, 0.0)]], where=[(0, 0)])
    assert bf16_stages.beyond(one) == [True] and bf16_stages.judge(one) is None  # one call never decides


def test_router_ties_take_the_peers_choice_only_across_a_tie():
    probs = np.array([[0.4, 0.2, 0.2, 0.2],  # an exact three-way tie at the 2nd place
                      [0.4, 0.3, 0.3 * (1 + 2 ** -7), 0.0],  # a near tie (one bfloat16 ulp of a router logit)
                      [0.5, 0.3, 0.2, 0.0],  # no tie: the peer's other choice is a real difference
                      [0.5, 0.3, 0.2, 0.0]], dtype=np.float32)
    peer = np.array([[0, 3], [0, 1], [0, 2], [0, 1]])
    replay = bf16_stages.ReplayTies(peer)
    chosen = replay(probs, 2)
    assert chosen[0].tolist() == [0, 3] and chosen[1].tolist() == [0, 1]  # replayed
    assert set(chosen[2].tolist()) == {0, 1} and set(chosen[3].tolist()) == {0, 1}  # ours kept
    assert replay.exact == {0} and replay.near == {1}
    assert bf16_stages.ReplayTies(None)(probs, 2).shape == (4, 2)  # no peer choice recorded: ours


# ================================================================================ correct runs agree
def assert_agrees(report) -> None:
    text = report.to_text()
    assert report.exit_code == 0, text
    header = text.splitlines()[1]
    assert text.startswith("crosscheck transformers") and header.startswith("verdict rule:")
    assert "beyond" in header and "no false alarm on" in header  # the rule and its measured false alarms
    for g in report.generation:
        tf = g.teacher_forced
        assert tf["calls"] > 0 and tf["encodes"] > 0 and "decoder layer 0" in tf["stages"], tf
        assert g.sampler["steps"] == tf["calls"]


@pytest.mark.slow
def test_transformers_agrees_on_the_shipped_model(checkpoints):
    assert_agrees(crosscheck("transformers", checkpoints["shipped"], dtype="bfloat16"))


@pytest.mark.slow
def test_transformers_agrees_on_the_shipped_models_bfloat16_copy(tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(SHIPPED, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    for name in os.listdir(SHIPPED):
        if name.startswith(("generation", "tokenizer")):
            (tmp_path / "bf16" / name).write_bytes(open(os.path.join(SHIPPED, name), "rb").read())
    assert_agrees(crosscheck("transformers", tmp_path / "bf16", dtype="bfloat16"))


@pytest.mark.parametrize("config", list(RANDOM_CONFIGS))
def test_transformers_agrees_on_randomised_tiny_configs(config, tmp_path):
    spec, seed = RANDOM_CONFIGS[config]
    report = crosscheck("transformers", write_tiny_checkpoint(tmp_path / "m", spec, seed), seed=seed,
                        dtype="bfloat16")
    assert_agrees(report)


# ================================================================================ departures differ
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_single_rounding_departure_differs_with_its_stage_named(mutation, checkpoints, monkeypatch):
    _, stage, says = MUTATIONS[mutation]
    path = checkpoints["mutations"]
    before = decoder_logits(path)
    apply_mutation(mutation, monkeypatch)
    after = decoder_logits(path)
    assert np.max(np.abs(after - before)) > 0, "the mutation does not move the logits on this checkpoint"
    report = crosscheck("transformers", path, dtype="bfloat16")  # two canvases: two encodes to judge
    text = report.to_text()
    assert report.exit_code == 1 and "result: DIFFER" in text, text
    found = [g.divergence for g in report.generation if g.divergence is not None]
    assert found and all(d.stage == stage for d in found), (mutation, [d.stage for d in found])
    assert all(says in d.cause for d in found), [d.cause for d in found]


# ================================================================================ usage
def test_the_bfloat16_tiny_model_makes_the_embedding_scale_visible():
    assert BF16_SPEC.hidden_size ** 0.5 != 6.9375 and MUTATION_SPEC.hidden_size ** 0.5 != 6.9375


def test_bfloat16_is_for_the_tapped_peers_only_and_other_dtypes_are_usage_errors(capsys):
    from diffusiongemma.cli.main import main
    from diffusiongemma.crosscheck import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="transformers and diffusers peers only"):
        crosscheck("mlx-vlm", dtype="bfloat16")
    assert main(["crosscheck", "mlx-vlm", "--dtype", "bfloat16"]) == 2
    assert "--dtype bfloat16 is defined for the transformers and diffusers peers only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["crosscheck", "transformers", "--dtype", "float16"])
    assert exit_info.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


# ================================================================================ other peers' bfloat16 runs
@pytest.mark.slow
def test_diffusers_bfloat16_run_departs_at_the_self_conditioning_cast(checkpoints):
    """diffusers' pipeline on transformers' bfloat16 model passes the scheduler's float32 logits as the
    self-conditioning input, where transformers' generate casts them to bfloat16 first (SPEC §10.1 B8): the
    decoder input departs on nearly every self-conditioned call, and the report says why."""
    report = crosscheck("diffusers", checkpoints["mutations"], dtype="bfloat16", canvases=1)
    assert report.exit_code == 1
    for g in report.generation:
        assert g.divergence is not None and g.divergence.stage == "bf16 decoder input", g.divergence
        assert any("no bfloat16 numbers" in n and "B8" in n for n in g.notes), g.notes


def test_a_bfloat16_generate_says_what_it_promises_on_its_timing_line(capsys):
    from diffusiongemma.cli.main import main

    assert main(["generate", "And God said", "--seed", "1", "--dtype", "bfloat16", "--backend", "reference",
                 "-n", "4"]) == 0
    timing = [line for line in capsys.readouterr().err.splitlines() if "tokens/s" in line]
    assert timing and "bfloat16 agrees call by call across backends, free runs part" in timing[0], timing
