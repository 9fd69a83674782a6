"""Cross-check a llama.cpp build (``llama-diffusion-cli``) against the reference, from the seed alone.

    diffusiongemma crosscheck llama.cpp --llama-bin PATH [-m MODEL] [--prompt TEXT] [--seed S] [-n N]

llama.cpp is not installed by this package: its DiffusionGemma runner lives in PR #24423 of ggml-org/llama.cpp
(head commit c3fb97241295c196e09b783e705e84b96cd1bd74; the upstream main branch does not have
``src/models/diffusion-gemma.cpp``). Build the CMake target ``llama-diffusion-cli`` of that commit for the CPU
and pass its path with ``--llama-bin``; the model is written as a GGUF file for it
(``diffusiongemma/gguf_writer.py``), so llama.cpp's own converter is not needed.

What is compared. llama.cpp runs its entropy-bound denoiser on the GGUF with flash attention, its prompt KV
cache and its device sampling off (so every step decodes [prompt | canvas] on the CPU, in float32); the
reference runs ``generate(model, prompt_ids, semantics="llama.cpp", random=LlamaCppDraws(seed))`` on the same
prompt ids, with llama.cpp's float16 GELU table and float16 self-conditioning embedding emulated
(``llama_cpp_numerics``: without them an argmax near a tie can flip within about a thousand steps); the plain
float32 reference's result is reported beside it. The final tokens are always compared (from the CLI's printed reply, re-encoded by the GGUF's
tokenizer when only text is available). When the binary writes a per-step trace (a JSON line per denoising
step to ``$DIFFUSION_TRACE_FILE``: the block's prompt ids, the step's input canvas, argmax canvas, sampled
ids, accepted positions, entropies, and optionally one step's logits), every step is compared too: argmax
canvas, accepted set, sampled ids, the next input canvas, and the step count of each block. The stock CLI
writes no trace; a build with such prints added reports more, a stock build still reports the tokens.

llama.cpp's CLI always applies a chat template to ``-p``; the GGUF written here carries the checkpoint's
template, or a pass-through one (the prompt text unchanged) when the checkpoint has none. Its seed without
``-s`` is 0xFFFFFFFF, fixed; this check always passes ``-s``.

Exit status of the command: 0 llama.cpp agrees with the reference, 1 it differs (the report says where), 2 no
binary given or it cannot run (the message says how to get one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BUILD_HELP", "LlamaCppRun", "run_llama_cpp", "reference_run", "compare_runs", "crosscheck_llama_cpp",
           "add_arguments", "run", "LLAMA_CPP_COMMIT", "DETERMINISTIC_FLAGS"]

LLAMA_CPP_COMMIT = "c3fb97241295c196e09b783e705e84b96cd1bd74"
BUILD_HELP = (
    "llama.cpp's DiffusionGemma runner is not installed with this package. Get the llama.cpp source at commit "
    f"{LLAMA_CPP_COMMIT} (the head of ggml-org/llama.cpp pull request #24423; upstream main does not have "
    "src/models/diffusion-gemma.cpp), configure it with CMake for the CPU only, build the single target "
    "llama-diffusion-cli (10 to 30 minutes on two cores; a Release build makes the same decisions as an "
    "unoptimised one and runs ten times faster), and pass the binary with --llama-bin PATH.")
# every step decodes [prompt | canvas] on the host in float32: no flash attention (F16 accumulation), no prompt
# KV cache (an F16 store under flash attention), no device-side sampling
DETERMINISTIC_FLAGS = ("-fa", "off", "--diffusion-kv-cache", "off", "--diffusion-gpu-sampling", "off",
                       "--diffusion-gpu-sample-reduce", "off", "-ngl", "0")


class LlamaCppUnavailable(RuntimeError):
    """No usable llama-diffusion-cli: the message says why and how to get one."""


@dataclass
class LlamaCppRun:
    """One run of llama-diffusion-cli (or of the reference, in the same layout)."""

    prompt_ids: list[int]  # the first block's prompt (the chat-templated, tokenized -p text)
    tokens: list[int]  # the reply: the trimmed canvases, concatenated
    text: str = ""  # the reply as printed
    blocks: list[list[dict]] = field(default_factory=list)  # per block, per step: the trace records
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)
    log: str = ""

    @property
    def traced(self) -> bool:
        return bool(self.blocks)

    def steps_per_block(self) -> list[int]:
        return [len(b) for b in self.blocks]


def _writer():
    """(write_gguf, write_model_gguf) of the GGUF writer module."""
    try:
        from diffusiongemma.gguf_writer import write_gguf, write_model_gguf
    except ImportError:  # its home before the package's reorganisation
        from diffusiongemma.weights_converter.gguf_writer import write_gguf, write_model_gguf
    return write_gguf, write_model_gguf


def _check_binary(llama_bin: str | None) -> str:
    if not llama_bin:
        raise LlamaCppUnavailable("no llama.cpp binary given (--llama-bin PATH). " + BUILD_HELP)
    path = shutil.which(llama_bin) or llama_bin
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise LlamaCppUnavailable(f"--llama-bin {llama_bin!r} is not an executable file. " + BUILD_HELP)
    return path


def _reply_text(stdout: str) -> str:
    """The reply llama-diffusion-cli prints (``"\\n%s\\n"`` before its "total time" line)."""
    cut = stdout.rfind("\ntotal time:")
    body = stdout if cut < 0 else stdout[:cut]
    body = body.rsplit("\r", 1)[-1]  # after the last progress-bar redraw
    if body.startswith("\n"):
        body = body[1:]
    return body[:-1] if body.endswith("\n") else body


DEFAULT_TIMEOUT = 300.0  # seconds one llama-diffusion-cli run may take (the shipped model: a few seconds)
NOTICE_EVERY = 30.0  # seconds between "still running" notices


def _wait(command: list[str], env: dict, timeout: float, notice: Any) -> tuple[int, str, str]:
    """Run ``command`` to its end: (status, stdout, stderr). Every ``NOTICE_EVERY`` seconds ``notice`` (when
    given) is told how long it has run; past ``timeout`` seconds the process and its children are killed and
    ``LlamaCppUnavailable`` says so."""
    import signal

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               env=env, encoding="utf-8", errors="replace", start_new_session=True)
    start = time.monotonic()
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            try:
                stdout, stderr = process.communicate(timeout=max(0.0, min(NOTICE_EVERY, left)))
                return process.returncode, stdout, stderr
            except subprocess.TimeoutExpired:
                waited = time.monotonic() - start
                if waited >= timeout:
                    raise LlamaCppUnavailable(f"--llama-bin {command[0]} did not finish within {timeout:g} s and was stopped "
                                              "(--llama-timeout SECONDS allows longer runs)") from None
                if notice is not None:
                    notice(f"llama.cpp is still running ({waited:.0f} s of at most {timeout:g} s)")
    finally:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def run_llama_cpp(llama_bin: str, gguf: str, prompt: str, *, seed: int, n_predict: int, threads: int = 1,
                  logits_step: int | None = None, timeout: float = DEFAULT_TIMEOUT, extra: tuple[str, ...] = (),
                  notice: Any = None) -> LlamaCppRun:
    """Run ``llama_bin`` on ``gguf`` with ``-p prompt -s seed -n n_predict`` and the deterministic flags.

    logits_step: ask a tracing build to also write that step's canvas logits (the first block's). timeout:
    seconds a run may take before it is stopped. notice: called with a line of progress every 30 s of a
    long run (the command line prints it on stderr). Raises ``LlamaCppUnavailable`` when the binary is
    missing or fails (the message has its last output lines), runs past ``timeout``, or exits 0 without
    printing what llama-diffusion-cli prints (a reply and its "total time:" line, or a trace): not llama.cpp.
    """
    binary = _check_binary(llama_bin)
    with tempfile.TemporaryDirectory(prefix="llama-cpp-run-") as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        env = dict(os.environ, DIFFUSION_TRACE_FILE=trace)
        if logits_step is not None:
            env["DIFFUSION_TRACE_LOGITS_STEP"] = str(int(logits_step))
        command = [binary, "-m", os.fspath(gguf), "-p", prompt, "-s", str(int(seed)), "-n", str(int(n_predict)),
                   "-t", str(int(threads)), *DETERMINISTIC_FLAGS, *extra]
        for attempt in range(3):  # the CLI's asynchronous logger can lose the reply at exit: run again
            if os.path.exists(trace):
                os.unlink(trace)
            start = time.perf_counter()
            try:
                status, stdout, stderr = _wait(command, env, timeout, notice)
            except OSError as exc:
                raise LlamaCppUnavailable(f"{binary} could not run: {exc}") from exc
            seconds = time.perf_counter() - start
            if status != 0:
                tail = "\n".join((stdout + stderr).strip().splitlines()[-8:])
                raise LlamaCppUnavailable(f"{binary} exited with status {status}:\n{tail}")
            if "\ntotal time:" in stdout:
                break
        log = stderr
        records = []
        if os.path.isfile(trace):
            with open(trace, encoding="utf-8") as f:
                try:
                    records = [json.loads(line) for line in f if line.strip()]
                except json.JSONDecodeError as exc:
                    raise LlamaCppUnavailable(f"{binary} wrote a trace ({trace}) that is not JSON lines ({exc}): "
                                              "not llama.cpp's tracing llama-diffusion-cli?") from None
        if "\ntotal time:" not in stdout and not records:
            said = f"{len(stdout)} characters on stdout, {len(stderr)} on stderr" if stdout or stderr else "no output"
            raise LlamaCppUnavailable(f"--llama-bin {binary} exited 0 but printed no reply ({said}; "
                                      "llama-diffusion-cli ends its reply with a 'total time:' line): it is not "
                                      "llama.cpp's llama-diffusion-cli, or it did not run the model. " + BUILD_HELP)
    blocks: list[list[dict]] = []
    for record in records:
        if record["step"] == 0 or not blocks:
            blocks.append([])
        blocks[-1].append(record)
    prompt_ids = blocks[0][0]["prompt"] if blocks else []
    tokens: list[int] = []
    if blocks:
        for block in blocks:  # the reply = each block's final argmax canvas, trimmed as the CLI trims
            canvas = block[-1]["argmax"]
            cut = llama_cpp_trim(canvas, _eog_ids(gguf))
            tokens += canvas[:cut]
            if cut < len(canvas):
                break
    return LlamaCppRun(prompt_ids=prompt_ids, tokens=tokens, text=_reply_text(stdout), blocks=blocks,
                       seconds=seconds, command=command, log=log)


def _eog_ids(gguf: str) -> set[int]:
    from diffusiongemma.weights_converter.gguf import GGUFCheckpoint

    config = GGUFCheckpoint.open(gguf).config
    return {int(e) for e in config.eos_token_id}


def llama_cpp_trim(canvas: list[int], eog: set[int]) -> int:
    """Where llama-diffusion-cli cuts a denoised canvas (``trim_canvas``): the reference's
    ``variants.commit.llama_cpp_cut`` (first end id, or the start of 6 equal pairs at stride 1 or 2)."""
    from diffusiongemma.reference.variants.commit import llama_cpp_cut

    return llama_cpp_cut(list(canvas), eog)


# ------------------------------------------------------------------------------------------------ tiny model
BYTE_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")


def byte_level_tokenizer():
    """A byte-level BPE tokenizer of 262 ids: the five specials (pad 0, eos 1, bos 2, unk 3, mask 4), GPT-2's
    256 byte symbols (5..260) and one merge ("Ġ t" -> 261); BOS is added when encoding with special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    for c in symbols:
        vocab[c] = len(vocab)
    vocab["\u0120t"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                             special_tokens=[("<bos>", 2)])
    return tokenizer


