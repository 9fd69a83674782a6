"""DiffusionGemma on a CPU, side by side: the fast path, the reference and every peer found here.

    python benchmarks/bench_peers.py [--configs small medium] [--threads 1 2] [--rounds 3] [--repeats 1]
        [--llama-bin PATH/llama-diffusion-cli] [--jax-python PATH/python --gemma-src DIR]
        [--mlx-path DIR] [--peers fast reference transformers llama.cpp jax mlx-vlm]
        [--json OUT.json] [--plot OUT.png] [--q8] [--stages]
    python benchmarks/bench_peers.py --from-json OUT.json [--plot OUT.png]   # the table of an earlier run
    python benchmarks/bench_peers.py --stages-only WORKDIR [--configs ...]   # the fast path's stage profile

``--configs real`` adds a model with the released model's ratios (128 experts top 8, head sizes 256 / 512),
scaled down (hidden 768, 4 layers, vocabulary 32768).

One random model per configuration (``diffusiongemma.tiny``, seed 0) is written once as a transformers
directory (with a byte-level BPE tokenizer, so that llama.cpp can read it) and converted for each peer:

* fast path / reference: ``Model.from_pretrained(DIR)`` of ``diffusiongemma.fast`` / ``diffusiongemma.reference``;
* transformers: ``DiffusionGemmaForBlockDiffusion.from_pretrained(DIR)`` (float32, its default attention:
  SDPA where the model supports it, as a user gets it; the implementation used is recorded as ``attention``);
* llama.cpp: a float32 GGUF (``diffusiongemma.gguf_writer``, what ``diffusiongemma convert`` writes), run by
  the ``llama-diffusion-cli`` given with ``--llama-bin`` (entropy-bound sampler, host sampling, prompt KV
  cache on, flash attention off, no GPU layers, ``--no-mmap``);
* JAX: the transformers tensors mapped onto gemma's ``DiffusionGemma_26B_A4B`` parameter tree
  (``examples/record_jax_golden.py``'s ``jax_params``), sampled by ``gemma.diffusion.Sampler`` in the Python
  given with ``--jax-python`` (a virtual environment with jax and a snapshot of google-deepmind/gemma);
* mlx-vlm: the same directory with the two config keys mlx-vlm reads
  (``crosscheck.mlx_vlm_peer.adapt_checkpoint``), run by ``stream_diffusion_generate`` on mlx's CPU device
  (``--mlx-path``: a directory holding mlx and mlx-vlm, put on PYTHONPATH).

The work is the same everywhere: batch 1, the same prompt ids (BOS + bytes of a fixed text, checked against
the ids llama.cpp reports), one canvas, a fixed number of denoising steps with adaptive stopping off (no
stability/confidence stop, no EOS), so every run makes the same number of decoder passes. A peer's run is
one subprocess that loads the model, runs one untimed generate (warm-up; for JAX it compiles) and then
``--repeats`` timed ones; llama.cpp's CLI is one process per run and reports its own generation time (the
turn's wall time, model load excluded). To time llama.cpp warm as the Python peers are, its weights are read
into memory at load (``--no-mmap``: with the default mmap, the timed turn paid the page faults of every
weight, which the Python peers pay in their untimed load) and llama.cpp's own warm-up decode runs at load
(its default), and one untimed process runs first (file cache). Peak resident memory is the subprocess's ``VmHWM`` (load included;
``ru_maxrss`` would also count the benchmark's own size at the fork).

Threads. Each subprocess gets N threads through every knob its library reads, and is confined to N CPUs
(``sched_setaffinity``), so that a library that sizes a pool by the machine cannot use more: OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS, MKL_NUM_THREADS (NumPy's OpenBLAS, the fast path's OpenMP kernels, mlx's BLAS);
``torch.set_num_threads(N)`` (transformers); XLA_FLAGS ``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1`` at N = 1 (JAX; at N = 2 XLA's pool is sized by the 2 CPUs of the affinity);
``-t N -tb N`` (llama.cpp; its host sampler starts one thread per machine core, the affinity holds them to N).

Order: for each configuration and thread count, ``--rounds`` rounds of every implementation in turn (A B C
... A B C ...), so that a change of the machine's load hits all alike; the table gives medians over rounds.

Disturbed rounds. While a peer's subprocess runs, the benchmark samples every 20 ms the runnable tasks of
other processes (``/proc/loadavg``'s runnable count less the subprocess's threads in state R and the
benchmark's own): a round during which they averaged more than the cores the subprocess leaves free (cores
minus its threads) plus ``--disturbed-margin`` (default 0.5) competed for its CPUs. It is flagged
(``disturbed``, ``other_runnable``) and run again, up to ``--reruns`` times (default 2); a round still
disturbed after that is kept, flagged, and counted in the table's ``disturbed`` column.

Printed first and kept in the JSON: CPU vendor, model and flags, cores, load average before and after each
configuration, the commit, and each peer found or not (with how to get it); the CPU's vendor and model are
printed again above the table and in the plot's title, since results differ between Intel and AMD.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_TAG = "BENCH_PEERS_RESULT "

# (TinySpec fields, prompt length, denoising steps). small and medium: benchmarks/common.py's shapes.
# "real": the shape ratios of the released model (128 experts, top 8; head sizes 256 sliding / 512 full,
# twice the sliding one) scaled down in width and depth.
STEPS = {"small": 16, "medium": 4, "real": 4}

HOW_TO_GET = {
    "transformers": "pip install 'transformers>=5.24' torch (CPU wheel)",
    "llama.cpp": "build target llama-diffusion-cli of ggml-org/llama.cpp pull request #24423 (head c3fb972) "
                 "with CMake, -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON, CPU only; pass --llama-bin",
    "jax": "a Python 3.12 virtual environment with jax[cpu], flax, kauldron and a snapshot of "
           "google-deepmind/gemma (gemma/diffusion) installed editable; pass --jax-python and --gemma-src",
    "mlx-vlm": "pip install --no-deps --target DIR 'mlx[cpu]==0.32.4' mlx-cpu==0.32.4 mlx-vlm==0.7.10; "
               "pass --mlx-path DIR",
}


def spec_for(name: str):
    from diffusiongemma.tiny import FULL, SLIDING, TinySpec

    if name == "real":
        # hidden 768 = 2816 / 3.67 with the real ratios (dense MLP 0.75 H, experts H / 4), every width a
        # whole number of Q8_0 blocks (704 / 176 were not, so a Q8_0 file stored the expert down projection F16)
        return TinySpec(vocab_size=32768, hidden_size=768, intermediate_size=576, moe_intermediate_size=192,
                        layer_types=[SLIDING, SLIDING, SLIDING, FULL], num_attention_heads=4,
                        num_key_value_heads=2, num_global_key_value_heads=1, head_dim=256, global_head_dim=512,
                        num_experts=128, top_k_experts=8, sliding_window=512, canvas_length=128), 256
    from common import MEDIUM, MEDIUM_PROMPT, SMALL, SMALL_PROMPT

    return {"small": (SMALL, SMALL_PROMPT), "medium": (MEDIUM, MEDIUM_PROMPT)}[name]


# ------------------------------------------------------------------------------------------ machine facts
def cpu_facts() -> dict:
    model, flags, vendor = platform.processor() or platform.machine(), [], None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and vendor is None:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("model name") and model == (platform.processor() or platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "sse4"))]
    return {"vendor": vendor or "unknown", "model": model, "cores": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "simd_flags": simd}


def cpu_line(facts: dict) -> str:
    """``CPU: GenuineIntel, Intel(R) Xeon(R) ...; 2 cores; commit ...``: printed with every table."""
    cpu = facts.get("cpu", {})
    return (f"CPU: {cpu.get('vendor', 'unknown')}, {cpu.get('model', '?')}; {cpu.get('cores', '?')} cores; "
            f"commit {facts.get('commit', '?')}; load {facts.get('load_start')} -> {facts.get('load_end')}")


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "fast", "reference"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + (" (fast/ or reference/ modified)" if dirty else "")
    except OSError:
        return "unknown"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------------------ the model files
def write_model(name: str, workdir: str, q8: bool) -> dict:
    """Write the configuration's random checkpoint once and convert it; returns the paths and prompt ids."""
    from diffusiongemma.crosscheck.llama_cpp_peer import byte_level_tokenizer
    from diffusiongemma.tiny import write_checkpoint

    spec, prompt_len = spec_for(name)
    directory = os.path.join(workdir, name, "hf")
    gen = {"max_denoising_steps": STEPS[name], "t_min": 0.4, "t_max": 0.8, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
           "stability_threshold": 1, "confidence_threshold": 0.005, "eos_token_id": [1], "pad_token_id": 0,
           "bos_token_id": 2}
    write_checkpoint(directory, spec, seed=0, tokenizer=False, generation_config=gen)
    tok = byte_level_tokenizer()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}, f)
    letters = "abcdefghijklmnopqrsuvwxyz"  # no 't' and no space: one id per byte, no merge
    text = "".join(letters[(7 * i) % len(letters)] for i in range(prompt_len - 1))
    ids = tok.encode(text, add_special_tokens=True).ids
    assert len(ids) == prompt_len, (len(ids), prompt_len)
    from diffusiongemma.gguf_writer import write_gguf

    paths = {"hf": directory, "gguf_f32": os.path.join(workdir, name, "model-f32.gguf"), "prompt_text": text,
             "prompt_ids": ids, "canvas": spec.canvas_length, "steps": STEPS[name]}
    write_gguf(directory, paths["gguf_f32"], "f32", force=True, name=f"bench-{name}")
    if q8:
        paths["gguf_q8_0"] = os.path.join(workdir, name, "model-q8_0.gguf")
        write_gguf(directory, paths["gguf_q8_0"], "q8_0", force=True, name=f"bench-{name}-q8_0")
    from diffusiongemma.crosscheck.mlx_vlm_peer import adapt_checkpoint
    import shutil

    shutil.rmtree(os.path.join(workdir, name, "mlx-vlm-checkpoint"), ignore_errors=True)
    paths["mlx"], _ = adapt_checkpoint(directory, os.path.join(workdir, name))
    # mlx-vlm's detokenizer indexes a table by the generated ids: give its copy one token per id (the prompt
    # is passed as ids, so the tokenizer only names the output)
    from diffusiongemma.tiny import write_word_tokenizer

    write_word_tokenizer(paths["mlx"], spec.vocab_size)
    with open(os.path.join(workdir, name, "paths.json"), "w", encoding="utf-8") as f:
        json.dump(paths, f)
    return paths


