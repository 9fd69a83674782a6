"""Prepare the data, train a tiny DiffusionGemma and evaluate it beside the shipped model: one command.

    python examples/pipeline.py --minutes 6 --out DIR                   # on a GPU (see train_gpu.sh)
    python examples/pipeline.py --minutes 1 --out DIR --verses examples/kjv_sample.tsv --preset test \
        --device cpu --baseline-json examples/eval_tiny-kjv.json          # on a CPU, the shipped sample

Stages (each a subprocess with a hard time limit, so a hung stage cannot eat the budget):

1. **data**: ``prepare_data.py`` into ``--data-dir`` unless it already holds the prepared files (on a
   machine without network, prepare them beforehand and carry the folder along). ``--verses FILE`` reads
   the verses from a ``<reference>\\t<text>`` file instead of the Debian package.
2. **train**: ``train_tiny.py`` with what is left of ``--minutes`` after the data stage and the
   evaluation's share (``--eval-minutes``), writing the checkpoint and its resumable state under
   ``--work`` and the training log to ``OUT/train_log.txt``. ``--resume`` continues the state left there.
3. **evaluate**: ``evaluate_tiny.py --baseline BASELINE --candidate NEW`` (or ``--baseline-json`` with the
   old model's stored measures) on what is left, writing ``OUT/evaluation.md`` (the table and samples for
   examples/README.md) and ``OUT/evaluation.json``. Past its budget it starts no further sample and
   reports on those it has.
4. **pack**: the new checkpoint folder as ``OUT/model.tar``, cut into parts of at most ``--part-mib``
   MiB (``model.tar.part00``, ...) when larger, so that it comes back from a machine that returns few,
   small files. Unpack with ``cat OUT/model.tar* | tar -x -C DEST``.

``OUT`` ends with at most seven files: the model's tar part(s) (two for up to 30 MiB), ``train_log.txt``,
``evaluation.md``, ``evaluation.json``, ``pipeline.log`` (every stage's output) and ``summary.json`` (each
stage's status and seconds, the budget, the steps trained). The whole run stays inside ``--minutes``:
the training stage stops early enough for its final evaluation and save (train_tiny.py's budget), the
evaluation gets the rest, and packing takes seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PREPARED = ("tokenizer.json", "tokenizer_config.json", "kjv_verses.tsv", "kjv_train.txt", "kjv_test.txt",
            "kjv_chapters_train.txt", "kjv_chapters_test.txt")

# the training run a GPU gets by default (train_tiny.py flags); --train-args adds to / overrides these
GPU_TRAIN = ["--batch-size", "256", "--lr", "2e-3", "--warmup-steps", "100", "--min-lr-frac", "0.1",
             "--log-every", "50", "--eval-every-minutes", "1", "--eval-batches", "8",
             "--save-every-minutes", "2", "--storage", "bf16"]
CPU_TRAIN = ["--batch-size", "16", "--lr", "2e-3", "--warmup-steps", "50", "--log-every", "25",
             "--storage", "bf16"]


def prepared(data_dir: Path) -> bool:
    return all((data_dir / f).is_file() for f in PREPARED)


class Runner:
    """Runs the stages as subprocesses, appends their output to ``pipeline.log`` and records each stage's
    status and duration for ``summary.json``."""

    def __init__(self, out: Path, t0: float, minutes: float):
        self.out, self.t0, self.deadline = out, t0, t0 + minutes * 60
        self.log = open(out / "pipeline.log", "a", encoding="utf-8")
        self.stages = []

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        self.log.write(msg + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list, limit_s: float) -> int:
        """Run ``cmd`` (a list) with at most ``limit_s`` seconds; its output goes to stdout and the log."""
        self.say(f"## {name} ({limit_s:.0f} s at most): {' '.join(shlex.quote(str(c)) for c in cmd)}")
        ts = time.time()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=ROOT)
        try:
            import threading

            def pump():
                for line in proc.stdout:
                    if "Writing model shards" in line or "Loading weights" in line:
                        continue  # transformers' progress bars
                    sys.stdout.write(line)
                    self.log.write(line)
                self.log.flush()

            th = threading.Thread(target=pump, daemon=True)
            th.start()
            rc = proc.wait(timeout=max(limit_s, 1))
            th.join(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = 124
        dt = time.time() - ts
        self.stages.append(dict(stage=name, rc=rc, seconds=round(dt, 1)))
        self.say(f"## {name}: exit {rc} in {dt:.1f} s ({self.left():.0f} s of the budget left)")
        return rc


def pack(model_dir: Path, out: Path, part_mib: float) -> list:
    """``model_dir`` as an uncompressed tar in ``out``: ``model.tar``, or ``model.tar.partNN`` pieces of at
    most ``part_mib`` MiB when larger. Returns the files written."""
    tar = out / "model.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(model_dir, arcname=model_dir.name)
    size, limit = tar.stat().st_size, int(part_mib * 2**20)
    if size <= limit:
        return [tar]
    parts = []
    with open(tar, "rb") as f:
        while chunk := f.read(limit):
            part = out / f"model.tar.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    tar.unlink()
    return parts


def main(argv=None) -> dict:
    t0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget of the whole command")
    ap.add_argument("--out", required=True, help="folder for the few outputs (e.g. $OUT)")
    ap.add_argument("--work", default="", help="checkpoint and training state (default: OUT/../dg_work)")
    ap.add_argument("--data-dir", default="", help="prepared data (default: examples/data; with --verses "
                                                     "WORK/data, so a sample never replaces the whole Bible)")
    ap.add_argument("--verses", default="", help="prepare from this <reference>\\t<text> file, not Debian")
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="tokenizer ids (default: 4096 for the whole Bible, 512 with --verses: a sample cannot "
                         "fill 4096)")
    ap.add_argument("--preset", default="cpu-max", help="model size (train_tiny.PRESETS)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--baseline", default=str(ROOT / "diffusiongemma" / "assets" / "tiny-kjv"),
                    help="the old model for the comparison ('' : evaluate the new one alone)")
    ap.add_argument("--baseline-json", default="",
                    help="the old model's measures from an earlier evaluate_tiny.py --json (instead of "
                         "evaluating --baseline again: saves the GPU's time)")
    ap.add_argument("--eval-minutes", type=float, default=-1.0,
                    help="kept back for the evaluation (default: 2, or 40%% of --minutes when that is less)")
    ap.add_argument("--train-args", default="", help="more train_tiny.py flags (one string)")
    ap.add_argument("--eval-args", default="", help="more evaluate_tiny.py flags (one string)")
    ap.add_argument("--resume", action="store_true", help="continue the training state left in --work")
    ap.add_argument("--part-mib", type=float, default=15.0, help="largest piece of model.tar")
    args = ap.parse_args(argv)
    if args.eval_minutes == -1.0:
        args.eval_minutes = min(2.0, 0.4 * args.minutes) if math.isfinite(args.minutes) else 2.0
    if not args.vocab_size:
        args.vocab_size = 512 if args.verses else 4096
    check_args(args)

    # absolute paths: the stages run in the repository root, not in the caller's folder
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else out.parent / "dg_work"
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir).resolve() if args.data_dir else (work / "data" if args.verses else HERE / "data")
    for name in ("verses", "baseline", "baseline_json"):
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    model_dir = work / "tiny-kjv-new"
    R = Runner(out, t0, args.minutes)
    py = sys.executable
    summary = dict(minutes=args.minutes, preset=args.preset, device=args.device, out=str(out), work=str(work),
                   data_dir=str(data), stages=R.stages)

    # 1. data
    if not prepared(data) or args.verses:
        cmd = [py, HERE / "prepare_data.py", "--data-dir", data, "--vocab-size", args.vocab_size]
        if args.verses:
            cmd += ["--verses", args.verses]
        if R.run("data", cmd, max(R.left() - 60, 10)) != 0:
            return finish(R, summary, "data preparation failed")
    else:
        R.say(f"## data: {data} is prepared already")

    # 2. train: what is left after the evaluation's share, less a margin for starting the interpreter
    import torch  # only to see the device; the stages import their own

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    train_min = (R.left() - args.eval_minutes * 60 - 10) / 60
    if train_min <= 0.1:
        return finish(R, summary, f"--minutes {args.minutes} leaves no time to train after the data stage "
                                  f"and --eval-minutes {args.eval_minutes}")
    cmd = [py, HERE / "train_tiny.py", *(GPU_TRAIN if device == "cuda" else CPU_TRAIN),
           "--data-dir", data, "--out", model_dir, "--log", out / "train_log.txt", "--preset", args.preset,
           "--device", device, "--minutes", f"{train_min:.3f}", *shlex.split(args.train_args)]
    if args.resume:
        cmd += ["--resume", model_dir]
    rc = R.run("train", cmd, train_min * 60 + 20)
    summary["train_minutes"] = round(train_min, 3)
    if rc != 0 or not (model_dir / "config.json").is_file():
        return finish(R, summary, "training failed")
    meta = json.loads((model_dir / "train_meta.json").read_text())
    summary.update(steps=meta["step"], heldout=meta.get("heldout_losses"), text_params=meta.get("text_params"))

    # 3. evaluate, on what is left (less a few seconds for packing)
    cmd = [py, HERE / "evaluate_tiny.py", "--candidate", model_dir, "--data-dir", data, "--device", device,
           "--markdown", out / "evaluation.md", "--json", out / "evaluation.json", *shlex.split(args.eval_args)]
    if args.baseline_json:
        cmd += ["--baseline-json", args.baseline_json]
    elif args.baseline:
        cmd += ["--baseline", args.baseline]
    if R.left() < 20:
        R.say("## evaluate: skipped, no time left")
        R.stages.append(dict(stage="evaluate", rc=None, seconds=0))
    else:  # its own budget stops sampling in time; the hard limit is a last resort
        R.run("evaluate", cmd + ["--minutes", f"{(R.left() - 30) / 60:.3f}"], R.left() - 8)

    # 4. pack the new model into a few files
    ts = time.time()
    files = pack(model_dir, out, args.part_mib)
    R.stages.append(dict(stage="pack", rc=0, seconds=round(time.time() - ts, 1)))
    summary["model_files"] = [f.name for f in files]
    R.say(f"## pack: {', '.join(f.name for f in files)} (unpack: cat {out}/model.tar* | tar -x -C DEST)")
    failed = [s["stage"] for s in R.stages if s["rc"] not in (0, None)]
    return finish(R, summary, "ok" if not failed else "failed: " + ", ".join(failed))


def check_args(args) -> None:
    """``ValueError`` naming the option for a budget that is not a finite positive number, an evaluation
    share outside [0, --minutes), a tokenizer size or tar part size out of range, a --verses file that is
    not there."""
    if not (math.isfinite(args.minutes) and 0 < args.minutes <= 60 * 24 * 365):
        raise ValueError(f"--minutes must be a finite number > 0, got {args.minutes}")
    if not (math.isfinite(args.eval_minutes) and 0 <= args.eval_minutes < args.minutes):
        raise ValueError(f"--eval-minutes must be a number in [0, --minutes={args.minutes:g}), got {args.eval_minutes}")
    if not 16 <= args.vocab_size <= 1_000_000:
        raise ValueError(f"--vocab-size must be an integer in [16, 1000000], got {args.vocab_size}")
    if not (math.isfinite(args.part_mib) and args.part_mib >= 1):
        raise ValueError(f"--part-mib must be a number >= 1, got {args.part_mib}")
    if args.verses and not Path(args.verses).is_file():
        raise ValueError(f"--verses {args.verses}: no such file")
    if args.baseline_json and not Path(args.baseline_json).is_file():
        raise ValueError(f"--baseline-json {args.baseline_json}: no such file")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    for name in ("train_args", "eval_args"):
        try:
            shlex.split(getattr(args, name))
        except ValueError as exc:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)!r}: {exc}") from None


def finish(R: Runner, summary: dict, status: str) -> dict:
    summary.update(status=status, seconds=round(time.time() - R.t0, 1))
    (R.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    R.say(f"## {status}: {summary['seconds']} s of {summary['minutes'] * 60:.0f}")
    R.log.close()
    return summary


if __name__ == "__main__":
    try:
        s = main()
    except ValueError as exc:
        print(f"pipeline.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if s["status"] == "ok" else 1)
