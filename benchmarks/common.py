"""Shared benchmark helpers: the benchmark configs, machine/commit facts, timing."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time

from diffusiongemma.tiny import FULL, SLIDING, TinySpec  # noqa: E402

SMALL = TinySpec(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 layer_types=[SLIDING, FULL, SLIDING, FULL], num_attention_heads=4, num_key_value_heads=2,
                 num_global_key_value_heads=1, head_dim=64, global_head_dim=128, num_experts=8,
                 top_k_experts=2, sliding_window=64, canvas_length=64)
SMALL_PROMPT = 128

MEDIUM = TinySpec(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                  layer_types=[SLIDING, FULL, SLIDING, FULL], num_attention_heads=8, num_key_value_heads=4,
                  num_global_key_value_heads=2, head_dim=128, global_head_dim=256, num_experts=16,
                  top_k_experts=2, sliding_window=128, canvas_length=128)
MEDIUM_PROMPT = 256


def machine_facts() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit, dirty = "unknown", ""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"machine: {cpu}, {os.cpu_count()} cores visible; python {platform.python_version()}; "
            f"commit {commit}{' (dirty)' if dirty else ''}; load avg {os.getloadavg()[0]:.2f}")


def best_of(fn, repeats: int = 5, warmup: int = 1, sync=None) -> float:
    """Median wall time (seconds) of ``fn()`` over ``repeats`` runs after ``warmup`` runs. ``sync``: called
    after the warm-up and after each timed run (a GPU's synchronisation), so that each time covers the work
    ``fn`` queued, not only its launch."""
    wait = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    wait()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_ms(device, fn, repeats: int) -> float:
    """Median milliseconds of ``fn()`` on a ``fast.gpu`` device over ``repeats`` calls after one warm-up call:
    CUDA events around each call on a GPU (CuPy), wall time on cuda-sim (NumPy's ``xp``)."""
    import numpy as np

    fn()
    device.synchronize()
    times = []
    for _ in range(repeats):
        if hasattr(device, "xp") and device.xp is not np:
            start, end = device.xp.cuda.Event(), device.xp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(device.xp.cuda.get_elapsed_time(start, end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def kernel_bench_args(argv, doc: str, repeats: int, items: str):
    """The options of a kernel benchmark (``--sim``, ``--repeats``, ``--budget``, ``--out``) parsed from ``argv``;
    ``doc``: the script's docstring (its first line describes it), ``items``: what its table rows are ("shapes")."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--sim", action="store_true", help=f"run small {items} on cuda-sim (no GPU needed)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--budget", type=float, default=120.0, help=f"seconds; later {items} are skipped after it")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    return parser.parse_args(argv)


def kernel_bench_device(sim: bool):
    """(device, torch) of a kernel benchmark: cuda-sim and no torch for ``sim``; otherwise the GPU and torch where
    it sees the GPU (else None). None, after printing "no GPU: <reason>", when there is no GPU to run on."""
    from diffusiongemma.fast.gpu.device import gpu_available, make_device

    if not sim:
        ok, reason = gpu_available()
        if not ok:
            print(f"no GPU: {reason}")
            return None
    device = make_device("cuda-sim" if sim else "cuda")
    torch = None
    if not sim:
        try:
            import torch as _torch
            torch = _torch if _torch.cuda.is_available() else None
        except ImportError:
            pass
    return device, torch


def print_table(lines: list[str], out: str | None) -> None:
    """Print a benchmark's Markdown table and, with ``out``, also write it to that file."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