# ------------------------------------------------------------------------------------------ workers
def _worker_generate(impl: str, model_dir: str, ids: list[int], canvas: int, steps: int, threads: int):
    """(load seconds, a function running one generate) for a Python implementation."""
    import numpy as np

    start = time.perf_counter()
    if impl in ("fast", "fast Q8_0", "reference"):
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
        if impl.startswith("fast"):  # "fast Q8_0": model_dir is the Q8_0 GGUF, its experts kept quantized
            from diffusiongemma import fast

            model, generate = fast.Model.from_pretrained(model_dir, device="cpu"), fast.generate
            WEIGHT_BYTES["fast"] = model.weight_nbytes
        else:
            from diffusiongemma.reference import Model, generate

            model = Model.from_pretrained(model_dir)
        prompt = np.asarray([ids], dtype=np.int64)

        def run():
            generate(model, prompt, random=0, max_new_tokens=canvas, max_denoising_steps=steps,
                     stability_threshold=None, eos_token_id=())
            return steps
    elif impl == "transformers":
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        torch.set_num_threads(threads)
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32).eval()
        ATTENTION["transformers"] = getattr(model.config, "_attn_implementation", None)
        g = model.generation_config
        g.eos_token_id, g.pad_token_id, g.stability_threshold = None, None, None
        prompt = torch.tensor([ids], dtype=torch.long)

        def run():
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=canvas, max_denoising_steps=steps)
            return steps
    elif impl == "mlx-vlm":
        import mlx.core as mx
        from mlx_vlm.generate import diffusion as engine
        from mlx_vlm.utils import load_model, StoppingCriteria
        from pathlib import Path
        from transformers import PreTrainedTokenizerFast
        from mlx_vlm.tokenizer_utils import load_tokenizer

        mx.set_default_device(mx.cpu)
        model = load_model(Path(model_dir))
        # no stability/confidence keys: mlx-vlm's adaptive stop is off; entropy-bound sampler, argmax proposals
        model.config.generation_config = {"max_new_tokens": canvas, "max_denoising_steps": steps, "t_min": 0.4,
                                          "t_max": 0.8, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                                                                           "entropy_bound": 0.1},
                                          "eos_token_id": []}
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
        tok.detokenizer = load_tokenizer(Path(model_dir), return_tokenizer=False)(tok)
        tok.stopping_criteria = StoppingCriteria([], tok)
        prompt = mx.array([ids])
        calls = {"n": 0}
        inner = model.diffusion_decoder_logits

        def counting(*a, **k):
            calls["n"] += 1
            return inner(*a, **k)

        model.diffusion_decoder_logits = counting

        def run():
            calls["n"] = 0
            mx.random.seed(0)
            for _ in engine.stream_diffusion_generate(model, tok, tok, prompt, None, None, max_tokens=canvas,
                                                      skip_special_token_ids=[], temperature=0.0,
                                                      max_denoising_steps=steps, diffusion_sampler="entropy-bound"):
                pass
            return calls["n"]
    elif impl == "jax":
        import jax
        import jax.numpy as jnp

        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from record_jax_golden import IdTokenizer, jax_config, jax_params
        from gemma.diffusion import _chat_sampler, _early_stopping, _models, _sampler
        from safetensors.numpy import load_file

        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            text = json.load(f)["text_config"]
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        model = _models.DiffusionGemma_26B_A4B(config=jax_config(text), dtype=jnp.float32)
        params = jax.tree_util.tree_map(jnp.asarray, jax_params(text, tensors))
        del tensors
        sampler = _chat_sampler.Sampler(
            model=model, params=params, tokenizer=IdTokenizer(text["vocab_size"], 1),
            cache_length=len(ids) + 3 * canvas, max_out_length=canvas, pad_length=None, canvas_length=canvas,
            max_denoising_steps=steps,
            logit_shaper=_sampler.AnnealingTemperatureShaper(
                config=_sampler.AnnealingTemperatureShaperConfig(min_temperature=0.4, max_temperature=0.8)),
            sample_from_predictions=_sampler.SampleFromPredictions(entropy_bound=0.1),
            early_stop_fn=_early_stopping.NoEarlyStop())
        prompt = " ".join(map(str, ids))

        def run():
            out = sampler.sample([prompt], max_new_tokens=canvas, rng=0, return_state=True)
            np.asarray(out.state.predicted_tokens)
            return steps
    else:
        raise SystemExit(f"unknown implementation {impl!r}")
    return time.perf_counter() - start, run


