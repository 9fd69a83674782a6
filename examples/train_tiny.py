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

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from diffusiongemma.tiny import BOS_ID, EOS_ID, FULL, PAD_ID, SLIDING, TinySpec, hf_config  # noqa: F401

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


@dataclass
class TrainConfig:
    """Training knobs (defaults are the shipped run)."""

    data_dir: str = str(HERE / "data")  # output of prepare_data.py
    out: str = str(HERE.parent / "diffusiongemma" / "assets" / "tiny-kjv")  # checkpoint directory
    log: str = str(HERE / "train_log.txt")  # loss log (appended every log_every steps)
    batch_size: int = 16  # B
    data: str = "chapters"  # "chapters": running text (make_running_batch); "verses": one verse + EOS
    max_context: int = 224  # chapters: most context tokens before the canvas (prompt is <bos> + these)
    short_context: int = 48  # chapters: with probability p_short the context is at most this long
    p_short: float = 0.5  # chapters: share of examples with a short context (a short prompt, as at use)
    max_prev_tokens: int = 48  # verses: the previous verse is cut to its last this-many tokens
    p_prev: float = 0.5  # verses: probability that the prompt starts with the previous verse
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac at max_minutes
    warmup_steps: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eps: float = 1e-3  # t = eps + (1 - eps) u
    p_self_cond: float = 0.5  # per-example self-conditioning probability
    w_enc: float = 1.0  # weight of the encoder AR co-loss
    max_minutes: float = 70.0  # wall-clock budget for the whole run
    save_every_minutes: float = 10.0
    log_every: int = 25
    max_steps: int = 0  # 0 = no step limit (only the time limit)
    seed: int = 0
    threads: int = 1  # torch.set_num_threads
    init_from: str = ""  # continue from this checkpoint's weights (fresh optimizer and schedule); "" = scratch


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
    off = k[:, None] * canvas + torch.arange(canvas)[None, :]  # (B, C) response offsets
    inside = off < resp_len[:, None]
    idx = torch.where(inside, prompt_len[:, None] + off, torch.zeros_like(off))
    return torch.where(inside, torch.gather(x, 1, idx), torch.full_like(off, eos_id))


