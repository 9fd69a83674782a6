"""Train a tiny DiffusionGemma on the King James Bible with the block-diffusion objective.

The model is the official ``transformers`` class ``DiffusionGemmaForBlockDiffusion`` (CPU, fp32); this
script adds only what no released ``transformers`` forward has: the forward (noising) process and the
loss. The objective is the project's canonical one (TRAINING.md §9, TRL's recipe with the sliding-window
fix of §2.3):

* an example is ``x = [prompt | response]``: the prompt is ``<bos>``, optionally the previous verse, and
  the first few words of a verse; the response is the rest of that verse. The response is cut into
  canvases of C tokens; one canvas k is chosen uniformly, its target is the response tokens it covers
  with ``<eos>`` filling the tail of the last canvas (so the model learns to stop at the end of a verse);
* one encoder pass over the clean ``x`` (causal) gives both the autoregressive co-loss (token mean over
  every valid next-token pair, prompt included) and the K/V cache the decoder reads. The cache is an
  untrimmed ``DynamicCache()``, and the decoder gets explicit 4-D masks: full layers see the L = P + kC
  tokens before the canvas, sliding layers only the last W - 1 of them (block-anchored), canvas keys are
  always visible. This is exactly the inference geometry (encode the L-token prefix, then decode);
* the canvas is corrupted with the uniform-state kernel at rate t = eps + (1 - eps) u, eps = 1e-3;
* decoder pass 1 (no gradient, no self-conditioning) gives logits z1; pass 2 gets z1 raw as
  ``self_conditioning_logits`` with ``self_conditioning_mask = u_sc < 0.5`` per example;
* loss = mean CE over all B*C canvas positions of pass 2 (no time weighting) + the AR co-loss.

Random draws per step, from one CPU ``torch.Generator`` in TRL's order (TRAINING.md §8.1): u_blk (B),
u_t (B, 1), u_cor (B, C), r = randint(V, (B, C)), u_sc (B). ``diffusiongemma.reference.noising`` replays
them in NumPy; ``tests/test_noising.py`` checks that the pure functions below match it.

Importing this module has no side effects (torch/transformers are imported inside functions where heavy).

Usage (after ``python examples/prepare_data.py``)::

    OMP_NUM_THREADS=1 python examples/train_tiny.py --out diffusiongemma/assets/tiny-kjv --max-minutes 70
"""

from __future__ import annotations

import time

_T_START = time.time()  # the --minutes budget counts from here: imports, data and model setup included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from diffusiongemma.tiny import BOS_ID, EOS_ID, FULL, PAD_ID, SLIDING, TinySpec, hf_config  # noqa: F401,E402

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------------
# configuration


@dataclass
class ModelSpec(TinySpec):
    """Shape of the shipped tiny model: the package's ``TinySpec`` with these defaults (``hf_config`` builds
    its ``DiffusionGemmaConfig``: image ids at V-1, V-2, V-3, the reserved tokenizer specials)."""

    vocab_size: int = 4096  # tokenizer size; the top three ids are the reserved image specials
    hidden_size: int = 160  # H
    intermediate_size: int = 320  # dense MLP and self-conditioning MLP width
    moe_intermediate_size: int = 160  # per-expert width
    layer_types: list = field(default_factory=lambda: [SLIDING, FULL, SLIDING, FULL])  # last must be F
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # sliding layers (GQA group 2)
    num_global_key_value_heads: int = 1  # full layers (GQA group 4)
    head_dim: int = 32  # sliding layers
    global_head_dim: int = 64  # full layers
    num_experts: int = 8
    top_k_experts: int = 2
    sliding_window: int = 16  # W: shorter than most prompts, so the window is exercised
    canvas_length: int = 32  # C


PRESETS = {
    # the shipped tiny-kjv model (4.20 M text parameters at vocab 4096)
    "shipped": {},
    # the largest size the README's first command affords on a 2-core CPU (examples/time_generate.py
    # measures it: random weights, 256 new tokens, 16 steps per canvas, --backend reference and cpu)
    "cpu-max": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                    layer_types=[SLIDING, FULL, SLIDING, FULL, SLIDING, FULL], num_attention_heads=4,
                    num_key_value_heads=2, num_global_key_value_heads=1, head_dim=64, global_head_dim=128,
                    num_experts=8, top_k_experts=2, sliding_window=32, canvas_length=32),
    # cpu-max with four layers and narrower experts: 8.7 M parameters, a bf16 file as large as the
    # shipped fp32 one (17 MiB)
    "cpu-mid": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=192,
                    layer_types=[SLIDING, FULL, SLIDING, FULL], num_attention_heads=4,
                    num_key_value_heads=2, num_global_key_value_heads=1, head_dim=64, global_head_dim=128,
                    num_experts=8, top_k_experts=2, sliding_window=32, canvas_length=32),
    # seconds-sized, for tests/test_train_pipeline.py (every code path, no quality)
    "test": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, layer_types=[SLIDING, FULL],
                 num_attention_heads=2, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16,
                 global_head_dim=16, num_experts=4, top_k_experts=2, sliding_window=8, canvas_length=8),
}


def preset_spec(name: str, vocab_size: int = 4096) -> ModelSpec:
    """The ``ModelSpec`` of preset ``name`` (a key of ``PRESETS``) with ``vocab_size`` (the tokenizer's).
    Raises ValueError naming the preset when it is unknown."""
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    return ModelSpec(**{**PRESETS[name], "vocab_size": vocab_size})