ATTENTION: dict = {}  # the attention implementation a peer's model runs (transformers: its default, e.g. "sdpa")
WEIGHT_BYTES: dict = {}  # the fast path's weights as it holds them (Model.weight_nbytes), reported by the worker


def vm_hwm_kib(pid: "int | str" = "self") -> int:
    """The peak resident set of a process (``VmHWM`` of /proc/PID/status, KiB); 0 when unreadable. Unlike
    ``ru_maxrss`` it starts afresh at exec, so the benchmark's own size before the fork does not count."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(l.split()[1]) for l in f if l.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def stage_worker(spec: dict) -> int:
    """The fast path's stage profile (``bench_fast.StageProfile``) of one generate on the benchmark's model."""
    from threadpoolctl import threadpool_limits

    sys.path.insert(0, HERE)
    from bench_fast import StageProfile
    from diffusiongemma import fast
    import numpy as np

    threadpool_limits(spec["threads"])
    model = fast.Model.from_pretrained(spec["model"], device="cpu")
    prompt = np.asarray([spec["ids"]], dtype=np.int64)

    def run():
        fast.generate(model, prompt, random=0, max_new_tokens=spec["canvas"], max_denoising_steps=spec["steps"],
                      stability_threshold=None, eos_token_id=())
    run()
    with StageProfile(model) as profile:
        start = time.perf_counter()
        run()
        total = time.perf_counter() - start
    print(RESULT_TAG + json.dumps({"total_s": total, "lines": list(profile.lines(total))}), flush=True)
    return 0


def worker(args) -> int:
    spec = json.loads(args.worker_spec)
    if args.worker == "fast-stages":
        return stage_worker(spec)
    load_s, run = _worker_generate(args.worker, spec["model"], spec["ids"], spec["canvas"], spec["steps"],
                                   spec["threads"])
    start = time.perf_counter()
    passes = run()
    warm = time.perf_counter() - start
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        passes = run()
        times.append(time.perf_counter() - start)
    print(RESULT_TAG + json.dumps({"load_s": load_s, "warmup_s": warm, "seconds": times, "passes": passes,
                                    "vm_hwm_kib": vm_hwm_kib(), "cpus": len(os.sched_getaffinity(0)),
                                    "weight_bytes": WEIGHT_BYTES.get("fast"),
                                    "attention": ATTENTION.get(args.worker)}),
          flush=True)
    return 0


# ------------------------------------------------------------------------------------------ running peers
def _affinity(threads: int):
    cpus = sorted(os.sched_getaffinity(0))[:threads]

    def pin():
        os.sched_setaffinity(0, cpus)
    return pin


def thread_env(threads: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["XLA_FLAGS"] = ("--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" if threads == 1
                        else "")
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra or {})
    return env


def _running(tasks: str) -> int:
    """Threads in state R under a /proc/PID/task folder (0 when it cannot be read)."""
    try:
        names = os.listdir(tasks)
    except OSError:
        return 0
    count = 0
    for name in names:
        try:
            with open(os.path.join(tasks, name, "stat"), encoding="ascii", errors="replace") as f:
                count += f.read().rsplit(")", 1)[1].split()[:1] == ["R"]
        except (OSError, IndexError):
            continue
    return count


def other_runnable(pid: int) -> int | None:
    """Runnable tasks of processes other than ``pid`` and this benchmark, now (None without /proc)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            runnable = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, runnable - _running(f"/proc/{pid}/task") - max(1, _running("/proc/self/task")))


