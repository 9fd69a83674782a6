"""How long the command takes to start: wall time of ``diffusiongemma --version``, ``--help``, ``generate
--help``, ``import diffusiongemma`` and a short ``generate`` run, each a fresh process, and what the run's
imports cost (``python -X importtime``: the modules a float32 ``generate`` imports, and the largest).

    python benchmarks/bench_startup.py                 # 7 runs of each, median and fastest
    python benchmarks/bench_startup.py --repeats 3

Prints the machine (CPU model, cores this process may use, load average) and the commit first: start-up times
on a shared machine move with its load, so compare numbers taken in one run. Results: RESULTS_startup.md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_facts  # noqa: E402

PROMPT = ["generate", "And God said", "--seed", "1", "-n", "32", "--steps", "4", "--no-progress"]
COMMANDS = [
    ("diffusiongemma --version", [sys.executable, "-m", "diffusiongemma", "--version"]),
    ("diffusiongemma --help", [sys.executable, "-m", "diffusiongemma", "--help"]),
    ("diffusiongemma generate --help", [sys.executable, "-m", "diffusiongemma", "generate", "--help"]),
    ("python -c 'import diffusiongemma'", [sys.executable, "-c", "import diffusiongemma"]),
    ("python -c pass (the interpreter alone)", [sys.executable, "-c", "pass"]),
    ("diffusiongemma generate (1 canvas, 4 steps)", [sys.executable, "-m", "diffusiongemma", *PROMPT]),
]
WATCHED = ("numpy", "ml_dtypes", "torch", "matplotlib", "transformers", "tokenizers", "safetensors",
           "diffusiongemma.reference", "diffusiongemma.fast", "diffusiongemma.weights_converter", "tqdm")


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return elapsed


def import_costs(argv: list[str]) -> tuple[float, dict[str, float]]:
    """Total import time (s) of ``argv`` under ``-X importtime`` and the cumulative time of each watched
    top-level package it imported (absent: not imported)."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    total, watched = 0.0, {}
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if not m:
            continue
        self_us, cumulative_us, indent, name = int(m[1]), int(m[2]), m[3], m[4]
        total += self_us / 1e6
        if name in WATCHED:
            watched[name] = max(watched.get(name, 0.0), cumulative_us / 1e6)
    return total, watched


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="runs of each command (default 7)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(machine_facts())
    print(f"cores this process may use: {len(os.sched_getaffinity(0))}; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}; python {sys.executable}")
    print(f"\nwall time of a fresh process, {args.repeats} runs each (after one warm-up run)")
    print(f"  {'command':46s} {'median':>8s} {'fastest':>8s}")
    for label, command in COMMANDS:
        wall(command)  # warm the file cache
        times = [wall(command) for _ in range(args.repeats)]
        print(f"  {label:46s} {statistics.median(times):7.3f}s {min(times):7.3f}s")
    print("\nimports (python -X importtime; cumulative seconds of each package, '-' = not imported)")
    for label, command in COMMANDS[:3] + COMMANDS[5:]:
        total, watched = import_costs(command)
        parts = ", ".join(f"{name} {watched[name]:.2f}" for name in WATCHED if name in watched) or "-"
        print(f"  {label:46s} all imports {total:.2f}s: {parts}")
    print(f"\nload average after the runs: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