@dataclass
class TrainConfig:
    """Training knobs (defaults: the shipped running-text run, on the CPU)."""

    data_dir: str = str(HERE / "data")  # output of prepare_data.py
    out: str = str(HERE.parent / "diffusiongemma" / "assets" / "tiny-kjv")  # checkpoint directory
    log: str = str(HERE / "train_log.txt")  # loss log (appended; every line is also printed)
    preset: str = "shipped"  # model size: a key of PRESETS
    device: str = "auto"  # auto (cuda when available), cpu or cuda
    amp: str = "auto"  # bf16 autocast: auto (on CUDA only), bf16 (also on the CPU: tests the path), off
    batch_size: int = 16  # B
    data: str = "chapters"  # "chapters": running text (make_running_batch); "verses": one verse + EOS
    max_context: int = 224  # chapters: most context tokens before the canvas (prompt is <bos> + these)
    short_context: int = 48  # chapters: with probability p_short the context is at most this long
    p_short: float = 0.5  # chapters: share of examples with a short context (a short prompt, as at use)
    max_prev_tokens: int = 48  # verses: the previous verse is cut to its last this-many tokens
    p_prev: float = 0.5  # verses: probability that the prompt starts with the previous verse
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_frac: float = 0.1  # the cosine ends at lr * min_lr_frac
    warmup_steps: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eps: float = 1e-3  # t = eps + (1 - eps) u
    p_self_cond: float = 0.5  # per-example self-conditioning probability
    w_enc: float = 1.0  # weight of the encoder AR co-loss
    minutes: float = 70.0  # wall-clock budget of this process, setup, evaluations and saves included
    max_steps: int = 0  # 0 = no step limit; else the run ends (and the cosine is scheduled) at this step
    session_steps: int = 0  # 0 = no limit; else this process stops after this many steps (resumable)
    schedule_minutes: float = 0.0  # training minutes the cosine spans (0: what the budget leaves)
    save_every_minutes: float = 10.0
    log_every: int = 25
    eval_every: int = 0  # held-out loss every this many steps (0: every eval_every_minutes)
    eval_every_minutes: float = 5.0
    eval_batches: int = 4  # held-out batches per evaluation (the same windows every time)
    storage: str = "fp32"  # dtype of the saved weights: fp32 or bf16 (training always keeps fp32)
    seed: int = 0
    threads: int = 1  # torch.set_num_threads (CPU)
    init_from: str = ""  # start from this checkpoint's weights (fresh optimizer and schedule); "" = scratch
    resume: str = ""  # continue a run from its state file (or the checkpoint folder beside it)


# ----------------------------------------------------------------------------------------------------
# checking the options (every one, before anything is read or written)