LAST_RUN: dict = {}  # what run_process saw of other load during its last subprocess


def run_process(command: list[str], env: dict, threads: int, timeout: float) -> tuple[str, int, int]:
    """(stdout + stderr, exit status, peak RSS in KiB) of one subprocess confined to ``threads`` CPUs; the peak
    is VmHWM polled every 20 ms (a Python worker reports its own at the end, which is used instead). Each poll
    also samples ``other_runnable``; their mean is left in ``LAST_RUN["other_runnable"]``."""
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_affinity(threads), text=True)
        deadline = time.monotonic() + timeout
        peak, others = 0, []
        while True:
            peak = max(peak, vm_hwm_kib(proc.pid))
            seen = other_runnable(proc.pid)
            if seen is not None:
                others.append(seen)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        LAST_RUN["other_runnable"] = statistics.fmean(others) if others else None
        out.seek(0)
        return out.read(), proc.returncode, peak


def run_python_peer(impl: str, python: str, model: str, paths: dict, threads: int, repeats: int,
                    extra_env: dict | None, timeout: float) -> dict:
    spec = {"model": model, "ids": paths["prompt_ids"], "canvas": paths["canvas"], "steps": paths["steps"],
            "threads": threads, "repeats": repeats}
    command = [python, os.path.abspath(__file__), "--worker", impl, "--worker-spec", json.dumps(spec)]
    text, rc, rss = run_process(command, thread_env(threads, extra_env), threads, timeout)
    line = next((l for l in text.splitlines() if l.startswith(RESULT_TAG)), None)
    if rc != 0 or line is None:
        return {"error": "\n".join(text.strip().splitlines()[-6:]) or f"exit status {rc}"}
    result = json.loads(line[len(RESULT_TAG):])
    result["rss_mib"] = max(result.pop("vm_hwm_kib", 0), rss) / 1024
    result["other_runnable"] = LAST_RUN.get("other_runnable")
    return result