def _byte_of(symbol: str) -> int:
    """GPT-2's byte -> printable-character map, inverted (for ordering the 256 byte symbols by byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[symbol]


TINY_GENERATION = {"max_denoising_steps": 64, "t_min": 0.1, "t_max": 1.0, "stability_threshold": 0,
                   "confidence_threshold": 0.15, "sampler_config": {"entropy_bound": 0.1}, "eos_token_id": 1,
                   "pad_token_id": 0, "bos_token_id": 2}


def random_tiny_model(seed: int = 0, *, final_norm_gain: float = 25.0):
    """A small random DiffusionGemma (vocabulary 262, hidden 32, a sliding and a full layer, canvas 16, window
    8, 4 experts) whose weights come from ``MT19937(seed)`` alone (uniform draws of unit variance), so every
    NumPy version rebuilds it bit for bit. The final norm is scaled by ``final_norm_gain`` so that the logits
    are peaked enough for the entropy-bound sampler to accept tokens and stop early. -> reference ``Model``."""
    from diffusiongemma.reference.config import FULL, SLIDING, ModelConfig, RopeParameters
    from diffusiongemma.reference.model import Model
    from diffusiongemma.reference.variants.llama_cpp_draws import MT19937

    config = ModelConfig(vocab_size=262, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, layer_types=(SLIDING, FULL),
                         layer_head_dim=(16, 32), layer_num_key_value_heads=(1, 1), sliding_window=8,
                         rope_parameters={SLIDING: RopeParameters("default", 1e4),
                                          FULL: RopeParameters("proportional", 1e6, 0.25)},
                         num_experts=4, top_k_experts=2, canvas_length=16,
                         eos_token_id=(1,), pad_token_id=0, bos_token_id=2)
    engine = MT19937(seed)
    tensors = {}
    for name, shape in _expected_shapes(config).items():
        count = int(np.prod(shape))
        unit = (engine.words(count).astype(np.float64) / 2**32 - 0.5) * np.sqrt(12.0)  # mean 0, variance 1
        unit = unit.astype(np.float32).reshape(shape)
        if name.endswith("layer_scalar"):
            tensors[name] = np.float32(1.0) + np.float32(0.25) * unit
        elif len(shape) == 1:
            tensors[name] = np.float32(1.0) + np.float32(0.3) * unit
        else:
            tensors[name] = np.float32(0.08) * unit
    tensors["final_norm"] = tensors["final_norm"] * np.float32(final_norm_gain)
    tensors["self_conditioning.down_proj"] = tensors["self_conditioning.down_proj"] * np.float32(0.01)
    return Model(config, tensors)


def _expected_shapes(config):
    try:
        from diffusiongemma.reference.weights import expected_shapes
    except ImportError:  # pragma: no cover - the module's home after the reference's reorganisation
        from diffusiongemma.reference.support.checkpoint_io import expected_shapes
    return expected_shapes(config)


def write_tiny_checkpoint_text(directory: str) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of ``random_tiny_model`` in
    ``directory`` (what ``write_model_gguf`` reads for the tokenizer and the sampler defaults)."""
    os.makedirs(directory, exist_ok=True)
    byte_level_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}, f, indent=1)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_GENERATION, f, indent=1)