MAX_BATCH = 4096  # B: a step holds B x (context + canvas) x vocab logits; beyond this a step cannot end soon
MAX_TOKENS = 8192  # --max-context, --short-context, --max-prev-tokens: the model's context is far shorter
MAX_EVAL_BATCHES = 1024  # held-out batches are built up front: more would take minutes before the first step
MAX_SEED = 2**32 - 1  # numpy's default_rng and torch.manual_seed both take it


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_config(cfg: TrainConfig, what: str = "") -> None:
    """Refuse, with ``ValueError`` naming the option and the value (``what`` prefixed: e.g. the state file a
    resumed run's settings came from), any setting of the wrong type or outside its range, and an ``--out``
    that would clobber something that is not a checkpoint: an existing file, a non-empty folder without
    train_meta.json, the data folder, a folder inside it or one that holds it."""
    def bad(name, value, rule):
        raise ValueError(f"{what}{_option(name)} must be {rule}, got {value!r}")

    choices = dict(preset=sorted(PRESETS), device=["auto", "cpu", "cuda"], amp=["auto", "bf16", "off"],
                   data=["chapters", "verses"], storage=["fp32", "bf16"])
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            bad(name, getattr(cfg, name), "one of " + ", ".join(allowed))
    ints = dict(batch_size=(1, MAX_BATCH), max_context=(0, MAX_TOKENS), short_context=(0, MAX_TOKENS),
                max_prev_tokens=(0, MAX_TOKENS), warmup_steps=(0, None), max_steps=(0, None), session_steps=(0, None),
                log_every=(1, None), eval_every=(0, None), eval_batches=(1, MAX_EVAL_BATCHES), seed=(0, MAX_SEED),
                threads=(1, max(os.cpu_count() or 1, 1)))
    for name, (low, high) in ints.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            bad(name, value, "an integer")
        if value < low or (high is not None and value > high):
            bad(name, value, f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}")
    # (low, high, low inclusive, high inclusive); None: unbounded
    reals = dict(p_short=(0, 1, True, True), p_prev=(0, 1, True, True), lr=(0, 1, False, True),
                 min_lr_frac=(0, 1, True, True), weight_decay=(0, None, True, None), grad_clip=(0, None, False, None),
                 eps=(0, 1, False, False), p_self_cond=(0, 1, True, True), w_enc=(0, None, True, None),
                 minutes=(0, 60 * 24 * 365, False, True), schedule_minutes=(0, None, True, None),
                 save_every_minutes=(0, None, False, None), eval_every_minutes=(0, None, False, None))
    for name, (low, high, low_in, high_in) in reals.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad(name, value, "a finite number")
        if (value < low if low_in else value <= low) or (high is not None and (value > high if high_in else value >= high)):
            rule = ("[" if low_in else "(") + f"{low}, " + (f"{high}" + ("]" if high_in else ")") if high is not None
                                                             else "inf)")
            bad(name, value, "in " + rule)
    if cfg.short_context > cfg.max_context:
        raise ValueError(f"{what}--short-context ({cfg.short_context}) must not exceed --max-context ({cfg.max_context})")
    for name in ("data_dir", "out", "log"):
        if not getattr(cfg, name).strip():
            bad(name, getattr(cfg, name), "a path")
    check_out(cfg, what)


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_out(cfg: TrainConfig, what: str = "") -> None:
    """``--out`` may name a new path or a checkpoint folder this script wrote (it holds train_meta.json): the
    save renames it away and back, so anything else there would be lost. ``--log`` must not be a folder."""
    out, data = Path(cfg.out).resolve(), Path(cfg.data_dir).resolve()
    if out.is_file() or out.is_symlink() and not out.exists():
        raise ValueError(f"{what}--out {cfg.out}: is a file; give a folder for the checkpoint (a new one, or one "
                         "this script wrote)")
    if _inside(out, data) or _inside(data, out):
        raise ValueError(f"{what}--out {cfg.out}: {'is inside' if _inside(out, data) else 'holds'} the data folder "
                         f"{cfg.data_dir}; saving renames --out away, which would break the data: give a folder "
                         "outside it")
    if out.is_dir() and any(out.iterdir()) and not (out / "train_meta.json").is_file():
        raise ValueError(f"{what}--out {cfg.out}: is a folder with other files (no train_meta.json of an earlier "
                         "run); saving replaces it whole, so give a new folder")
    for sibling in (out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")):
        if sibling.exists() and not sibling.is_dir():
            raise ValueError(f"{what}--out {cfg.out}: {sibling} is in the way (a file where the save puts its "
                             "temporary folder); move it")
    state = state_path(str(out))
    if state.exists() and not state.is_file():
        raise ValueError(f"{what}--out {cfg.out}: {state} (where the training state goes) is not a file")
    if Path(cfg.log).is_dir():
        raise ValueError(f"{what}--log {cfg.log}: is a folder; give a file for the loss log")


def read_tokenizer(path: Path):
    """The ``tokenizers.Tokenizer`` of ``path``; ``ValueError`` naming the file when it does not load or has
    too few ids for the specials (ids 0-4 and the top three)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a damaged file
        raise ValueError(f"{path}: not a readable tokenizer ({' '.join(str(exc).split())[:200]}); run "
                         "examples/prepare_data.py again") from None
    if tokenizer.get_vocab_size() < 16:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.get_vocab_size()} ids; it needs at least 16")
    return tokenizer


def read_corpus(path: Path) -> list[str]:
    """The non-blank lines of a prepared text file; ``ValueError`` naming it when it is not UTF-8 text (a
    binary file: a NUL byte or bytes that do not decode) or holds no text at all."""
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run examples/prepare_data.py first")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); run examples/prepare_data.py again") from None
    if "\0" in text:
        raise ValueError(f"{path}: a binary file (NUL byte at {text.index(chr(0))}), not text")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: {'empty' if not raw else 'only blank lines'}: no text to train or evaluate on")
    return lines


# ----------------------------------------------------------------------------------------------------
# the forward (noising) process and the loss: pure torch functions (mirrored by reference/noising.py)


def draw_noise(gen: torch.Generator, batch: int, canvas: int, vocab: int) -> dict:
    """The five random arrays of one step, in TRL's order from one CPU generator (TRAINING.md §8.1).

    Returns {"u_blk": float32 (B,), "u_t": float32 (B, 1), "u_cor": float32 (B, C),
    "r": int64 (B, C) in [0, V), "u_sc": float32 (B,)}.
    """
    u_blk = torch.rand(batch, generator=gen)
    u_t = torch.rand(batch, 1, generator=gen)
    u_cor = torch.rand(batch, canvas, generator=gen)
    r = torch.randint(vocab, (batch, canvas), generator=gen)
    u_sc = torch.rand(batch, generator=gen)
    return dict(u_blk=u_blk, u_t=u_t, u_cor=u_cor, r=r, u_sc=u_sc)


def num_canvases(resp_len: torch.Tensor, canvas: int) -> torch.Tensor:
    """n = ceil(R / C) per row; ``resp_len`` int64 (B,) must be >= 1 (ValueError otherwise)."""
    if bool((resp_len < 1).any()):
        raise ValueError(f"every response needs >= 1 token, got lengths {resp_len.tolist()}")
    return (resp_len - 1) // canvas + 1


def select_canvas(u_blk: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Canvas index k = trunc(float32(u * n)), clamped to n - 1 (TRL/NeMo ``floor(u n)``).

    u_blk float32 (B,) in [0, 1); n int64 (B,) >= 1. Returns int64 (B,).
    """
    k = (u_blk.to(torch.float32) * n.to(torch.float32)).to(torch.int64)
    return torch.minimum(k, n - 1)


def canvas_targets(x: torch.Tensor, prompt_len: torch.Tensor, resp_len: torch.Tensor, k: torch.Tensor,
                   canvas: int, eos_id: int = EOS_ID) -> torch.Tensor:
    """Targets y (B, C) int64: response tokens k*C .. k*C+C-1 of each row, EOS where past the response.

    x int64 (B, S) = [prompt | response | pad]; prompt_len, resp_len, k int64 (B,).
    """
    off = k[:, None] * canvas + torch.arange(canvas, device=x.device)[None, :]  # (B, C) response offsets
    inside = off < resp_len[:, None]
    idx = torch.where(inside, prompt_len[:, None] + off, torch.zeros_like(off))
    return torch.where(inside, torch.gather(x, 1, idx), torch.full_like(off, eos_id))


def time_from_uniform(u_t: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """t = eps + (1 - eps) * u in float32 (multiply, then add); u_t float32 (B, 1) -> t float32 (B, 1)."""
    return (torch.tensor(eps, dtype=torch.float32, device=u_t.device)
            + torch.tensor(1.0 - eps, dtype=torch.float32, device=u_t.device) * u_t)


def corrupt(y: torch.Tensor, t: torch.Tensor, u_cor: torch.Tensor, r: torch.Tensor):
    """Uniform-state corruption: position j is corrupted iff u_cor[j] < t, and then becomes r[j].

    y int64 (B, C); t float32 (B, 1); u_cor float32 (B, C); r int64 (B, C).
    Returns (x_noisy int64 (B, C), corrupted bool (B, C)). r may equal y (still flagged corrupted).
    """
    corrupted = u_cor < t
    return torch.where(corrupted, r, y), corrupted


def self_cond_mask(u_sc: torch.Tensor, p: float = 0.5) -> torch.Tensor:
    """Per-example self-conditioning coin s = u_sc < p; float32 (B,) -> bool (B,)."""
    return u_sc < p


def diffusion_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean CE over every canvas position (corrupted or not, EOS fill included), no time weight.

    logits float32 (B, C, V) soft-capped; y int64 (B, C). Returns a scalar.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def ar_loss(logits: torch.Tensor, x: torch.Tensor, valid: torch.Tensor, reduction: str = "token"):
    """Encoder next-token CE over pairs (i, i+1) with both positions valid.

    logits float32 (B, S, V) soft-capped; x int64 (B, S); valid bool/int (B, S).
    reduction "token" (TRL/NeMo: sum / number of pairs) or "example" (JAX: per-row mean, then batch
    mean; rows without pairs count as 0). Raises ValueError for another reduction or no pair at all.
    """
    pair = (valid[:, :-1] != 0) & (valid[:, 1:] != 0)  # (B, S-1)
    ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), x[:, 1:], reduction="none")  # (B, S-1)
    ce = ce * pair
    if not bool(pair.any()):
        raise ValueError("ar_loss: no valid next-token pair in the batch")
    if reduction == "token":
        return ce.sum() / pair.sum()
    if reduction == "example":
        return (ce.sum(1) / pair.sum(1).clamp(min=1)).mean()
    raise ValueError(f"reduction must be 'token' or 'example', got {reduction!r}")