def run_llama(binary: str, gguf: str, paths: dict, threads: int, repeats: int, timeout: float) -> dict:
    n_ctx = len(paths["prompt_ids"]) + paths["canvas"]
    command = [binary, "-m", gguf, "-p", paths["prompt_text"], "-s", "0", "-n", str(paths["canvas"]),
               "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-ub", str(n_ctx), "-b", str(n_ctx),
               "-fa", "off", "--diffusion-kv-cache", "on", "--diffusion-gpu-sampling", "off",
               "--diffusion-gpu-sample-reduce", "off", "-ngl", "0",
               "--diffusion-eb-max-steps", str(paths["steps"]), "--diffusion-eb-confidence", "0",
               "--diffusion-eb-stability", str(paths["steps"] + 1)]
    command.append("--no-mmap")  # weights read at load, not faulted in by the timed turn (module docstring)
    times, rss, passes, n_input, others = [], 0, None, None, []
    for _ in range(repeats + 1):  # the first run: warm-up (file cache), not timed
        with tempfile.TemporaryDirectory() as tmp:
            env = thread_env(threads, {"DIFFUSION_TRACE_FILE": os.path.join(tmp, "trace.jsonl")})
            for _attempt in range(3):  # the CLI's asynchronous logger can lose its last lines at exit: run again
                text, rc, rss_kib = run_process(command, env, threads, timeout)
                if rc != 0 or "total time:" in text:
                    break
            if rc != 0 or "total time:" not in text:
                why = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
                return {"error": why + "\n" + "\n".join(text.strip().splitlines()[-6:])}
            trace = os.path.join(tmp, "trace.jsonl")
            if os.path.isfile(trace):
                with open(trace, encoding="utf-8") as f:
                    records = [json.loads(l) for l in f if l.strip()]
                n_input = records[0]["n_input"] if records else None
        line = text[text.rindex("total time:"):].splitlines()[0]
        ms = float(line.split("total time:")[1].split("ms")[0])
        passes = int(line.split("(")[1].split(" steps")[0])
        times.append(ms / 1000.0)
        rss = max(rss, rss_kib)
        if LAST_RUN.get("other_runnable") is not None:
            others.append(LAST_RUN["other_runnable"])
    result = {"warmup_s": times[0], "seconds": times[1:], "passes": passes, "rss_mib": rss / 1024,
              "other_runnable": max(others[1:] or others) if others else None}  # the timed processes
    if n_input is not None and n_input != len(paths["prompt_ids"]):
        result["note"] = f"llama.cpp saw {n_input} prompt ids, the others {len(paths['prompt_ids'])}"
    return result