def case_gguf(model: "str | int", directory: str) -> str:
    """Write the GGUF (F32) of a golden case's model into ``directory``: ``"shipped"`` (the shipped tiny-kjv)
    or the seed of ``random_tiny_model`` (with ``write_tiny_checkpoint_text``'s tokenizer and settings).
    Returns its path; the same bytes every time (tests/golden/llama.cpp record their digests)."""
    from diffusiongemma.checkpoint import default_model_dir
    write_gguf, write_model_gguf = _writer()

    if model == "shipped":
        path = os.path.join(directory, "tiny-kjv.gguf")
        write_gguf(default_model_dir(), path, "f32", force=True, name="tiny-kjv")
    else:
        text = os.path.join(directory, f"random-tiny-{model}-text")
        write_tiny_checkpoint_text(text)
        path = os.path.join(directory, f"random-tiny-{model}.gguf")
        write_model_gguf(random_tiny_model(int(model)), text, path, "f32", force=True, name=f"random-tiny-{model}")
    return path


# ------------------------------------------------------------------------------------------------ numerics
_F16_GELU: np.ndarray | None = None


def ggml_gelu(x: np.ndarray, dtype: object = None) -> np.ndarray:
    """ggml-cpu's GELU (``GGML_GELU_FP16``): 0 for x <= -10, x for x >= 10, else a 65536-entry table indexed by
    float16(x) holding float16(0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))) computed in float32.
    ``dtype`` (the reference's ``gelu_tanh`` signature) is ignored: the table is llama.cpp's own rounding."""
    global _F16_GELU
    if _F16_GELU is None:
        h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            g = np.float32(0.5) * h * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * h *
                                                               (np.float32(1) + np.float32(0.044715) * h * h)))
        _F16_GELU = g.astype(np.float16).astype(np.float32)
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        looked_up = _F16_GELU[x.astype(np.float16).view(np.uint16)]
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, looked_up)).astype(np.float32)