def decoder_masks(context_len: torch.Tensor, valid: torch.Tensor, canvas: int, window: int,
                  dtype=torch.float32) -> dict:
    """Additive decoder masks for an untrimmed encoder cache of S tokens (TRAINING.md §2.3).

    context_len int64 (B,) = L = P + kC; valid (B, S) keep-mask of the encoder input.
    Returns {"full_attention", "sliding_attention"}: dtype (B, 1, C, S + C), 0 = visible, dtype min =
    hidden. Full: encoder key i visible iff i < L and valid; sliding: also i >= L - (W - 1);
    canvas keys always visible.
    """
    B, S = valid.shape
    dev = valid.device
    i = torch.arange(S, device=dev)[None, :]
    L = context_len[:, None]
    full = (i < L) & (valid != 0)
    slide = full & (i >= L - (window - 1))
    neg = torch.finfo(dtype).min
    out = {}
    for name, keep in ((FULL, full), (SLIDING, slide)):
        keep = torch.cat([keep, torch.ones(B, canvas, dtype=torch.bool, device=dev)], dim=1)  # (B, S + C)
        zero, hidden = torch.tensor(0.0, dtype=dtype, device=dev), torch.tensor(neg, dtype=dtype, device=dev)
        m = torch.where(keep, zero, hidden)
        out[name] = m[:, None, None, :].expand(B, 1, canvas, S + canvas)
    return out