# ------------------------------------------------------------------------------------------ discovery
def find_peers(args) -> dict:
    """{peer: (True, how it is run) or (False, why not and how to get it)}."""
    found = {"fast": (True, "diffusiongemma.fast"), "reference": (True, "diffusiongemma.reference")}
    try:
        import transformers
        import torch

        found["transformers"] = (True, f"transformers {transformers.__version__}, torch {torch.__version__}")
    except ImportError as exc:
        found["transformers"] = (False, f"not installed ({exc}); {HOW_TO_GET['transformers']}")
    b = args.llama_bin
    if b and os.path.isfile(b) and os.access(b, os.X_OK):
        found["llama.cpp"] = (True, b)
    else:
        found["llama.cpp"] = (False, f"no llama-diffusion-cli given or not executable ({b!r}); {HOW_TO_GET['llama.cpp']}")
    jp = args.jax_python
    if jp and os.path.isfile(jp):
        probe = subprocess.run([jp, "-c", "import jax, gemma.diffusion; print(jax.__version__)"], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=args.gemma_src or ""))
        found["jax"] = ((True, f"jax {probe.stdout.strip()} in {jp}") if probe.returncode == 0 else
                        (False, f"{jp} cannot import jax/gemma.diffusion; {HOW_TO_GET['jax']}"))
    else:
        found["jax"] = (False, f"no --jax-python; {HOW_TO_GET['jax']}")
    mp = args.mlx_path
    probe = subprocess.run([sys.executable, "-c", "import mlx.core, mlx_vlm, importlib.metadata as m; "
                            "print(m.version('mlx-vlm'), m.version('mlx'))"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=mp or ""))
    found["mlx-vlm"] = ((True, f"mlx-vlm/mlx {probe.stdout.strip()}" + (f" from {mp}" if mp else "")) if probe.returncode == 0
                        else (False, f"mlx-vlm not importable; {HOW_TO_GET['mlx-vlm']}"))
    return {k: v for k, v in found.items() if k in args.peers}


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["small", "medium"], choices=["small", "medium", "real"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="timed generates per subprocess, after one warm-up")
    p.add_argument("--peers", nargs="+", default=["fast", "reference", "transformers", "llama.cpp", "jax", "mlx-vlm"])
    p.add_argument("--skip", nargs="*", default=[], metavar="CONFIG:PEER",
                   help="leave a peer out at a configuration, e.g. real:reference")
    p.add_argument("--llama-bin", default=None)
    p.add_argument("--jax-python", default=None)
    p.add_argument("--gemma-src", default=None, help="directory to put on the JAX Python's path (gemma snapshot)")
    p.add_argument("--mlx-path", default=None)
    p.add_argument("--q8", action="store_true", help="also run llama.cpp and the fast path on a Q8_0 GGUF of the "
                                                      "same model (the fast path keeps its experts Q8_0)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--reruns", type=int, default=2,
                   help="run a round again (at most this many times) while other processes competed for its CPUs")
    p.add_argument("--disturbed-margin", type=float, default=0.5, metavar="TASKS",
                   help="a round is disturbed when other processes' runnable tasks averaged more than the free "
                        "cores (cores minus threads) plus this")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stages", action="store_true",
                   help="after the table, the fast path's stage profile (bench_fast.StageProfile) on each model")
    p.add_argument("--stages-only", default=None, metavar="WORKDIR",
                   help="only the stage profile, on the models an earlier run left in WORKDIR")
    p.add_argument("--from-json", default=None, metavar="RUN.json",
                   help="print the table (and --plot) of an earlier run's --json instead of running")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.stages_only:
        stage_profiles(args, args.stages_only, {})
        return 0
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            saved = json.load(f)
        table = summarize(saved["runs"])
        print(cpu_line(saved["facts"]))
        print(format_table(table))
        if args.plot:
            plot(table, args.plot, saved["facts"])
        return 0
    sys.path.insert(0, HERE)

    facts = {"cpu": cpu_facts(), "commit": commit(), "python": platform.python_version(), "load_start": load(),
             "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats}
    peers = find_peers(args)
    facts["peers"] = {k: {"found": ok, "detail": d} for k, (ok, d) in peers.items()}
    print(json.dumps(facts, indent=1), flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-peers-")
    results = []
    for name in args.configs:
        paths = write_model(name, workdir, args.q8)
        files = {"float32 safetensors": os.path.getsize(os.path.join(paths["hf"], "model.safetensors")),
                 "GGUF F32": os.path.getsize(paths["gguf_f32"])}
        if "gguf_q8_0" in paths:
            files["GGUF Q8_0"] = os.path.getsize(paths["gguf_q8_0"])
        print(f"[{name}] prompt {len(paths['prompt_ids'])} ids, canvas {paths['canvas']}, {paths['steps']} steps; "
              f"files {files}", flush=True)
        entries = [k for k, (ok, _) in peers.items() if ok and f"{name}:{k}" not in args.skip]
        if "gguf_q8_0" in paths and "llama.cpp" in entries:
            entries.append("llama.cpp Q8_0")
        if "gguf_q8_0" in paths and "fast" in entries:
            entries.insert(entries.index("fast") + 1, "fast Q8_0")  # the same Q8_0 file, experts kept Q8_0
        for threads in args.threads:
            before = load()
            allowance = max(0, len(os.sched_getaffinity(0)) - threads) + args.disturbed_margin
            for r in range(args.rounds):
                for impl in entries:
                    for attempt in range(args.reruns + 1):
                        if impl.startswith("llama.cpp"):
                            gguf = paths["gguf_q8_0"] if impl.endswith("Q8_0") else paths["gguf_f32"]
                            out = run_llama(args.llama_bin, gguf, paths, threads, args.repeats, args.timeout)
                        elif impl == "jax":
                            out = run_python_peer(impl, args.jax_python, paths["hf"], paths, threads, args.repeats,
                                                  {"PYTHONPATH": args.gemma_src or ""}, args.timeout)
                        elif impl == "mlx-vlm":
                            out = run_python_peer(impl, sys.executable, paths["mlx"], paths, threads, args.repeats,
                                                  {"PYTHONPATH": os.pathsep.join(filter(None, [args.mlx_path, ROOT]))},
                                                  args.timeout)
                        elif impl == "fast Q8_0":
                            out = run_python_peer(impl, sys.executable, paths["gguf_q8_0"], paths, threads,
                                                  args.repeats, None, args.timeout)
                        else:
                            out = run_python_peer(impl, sys.executable, paths["hf"], paths, threads, args.repeats,
                                                  None, args.timeout)
                        others = out.get("other_runnable")
                        out.update(config=name, threads=threads, round=r, impl=impl, load=load(),
                                   canvas=paths["canvas"], steps=paths["steps"], files=files, attempt=attempt,
                                   disturbed=others is not None and others > allowance)
                        results.append(out)
                        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()
                                 if k not in ("files",)}
                        shown["seconds"] = [round(s, 3) for s in out.get("seconds", [])]
                        print(json.dumps(shown), flush=True)
                        if "error" in out or not out["disturbed"]:
                            break
                        print(f"[{name}] {impl}, threads {threads}, round {r}: disturbed (other runnable tasks "
                              f"{others:.2f} > {allowance:.2f})" + (", again" if attempt < args.reruns else ", kept"),
                              flush=True)
            print(f"[{name}] threads {threads}: load {before} -> {load()}", flush=True)
    facts["load_end"] = load()
    if args.stages:
        stage_profiles(args, workdir, facts)
    table = summarize(results)
    print(cpu_line(facts), flush=True)
    print(format_table(table), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"facts": facts, "runs": results, "table": table}, f, indent=1)
    if args.plot:
        plot(table, args.plot, facts)
    return 0


