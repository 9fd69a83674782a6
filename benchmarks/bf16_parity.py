"""How closely the reference's bfloat16 run (docs/SPEC.md §10.1) reproduces transformers 5.24.0 loaded with
``dtype=torch.bfloat16`` (eager attention, CPU): the numbers behind benchmarks/RESULTS_bf16.md.

    python benchmarks/bf16_parity.py [--seeds 6] [--free-seeds 10] [--verdict-seeds 3] [--only-verdicts]

1. Teacher-forced calls (``diffusiongemma.crosscheck.bf16_teacher``'s five tiny configs and calls, as
   tests/test_bf16_reference.py checks them): per call the ratio
   max|ours - transformers bf16| / max|transformers bf16 - transformers fp32|, with our router on torch's
   CPU tie order, and the same ratio for transformers' own bfloat16 run with oneDNN off (torch's own CPU
   matrix product: the same sums in another order) in place of ours; each call above 1/8 that is not
   within 1/8 of that other run is run again with transformers' expert choices replayed.
2. Free runs with transformers' draws replayed (``crosscheck``'s recorder) on the bfloat16 cross-check
   model and on a contractive one (self-conditioning output x 1e-3): the share of seeds whose tokens agree,
   for our bfloat16 and float32 runs and for transformers' run with oneDNN off, and for each departure the first decoder call whose inputs were the
   same on both sides but whose logits differ (where the rounding flipped) and its size.
3. ``crosscheck transformers --dtype bfloat16`` (``--only-verdicts``): its verdict on correct runs (the shipped
   model and ``tests/test_crosscheck_bf16.py``'s randomised configs, ``--verdict-seeds`` seeds each: false
   alarms) and on each single-rounding mutation of transformers' bfloat16 run (misses, and stages misnamed).
Prints a report; nothing is written. A few minutes on two cores (section 3: about 15 s per cross-check).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_facts  # noqa: E402
from diffusiongemma.crosscheck.bf16_teacher import (CONFIGS, other_kernel, other_ratio, ratio,  # noqa: E402
                                                  ratio_to_other, teacher_forced_ratios)


def teacher_forced(seeds: int, tmp: str) -> None:
    print("1. teacher-forced calls: max|ours - hf bf16| / max|hf bf16 - hf fp32| per call; the same ratio for")
    print("   transformers' bf16 run with oneDNN off (hf', torch's own CPU matrix product) in place of ours")
    everything, upstream, neither = [], [], 0
    for name, spec in CONFIGS.items():
        rows = [(seed,) + r for seed in range(seeds) for r in teacher_forced_ratios(spec, seed, os.path.join(tmp, f"{name}{seed}"))]
        ratios = np.array([ratio(r[1:]) for r in rows])
        others = np.array([other_ratio(r[1:]) for r in rows])
        everything += list(ratios)
        upstream += list(others)
        line = (f"  {name:32s} calls {len(ratios):3d}  ours: median {np.median(ratios):.1e} <=1/8 {np.mean(ratios <= 1 / 8):5.1%}"
                f" max {ratios.max():.3f} | hf': <=1/8 {np.mean(others <= 1 / 8):5.1%} max {others.max():.3f}")
        above = [(r[0], r[1]) for r, q in zip(rows, ratios) if q > 1 / 8 and ratio_to_other(r[1:]) > 1 / 8]
        near_other = [f"s{r[0]} {r[1]} (ours to hf' {ratio_to_other(r[1:]):.3f})" for r, q in zip(rows, ratios)
                      if q > 1 / 8 and ratio_to_other(r[1:]) <= 1 / 8]
        if near_other:
            line += "; above 1/8 but hf's other run: " + ", ".join(near_other)
        neither += len(above)
        for seed in sorted({s for s, _ in above}):
            again = teacher_forced_ratios(spec, seed, os.path.join(tmp, f"{name}r{seed}"), replay=True)
            calls = [c for s, c in above if s == seed]
            line += "; seed %d %s -> %s with transformers' expert choices" % (
                seed, "/".join(calls), "/".join(f"{ratio(r):.3f}" for r in again if r[0] in calls))
        print(line)
    everything, upstream = np.array(everything), np.array(upstream)
    print(f"  all: {everything.size} calls, bit-identical or float32-tanh-close (ratio < 1e-5) {np.mean(everything < 1e-5):.1%}, "
          f"<= 1/8 {np.mean(everything <= 1 / 8):.1%}, max {everything.max():.3f}; above 1/8 and not within 1/8 of hf' {neither}")
    print(f"  transformers against itself (hf' in place of ours): < 1e-5 {np.mean(upstream < 1e-5):.1%}, "
          f"<= 1/8 {np.mean(upstream <= 1 / 8):.1%}, max {upstream.max():.3f}")


def free_runs(seeds: int, tmp: str) -> None:
    import torch

    from diffusiongemma.crosscheck import _run_ours, _settings, transformers_peer, variants
    from diffusiongemma.crosscheck.common import forward_inputs
    from diffusiongemma.crosscheck.tiny import BF16_SPEC, GENERATION_CONFIG
    from diffusiongemma.reference import Model
    from diffusiongemma.reference.primitives import round_to
    from diffusiongemma.reference.variants.router import torch_cpu_top_k
    from diffusiongemma.tiny import tiny_model, write_checkpoint

    print("2. free runs, transformers bf16 generate with its draws replayed into our loop")
    for label, gain in (("cross-check bf16 model", 1.0), ("contractive (self-conditioning x 1e-3)", 1e-3)):
        model = tiny_model(BF16_SPEC, 0, self_conditioning_gain=gain)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.copy_(p.to(torch.bfloat16).float())
        path = write_checkpoint(os.path.join(tmp, f"free{gain}"), BF16_SPEC, 0, model=model,
                                generation_config=GENERATION_CONFIG)
        peer = transformers_peer.Peer(path, tmp, dtype="bfloat16")
        ours = {dtype: Model.from_pretrained(path, dtype=dtype) for dtype in ("bfloat16", "float32")}
        for m in ours.values():
            m.router_top_k = torch_cpu_top_k
        settings = _settings(path, ours["bfloat16"], 2)
        agree, where = {"bfloat16": 0, "float32": 0, "other": 0}, []
        for seed in range(seeds):
            x = forward_inputs(ours["bfloat16"].config, seed, settings.t_max)
            run = peer.generate(x.prompt, settings, seed, {})
            other = other_kernel(peer.generate, x.prompt, settings, seed, {})
            agree["other"] += other.tokens == run.tokens
            for dtype, m in ours.items():
                calls: list = []
                try:
                    tokens, calls = _run_ours(m, x.prompt, settings, variants.semantics("transformers"), run.tape, calls)
                except Exception:  # our run asked for a draw the peer never made: it parted
                    tokens = None
                agree[dtype] += tokens == run.tokens
                if dtype == "bfloat16" and tokens != run.tokens:
                    for a, b in zip(run.calls, calls):
                        same = np.array_equal(a.ids, b.ids) and (a.sc is None) == (b.sc is None) and (
                            a.sc is None or np.array_equal(a.sc, round_to(b.sc, m.dtype)))
                        d = float(np.abs(a.logits - b.logits).max())
                        if same and d > 1e-5:
                            where.append(f"s{seed}: canvas {a.canvas} step {a.step} max|d| {d:.2g}")
                            break
                        if not same:
                            where.append(f"s{seed}: inputs parted at canvas {a.canvas} step {a.step}")
                            break
        print(f"  {label}: tokens agree on {agree['bfloat16']}/{seeds} seeds (bf16 reference), "
              f"{agree['float32']}/{seeds} (float32 reference); transformers bf16 with oneDNN off against "
              f"itself with oneDNN: {agree['other']}/{seeds}")
        print("    first flipped call (same inputs, logits differ) per departure: " + "; ".join(where))


def verdicts(seeds: int, tmp: str, shipped: bool = True) -> None:
    """``crosscheck transformers --dtype bfloat16``: false alarms on correct runs, misses on mutations."""
    import time

    import pytest

    from diffusiongemma.crosscheck import crosscheck
    from diffusiongemma.crosscheck.tiny import write_tiny_checkpoint
    from diffusiongemma.crosscheck.bf16_mutations import MUTATION_SPEC, MUTATIONS, RANDOM_CONFIGS, SHIPPED, apply_mutation

    print("3. the bfloat16 cross-check verdict (stage-forced, against the null of another summation order)")
    correct = [(name, write_tiny_checkpoint(os.path.join(tmp, f"v{name}{s}"), spec, seed + 10 * s), seed + 10 * s)
               for name, (spec, seed) in RANDOM_CONFIGS.items() for s in range(seeds)]
    if shipped:
        correct[:0] = [("shipped tiny-kjv", SHIPPED, s) for s in range(seeds)]
    alarms = 0
    for name, path, seed in correct:
        t = time.time()
        report = crosscheck("transformers", path, seed=seed, dtype="bfloat16")
        alarms += report.exit_code != 0
        ties = sum(g.teacher_forced.get("router_ties_replayed", 0) + g.teacher_forced.get(
            "router_near_ties_replayed", 0) for g in report.generation)
        stages = [g.divergence.stage for g in report.generation if g.divergence is not None]
        print(f"  correct  {name:40s} seed {seed:2d}: {'AGREE' if report.exit_code == 0 else 'DIFFER ' + str(stages)}"
              f" (router ties replayed {ties}; {time.time() - t:.0f} s)")
    print(f"  false alarms: {alarms} of {len(correct)} correct runs")
    misses = wrong = runs = 0
    for mutation, (_, stage, says) in MUTATIONS.items():
        for s in range(seeds):
            path = write_tiny_checkpoint(os.path.join(tmp, f"m{s}"), MUTATION_SPEC, 7 + s)
            with pytest.MonkeyPatch.context() as patch:
                apply_mutation(mutation, patch)
                report = crosscheck("transformers", path, seed=s, dtype="bfloat16")
            runs += 1
            found = [g.divergence for g in report.generation if g.divergence is not None]
            missed = report.exit_code == 0
            misnamed = not missed and not all(d.stage == stage and says in d.cause for d in found)
            misses += missed
            wrong += misnamed
            print(f"  mutation {mutation:42s} seed {7 + s}: "
                  + ("AGREE (missed)" if missed else f"DIFFER at {found[0].stage if found else 'forward'}"
                     + (" (stage misnamed)" if misnamed else "")))
    print(f"  misses: {misses} of {runs} mutated runs; stage misnamed: {wrong}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--free-seeds", type=int, default=10)
    parser.add_argument("--verdict-seeds", type=int, default=3,
                        help="seeds per config of the bfloat16 cross-check verdict (section 3)")
    parser.add_argument("--only-verdicts", action="store_true", help="run section 3 only")
    args = parser.parse_args()
    print(machine_facts())
    import torch
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    with tempfile.TemporaryDirectory(prefix="bf16-parity-") as tmp, torch.no_grad():
        if not args.only_verdicts:
            teacher_forced(args.seeds, tmp)
            free_runs(args.free_seeds, tmp)
        verdicts(args.verdict_seeds, tmp)


if __name__ == "__main__":
    main()