def _f16_soft_embedding(model: Any):
    table = np.ascontiguousarray(model.tensors["embed_tokens"].astype(np.float16).astype(np.float32))

    def self_conditioning_embedding(logits: np.ndarray) -> np.ndarray:
        z = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=-1, keepdims=True)
        probs = probs.astype(np.float16).astype(np.float32)  # ggml converts the activations to F16 too
        return (probs @ table) * np.float32(model.config.embed_scale)

    return self_conditioning_embedding


@contextlib.contextmanager
def llama_cpp_numerics(model: Any, gelu: bool = True, sc_embedding: bool = True):
    """Run the reference ``model`` with two of llama.cpp's float16 shortcuts, for a forward comparison:
    ggml-cpu's GELU table (``ggml_gelu``, in every gated MLP and expert) and the self-conditioning soft
    embedding against a float16 copy of the embedding table with float16 probabilities (llama.cpp's
    ``sc_embT``). Swaps the reference's functions for the duration (not thread-safe)."""
    from diffusiongemma.reference import layers, primitives

    saved = [(module, "gelu_tanh", getattr(module, "gelu_tanh")) for module in (primitives, layers)
             if gelu and hasattr(module, "gelu_tanh")]
    had_own = "self_conditioning_embedding" in vars(model)
    try:
        for module, name, _ in saved:
            setattr(module, name, ggml_gelu)
        if sc_embedding:
            model.self_conditioning_embedding = _f16_soft_embedding(model)
        yield model
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        if sc_embedding and not had_own:
            del model.self_conditioning_embedding