def stage_profiles(args, workdir: str, facts: dict) -> None:
    """Print (and keep in ``facts``) the fast path's stage profile on each configuration's model."""
    for name in args.configs:
        paths = json.load(open(os.path.join(workdir, name, "paths.json"), encoding="utf-8"))
        spec = {"model": paths["hf"], "ids": paths["prompt_ids"], "canvas": paths["canvas"],
                "steps": paths["steps"], "threads": 1}
        text, rc, _ = run_process([sys.executable, os.path.abspath(__file__), "--worker", "fast-stages",
                                   "--worker-spec", json.dumps(spec)], thread_env(1), 1, args.timeout)
        line = next((l for l in text.splitlines() if l.startswith(RESULT_TAG)), None)
        if line is None:
            print(f"[{name}] stage profile failed:\n" + "\n".join(text.splitlines()[-5:]), flush=True)
            continue
        prof = json.loads(line[len(RESULT_TAG):])
        facts.setdefault("stages", {})[name] = prof
        print(f"\n[{name}] fast path, stages of one generate at 1 thread ({prof['total_s']:.3f} s, load {load()}):")
        print("\n".join(prof["lines"]), flush=True)


def summarize(results: list[dict]) -> list[dict]:
    rows = {}
    kept = {}  # (config, threads, impl, round) -> the last attempt of that round
    for r in results:
        kept[(r["config"], r["threads"], r["impl"], r.get("round"))] = r
    for r in kept.values():
        key = (r["config"], r["threads"], r["impl"])
        row = rows.setdefault(key, {"config": r["config"], "threads": r["threads"], "impl": r["impl"], "per_round": [],
                                    "rss_mib": 0.0, "passes": r.get("passes"), "canvas": r["canvas"], "errors": [],
                                    "disturbed": 0, "attention": r.get("attention")})
        if "error" in r:
            row["errors"].append(r["error"])
            continue
        row["per_round"].append(statistics.median(r["seconds"]))
        row["disturbed"] += bool(r.get("disturbed"))
        row["rss_mib"] = max(row["rss_mib"], r["rss_mib"])
        row["passes"] = r["passes"]
        row["warmup_s"] = r.get("warmup_s")
        if r.get("weight_bytes"):
            row["weight_mib"] = r["weight_bytes"] / 2 ** 20
    table = list(rows.values())
    for row in table:
        if row["per_round"]:
            s = statistics.median(row["per_round"])
            row.update(seconds=s, passes_per_s=row["passes"] / s, tokens_per_s=row["canvas"] / s)
    for row in table:  # the fast path's ratio to the fastest peer (not ours) at its config and threads
        if row["impl"].startswith("fast") and "seconds" in row:  # fast Q8_0: against the peers' Q8_0 runs
            q8 = row["impl"].endswith("Q8_0")
            others = [o for o in table if (o["config"], o["threads"]) == (row["config"], row["threads"])
                      and not o["impl"].startswith(("fast", "reference")) and "seconds" in o
                      and o["impl"].endswith("Q8_0") == q8]
            if others:
                best = min(others, key=lambda o: o["seconds"])
                row["fastest_peer"], row["ratio_to_fastest_peer"] = best["impl"], best["seconds"] / row["seconds"]
    return table