def softcap_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Soft-capped fp32 logits c * tanh(lm_head(h) / c), as the HF forward computes them."""
    c = model.final_logit_softcapping
    return torch.tanh(model.lm_head(hidden).float() / c) * c


def training_forward(model, x, valid, prompt_len, resp_len, noise, eps=1e-3, p_sc=0.5,
                     w_enc=1.0, ar_reduction="token"):
    """One step's loss for a batch. Returns dict(loss, diff, ar) (scalars, ``loss`` differentiable).

    x int64 (B, S) right-padded [prompt | response]; valid (B, S); prompt_len, resp_len int64 (B,);
    noise = ``draw_noise(...)`` output.
    """
    from transformers import DynamicCache

    C = model.config.canvas_length
    W = model.config.text_config.sliding_window
    k = select_canvas(noise["u_blk"], num_canvases(resp_len, C))
    y = canvas_targets(x, prompt_len, resp_len, k, C)
    t = time_from_uniform(noise["u_t"], eps)
    x_noisy, _ = corrupt(y, t, noise["u_cor"], noise["r"])
    s = self_cond_mask(noise["u_sc"], p_sc)
    L = prompt_len + k * C
    masks = decoder_masks(L, valid, C, W)
    pos = L[:, None] + torch.arange(C, device=x.device)[None, :]  # (B, C) absolute canvas positions

    enc = model.model.encoder(input_ids=x, attention_mask=valid.long(), cache=DynamicCache())
    ar = ar_loss(softcap_logits(model, enc.last_hidden_state), x, valid, ar_reduction)
    cache = enc.cache
    with torch.no_grad():
        z1 = model(cache=cache, decoder_input_ids=x_noisy, decoder_attention_mask=masks,
                   decoder_position_ids=pos).logits
    z = model(cache=cache, decoder_input_ids=x_noisy, decoder_attention_mask=masks,
              decoder_position_ids=pos, self_conditioning_logits=z1.detach(),
              self_conditioning_mask=s).logits
    diff = diffusion_loss(z, y)
    return dict(loss=diff + w_enc * ar, diff=diff.detach(), ar=ar.detach())


# ----------------------------------------------------------------------------------------------------
# data


def load_verses(data_dir: str, split: str, tokenizer) -> tuple[list, list]:
    """Token ids of each verse of ``split`` ("train"/"test"): (plain, with a leading space).

    The leading-space form is used when the verse follows another one inside the prompt.
    """
    path = Path(data_dir) / f"kjv_{split}.txt"
    lines = read_corpus(path)
    if len(lines) < 2:  # make_batch draws a verse after the first one
        raise ValueError(f"{path}: {len(lines)} verse; the verse data needs at least 2")
    bare = dict(add_special_tokens=False)  # <bos> is added by make_batch
    plain = [np.asarray(e.ids, np.int64) for e in tokenizer.encode_batch(lines, **bare)]
    spaced = [np.asarray(e.ids, np.int64) for e in tokenizer.encode_batch([" " + ln for ln in lines], **bare)]
    return plain, spaced


def make_batch(rng: np.random.Generator, plain: list, spaced: list, batch: int,
               max_prev: int = 48, p_prev: float = 0.5):
    """Sample ``batch`` examples: prompt = <bos> [+ tail of previous verse] + first words of a verse,
    response = the rest of that verse (>= 1 token). Returns torch tensors
    (x int64 (B, S), valid bool (B, S), prompt_len int64 (B,), resp_len int64 (B,)), right-padded."""
    rows, P, R = [], [], []
    n = len(plain)
    for _ in range(batch):
        i = int(rng.integers(1, n))
        use_prev = rng.random() < p_prev
        verse = spaced[i] if use_prev else plain[i]
        cut = int(rng.integers(0, len(verse)))  # prompt keeps verse[:cut], response verse[cut:]
        prev = plain[i - 1][-max_prev:] if use_prev else np.zeros(0, np.int64)
        prompt = np.concatenate([[BOS_ID], prev, verse[:cut]]).astype(np.int64)
        rows.append(np.concatenate([prompt, verse[cut:]]))
        P.append(len(prompt))
        R.append(len(verse) - cut)
    S = max(len(r) for r in rows)
    x = np.full((batch, S), PAD_ID, np.int64)
    valid = np.zeros((batch, S), bool)
    for b, r in enumerate(rows):
        x[b, :len(r)] = r
        valid[b, :len(r)] = True
    return (torch.from_numpy(x), torch.from_numpy(valid), torch.tensor(P, dtype=torch.int64),
            torch.tensor(R, dtype=torch.int64))


def load_chapters(data_dir: str, split: str, tokenizer) -> list:
    """Token ids (int64 arrays, no specials) of each chapter of ``split`` ("train"/"test") of the
    running-text files ``kjv_chapters_{split}.txt`` written by prepare_data.py (one chapter a line)."""
    path = Path(data_dir) / f"kjv_chapters_{split}.txt"
    lines = read_corpus(path)
    return [np.asarray(e.ids, np.int64) for e in tokenizer.encode_batch(lines, add_special_tokens=False)]


def make_running_batch(rng: np.random.Generator, chapters: list, batch: int, canvas: int,
                       max_context: int = 224, short_context: int = 48, p_short: float = 0.5):
    """Sample ``batch`` windows of running text: the canvas starts at a token j drawn uniformly over all
    tokens of all chapters; the prompt is <bos> + up to n tokens before j inside the same chapter (n
    uniform in [0, short_context] with probability p_short, else in [0, max_context]); the response is
    the next ``canvas`` tokens, fewer at the chapter end, where ``canvas_targets`` fills the rest with
    <eos>. So <eos> is seen only after the last verse of a chapter, never between verses, and the
    response is one canvas (n = 1, k = 0: the context plays the part of the earlier canvases).
    Returns torch tensors (x int64 (B, S), valid bool (B, S), prompt_len int64 (B,), resp_len int64
    (B,)), right-padded, as ``make_batch``."""
    lens = np.asarray([len(c) for c in chapters], np.int64)
    ends = np.cumsum(lens)
    rows, P, R = [], [], []
    for _ in range(batch):
        g = int(rng.integers(0, int(ends[-1])))
        ci = int(np.searchsorted(ends, g, side="right"))
        ch = chapters[ci]
        j = g - int(ends[ci] - lens[ci])
        hi = short_context if rng.random() < p_short else max_context
        n = int(rng.integers(0, hi + 1))
        prompt = np.concatenate([[BOS_ID], ch[max(0, j - n):j]]).astype(np.int64)
        resp = ch[j:j + canvas]
        rows.append(np.concatenate([prompt, resp]))
        P.append(len(prompt))
        R.append(len(resp))
    S = max(len(r) for r in rows)
    x = np.full((batch, S), PAD_ID, np.int64)
    valid = np.zeros((batch, S), bool)
    for b, r in enumerate(rows):
        x[b, :len(r)] = r
        valid[b, :len(r)] = True
    return (torch.from_numpy(x), torch.from_numpy(valid), torch.tensor(P, dtype=torch.int64),
            torch.tensor(R, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------------
# checkpointing


def generation_defaults(spec: ModelSpec) -> dict:
    """Sampler defaults stored in generation_config.json (the class's own sampler, scaled to C=32):
    256 new tokens, i.e. 8 canvases of running text unless the model closes the chapter with <eos>."""
    return dict(max_new_tokens=256, max_denoising_steps=16,
                sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
                t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=BOS_ID)


class SaveError(OSError):
    """A checkpoint or state that could not be written (its errno kept); the message names the file."""

    def __str__(self) -> str:
        return str(self.strerror)


def save_checkpoint(model, out: str, tokenizer_path: Path, spec: ModelSpec, meta: dict,
                    storage: str = "fp32", trial: bool = False) -> float:
    """Write model (safetensors in ``storage``: "fp32" or "bf16"), tokenizer.json (+ tokenizer_config.json
    when the data folder has one), generation_config.json and train_meta.json to ``out`` through a
    sibling temporary directory, then swap it in (no half-written checkpoint). The model in memory is not
    changed (bf16 storage saves a rounded copy). ``trial``: write the temporary directory and remove it,
    leaving ``out`` alone (what a save costs). A failed write (a full disk) removes the temporary directory
    and raises ``OSError`` naming ``out``; the old checkpoint stays. Returns the seconds it took."""
    import copy

    from transformers import GenerationConfig

    t0 = time.time()
    if storage not in ("fp32", "bf16"):
        raise ValueError(f"--storage must be fp32 or bf16, got {storage!r}")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        model.generation_config = GenerationConfig(**generation_defaults(spec))
        if storage == "bf16":
            copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(tmp)
        else:
            model.save_pretrained(tmp)
        shutil.copy(tokenizer_path, tmp / "tokenizer.json")
        if (tokenizer_path.parent / "tokenizer_config.json").exists():
            shutil.copy(tokenizer_path.parent / "tokenizer_config.json", tmp / "tokenizer_config.json")
        (tmp / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(exc.errno, f"cannot write the checkpoint {out}: {exc.strerror or exc}; the previous one "
                                   "is kept") from None
    if trial:
        shutil.rmtree(tmp)
        return time.time() - t0
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)
    return time.time() - t0


STATE_FORMAT = "diffusiongemma-train-state"  # the safetensors metadata key "format" of a training state
STATE_VERSION = 1


def state_path(out: str) -> Path:
    """Where a run keeps its resumable state: ``<out>.train_state.safetensors`` beside the checkpoint folder
    (not inside it, so the checkpoint stays the few files a user needs)."""
    out = Path(out)
    return out.with_name(out.name + ".train_state.safetensors")


def state_tensors(model, opt, gen: torch.Generator, cuda: bool) -> dict:
    """The tensors of a training state: ``model/<name>`` (fp32 weights, each its own copy: tied weights
    share memory, which safetensors refuses), ``optim/<param index>/<key>`` (AdamW's step and moments) and
    ``rng/noise``, ``rng/torch`` (and ``rng/cuda``) as uint8."""
    out = {f"model/{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    for index, slot in opt.state_dict()["state"].items():
        for key, value in slot.items():
            out[f"optim/{index}/{key}"] = torch.as_tensor(value).detach().to("cpu", copy=True).contiguous()
    out["rng/noise"] = gen.get_state().clone()
    out["rng/torch"] = torch.get_rng_state().clone()
    if cuda:
        out["rng/cuda"] = torch.cuda.get_rng_state().clone()
    return out


def save_state(path: Path, tensors: dict, info: dict) -> None:
    """Write a training state: ``tensors`` (see ``state_tensors``) as safetensors, ``info`` (settings, step,
    schedule, held-out history, the optimizer's param groups, the data sampler's NumPy state: plain JSON)
    in its metadata. Through a temporary file, then rename: a stopped run leaves the old state whole; a
    failed write (a full disk) removes the temporary file and raises ``OSError`` naming ``path``."""
    from safetensors.torch import save

    data = save(tensors, metadata={"format": STATE_FORMAT, "version": str(STATE_VERSION),
                                   "info": json.dumps(info)})
    write_file_atomic(path, data, "the training state")


def write_file_atomic(path: Path, data: bytes, what: str) -> None:
    """``data`` into ``path`` through ``<path>.tmp`` (flushed, then renamed); on any ``OSError`` the temporary
    file is removed and the error names ``what`` and ``path`` (the old file, if any, is kept)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SaveError(exc.errno, f"cannot write {what} {path}: {exc.strerror or exc}; nothing was replaced") from None


def load_state(path: Path) -> tuple[dict, dict]:
    """(tensors, info) of a training state written by ``save_state``. Nothing in the file is executed: a
    pickled state of an earlier version (``*.train_state.pt``) or any other file is refused with
    ``ValueError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    raw = Path(path).read_bytes()
    if raw[:2] == b"\x80\x02" or raw[:4] == b"PK\x03\x04" or Path(path).suffix == ".pt":
        raise ValueError(f"--resume {path}: a pickled training state (torch.save, an earlier version of this "
                         "script); it is not loaded, because unpickling runs code from the file. Resume from a "
                         "*.train_state.safetensors file, or start again")
    try:
        import safetensors

        with safetensors.safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load(raw)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"--resume {path}: not a training state (not a readable safetensors file: "
                         f"{' '.join(str(exc).split())})") from None
    if meta.get("format") != STATE_FORMAT or meta.get("version") != str(STATE_VERSION):
        raise ValueError(f"--resume {path}: not a training state of this script (format "
                         f"{meta.get('format')!r} version {meta.get('version')!r}; wanted {STATE_FORMAT!r} "
                         f"version {STATE_VERSION})")
    try:
        info = json.loads(meta.get("info", ""))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--resume {path}: the state's settings are damaged ({exc})") from None
    need = {"cfg", "spec", "step", "train_seconds", "schedule_seconds", "warmup_seconds", "evals",
            "numpy_rng", "param_groups"}
    if not isinstance(info, dict) or not need <= set(info):
        have = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"--resume {path}: the state's settings lack {sorted(need - set(info or {}))} "
                         f"(has {have})")
    for key in ("rng/noise", "rng/torch"):
        if key not in tensors:
            raise ValueError(f"--resume {path}: the state has no tensor {key!r}")
    return tensors, info


def optimizer_state(tensors: dict, param_groups: list) -> dict:
    """AdamW's ``state_dict`` from a state's ``optim/<index>/<key>`` tensors and its JSON param groups."""
    state: dict = {}
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": param_groups}


# ----------------------------------------------------------------------------------------------------
# training loop


def data_split(data: str) -> dict:
    """Which text the run trained on and which it held out, as written into train_meta.json (the split
    itself is made by examples/prepare_data.py, whose constants are read here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_data", HERE / "prepare_data.py")
    pd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pd)
    test_verses = f"every {pd.TEST_EVERY}th verse (verse index i % {pd.TEST_EVERY} == {pd.TEST_EVERY - 1})"
    if data == "chapters":
        return dict(train="kjv_chapters_train.txt: every chapter outside the held-out books, "
                          "its verses joined by spaces, without the test verses",
                    heldout_books=list(pd.HELDOUT_BOOKS), heldout_verses=test_verses,
                    eos="only where a chapter ends (the canvas fill after its last token)")
    return dict(train="kjv_train.txt: one verse per example", heldout_verses=test_verses,
                eos="after every verse")


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over ``warmup_steps``, then a cosine from ``lr`` to ``lr * min_lr_frac`` over
    ``progress`` in [0, 1]: the share of the steps (``max_steps``) or of the training time (the budget)
    after the warmup that has passed."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(max(progress, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_model(spec: ModelSpec, seed: int):
    """A freshly initialised fp32 eager ``DiffusionGemmaForBlockDiffusion`` for ``spec``."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                        attn_implementation="eager")


def text_params(spec: ModelSpec) -> int:
    """Parameters of a model of ``spec`` outside the vision tower (built on the meta device: no memory)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        model = DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32)
    return sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)