def reference_run(model: Any, prompt_ids: list[int], *, seed: int, n_predict: int, generation_config: Any,
                  numerics: bool = False) -> LlamaCppRun:
    """The reference's run in llama.cpp's layout: ``semantics="llama.cpp"``, ``LlamaCppDraws(seed)``; with
    ``numerics``, inside ``llama_cpp_numerics(model)``."""
    from diffusiongemma.reference import generate
    from diffusiongemma.reference.variants.llama_cpp_draws import LlamaCppDraws

    C = model.config.canvas_length
    blocks: list[list[dict]] = []
    state = {"input": None}

    class Steps:
        def on_step(self, info):
            if info.step_index == 0:
                blocks.append([])
                state["input"] = None
            blocks[-1].append({"step": info.step_index, "argmax": info.draft[0].tolist(),
                               "sampled": info.sampled[0].tolist(),
                               "accepted": np.flatnonzero(info.accepted[0]).tolist(),
                               "entropy": info.entropies[0].tolist(), "next": info.canvas[0].tolist()})

    ids = np.asarray([prompt_ids], dtype=np.int64)
    start = time.perf_counter()
    with (llama_cpp_numerics(model) if numerics else contextlib.nullcontext()):
        result = generate(model, ids, generation_config=generation_config, random=LlamaCppDraws(seed),
                          semantics="llama.cpp", callback=Steps(), max_new_tokens=-(-int(n_predict) // C) * C)
    seconds = time.perf_counter() - start
    new = result.sequences[0, ids.shape[1]:].tolist()
    tokens: list[int] = []
    eog = {int(e) for e in model.config.eos_token_id}
    for k in range(0, len(new), C):  # the CLI's reply: each canvas trimmed, up to the first cut one
        cut = llama_cpp_trim(new[k:k + C], eog)
        tokens += new[k:k + cut]
        if cut < C:
            break
    return LlamaCppRun(prompt_ids=list(prompt_ids), tokens=[int(t) for t in tokens], blocks=blocks, seconds=seconds)


def compare_runs(peer: LlamaCppRun, ours: LlamaCppRun) -> list[str]:
    """Differences between llama.cpp's run and the reference's (empty when they agree), first ones first.

    Per traced step: the argmax canvas, the accepted set, the sampled ids at accepted positions and the next
    step's input canvas (a sampled id at a position that is not accepted is replaced by renoise and changes
    nothing: such flips, from float rounding near a cumulative boundary, are counted by ``sampled_flips``).
    Then the number of steps per block, the number of blocks, and the reply tokens.
    """
    problems: list[str] = []
    if peer.traced:
        for b, (pb, ob) in enumerate(zip(peer.blocks, ours.blocks)):
            for s, (p, o) in enumerate(zip(pb, ob)):
                accepted = o["accepted"]
                checks = (("argmax canvas", p["argmax"], o["argmax"]), ("accepted set", p["accepted"], accepted),
                          ("accepted draws", [p["sampled"][i] for i in accepted], [o["sampled"][i] for i in accepted]))
                for what, x, y in checks:
                    if x != y:
                        where = [i for i, (u, v) in enumerate(zip(x, y)) if u != v][:5] if len(x) == len(y) else "-"
                        problems.append(f"block {b} step {s}: {what} differs (llama.cpp {x[:10]}, reference "
                                        f"{y[:10]}; first differing entries {where})")
                        return problems
                if s + 1 < len(pb) and pb[s + 1]["input"] != o["next"]:
                    problems.append(f"block {b} step {s}: the next step's input canvas differs")
                    return problems
            if len(pb) != len(ob):
                problems.append(f"block {b}: llama.cpp ran {len(pb)} denoising steps, the reference {len(ob)}")
                return problems
        if len(peer.blocks) != len(ours.blocks):
            problems.append(f"llama.cpp denoised {len(peer.blocks)} blocks, the reference {len(ours.blocks)}")
    if peer.tokens != ours.tokens:
        first = next((i for i, (x, y) in enumerate(zip(peer.tokens, ours.tokens)) if x != y),
                     min(len(peer.tokens), len(ours.tokens)))
        problems.append(f"reply tokens differ from position {first} (llama.cpp {len(peer.tokens)} tokens, reference "
                        f"{len(ours.tokens)})")
    return problems


def sampled_flips(peer: LlamaCppRun, ours: LlamaCppRun) -> int:
    """Sampled ids that differ at positions not accepted (no effect on the run; see ``compare_runs``)."""
    return sum(1 for pb, ob in zip(peer.blocks, ours.blocks) for p, o in zip(pb, ob)
               for i, (x, y) in enumerate(zip(p["sampled"], o["sampled"])) if x != y and i not in o["accepted"])


def llama_cpp_temperature(step_index: int, max_steps: int, t_min: float, t_max: float) -> np.float32:
    """llama.cpp's T of a step, in its float order: ``t_min + (t_max - t_min) * ((float) cur_step / (float) S)``
    with cur_step = S - step_index."""
    f = np.float32
    return f(f(t_min) + f(f(f(t_max) - f(t_min)) * f(f(max_steps - step_index) / f(max_steps))))


def llama_cpp_accept(entropy: np.ndarray, bound: float) -> np.ndarray:
    """llama.cpp's acceptance: positions by ascending entropy, accepted while the double sum of the strictly
    lower-ranked entropies is <= the float bound."""
    order = np.argsort(np.asarray(entropy, dtype=np.float32), kind="stable")
    accepted = np.zeros(len(order), dtype=bool)
    total = 0.0
    for pos in order:
        if total <= float(np.float32(bound)):
            accepted[pos] = True
        total += float(entropy[pos])
    return accepted


def teacher_forced(model: Any, peer: LlamaCppRun, generation_config: Any, *, numerics: bool = True,
                   tolerance: float = 3e-4) -> dict:
    """Each traced llama.cpp step repeated by the reference on llama.cpp's own inputs (the block's prompt, the
    step's input canvas, self-conditioning from the reference's logits of llama.cpp's previous input), so that
    one difference does not carry into later steps. Compares the argmax canvas and the accepted set.

    A difference is called a near tie when the reference's own margin is within the forward error: the gap
    between the two largest temperature-scaled logits below ``2 * tolerance * max|logit| / T`` for an argmax,
    the running entropy sum within ``2 * tolerance * max|logit| / T`` of the bound for an acceptance.
    With llama.cpp's uniforms in the trace (``u``), the categorical draws at accepted positions are compared too
    (a near tie: ``u`` within the same slack of a cumulative boundary).
    Returns {"steps", "argmax_differences", "accepted_differences", "draw_differences", "beyond_tolerance"}.
    """
    from diffusiongemma.reference.sampling import softmax_and_entropy

    g = generation_config
    from diffusiongemma.reference.variants.llama_cpp_draws import first_reaching

    out = {"steps": 0, "argmax_differences": 0, "accepted_differences": 0, "draw_differences": 0,
           "beyond_tolerance": []}
    with (llama_cpp_numerics(model) if numerics else contextlib.nullcontext()):
        for b, block in enumerate(peer.blocks):
            cache = model.new_cache(1)
            model.encode(np.asarray([block[0]["prompt"]], dtype=np.int64), cache)
            sc = None
            for s, record in enumerate(block):
                logits = model.denoise(np.asarray([record["input"]], dtype=np.int64), cache, sc)[0]
                T = llama_cpp_temperature(s, g.max_denoising_steps, g.t_min, g.t_max)
                z = logits * np.float32(np.float32(1.0) / T)
                probs, entropy = softmax_and_entropy(z[None])
                probs, entropy = probs[0], entropy[0]
                slack = 2 * tolerance * float(np.abs(logits).max()) / float(T)
                out["steps"] += 1
                argmax = z.argmax(axis=-1)
                for i in np.flatnonzero(argmax != np.asarray(record["argmax"])):
                    out["argmax_differences"] += 1
                    top = np.sort(z[i])[-2:]
                    if top[1] - top[0] > slack:
                        out["beyond_tolerance"].append(f"block {b} step {s} position {i}: argmax {int(argmax[i])} vs "
                                                       f"llama.cpp {record['argmax'][i]}, margin {top[1] - top[0]:.3g}")
                accepted = llama_cpp_accept(entropy, g.entropy_bound)
                theirs = np.zeros_like(accepted)
                theirs[record["accepted"]] = True
                if (accepted != theirs).any():
                    out["accepted_differences"] += 1
                    sums = np.cumsum(np.sort(entropy.astype(np.float64))) - np.sort(entropy.astype(np.float64))
                    nearest = float(np.min(np.abs(sums - g.entropy_bound)))
                    if nearest > slack * len(entropy):
                        out["beyond_tolerance"].append(f"block {b} step {s}: accepted set differs, the entropy sums "
                                                       f"are {nearest:.3g} from the bound")
                if "u" in record:  # the draws at accepted positions, from llama.cpp's own uniforms
                    u = np.asarray(record["u"], dtype=np.float32)
                    sampled = first_reaching(probs, u)
                    for i in record["accepted"]:
                        if sampled[i] != record["sampled"][i]:
                            out["draw_differences"] += 1
                            cdf = np.cumsum(probs[i], dtype=np.float64)
                            gap = float(np.min(np.abs(cdf - float(u[i]))))
                            if gap > slack:
                                out["beyond_tolerance"].append(
                                    f"block {b} step {s} position {i}: draw {int(sampled[i])} vs llama.cpp "
                                    f"{record['sampled'][i]}, u {float(u[i]):.7g} is {gap:.3g} from a boundary")
                sc = z[None]
    return out


def crosscheck_llama_cpp(llama_bin: str, model_path: str | None = None, *, prompt: str = "And God said",
                         seed: int = 1, n_predict: int | None = None, gguf_type: str = "f32",
                         threads: int = 1, timeout: float = DEFAULT_TIMEOUT, notice: Any = None) -> dict:
    """Write ``model_path`` (default: the shipped model) as a GGUF, run llama.cpp and the reference on it and
    return a report dict (``agree``, ``problems``, both runs' tokens and per-block step counts, timings).
    ``timeout`` and ``notice``: ``run_llama_cpp``'s."""
    from diffusiongemma.checkpoint import default_model_dir, load_generation_config
    from diffusiongemma.reference.model import Model
    write_gguf, _ = _writer()

    _check_binary(llama_bin)
    model_path = model_path or default_model_dir()
    with tempfile.TemporaryDirectory(prefix="llama-cpp-check-") as tmp:
        if os.path.isfile(model_path) and model_path.lower().endswith(".gguf"):
            gguf = model_path
        else:
            gguf = os.path.join(tmp, "model.gguf")
            write_gguf(model_path, gguf, gguf_type)
        model = Model.from_pretrained(gguf)
        config = load_generation_config(gguf)
        C = model.config.canvas_length
        n_predict = int(n_predict or C)
        if notice is not None:
            notice(f"running {llama_bin} (stopped after {timeout:g} s: --llama-timeout)")
        peer = run_llama_cpp(llama_bin, gguf, prompt, seed=seed, n_predict=n_predict, threads=threads,
                             timeout=timeout, notice=notice)
        prompt_ids = peer.prompt_ids or _encode_like_llama_cpp(gguf, prompt)
        ours = reference_run(model, prompt_ids, seed=seed, n_predict=n_predict, generation_config=config,
                             numerics=True)
        plain = reference_run(model, prompt_ids, seed=seed, n_predict=n_predict, generation_config=config)
        if not peer.traced:  # only the printed reply: compare it as text, and as the ids it re-encodes to
            ours_text = _decode(gguf, ours.tokens)
            peer.tokens = ours.tokens if peer.text == ours_text else _encode_plain(gguf, peer.text)
        problems = compare_runs(peer, ours)
        plain_problems = compare_runs(peer, plain)
        forced = teacher_forced(model, peer, config) if peer.traced else None
    return {"peer": "llama.cpp", "binary": llama_bin, "model": model_path, "gguf_type": gguf_type, "seed": seed,
            "prompt": prompt, "prompt_ids": prompt_ids, "n_predict": n_predict, "traced": peer.traced,
            "identical": not problems, "agree": not problems or (forced is not None and not forced["beyond_tolerance"]
                                                                  and peer.tokens == ours.tokens),
            "problems": problems, "plain_float32_problems": plain_problems, "teacher_forced": forced,
            "sampled_flips": sampled_flips(peer, ours) if peer.traced else None, "llama_cpp_tokens": peer.tokens,
            "reference_tokens": ours.tokens, "llama_cpp_text": peer.text,
            "llama_cpp_steps_per_block": peer.steps_per_block(), "reference_steps_per_block": ours.steps_per_block(),
            "llama_cpp_seconds": round(peer.seconds, 3), "reference_seconds": round(ours.seconds, 3)}


def _text_side(gguf: str):
    """The tokenizer and chat template stored in the GGUF itself (what llama.cpp reads), as a ``TextSide``."""
    from diffusiongemma.checkpoint import TextSide
    from diffusiongemma.weights_converter.gguf import gguf_text_side

    side = gguf_text_side(gguf)
    return side if isinstance(side, TextSide) else TextSide(*side)


def _encode_like_llama_cpp(gguf: str, prompt: str) -> list[int]:
    """The prompt ids llama.cpp feeds: the GGUF's chat template applied to one user turn, then tokenized with
    BOS (``common_tokenize(..., add_special=true, parse_special=true)``)."""
    text = _text_side(gguf)
    rendered = text.apply_chat_template(prompt) if text.chat_template else prompt
    return text.encode(rendered, add_special_tokens=True)


def _decode(gguf: str, ids: list[int]) -> str:
    return _text_side(gguf).decode(ids, skip_special_tokens=True)


def _encode_plain(gguf: str, text: str) -> list[int]:
    return _text_side(gguf).encode(text, add_special_tokens=False)


def report_text(report: dict) -> str:
    lines = [f"llama.cpp ({report['binary']}) vs reference (semantics='llama.cpp', LlamaCppDraws({report['seed']}))",
             f"model {report['model']} as GGUF {report['gguf_type']}; prompt {report['prompt']!r} -> "
             f"{len(report['prompt_ids'])} ids; -n {report['n_predict']}",
             f"per-step trace from the binary: {'yes' if report['traced'] else 'no (stock build: reply only)'}",
             f"steps per block: llama.cpp {report['llama_cpp_steps_per_block'] or '-'}, reference "
             f"{report['reference_steps_per_block']}",
             f"reply: llama.cpp {len(report['llama_cpp_tokens'])} tokens in {report['llama_cpp_seconds']} s, reference "
             f"{len(report['reference_tokens'])} tokens in {report['reference_seconds']} s"]
    if report["traced"]:
        lines.append(f"sampled ids that differ at positions not accepted (no effect): {report['sampled_flips']}")
    plain = report["plain_float32_problems"]
    lines.append("plain float32 reference (no float16 emulation): " + ("agrees" if not plain else plain[0]))
    forced = report["teacher_forced"]
    if forced is not None:
        lines.append(f"teacher-forced on llama.cpp's inputs: {forced['steps']} steps, {forced['argmax_differences']} "
                     f"argmax positions, {forced['accepted_differences']} accepted sets and {forced['draw_differences']} "
                     f"accepted draws differ, "
                     f"{len(forced['beyond_tolerance'])} beyond float rounding")
    if report["identical"]:
        lines.append("AGREE: " + ("every step and " if report["traced"] else "") + "the reply, token for token "
                     "(reference with llama.cpp's float16 GELU table and self-conditioning embedding emulated)")
    elif report["agree"]:
        lines += ["AGREE up to near ties: the free-running runs part where a margin is within float rounding:"] + \
            [f"  {p}" for p in report["problems"]]
    else:
        lines += ["DIFFER:"] + [f"  {p}" for p in report["problems"] + (forced or {}).get("beyond_tolerance", [])[:5]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line
def add_arguments(parser) -> None:
    """The llama.cpp options of ``diffusiongemma crosscheck``."""
    parser.add_argument("--llama-bin", default=None, metavar="PATH",
                        help="llama.cpp's llama-diffusion-cli (peer llama.cpp only; see docs/PEERS.md)")
    parser.add_argument("--prompt", default="And God said", help="prompt text for llama.cpp (peer llama.cpp)")
    from diffusiongemma.cli.argtypes import positive_float, positive_int

    parser.add_argument("--llama-timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="stop a llama.cpp run that takes longer, with an error (peer llama.cpp)")
    parser.add_argument("-n", "--n-predict", type=positive_int, default=None,
                        help="tokens to generate, rounded up to whole canvases (peer llama.cpp; default one canvas)")
    parser.add_argument("--gguf-type", choices=("f32", "f16", "q8_0"), default="f32",
                        help="storage type of the GGUF written for llama.cpp (peer llama.cpp)")


def run(args) -> int:
    """``diffusiongemma crosscheck llama.cpp ...``: 0 agree, 1 differ, 2 no usable binary / bad input."""
    import sys

    from diffusiongemma.reference import CheckpointError, ConfigError, InputError

    seed = int(args.seed) if args.seed is not None else 1
    try:
        report = crosscheck_llama_cpp(args.llama_bin, args.model, prompt=args.prompt, seed=seed,
                                      n_predict=args.n_predict, gguf_type=args.gguf_type,
                                      timeout=getattr(args, "llama_timeout", DEFAULT_TIMEOUT),
                                      notice=lambda line: print(f"diffusiongemma crosscheck: {line}", file=sys.stderr,
                                                                flush=True))
    except LlamaCppUnavailable as exc:
        print(f"diffusiongemma crosscheck: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, InputError) as exc:
        print(f"diffusiongemma crosscheck: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if getattr(args, "json", False) else report_text(report))
    return 0 if report["agree"] else 1