def format_table(table: list[dict]) -> str:
    lines = ["| config | threads | implementation | s / generate | decoder passes/s | tokens/s | peak RSS MiB | "
             "weights held MiB | rounds | disturbed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        if "seconds" not in row:
            lines.append(f"| {row['config']} | {row['threads']} | {row['impl']} | failed: "
                         f"{row['errors'][0].splitlines()[0][:80] if row['errors'] else '?'} | | | | | | |")
            continue
        extra = f" [{row['attention']}]" if row.get("attention") else ""
        if "ratio_to_fastest_peer" in row:
            extra = f" ({row['ratio_to_fastest_peer']:.2f}x {row['fastest_peer']})"
        lines.append(f"| {row['config']} | {row['threads']} | {row['impl']}{extra} | {row['seconds']:.3f} | "
                     f"{row['passes_per_s']:.2f} | {row['tokens_per_s']:.1f} | {row['rss_mib']:.0f} | "
                     f"{format(row['weight_mib'], '.0f') if 'weight_mib' in row else ''} | {len(row['per_round'])} | "
                     f"{row.get('disturbed', 0) or ''} |")
    return "\n".join(lines)


def plot(table: list[dict], path: str, facts: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["config"], r["threads"]) for r in table if "seconds" in r},
                    key=lambda g: (["small", "medium", "real"].index(g[0]), g[1]))
    impls = [i for i in ["fast", "fast Q8_0", "reference", "transformers", "llama.cpp", "llama.cpp Q8_0", "jax",
                         "mlx-vlm"]
             if any(r["impl"] == i and "seconds" in r for r in table)]  # a peer that failed everywhere: left out
    fig, axes = plt.subplots(1, len(groups), figsize=(2.6 * len(groups) + 1, 3.2), squeeze=False)
    for ax, (config, threads) in zip(axes[0], groups):
        vals = [next((r["passes_per_s"] for r in table if (r["config"], r["threads"], r["impl"]) ==
                      (config, threads, i) and "seconds" in r), 0.0) for i in impls]
        ax.bar(range(len(impls)), vals, color=[f"C{k}" for k in range(len(impls))])
        ax.set_xticks(range(len(impls)), impls, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{config}, {threads} thread{'s' if threads > 1 else ''}", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    axes[0][0].set_ylabel("decoder passes / s (higher is better)", fontsize=8)
    fig.suptitle(f"{facts['cpu'].get('vendor', '')} {facts['cpu']['model']}, commit {facts['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
