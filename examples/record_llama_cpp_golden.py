"""Record llama.cpp goldens: llama-diffusion-cli run on the shipped model and on a random tiny model, step by step.

    python examples/record_llama_cpp_golden.py --llama-bin PATH [--out tests/golden/llama.cpp]

Writes one JSON file per case (and an ``.npz`` with one step's logits) that tests/test_llama_cpp_golden.py replays
without llama.cpp: from the seed alone, ``generate(model, prompt_ids, semantics="llama.cpp",
random=LlamaCppDraws(seed))`` must give llama.cpp's argmax canvas, accepted set and accepted draws at every
step, its step count per block and its reply.

The build these goldens come from. llama.cpp's DiffusionGemma runner is the head of ggml-org/llama.cpp pull
request #24423, commit c3fb97241295c196e09b783e705e84b96cd1bd74 (held by the unslothai/llama.cpp mirror as a
pinned ref; the mirror's HEAD lacks src/models/diffusion-gemma.cpp). Its source was extracted without the
models/ folder (seven vocabulary test files are missing there, none needed). It was configured with CMake for
the CPU only, native instructions on, no optimisation (-O0 as the C and C++ flags, build type None), shared
libraries, HTTPS, tests, tools, server, app and web UI off, and only the target llama-diffusion-cli was built,
with two parallel jobs at low priority on a machine whose two cores other work shared: 844 seconds (14 min),
with GCC 12.2, CMake 3.25 and Ninja (another such build, elsewhere, took about 32 min). A Release build of the
same commit and options (-O3) took 602 seconds here; on the five goldens it makes every decision the -O0 build
made (argmax canvas, accepted set, accepted draws, next input, reply), its step-0 logits differ from the -O0
ones by at most 9e-5 on the shipped model and 3e-3 on the tiny one (where the logits reach 27), only sampled
ids at positions that are not accepted (replaced by renoise, no effect) differ, and it runs 10 to 16 times
faster.

The same build also loads the F16 and Q8_0 files of ``diffusiongemma convert MODEL out.gguf --gguf-type``: on the
shipped model (seed 1, -n 64) the F16 run gives the F32 reference's 64 reply tokens (one argmax near a tie
differs on the way, at block 0 step 8); Q8_0 quantizes the activations too (ggml's Q8_0 products), its step-0
logits differ by 0.16 and the run parts from the reference at the third step: only F32 files are goldens.

The per-step records. The stock CLI prints only a progress bar and the reply. For these goldens its
``diffusion_generate_entropy_bound`` (examples/diffusion/diffusion.cpp) had a print added after the
acceptance step, not part of llama.cpp and not kept here: when the environment variable DIFFUSION_TRACE_FILE
is set it appends one JSON line per denoising step with the block's prompt ids (``prompt``), ``n_input``,
``step``, the step's input canvas (``input``), argmax canvas (``argmax``), sampled ids (``sampled``), the
accepted positions (``accepted``), per-position entropies (``entropy``), the uniforms and renoise ids drawn
(``u``, ``renoise``) and, on the step named by DIFFUSION_TRACE_LOGITS_STEP, the canvas rows of the logits
(``logits``). Run against a stock binary, this script records the reply only and says so.

Runs use ``-t 1`` and ``diffusiongemma.crosscheck.llama_cpp_peer.DETERMINISTIC_FLAGS`` (flash attention, the
prompt KV cache and device sampling off), ``-s SEED`` always (without it the seed is the fixed 0xFFFFFFFF), and
``-p`` text that the CLI passes through the GGUF's chat template: the written GGUF carries a pass-through
template, so the prompt ids are BOS + the tokenized text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

import numpy as np

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "llama.cpp")

# name, model ("shipped" or a random_tiny_model seed), prompt, draw seed, -n, logits positions kept (None: all)
CASES = [
    ("shipped-seed1", "shipped", "And God said", 1, 64, 4),
    ("shipped-seed2", "shipped", "And God said", 2, 64, 4),  # the first canvas is cut at a repetition loop
    ("shipped-seed7", "shipped", "In the beginning", 7, 32, 4),
    ("tiny0-seed1", 0, "And God said", 1, 48, None),
    ("tiny0-seed2", 0, "And God said", 2, 48, None),
]


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record(llama_bin: str, out: str, threads: int = 1) -> list[str]:
    from importlib.metadata import version

    from diffusiongemma.crosscheck.llama_cpp_peer import (DETERMINISTIC_FLAGS, LLAMA_CPP_COMMIT, case_gguf,
                                                          compare_runs, reference_run, run_llama_cpp)
    from diffusiongemma.checkpoint import load_generation_config
    from diffusiongemma.reference.model import Model

    os.makedirs(out, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="llama-golden-") as tmp:
        for name, model_spec, prompt, seed, n_predict, keep in CASES:
            path = case_gguf(model_spec, tmp)
            run = run_llama_cpp(llama_bin, path, prompt, seed=seed, n_predict=n_predict, threads=threads,
                                logits_step=0)  # reruns when the CLI's asynchronous log drops the reply
            model = Model.from_pretrained(path)
            generation = load_generation_config(path)
            record_ = {
                "case": name, "model": model_spec if model_spec == "shipped" else {"random_tiny_model": model_spec},
                "gguf_sha256": sha256(path), "gguf_type": "f32", "gguf_package": version("gguf"),
                "llama_cpp": {"commit": LLAMA_CPP_COMMIT, "target": "llama-diffusion-cli", "threads": threads,
                              "flags": list(DETERMINISTIC_FLAGS), "seconds": round(run.seconds, 2)},
                "prompt": prompt, "seed": seed, "n_predict": n_predict, "prompt_ids": run.prompt_ids,
                "generation": generation.to_dict() if hasattr(generation, "to_dict") else vars(generation),
                "traced": run.traced, "tokens": run.tokens, "text": run.text,
                "blocks": [[{k: step[k] for k in ("n_input", "step", "input", "argmax", "sampled", "accepted")}
                            for step in block] for block in run.blocks],
            }
            if run.traced:
                for variant, numerics in (("plain", False), ("float16_numerics", True)):
                    ours = reference_run(model, run.prompt_ids, seed=seed, n_predict=n_predict,
                                         generation_config=generation, numerics=numerics)
                    record_[f"reference_{variant}_agrees"] = not compare_runs(run, ours)
                logits = np.asarray(run.blocks[0][0]["logits"], dtype=np.float32)
                rows = logits if keep is None else logits[:keep]
                np.savez_compressed(os.path.join(out, f"{name}-logits.npz"), logits=rows,
                                    positions=np.arange(rows.shape[0]))
                record_["logits"] = {"file": f"{name}-logits.npz", "block": 0, "step": 0,
                                     "positions": int(rows.shape[0])}
            target = os.path.join(out, f"{name}.json")
            with open(target, "w", encoding="utf-8") as f:
                json.dump(record_, f, separators=(",", ":"))
                f.write("\n")
            written.append(target)
            agree = {k: v for k, v in record_.items() if k.endswith("_agrees")}
            print(f"{name}: {len(run.blocks)} blocks, steps {run.steps_per_block()}, {len(run.tokens)} tokens, "
                  f"traced={run.traced}, {agree}", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", required=True, metavar="PATH", help="llama.cpp's llama-diffusion-cli")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: tests/golden/llama.cpp)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (-t)")
    args = parser.parse_args(argv)
    from diffusiongemma.crosscheck.llama_cpp_peer import LlamaCppUnavailable

    try:
        record(args.llama_bin, os.path.abspath(args.out), args.threads)
    except LlamaCppUnavailable as exc:
        print(f"record_llama_cpp_golden: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