def pick_device(name: str) -> torch.device:
    """``auto``: cuda when torch sees a GPU, else cpu; ``cuda`` without a GPU is an error."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resume_file(path: str) -> Path:
    """The state file named by ``--resume``: the file itself, or the one beside a checkpoint folder (an
    earlier version's pickled ``.train_state.pt`` there is named and refused by ``load_state``)."""
    p = Path(path)
    if p.is_dir():
        old = p.with_name(p.name + ".train_state.pt")
        p = state_path(str(p))
        if not p.is_file() and old.is_file():
            p = old
    if not p.is_file():
        raise FileNotFoundError(f"--resume {path}: no training state at {p}")
    return p


class Budget:
    """The wall-clock budget of one process: ``minutes`` from ``t0``. ``allows(seconds)`` says whether
    something estimated to take ``seconds`` still fits while keeping ``reserve`` seconds (the final
    evaluation and save, with a margin) for the end."""

    def __init__(self, minutes: float, t0: float):
        self.t0, self.deadline = t0, t0 + minutes * 60
        self.reserve = 0.0

    def left(self) -> float:
        return self.deadline - time.time()

    def allows(self, seconds: float) -> bool:
        return self.left() - self.reserve >= seconds


def train(cfg: TrainConfig, spec: ModelSpec | None = None, t0: float | None = None) -> dict:
    """Train until ``max_steps``, ``session_steps`` or the ``minutes`` budget, whichever comes first;
    log training losses every ``log_every`` steps and held-out losses at the start, every
    ``eval_every`` steps (or ``eval_every_minutes``) and at the end; checkpoint every
    ``save_every_minutes`` and at the end (model folder ``out`` and its resumable state file, see
    ``state_path``). ``spec`` None: ``cfg.preset`` with the tokenizer's vocabulary. ``t0`` is when the
    budget started (default: now). Returns a summary dict (steps, minutes, last losses, stop reason).

    With ``resume``, the run's saved settings are used except the budget, session limit, device, data
    folder (the same files, perhaps elsewhere), log, output folder and evaluation/save cadence given now;
    the model, optimizer, step, learning-rate schedule, data sampler and noise generator continue where
    the state left them, so on one device an interrupted run gives the same weights as an uninterrupted
    one."""
    from tokenizers import Tokenizer

    t0 = time.time() if t0 is None else t0
    budget = Budget(cfg.minutes, t0)
    state = None
    check_config(cfg)  # every option, before anything is read or written
    if cfg.resume:
        state_file = resume_file(cfg.resume)
        tensors, state = load_state(state_file)
        try:
            saved = dict(state["cfg"])
            for k in ("minutes", "session_steps", "device", "amp", "data_dir", "log", "out", "resume",
                      "save_every_minutes", "eval_every", "eval_every_minutes", "log_every", "threads", "max_steps"):
                saved[k] = getattr(cfg, k)
            cfg = TrainConfig(**saved)
            spec = ModelSpec(**state["spec"])
        except TypeError as exc:  # a setting this version does not know, or one missing
            raise ValueError(f"--resume {state_file}: the state's settings do not fit this script ({exc})") from None
        check_config(cfg, what=f"--resume {state_file}: ")
    device = pick_device(cfg.device)
    cuda = device.type == "cuda"
    if cfg.amp not in ("auto", "bf16", "off"):
        raise ValueError(f"--amp must be auto, bf16 or off, got {cfg.amp!r}")
    amp = cfg.amp == "bf16" or (cfg.amp == "auto" and cuda)
    torch.set_num_threads(cfg.threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if not Path(cfg.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir {cfg.data_dir}: no such folder (examples/prepare_data.py writes it)")
    tok_path = Path(cfg.data_dir) / "tokenizer.json"
    if not tok_path.exists():
        raise FileNotFoundError(f"{tok_path} missing: run examples/prepare_data.py first")
    tokenizer = read_tokenizer(tok_path)
    spec = spec or preset_spec(cfg.preset, tokenizer.get_vocab_size())
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.get_vocab_size()} ids, model {spec.vocab_size}")
    if cfg.data == "chapters":
        chapters = load_chapters(cfg.data_dir, "train", tokenizer)
        test_chapters = load_chapters(cfg.data_dir, "test", tokenizer)
    elif cfg.data == "verses":
        plain, spaced = load_verses(cfg.data_dir, "train", tokenizer)
        test_plain, test_spaced = load_verses(cfg.data_dir, "test", tokenizer)
    else:
        raise ValueError(f"--data must be 'chapters' or 'verses', got {cfg.data!r}")
    if cfg.storage not in ("fp32", "bf16"):
        raise ValueError(f"--storage must be fp32 or bf16, got {cfg.storage!r}")

    def next_batch(rng_):
        if cfg.data == "chapters":
            return make_running_batch(rng_, chapters, cfg.batch_size, spec.canvas_length, cfg.max_context,
                                      cfg.short_context, cfg.p_short)
        return make_batch(rng_, plain, spaced, cfg.batch_size, cfg.max_prev_tokens, cfg.p_prev)

    # held-out windows and their noise: drawn once from a fixed seed, the same at every evaluation
    ev_rng, ev_gen = np.random.default_rng(10_000 + cfg.seed), torch.Generator().manual_seed(10_000 + cfg.seed)
    heldout = []
    for _ in range(cfg.eval_batches):
        if cfg.data == "chapters":
            b = make_running_batch(ev_rng, test_chapters, cfg.batch_size, spec.canvas_length, cfg.max_context,
                                   cfg.short_context, cfg.p_short)
        else:  # neighbours in the verse test split are 50 verses apart: no previous-verse context
            b = make_batch(ev_rng, test_plain, test_spaced, cfg.batch_size, cfg.max_prev_tokens, 0.0)
        heldout.append((b, draw_noise(ev_gen, cfg.batch_size, spec.canvas_length, spec.vocab_size)))

    if state is not None:
        model = build_model(spec, cfg.seed)
        weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:
            raise ValueError(f"--resume {state_file}: the weights do not fit the model of its settings "
                             f"({' '.join(str(exc).split())[:300]})") from None
    elif cfg.init_from:
        from transformers import DiffusionGemmaForBlockDiffusion

        try:
            model = DiffusionGemmaForBlockDiffusion.from_pretrained(cfg.init_from, dtype=torch.float32,
                                                                    attn_implementation="eager")
        except Exception as exc:  # transformers' own errors (OSError, ValueError, KeyError...): one line
            raise ValueError(f"--init-from {cfg.init_from}: not a checkpoint transformers can load "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
        if model.config.text_config.vocab_size != spec.vocab_size:
            raise ValueError(f"--init-from {cfg.init_from}: vocab {model.config.text_config.vocab_size}, "
                             f"tokenizer {spec.vocab_size}")
    else:
        model = build_model(spec, cfg.seed)
    model.to(device)
    model.train()
    n_params = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, train_s, schedule_s, warm_s, evals = 0, 0.0, 0.0, None, []
    if state is not None:
        try:
            opt.load_state_dict(optimizer_state(tensors, state["param_groups"]))
            step, train_s, evals = int(state["step"]), float(state["train_seconds"]), list(state["evals"])
            schedule_s = float(state["schedule_seconds"])
            warm_s = None if state["warmup_seconds"] is None else float(state["warmup_seconds"])
            rng.bit_generator.state = state["numpy_rng"]
            gen.set_state(tensors["rng/noise"])
            torch.set_rng_state(tensors["rng/torch"])
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise ValueError(f"--resume {state_file}: the optimizer or random states are damaged "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") from None
        if cuda and "rng/cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng/cuda"])
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
    log = open(cfg.log, "a", encoding="utf-8")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    def to_dev(batch, noise):
        x, valid, P, R = (t.to(device, non_blocking=True) for t in batch)
        return x, valid, P, R, {k: v.to(device, non_blocking=True) for k, v in noise.items()}

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)

    @torch.no_grad()
    def evaluate() -> tuple[dict, float]:
        te = time.time()
        model.eval()
        sums = np.zeros(3)
        for batch, noise in heldout:
            x, valid, P, R, nz = to_dev(batch, noise)
            with autocast():
                o = training_forward(model, x, valid, P, R, nz, cfg.eps, cfg.p_self_cond, cfg.w_enc)
            sums += [o["loss"].item(), o["diff"].item(), o["ar"].item()]
        model.train()
        m = sums / len(heldout)
        return dict(step=step, loss=float(m[0]), diff=float(m[1]), ar=float(m[2])), time.time() - te

    def meta() -> dict:
        return dict(step=step, train_minutes=round(train_s / 60, 2), train=asdict(cfg), model=asdict(spec),
                    text_params=n_params, device=str(device), data_split=data_split(cfg.data),
                    heldout_losses=evals[-1] if evals else None,
                    command="python examples/train_tiny.py " + " ".join(sys.argv[1:]))

    def checkpoint(trial: bool = False) -> float:
        """Save the checkpoint folder and the training state; ``trial``: write both to their temporary
        names and remove them (what a save costs, measured without touching ``out``)."""
        ts = time.time()
        save_checkpoint(model, cfg.out, tok_path, spec, meta(), cfg.storage, trial=trial)
        info = dict(cfg=asdict(cfg), spec=asdict(spec), step=step, train_seconds=train_s,
                    schedule_seconds=schedule_s, warmup_seconds=warm_s, evals=evals,
                    numpy_rng=rng.bit_generator.state, param_groups=opt.state_dict()["param_groups"])
        target = state_path(cfg.out)
        if trial:
            target = target.with_name(target.name + ".trial")
        save_state(target, state_tensors(model, opt, gen, cuda), info)
        if trial:
            target.unlink()
        return time.time() - ts

    gpu_name = f" ({torch.cuda.get_device_name(device)})" if cuda else ""
    say(f"# {'resume' if state is not None else 'start'} {time.strftime('%Y-%m-%d %H:%M:%S')} device {device}"
        f"{gpu_name}{', bf16 autocast' if amp else ''}, budget {cfg.minutes:g} min, "
        f"{budget.left() / 60:.2f} left after loading")
    say(f"# config {json.dumps(asdict(cfg))}")
    say(f"# model {json.dumps(asdict(spec))} text params {n_params}")
    ev, eval_s = evaluate()
    if state is None:
        evals.append(ev)
    say(f"eval   {step:6d}  heldout loss {ev['loss']:.4f}  diff {ev['diff']:.4f}  ar {ev['ar']:.4f}  "
        f"({eval_s:.1f} s)")
    save_s = checkpoint(trial=True)  # what a save costs; --out is first written after a training step
    say(f"# a save takes {save_s:.1f} s (measured on temporary files; {cfg.out} is written after the first step)")
    budget.reserve = 1.5 * (eval_s + save_s) + 2.0  # the final evaluation and save, with a margin
    if not schedule_s:
        schedule_s = cfg.schedule_minutes * 60 or max(budget.left() - budget.reserve, 1.0)
    # until a step has been timed, guess one step as three forwards of a held-out batch
    step_s, last_save, last_eval, session = 3 * eval_s / len(heldout), time.time(), time.time(), 0
    acc = torch.zeros(3, device=device)
    n_acc, stop = 0, "max_steps"
    while True:
        if cfg.max_steps and step >= cfg.max_steps:
            stop = "max_steps"
            break
        if cfg.session_steps and session >= cfg.session_steps:
            stop = "session_steps"
            break
        if not budget.allows(1.5 * step_s):
            stop = "time budget"
            break
        ts = time.time()
        # the cosine runs from the end of the warmup to the last step (or the end of the budget)
        if step >= cfg.warmup_steps and warm_s is None:
            warm_s = train_s
        if cfg.max_steps:
            progress = (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1)
        else:
            progress = (train_s - (warm_s or 0.0)) / max(schedule_s - (warm_s or 0.0), 1.0)
        lr = lr_at(cfg, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        x, valid, P, R, noise = to_dev(next_batch(rng), draw_noise(gen, cfg.batch_size, spec.canvas_length,
                                                                   spec.vocab_size))
        with autocast():
            out = training_forward(model, x, valid, P, R, noise, cfg.eps, cfg.p_self_cond, cfg.w_enc)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        acc += torch.stack([out["loss"].detach().float(), out["diff"].float(), out["ar"].float()])
        n_acc += 1
        step += 1
        session += 1
        if step % cfg.log_every == 0 or (cfg.max_steps and step == cfg.max_steps):
            m = (acc / n_acc).tolist()
            if not all(math.isfinite(v) for v in m):
                raise FloatingPointError(f"non-finite training loss by step {step}: {m}")
            say(f"step {step:6d}  min {(time.time() - t0) / 60:6.2f}  lr {lr:.2e}  loss {m[0]:.4f}  "
                f"diff {m[1]:.4f}  ar {m[2]:.4f}")
            acc.zero_()
            n_acc = 0
        if cuda:
            torch.cuda.synchronize()
        dt = time.time() - ts
        train_s += dt
        step_s = dt if session <= 2 else max(0.9 * step_s + 0.1 * dt, dt)  # the first steps warm up
        due_eval = (step % cfg.eval_every == 0) if cfg.eval_every else \
            time.time() - last_eval >= cfg.eval_every_minutes * 60
        if due_eval and budget.allows(eval_s + step_s):
            ev, eval_s = evaluate()
            evals.append(ev)
            last_eval = time.time()
            say(f"eval   {step:6d}  heldout loss {ev['loss']:.4f}  diff {ev['diff']:.4f}  ar {ev['ar']:.4f}")
        if time.time() - last_save >= cfg.save_every_minutes * 60 and budget.allows(save_s + step_s):
            save_s = checkpoint()
            last_save = time.time()
            say(f"# saved {cfg.out} at step {step}")
    if session == 0:  # nothing trained: --out and its state stay as they were
        minutes = (time.time() - t0) / 60
        say(f"# done ({stop}): no step fit in this process ({minutes:.2f} of {cfg.minutes:g} min); nothing saved, "
            f"{cfg.out} left as it was")
        log.close()
        return dict(step=step, session_steps=0, minutes=minutes, stop=stop, evals=evals, out=cfg.out,
                    state=str(state_path(cfg.out)), saved=False)
    if not evals or evals[-1]["step"] != step:
        ev, _ = evaluate()
        evals.append(ev)
        say(f"eval   {step:6d}  heldout loss {ev['loss']:.4f}  diff {ev['diff']:.4f}  ar {ev['ar']:.4f}")
    checkpoint()
    minutes = (time.time() - t0) / 60
    say(f"# done ({stop}): {step} steps, {session} in this process, {minutes:.2f} of {cfg.minutes:g} min; "
        f"saved {cfg.out} and {state_path(cfg.out).name}")
    log.close()
    return dict(step=step, session_steps=session, minutes=minutes, stop=stop, evals=evals,
                out=cfg.out, state=str(state_path(cfg.out)), saved=True)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ap = argparse.ArgumentParser(description="Train a tiny DiffusionGemma on the KJV Bible (CPU or GPU).")
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        flags = ["--" + name.replace("_", "-")] + (["--max-minutes"] if name == "minutes" else [])
        ap.add_argument(*flags, dest=name, type=type(value), default=value)
    args = ap.parse_args(argv)
    return TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when the run ends, 2 with one line naming the option or file for bad input or a
    failed step or save (no traceback), 130 when interrupted."""
    cfg = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars at every save: noise in a log
    try:
        # run as a script, the budget counts from its start (imports included); called from a longer-lived
        # process (a test, a notebook), from this call
        train(cfg, t0=_T_START if __name__ == "__main__" else time.time())
    except KeyboardInterrupt:
        print("train_tiny.py: interrupted (the last saved checkpoint and state are whole)", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, ArithmeticError, MemoryError) as exc:
        kind = "" if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: "
        print(f"train_tiny.py: error: {kind}{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
