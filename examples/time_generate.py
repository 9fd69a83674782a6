"""How long the README's first command takes at a given model size, before any training.

Builds a model of a ``train_tiny.PRESETS`` size (or a preset with fields overridden by ``--set``) with
transformers' own random initialisation, saves it with the shipped tokenizer and generation settings, and
times the command a new user runs first::

    diffusiongemma generate "And God said" -m DIR --backend B --seed S -n 256 --ignore-eos --json

for each backend (``cpu``, the compiled fast path that the default ``--backend auto`` picks on a CPU, and
``reference``, the NumPy specification). A random model is the
worst case: its predictions are nearly uniform, so no position is accepted early and every canvas runs
all its denoising steps (16 per 32-token canvas at the shipped settings); ``--ignore-eos`` makes every run
write all 256 tokens. Each backend runs ``--repeats`` times; the table reports the median and the fastest
of the command's own wall time (process start to exit: imports and model load included) and of the
generate time the command reports in ``--json``. It also prints the checkpoint's size in fp32 and bf16,
the CPU model, the thread count, the load average before and after, and the commit. On a shared machine
the wall times swing with the other processes' load; the command's CPU time (user + system, median) with
``--threads 1`` swings much less and is what the command takes on one idle core.

Usage::

    python examples/time_generate.py --preset cpu-max --preset shipped
    python examples/time_generate.py --preset cpu-max --set hidden_size=320 --set moe_intermediate_size=320
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_tiny as TT  # noqa: E402

SHIPPED = HERE.parent / "diffusiongemma" / "assets" / "tiny-kjv"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_set(items: list[str]) -> dict:
    """``["hidden_size=320", ...]`` -> {"hidden_size": 320, ...} (values read as JSON, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def write_random_model(spec: TT.ModelSpec, directory: Path, storage: str) -> int:
    """Save a randomly initialised model of ``spec`` with the shipped tokenizer; return the weights' bytes."""
    model = TT.build_model(spec, seed=0)
    tmp_tok = directory.parent / "tok"
    tmp_tok.mkdir(exist_ok=True)
    shutil.copy(SHIPPED / "tokenizer.json", tmp_tok / "tokenizer.json")
    shutil.copy(SHIPPED / "tokenizer_config.json", tmp_tok / "tokenizer_config.json")
    TT.save_checkpoint(model, str(directory), tmp_tok / "tokenizer.json", spec, {"random": True}, storage)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def time_command(model_dir: Path, backend: str, seed: int, threads: int) -> dict:
    """Run the README's command once; returns wall seconds and the command's own timings."""
    cmd = [sys.executable, "-m", "diffusiongemma", "generate", "And God said", "-m", str(model_dir),
           "--backend", backend, "--seed", str(seed), "-n", "256", "--ignore-eos", "--json"]
    if threads:
        cmd += ["--threads", str(threads)]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    d = json.loads(proc.stdout)
    return dict(wall_s=wall, cpu_s=cpu, generate_s=d["timings"]["generate_s"], load_s=d["timings"]["load_s"],
                tokens=sum(1 for t in d["token_ids"] if t != TT.PAD_ID), canvases=d["canvases"],
                steps=d["steps_per_canvas"], threads=d["threads"]["threads"])


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", action="append", default=[], help="a train_tiny preset (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE overriding the preset's spec")
    ap.add_argument("--backend", action="append", default=[], help="backends (default: reference and cpu)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="--threads of the command (0: its default)")
    args = ap.parse_args(argv)
    presets = args.preset or ["cpu-max"]
    backends = args.backend or ["reference", "cpu"]
    over = parse_set(args.set)
    print(f"# CPU {cpu_name()}, {os.cpu_count()} logical CPUs, load {os.getloadavg()}, commit {commit()}, "
          f"python {platform.python_version()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in presets:
            spec = TT.ModelSpec(**{**asdict(TT.preset_spec(name)), **over})
            model_dir = Path(tmp) / name / "model"
            model_dir.parent.mkdir(parents=True)
            fp32 = write_random_model(spec, model_dir, "fp32")
            bf16 = write_random_model(spec, model_dir, "bf16")  # the one timed: as it would ship
            n_text = TT.text_params(spec)
            label = name + ("+" + ",".join(f"{k}={v}" for k, v in over.items()) if over else "")
            print(f"## {label}: {n_text / 1e6:.2f} M text parameters; model.safetensors {fp32 / 2**20:.1f} MiB "
                  f"fp32, {bf16 / 2**20:.1f} MiB bf16")
            for backend in backends:
                time_command(model_dir, backend, 99, args.threads)  # warm the page cache and the imports
                runs = [time_command(model_dir, backend, s, args.threads) for s in range(args.repeats)]
                row = dict(preset=label, backend=backend, text_params=n_text, fp32_bytes=fp32, bf16_bytes=bf16,
                           wall_median=statistics.median(r["wall_s"] for r in runs),
                           wall_min=min(r["wall_s"] for r in runs),
                           generate_median=statistics.median(r["generate_s"] for r in runs),
                           generate_min=min(r["generate_s"] for r in runs),
                           cpu_median=statistics.median(r["cpu_s"] for r in runs), tokens=runs[0]["tokens"],
                           canvases=runs[0]["canvases"], steps=runs[0]["steps"], threads=runs[0]["threads"])
                rows.append(row)
                print(f"  {backend:9s} {row['tokens']} tokens, {row['canvases']} canvases, steps {row['steps']}, "
                      f"{row['threads']} threads: command {row['wall_median']:.2f} s median "
                      f"({row['wall_min']:.2f} fastest), generate {row['generate_median']:.2f} s "
                      f"({row['generate_min']:.2f}); CPU time of the command {row['cpu_median']:.2f} s median",
                      flush=True)
    print(f"# load after {os.getloadavg()}")
    return rows


if __name__ == "__main__":
    main()