def time_from_uniform(u_t: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """t = eps + (1 - eps) * u in float32 (multiply, then add); u_t float32 (B, 1) -> t float32 (B, 1)."""
    return torch.tensor(eps, dtype=torch.float32) + torch.tensor(1.0 - eps, dtype=torch.float32) * u_t


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
    i = torch.arange(S)[None, :]
    L = context_len[:, None]
    full = (i < L) & (valid != 0)
    slide = full & (i >= L - (window - 1))
    neg = torch.finfo(dtype).min
    out = {}
    for name, keep in ((FULL, full), (SLIDING, slide)):
        keep = torch.cat([keep, torch.ones(B, canvas, dtype=torch.bool)], dim=1)  # (B, S + C)
        m = torch.where(keep, torch.tensor(0.0, dtype=dtype), torch.tensor(neg, dtype=dtype))
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
    pos = L[:, None] + torch.arange(C)[None, :]  # (B, C) absolute canvas positions

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
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run examples/prepare_data.py first")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln]
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
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run examples/prepare_data.py first")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln]
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


def save_checkpoint(model, out: str, tokenizer_path: Path, spec: ModelSpec, meta: dict) -> None:
    """Write model (safetensors, fp32), tokenizer.json (+ tokenizer_config.json when the data folder has
    one), generation_config.json and train_meta.json to
    ``out`` through a sibling temporary directory, then swap it in (no half-written checkpoint)."""
    from transformers import GenerationConfig

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.generation_config = GenerationConfig(**generation_defaults(spec))
    model.save_pretrained(tmp)
    shutil.copy(tokenizer_path, tmp / "tokenizer.json")
    if (tokenizer_path.parent / "tokenizer_config.json").exists():
        shutil.copy(tokenizer_path.parent / "tokenizer_config.json", tmp / "tokenizer_config.json")
    (tmp / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    old = out.with_name(out.name + ".old")
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


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
        return dict(train="examples/data/kjv_chapters_train.txt: every chapter outside the held-out books, "
                          "its verses joined by spaces, without the test verses",
                    heldout_books=list(pd.HELDOUT_BOOKS), heldout_verses=test_verses,
                    eos="only where a chapter ends (the canvas fill after its last token)")
    return dict(train="examples/data/kjv_train.txt: one verse per example", heldout_verses=test_verses,
                eos="after every verse")


def lr_at(cfg: TrainConfig, step: int, frac_time: float) -> float:
    """Linear warmup over ``warmup_steps``, then cosine (in elapsed wall-clock fraction) to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(max(frac_time, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_model(spec: ModelSpec, seed: int):
    """A freshly initialised fp32 eager ``DiffusionGemmaForBlockDiffusion`` for ``spec``."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion._from_config(hf_config(spec), dtype=torch.float32,
                                                        attn_implementation="eager")


def train(cfg: TrainConfig, spec: ModelSpec) -> None:
    """Run the training loop until ``max_minutes`` / ``max_steps``; checkpoint periodically and at end."""
    from tokenizers import Tokenizer

    torch.set_num_threads(cfg.threads)
    tok_path = Path(cfg.data_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path))
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, model {spec.vocab_size}")
    if cfg.data == "chapters":
        chapters = load_chapters(cfg.data_dir, "train", tokenizer)
    elif cfg.data == "verses":
        plain, spaced = load_verses(cfg.data_dir, "train", tokenizer)
    else:
        raise ValueError(f"--data must be 'chapters' or 'verses', got {cfg.data!r}")
    if cfg.init_from:
        from transformers import DiffusionGemmaForBlockDiffusion

        model = DiffusionGemmaForBlockDiffusion.from_pretrained(cfg.init_from, dtype=torch.float32,
                                                                attn_implementation="eager")
    else:
        model = build_model(spec, cfg.seed)
    model.train()
    n_params = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    log = open(cfg.log, "a", encoding="utf-8")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    say(f"# config {json.dumps(asdict(cfg))}")
    say(f"# model {json.dumps(asdict(spec))} text params {n_params}")
    t0 = time.time()
    last_save = t0
    budget = cfg.max_minutes * 60
    step, acc = 0, np.zeros(3)

    def meta() -> dict:
        return dict(step=step, minutes=round((time.time() - t0) / 60, 2), train=asdict(cfg),
                    model=asdict(spec), text_params=n_params, data_split=data_split(cfg.data),
                    command="OMP_NUM_THREADS=1 python examples/train_tiny.py " + " ".join(sys.argv[1:]))

    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (cfg.max_steps and step >= cfg.max_steps):
            break
        lr = lr_at(cfg, step, elapsed / budget)
        for g in opt.param_groups:
            g["lr"] = lr
        if cfg.data == "chapters":
            x, valid, P, R = make_running_batch(rng, chapters, cfg.batch_size, spec.canvas_length,
                                                cfg.max_context, cfg.short_context, cfg.p_short)
        else:
            x, valid, P, R = make_batch(rng, plain, spaced, cfg.batch_size, cfg.max_prev_tokens, cfg.p_prev)
        noise = draw_noise(gen, cfg.batch_size, spec.canvas_length, spec.vocab_size)
        out = training_forward(model, x, valid, P, R, noise, cfg.eps, cfg.p_self_cond, cfg.w_enc)
        if not torch.isfinite(out["loss"]):
            raise FloatingPointError(f"non-finite loss at step {step}: {out['loss'].item()}")
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        acc += [out["loss"].item(), out["diff"].item(), out["ar"].item()]
        if step % cfg.log_every == 0:
            m = acc / cfg.log_every
            say(f"step {step:6d}  min {(time.time() - t0) / 60:6.2f}  lr {lr:.2e}  loss {m[0]:.4f}  "
                f"diff {m[1]:.4f}  ar {m[2]:.4f}")
            acc[:] = 0
        if time.time() - last_save >= cfg.save_every_minutes * 60:
            save_checkpoint(model, cfg.out, tok_path, spec, meta())
            last_save = time.time()
            say(f"# saved {cfg.out} at step {step}")
    save_checkpoint(model, cfg.out, tok_path, spec, meta())
    say(f"# done: {step} steps in {(time.time() - t0) / 60:.2f} min; saved {cfg.out}")
    log.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train a tiny DiffusionGemma on the KJV Bible (CPU).")
    defaults = TrainConfig()
    for name, value in asdict(defaults).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    train(cfg, ModelSpec())


if __name__ == "__main__":
    main()
