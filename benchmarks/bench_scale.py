"""Seconds per pass and memory at the released shape: each backend over the same checkpoint files.

    python benchmarks/bench_scale.py --model DIR [--gguf FILE.gguf] [--runs reference-bfloat16,cpu-bfloat16,...]
        [--cache cold|warm] [--prompt-tokens 16] [--decoder-passes 2] [--json OUT.json]

DIR is a checkpoint in transformers' layout (``diffusiongemma make-checkpoint DIR --layers 30`` writes the
released shape, 50.5 GB in bfloat16); FILE a Q8_0 GGUF of it (``--gguf q8_0`` of the same command). Each run
is one child process that opens the model, encodes a prompt (one encoder pass, the prefill) and makes
``--decoder-passes`` decoder passes over a 256-token canvas (the first without self-conditioning, the next
with the previous pass's logits), and reports:

* ``open s``: opening the model (``from_pretrained``: headers, mappings; transformers: its whole load);
* ``first pass s``: from the start of opening to the end of the first encoder pass (time to the first pass);
* ``encoder s`` / ``decoder s``: seconds of the prefill and of each decoder pass (the median of them);
* ``peak anon GB``: the largest memory the process held beyond mapped files (RssAnon, sampled every 20 ms), the
  number the memory budget is about; ``peak RSS GB``: the same with the mapped files' resident pages
  (VmHWM), which the kernel may drop and read again.

Runs: reference-float32, reference-bfloat16, cpu-float32, cpu-bfloat16, cpu-q8_0 (needs --gguf),
transformers-bfloat16 (``DiffusionGemmaForBlockDiffusion.from_pretrained(DIR, dtype=torch.bfloat16)``, eager
attention, its encoder and decoder called as ``diffusiongemma.crosscheck.transformers_peer`` does).
``--cache cold`` drops the page cache before each run (root only; otherwise it says so and runs warm). The
output starts with the CPU, the threads, the load average and the commit, then one row per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("reference-float32", "reference-bfloat16", "cpu-float32", "cpu-bfloat16", "cpu-q8_0", "transformers-bfloat16")


# ------------------------------------------------------------------------------------------ the child
class MemorySampler:
    """Peaks of RssAnon and VmRSS of this process, read from /proc/self/status every ``interval`` seconds."""

    def __init__(self, interval: float = 0.02):
        self.anon = self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            now = self.read()
            self.anon, self.rss = max(self.anon, now["RssAnon"]), max(self.rss, now["VmRSS"])
            time.sleep(interval)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        now = self.read()
        return {"peak_anon": max(self.anon, now["RssAnon"]), "peak_rss": max(self.rss, now["VmHWM"])}


def child(spec: dict) -> dict:
    import numpy as np

    backend, dtype = spec["run"].split("-", 1)
    sampler = MemorySampler()
    start = time.perf_counter()
    if backend == "transformers":
        import torch

        from diffusiongemma.crosscheck.transformers_peer import hf_cache, hf_denoise, hf_encode
        from transformers import DiffusionGemmaForBlockDiffusion

        torch.set_num_threads(spec["threads"])
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(spec["model"], dtype=torch.bfloat16,
                                                                attn_implementation="eager").eval()
        config = model.config.text_config
        V, C = config.vocab_size, model.config.canvas_length
        cache = hf_cache(model)
        encode = lambda ids: hf_encode(model, cache, ids)  # noqa: E731
        denoise = lambda canvas, sc: hf_denoise(model, cache, canvas, sc)  # noqa: E731
    else:
        from threadpoolctl import threadpool_limits

        threadpool_limits(spec["threads"])
        path = spec["gguf"] if dtype == "q8_0" else spec["model"]
        run_dtype = "float32" if dtype == "q8_0" else dtype
        if backend == "reference":
            from diffusiongemma.reference.model import Model
        else:
            from diffusiongemma.fast.model import Model
        model = Model.from_pretrained(path, dtype=run_dtype)
        V, C = model.config.vocab_size, model.config.canvas_length
        cache = model.new_cache(1)
        encode = lambda ids: model.encode(ids, cache)  # noqa: E731
        denoise = lambda canvas, sc: model.denoise(canvas, cache, sc)  # noqa: E731
    opened = time.perf_counter()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, V, size=(1, spec["prompt_tokens"]))
    encode(prompt)
    first = time.perf_counter()
    canvas = rng.integers(3, V, size=(1, C))
    decoder, sc = [], None
    for _ in range(spec["decoder_passes"]):
        t = time.perf_counter()
        logits = np.asarray(denoise(canvas, sc), dtype=np.float32)
        decoder.append(time.perf_counter() - t)
        sc = logits / np.float32(0.8)  # the next pass's self-conditioning input: temperature-scaled logits
        if not np.isfinite(logits).all():
            raise SystemExit(f"{spec['run']}: non-finite logits")
    memory = sampler.stop()
    return {"run": spec["run"], "open_s": opened - start, "first_pass_s": first - start, "encoder_s": first - opened,
            "decoder_s": decoder, **memory}


# ------------------------------------------------------------------------------------------ the parent
def facts(threads: int) -> dict:
    from common import machine_facts  # the CPU, cores, python, commit (dirty or not) and load, as every benchmark prints them

    with open("/proc/meminfo") as f:
        mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    return {"machine": machine_facts(), "threads": threads, "memory_gb": round(mem / 1e9, 1),
            "load": [round(x, 2) for x in os.getloadavg()]}


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def checkpoint_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=False)
    parser.add_argument("--gguf")
    parser.add_argument("--runs", default=",".join(r for r in RUNS if r != "cpu-q8_0"))
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--decoder-passes", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if not args.model:
        parser.error("--model DIR is required")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for run in runs:
        if run not in RUNS:
            parser.error(f"--runs: unknown run {run!r}; known: {', '.join(RUNS)}")
        if run == "cpu-q8_0" and not args.gguf:
            parser.error("--runs cpu-q8_0 needs --gguf FILE")
    machine = facts(args.threads)
    print(f"{machine['machine']}; {machine['threads']} threads a run; {machine['memory_gb']} GB memory")
    print(f"checkpoint: {args.model} ({checkpoint_bytes(args.model) / 1e9:.1f} GB)"
          + (f"; GGUF {args.gguf} ({checkpoint_bytes(args.gguf) / 1e9:.1f} GB)" if args.gguf else ""))
    print("| run | page cache | open s | first pass s | encoder s | decoder s (median) | peak anon GB | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for run in runs:
        cache = "cold" if args.cache == "cold" and drop_page_cache() else "warm"
        spec = {"run": run, "model": args.model, "gguf": args.gguf, "threads": args.threads,
                "prompt_tokens": args.prompt_tokens, "decoder_passes": args.decoder_passes}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                              capture_output=True, text=True, env=env)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {run} | {cache} | failed (exit {done.returncode}): {tail[:120]} |||||||")
            results.append({"run": run, "cache": cache, "error": tail})
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        r["cache"] = cache
        results.append(r)
        decoder = sorted(r["decoder_s"])[len(r["decoder_s"]) // 2]
        print(f"| {run} | {cache} | {r['open_s']:.1f} | {r['first_pass_s']:.1f} | {r['encoder_s']:.1f} | "
              f"{decoder:.1f} | {r['peak_anon'] / 1e9:.2f} | {r['peak_rss'] / 1e9:.2f} |", flush=True)
    machine["load_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load at the end: {machine['load_end']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
