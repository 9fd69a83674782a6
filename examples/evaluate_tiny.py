"""Evaluate a tiny KJV DiffusionGemma: held-out losses and samples from ``model.generate`` (transformers).

Prints (every number at settings that are the same for every checkpoint, so two models compare):

* held-out running text (``kjv_chapters_test.txt``: the books Ruth, Jonah, Mark, Philippians, left out
  of the running-text training; the verse model, which the running-text model starts from, saw 49 of 50
  of their verses one by one): canvas CE of the training objective (self-conditioning coin,
  t ~ U(0.001, 1)) on windows drawn as in training (``train_tiny.make_running_batch``: canvas start
  uniform over tokens, context up to 224 tokens, half of them at most 48), split into real tokens and the
  <eos> fill after a chapter end, plus the encoder AR CE; with ``--fixed-t`` canvas CE at fixed t (0.25 / 0.5 / 0.75 / 0.999)
  and at short (<= 48) and long (>= 128) contexts;
* held-out verses (``kjv_test.txt``: every 50th verse, never trained on by either shipped model): the
  verse objective of the first model (prompt = <bos> + first words of a verse, response = its rest);
  ``tokens`` is the CE on real verse tokens (the <eos> fill is reported apart: a running-text model is
  not taught to end a verse);
* held-out verses in context (the cleanest comparison): each verse-test verse scored as the canvas
  that follows the chapter text before it (up to 224 tokens), CE on the verse's own tokens only;
* a unigram baseline: the entropy (nats/token) of the training-split token frequencies;
* samples from ``model.generate`` with one sampler setting for all models (the checkpoint's
  generation_config.json, with ``max_new_tokens`` forced to ``--max-new-tokens``, 256 by default) for
  twelve prompts (the README's, five classics, ``--samples`` from the test books) and for the default run
  ``"And God said"`` with seeds 0..``--seeds``-1: per sample the canvases written, the decoder steps per
  canvas, tokens per decoder forward, whether it ended with <eos>; over all samples the share of generated
  words that are corpus words (any verse, case-insensitive) and the share of generated word bigrams
  (consecutive words) that occur in the running text, beside what a unigram model of the words scores.

``--baseline OLD --candidate NEW`` evaluates both and prints (``--markdown FILE`` also writes) one table
with a column per model, then each model's ten default-run samples, ready for examples/README.md.
``--device cuda`` runs the losses and the sampling on a GPU (fp32 weights; the numbers differ from the
CPU's by rounding and, for samples, by the GPU's random streams).

Usage::

    OMP_NUM_THREADS=1 python examples/evaluate_tiny.py --model diffusiongemma/assets/tiny-kjv --json out.json
    python examples/evaluate_tiny.py --baseline diffusiongemma/assets/tiny-kjv --candidate NEW \
        --markdown eval.md --json eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_tiny as TT  # noqa: E402  (same folder; importing it has no side effects)

DEFAULT_PROMPT = "And God said"  # the README's first command
PROMPTS = ["In the beginning God", "And the LORD said unto Moses,", "Blessed are the",
           "The LORD is my shepherd;", "And Jesus answered and said unto them,"]
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def corpus_words(data_dir: Path) -> set:
    """Lower-cased words of every KJV verse (train and test)."""
    text = "\n".join(TT.read_corpus(data_dir / "kjv_verses.tsv"))
    return {w.lower() for w in WORD.findall(text)}


def unigram_entropy(plain: list, vocab: int) -> float:
    """Entropy in nats/token of the token frequencies of ``plain`` (list of id arrays) plus <eos>."""
    counts = np.bincount(np.concatenate(plain), minlength=vocab).astype(np.float64)
    counts[TT.EOS_ID] += len(plain)  # one end-of-verse per verse
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@torch.no_grad()
def canvas_ce(model, x, valid, P, R, noise):
    """Per-position canvas CE (B, C) of the self-conditioned pass, the fill mask (B, C) and the AR CE.

    Same steps as ``train_tiny.training_forward`` (which returns only the means), kept per position so
    the EOS fill (easy once the model knows where a verse ends) can be reported apart from real tokens.
    """
    from transformers import DynamicCache

    C, W = model.config.canvas_length, model.config.text_config.sliding_window
    dev = next(model.parameters()).device  # the batch is built on the CPU; the model may sit on a GPU
    x, valid, P, R = (t.to(dev) for t in (x, valid, P, R))
    noise = {k: v.to(dev) for k, v in noise.items()}
    k = TT.select_canvas(noise["u_blk"], TT.num_canvases(R, C))
    y = TT.canvas_targets(x, P, R, k, C)
    fill = (k[:, None] * C + torch.arange(C, device=dev)[None, :]) >= R[:, None]
    x_noisy, _ = TT.corrupt(y, TT.time_from_uniform(noise["u_t"]), noise["u_cor"], noise["r"])
    L = P + k * C
    kw = dict(decoder_input_ids=x_noisy, decoder_attention_mask=TT.decoder_masks(L, valid, C, W),
              decoder_position_ids=L[:, None] + torch.arange(C, device=dev)[None, :])
    enc = model.model.encoder(input_ids=x, attention_mask=valid.long(), cache=DynamicCache())
    ar = TT.ar_loss(TT.softcap_logits(model, enc.last_hidden_state), x, valid)
    z1 = model(cache=enc.cache, **kw).logits
    z = model(cache=enc.cache, self_conditioning_logits=z1, self_conditioning_mask=TT.self_cond_mask(noise["u_sc"]),
              **kw).logits
    ce = torch.nn.functional.cross_entropy(z.float().transpose(1, 2), y, reduction="none")  # (B, C)
    return ce.cpu(), fill.cpu(), ar.item()


def heldout_losses(model, plain, spaced, batches: int, batch_size: int, seed: int, t_fixed=None) -> dict:
    """Held-out canvas CE (all positions / real tokens / EOS fill) and AR CE, averaged over positions
    of ``batches`` batches; ``t_fixed`` forces every example's t."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    C, V = model.config.canvas_length, model.config.text_config.vocab_size
    ces, fills, ars = [], [], []
    for _ in range(batches):
        # p_prev = 0: neighbours in the test split are 50 verses apart, so no previous-verse context
        x, valid, P, R = TT.make_batch(rng, plain, spaced, batch_size, p_prev=0.0)
        noise = TT.draw_noise(gen, batch_size, C, V)
        if t_fixed is not None:  # t = eps + (1 - eps) u  =>  u = (t - eps) / (1 - eps)
            noise["u_t"].fill_((t_fixed - 1e-3) / (1 - 1e-3))
        ce, fill, ar = canvas_ce(model, x, valid, P, R, noise)
        ces.append(ce)
        fills.append(fill)
        ars.append(ar)
    ce, fill = torch.cat(ces), torch.cat(fills)
    return dict(all=ce.mean().item(), tokens=ce[~fill].mean().item(), fill=ce[fill].mean().item(),
                ar=float(np.mean(ars)))


def heldout_running(model, chapters, batches: int, batch_size: int, seed: int, t_fixed=None,
                    context=(224, 48, 0.5)) -> dict:
    """Held-out canvas CE on running-text windows (``make_running_batch`` with ``context`` = (max,
    short, p_short)): all positions, real tokens, the <eos> fill, and by context length (short: <= 48
    tokens before the canvas, long: >= 128). Fixed seed, so every checkpoint sees the same windows."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    C, V = model.config.canvas_length, model.config.text_config.vocab_size
    ces, fills, ctx, ars = [], [], [], []
    for _ in range(batches):
        x, valid, P, R = TT.make_running_batch(rng, chapters, batch_size, C, *context)
        noise = TT.draw_noise(gen, batch_size, C, V)
        if t_fixed is not None:
            noise["u_t"].fill_((t_fixed - 1e-3) / (1 - 1e-3))
        ce, fill, ar = canvas_ce(model, x, valid, P, R, noise)
        ces.append(ce)
        fills.append(fill)
        ctx.append((P - 1)[:, None].expand(-1, C))
        ars.append(ar)
    ce, fill, ctx = torch.cat(ces), torch.cat(fills), torch.cat(ctx)
    tok = ~fill
    short, long_ = tok & (ctx <= 48), tok & (ctx >= 128)
    return dict(all=ce.mean().item(), tokens=ce[tok].mean().item(),
                fill=ce[fill].mean().item() if bool(fill.any()) else float("nan"),
                short_context=ce[short].mean().item(), long_context=ce[long_].mean().item(),
                ar=float(np.mean(ars)), positions=int(ce.numel()), fill_positions=int(fill.sum()))


def verses_in_context(data_dir: Path, tokenizer, max_context: int = 224) -> list:
    """Every verse-test verse (index i % 50 == 49, unseen by both shipped models) with the running text
    before it in its chapter: a list of (context ids, verse ids) int64 arrays, the context cut to its
    last ``max_context`` tokens. Verses are encoded with a leading space after the first of a chapter,
    as in the joined chapter text."""
    sys.path.insert(0, str(HERE))
    import prepare_data as PD

    path = data_dir / "kjv_verses.tsv"
    rows = [ln.split("\t", 1) for ln in TT.read_corpus(path)]
    for n, row in enumerate(rows, 1):
        if len(row) != 2:
            raise ValueError(f"{path}:{n}: expected '<reference>\\t<text>', got {row[0][:60]!r}")
    out, key, ctx = [], None, []
    for i, (ref, text) in enumerate(rows):
        book, chap, _ = PD.split_ref(ref)
        if (book, chap) != key:
            key, ctx = (book, chap), []
        ids = tokenizer.encode((" " if ctx else "") + text, add_special_tokens=False).ids
        if i % PD.TEST_EVERY == PD.TEST_EVERY - 1:
            out.append((np.asarray(ctx[-max_context:], np.int64), np.asarray(ids, np.int64)))
        ctx = ctx + ids
    return out


def heldout_verses_in_context(model, items: list, batch_size: int, seed: int, deadline: float = math.inf) -> dict:
    """Canvas CE on the tokens of each held-out verse (its first C tokens) when the canvas starts at the
    verse and the prompt is <bos> + the chapter text before it; positions after the verse are not scored
    (their targets differ between a verse model and a running-text model). t ~ U(0.001, 1) and the
    self-conditioning coin from a fixed seed. No batch starts that would end (judged by the slowest
    so far) past ``deadline`` (a ``time.time()``); ``verses`` says how many were scored."""
    gen = torch.Generator().manual_seed(seed)
    C, V = model.config.canvas_length, model.config.text_config.vocab_size
    tot, n, done, batch_s = 0.0, 0, 0, 0.0
    for b0 in range(0, len(items), batch_size):
        if done and time.time() + batch_s > deadline:  # the next batch would end past the deadline
            break
        tb = time.time()
        chunk = items[b0:b0 + batch_size]
        done += len(chunk)
        rows = [np.concatenate([[TT.BOS_ID], c, v[:C]]) for c, v in chunk]
        S = max(len(r) for r in rows)
        x = torch.full((len(rows), S), TT.PAD_ID, dtype=torch.int64)
        valid = torch.zeros((len(rows), S), dtype=torch.bool)
        for b, r in enumerate(rows):
            x[b, :len(r)] = torch.from_numpy(r)
            valid[b, :len(r)] = True
        P = torch.tensor([1 + len(c) for c, _ in chunk])
        R = torch.tensor([min(len(v), C) for _, v in chunk])
        noise = TT.draw_noise(gen, len(rows), C, V)
        ce, fill, _ = canvas_ce(model, x, valid, P, R, noise)
        tot += ce[~fill].sum().item()
        n += int((~fill).sum())
        batch_s = max(batch_s, time.time() - tb)
    return dict(tokens=tot / n, positions=n, verses=done, of_verses=len(items))


class CountingStreamer:
    """A streamer for ``model.generate`` that counts denoising steps per canvas: transformers calls
    ``put`` once with the prompt, then once per finished canvas, and ``put_draft`` once per decoder step."""

    def __init__(self):
        self.steps = []  # decoder steps of each finished canvas
        self._draft = 0
        self._seen_prompt = False

    def put_draft(self, value=None, logits=None):
        self._draft += 1

    def put(self, value):
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.steps.append(self._draft)
        self._draft = 0

    def end(self):
        pass


@torch.no_grad()
def sample(model, tokenizer, prompt: str, seed: int, max_new_tokens: int) -> dict:
    """Generate a continuation of ``prompt`` (with <bos>) under ``torch.manual_seed(seed)`` with the
    checkpoint's sampler settings and ``max_new_tokens``, on the model's device. Returns dict(text,
    tokens_per_forward, eos, canvases, steps (per canvas))."""
    dev = next(model.parameters()).device
    ids = torch.tensor([[TT.BOS_ID] + tokenizer.encode(prompt, add_special_tokens=False).ids], device=dev)
    torch.manual_seed(seed)
    streamer = CountingStreamer()
    out = model.generate(ids, max_new_tokens=max_new_tokens, streamer=streamer)
    new = out.sequences[0, ids.shape[1]:].tolist()
    ended = TT.EOS_ID in new
    if ended:
        new = new[:new.index(TT.EOS_ID)]
    new = [t for t in new if t != TT.PAD_ID]
    return dict(text=tokenizer.decode(new), tokens_per_forward=float(out.tokens_per_forward.float().mean()),
                eos=ended, canvases=len(streamer.steps), steps=streamer.steps)


def words_of(text: str) -> list:
    """Lower-cased words (letters, one inner apostrophe allowed) of ``text``, in order."""
    return [w.lower() for w in WORD.findall(text)]


def corpus_bigrams(data_dir: Path) -> set:
    """Every pair of consecutive words of the running text (``kjv_chapters_*.txt``, train and test: a
    chapter's verses follow one another, so a verse's last word and the next one's first form a pair)."""
    pairs = set()
    for split in ("train", "test"):
        for line in TT.read_corpus(data_dir / f"kjv_chapters_{split}.txt"):
            w = words_of(line)
            pairs.update(zip(w, w[1:]))
    return pairs


def word_measures(texts: list, words: set, bigrams: set) -> dict:
    """Over the generated ``texts``: the share of words that are corpus words and the share of word
    bigrams (consecutive words inside one text) that occur in the corpus; nan when there are none."""
    ws = [words_of(t) for t in texts]
    flat = [w for x in ws for w in x]
    pairs = [p for x in ws for p in zip(x, x[1:])]
    return dict(real_word_share=float(np.mean([w in words for w in flat])) if flat else float("nan"),
                bigram_share=float(np.mean([p in bigrams for p in pairs])) if pairs else float("nan"),
                generated_words=len(flat), generated_bigrams=len(pairs))


def unigram_word_reference(data_dir: Path, bigrams: set, n: int = 20000, seed: int = 0) -> float:
    """The bigram share a unigram model of the corpus words would score: pairs of words drawn
    independently by their corpus frequency (``n`` pairs, fixed seed). A model that writes sentences
    scores well above it."""
    text = "\n".join("\n".join(TT.read_corpus(data_dir / f"kjv_chapters_{s}.txt")) for s in ("train", "test"))
    vocab, counts = np.unique(np.asarray(words_of(text)), return_counts=True)
    rng = np.random.default_rng(seed)
    a = rng.choice(vocab, size=n, p=counts / counts.sum())
    b = rng.choice(vocab, size=n, p=counts / counts.sum())
    return float(np.mean([(x, y) in bigrams for x, y in zip(a, b)]))


def load_model(path: str, device: str = "cpu", option: str = "--model"):
    """The checkpoint as transformers' ``DiffusionGemmaForBlockDiffusion`` in fp32 (bf16 files widen
    exactly), in eval mode, on ``device``, with its tokenizer."""
    from tokenizers import Tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{option} {path}: not a checkpoint folder (no config.json)")
    try:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32).to(device)
    except Exception as exc:  # transformers' own errors (OSError, ValueError, KeyError, ...): one line
        raise ValueError(f"{option} {path}: not a checkpoint transformers can load ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:300]})") from None
    model.eval()
    return model, TT.read_tokenizer(p / "tokenizer.json")


def evaluate(path: str, data: Path, args, device: str = "cpu", say=print, deadline: float = math.inf,
             option: str = "--model") -> dict:
    """Every measure of one checkpoint (see the module docstring), as a dict; prints as it goes. With a
    ``deadline`` (a ``time.time()``), the verses in context get at most half of the time left, and no
    sample starts that would end (judged by the slowest so far) past it: the default runs come first,
    then the other prompts, and ``res["cut_short"]`` counts the samples left out."""
    model, tokenizer = load_model(path, device, option)
    if args.steps:
        model.generation_config.max_denoising_steps = args.steps
    C = model.config.canvas_length
    test_chapters = TT.load_chapters(str(data), "test", tokenizer)
    test_plain, test_spaced = TT.load_verses(str(data), "test", tokenizer)
    train_plain, _ = TT.load_verses(str(data), "train", tokenizer)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "vision" not in n)
    res = {"model": str(path), "text_params": n_params, "canvas_length": C,
           "weights_dtype": str(json.loads((Path(path) / "config.json").read_text()).get("dtype", "?")),
           "generation_config": model.generation_config.to_dict()}
    res["unigram_entropy"] = unigram_entropy(train_plain, model.config.text_config.vocab_size)
    say(f"== {path}: {n_params / 1e6:.2f} M text parameters")
    say(f"unigram baseline CE          {res['unigram_entropy']:.4f} nats/token")
    if not args.no_losses:
        h = heldout_running(model, test_chapters, args.batches, args.batch_size, args.seed)
        res["running"] = h
        say(f"held-out running text, canvas CE (t ~ U(0.001, 1), self-cond coin; {h['positions']} positions)")
        say(f"  all positions              {h['all']:.4f}")
        say(f"  real tokens                {h['tokens']:.4f}   (context <= 48: {h['short_context']:.4f}, "
            f">= 128: {h['long_context']:.4f})")
        say(f"  <eos> fill (chapter end)   {h['fill']:.4f}   ({h['fill_positions']} positions)")
        say(f"  encoder AR CE              {h['ar']:.4f}")
        for t in (0.25, 0.5, 0.75, 0.999) if args.fixed_t else ():
            d = heldout_running(model, test_chapters, args.batches, args.batch_size, args.seed, t)
            res[f"running_t{t}"] = d
            say(f"  at t={t:<5} real tokens     {d['tokens']:.4f}")
        v = heldout_losses(model, test_plain, test_spaced, max(1, args.batches // 2), args.batch_size, args.seed)
        res["verses"] = v
        say(f"held-out verses, canvas CE: real verse tokens {v['tokens']:.4f}, <eos> fill {v['fill']:.4f}, "
            f"all {v['all']:.4f}, encoder AR {v['ar']:.4f}")
        half = time.time() + (deadline - time.time()) / 2  # keep half of what is left for the samples
        vc = heldout_verses_in_context(model, verses_in_context(data, tokenizer), args.batch_size, args.seed,
                                       half)
        res["verses_in_context"] = vc
        say(f"held-out verses in their chapter context, canvas CE on verse tokens {vc['tokens']:.4f} "
            f"({vc['verses']} of {vc['of_verses']} verses, {vc['positions']} positions)")

    words, bigrams = corpus_words(data), corpus_bigrams(data)
    rng = np.random.default_rng(args.seed)
    prompts = [DEFAULT_PROMPT] + list(PROMPTS)
    for i in rng.choice(len(test_chapters), size=args.samples, replace=True) if args.samples else ():
        ch = test_chapters[i]
        j = int(rng.integers(0, max(1, len(ch) - 64)))
        words4 = tokenizer.decode(ch[j:j + 40].tolist()).split()[1:5]  # skip a possibly cut first word
        prompts.append(" ".join(words4))
    runs, cut, sample_s = [], 0, 0.0

    def fits() -> bool:  # would one more sample, as long as the longest so far, end before the deadline?
        return time.time() + sample_s <= deadline

    def timed_sample(prompt, seed):
        nonlocal sample_s
        ts = time.time()
        out = sample(model, tokenizer, prompt, seed, args.max_new_tokens)
        sample_s = max(sample_s, time.time() - ts)
        return out

    for seed in range(args.seeds):
        if not fits():
            cut += 1
            continue
        s = timed_sample(DEFAULT_PROMPT, seed)
        runs.append(dict(seed=seed, text=s["text"], canvases=s["canvases"], eos=s["eos"], steps=s["steps"],
                         tokens_per_forward=s["tokens_per_forward"]))
    samples = []
    for j, p in enumerate(prompts):
        if not fits():
            cut += 1
            continue
        s = timed_sample(p, args.seed + j)
        s["prompt"] = p
        samples.append(s)
        t = s["text"]
        say(f"\n[{p}] ->{'' if t.startswith(' ') else ' '}{t}{'  <eos>' if s['eos'] else ''}\n"
            f"   ({s['canvases']} canvases, steps {s['steps']}, tokens/forward {s['tokens_per_forward']:.2f})")
    if cut:
        say(f"\n{cut} samples left out: the evaluation's --minutes ran out")
    all_ = samples + runs
    steps = [n for s in all_ for n in s["steps"]]
    res.update(samples=samples, default_runs=runs, cut_short=cut, planned_canvases=-(-args.max_new_tokens // C),
               mean_tokens_per_forward=float(np.mean([s["tokens_per_forward"] for s in all_]))
               if all_ else float("nan"),
               mean_steps_per_canvas=float(np.mean(steps)) if steps else float("nan"),
               mean_canvases=float(np.mean([s["canvases"] for s in runs])) if runs else float("nan"),
               eos_runs=sum(r["eos"] for r in runs),
               **word_measures([s["text"] for s in all_], words, bigrams))
    say(f"\nmean tokens per forward      {res['mean_tokens_per_forward']:.3f}")
    say(f"mean steps per canvas        {res['mean_steps_per_canvas']:.2f} "
        f"(of {model.generation_config.max_denoising_steps})")
    say(f"real corpus words            {res['real_word_share']:.3f} of {res['generated_words']} generated words")
    say(f"corpus word bigrams          {res['bigram_share']:.3f} of {res['generated_bigrams']} generated bigrams")
    say(f"'{DEFAULT_PROMPT}', seeds 0..{args.seeds - 1}: canvases {[r['canvases'] for r in runs]} of "
        f"{res['planned_canvases']}, ended with <eos> {res['eos_runs']}/{len(runs)}")
    for r in runs:
        say(f"  seed {r['seed']}: {DEFAULT_PROMPT}{r['text']}")
    return res


def _f(x, nd=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{nd}f}"


def markdown(results: list, data: Path, args, chars: int = 240) -> str:
    """The measures of one or more checkpoints side by side (``results``: list of (label, dict)), then
    the samples of the default command for seeds 0.. of each, as markdown."""
    bigrams = corpus_bigrams(data)
    uni = unigram_word_reference(data, bigrams)
    head = "| measure | " + " | ".join(label for label, _ in results) + " |"
    rule = "|---|" + "---:|" * len(results)
    rows = []

    def row(name, fn):
        rows.append(f"| {name} | " + " | ".join(fn(r) for _, r in results) + " |")

    row("model", lambda r: f"{r['text_params'] / 1e6:.2f} M params, {r['weights_dtype']}")
    if not args.no_losses:
        row("held-out running text: canvas CE on real tokens (nats/token, lower is better)",
            lambda r: _f(r["running"]["tokens"]))
        row("held-out verses in their chapter context: canvas CE",
            lambda r: _f(r["verses_in_context"]["tokens"]) + (
                f" ({r['verses_in_context']['verses']} of {r['verses_in_context']['of_verses']} verses: time)"
                if r["verses_in_context"].get("of_verses", r["verses_in_context"]["verses"])
                != r["verses_in_context"]["verses"] else ""))
        row("held-out running text: encoder AR CE", lambda r: _f(r["running"]["ar"]))
        row("unigram baseline CE (token frequencies)", lambda r: _f(r["unigram_entropy"]))
    row("generated word bigrams found in the corpus",
        lambda r: f"{_f(r['bigram_share'])} (of {r['generated_bigrams']})")
    row("generated words that are corpus words",
        lambda r: f"{_f(r['real_word_share'])} (of {r['generated_words']})")
    row(f"`{DEFAULT_PROMPT}`, seeds 0-{args.seeds - 1}: canvases filled per run",
        lambda r: " ".join(str(x["canvases"]) for x in r["default_runs"]) + f" (of {r['planned_canvases']})")
    row("mean canvases per run", lambda r: _f(r["mean_canvases"], 2))
    row("runs ending in `<eos>`", lambda r: f"{r['eos_runs']}/{len(r['default_runs'])}")
    row("tokens per decoder forward", lambda r: _f(r["mean_tokens_per_forward"], 2))
    row("samples measured (prompts + seeds of the default run)",
        lambda r: f"{len(r['samples'])} + {len(r['default_runs'])}"
                  + (f" ({r['cut_short']} left out: time)" if r.get("cut_short") else ""))
    out = [head, rule, *rows, "",
           f"Reference point: word pairs drawn independently by corpus frequency (a unigram model of the "
           f"words) are corpus bigrams {uni:.3f} of the time. Samples: transformers' `generate` with each "
           f"checkpoint's `generation_config.json`, {args.max_new_tokens} new tokens, the prompts of "
           f"`evaluate_tiny.py` and `{DEFAULT_PROMPT}` with seeds 0-{args.seeds - 1}; the word measures count "
           f"every sample.", ""]
    for label, r in results:
        out.append(f"Samples, {label} (`{DEFAULT_PROMPT}`, `torch.manual_seed(seed)`, first {chars} characters):")
        out.append("")
        out.append("```")
        for x in r["default_runs"]:
            t = (DEFAULT_PROMPT + x["text"]).replace("\n", " ")
            t = t if len(t) <= chars else t[:chars] + " …"
            out.append(f"seed {x['seed']} ({x['canvases']} canvases{', <eos>' if x['eos'] else ''}): {t}")
        out.append("```")
        out.append("")
    return "\n".join(out)


LIMITS = dict(batches=(1, 1024), batch_size=(1, 4096), samples=(0, 1000), seeds=(1, 1000),
              max_new_tokens=(1, 65536), steps=(0, 10_000), seed=(0, 2**32 - 1), sample_chars=(1, 100_000),
              threads=(1, None))


def check_args(args) -> None:
    """Refuse, with ``ValueError`` naming the option and the value, a count outside its range (sizes are
    bounded so that a huge one is refused instead of running for hours), a budget that is not a finite number
    >= 0, an unknown device."""
    limits = dict(LIMITS, threads=(1, max(os.cpu_count() or 1, 1)))
    for name, (low, high) in limits.items():
        value = getattr(args, name)
        if not low <= value <= high:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer in [{low}, {high}], got {value}")
    if not (math.isfinite(args.minutes) and args.minutes >= 0):
        raise ValueError(f"--minutes must be a finite number >= 0 (0: no budget), got {args.minutes}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {args.device!r}")
    for name in ("json", "markdown"):
        target = getattr(args, name)
        if target and Path(target).is_dir():
            raise ValueError(f"--{name} {target}: is a folder; give a file")
        if target and not Path(target).resolve().parent.is_dir():
            raise ValueError(f"--{name} {target}: its folder does not exist")
    if not Path(args.data_dir).is_dir():
        raise ValueError(f"--data-dir {args.data_dir}: no such folder (examples/prepare_data.py writes it)")


def read_baseline_json(path: str) -> dict:
    """The stored measures of an earlier ``--json`` (one model's dict, or the first of a two-model file);
    ``ValueError`` naming the file when it is not such a file."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--baseline-json {path}: not a JSON file of evaluate_tiny.py ({exc})") from None
    if isinstance(data, dict) and "default_runs" not in data and data:
        data = next(iter(data.values()))  # a two-model file: its first model
    need = {"model", "default_runs", "text_params", "samples"}
    if not isinstance(data, dict) or not need <= set(data):
        raise ValueError(f"--baseline-json {path}: not the measures of evaluate_tiny.py --json (no "
                         f"{sorted(need - set(data)) if isinstance(data, dict) else 'object'})")
    return data


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="one checkpoint to evaluate (default: the shipped tiny-kjv)")
    ap.add_argument("--baseline", default="", help="the old checkpoint, shown beside --candidate")
    ap.add_argument("--candidate", default="", help="the new checkpoint")
    ap.add_argument("--data-dir", default=str(HERE / "data"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (auto: cuda when available)")
    ap.add_argument("--batches", type=int, default=16, help="held-out batches per loss figure")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=6, help="extra prompts taken from held-out chapters")
    ap.add_argument("--seeds", type=int, default=10, help="seeds of the default 'And God said' run")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the same for every checkpoint")
    ap.add_argument("--steps", type=int, default=0, help="max denoising steps (0: the checkpoint's)")
    ap.add_argument("--fixed-t", action="store_true", help="also canvas CE at t = 0.25/0.5/0.75/0.999")
    ap.add_argument("--no-losses", action="store_true", help="samples only (the losses need no sampler)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--sample-chars", type=int, default=240, help="characters of each sample in --markdown")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    ap.add_argument("--markdown", default="", help="also write the comparison table and samples here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="budget (0: none): no sample starts that would end past it; "
                         "the measures use those written")
    ap.add_argument("--baseline-json", default="",
                    help="take the baseline's measures from this --json file of an earlier run, not --baseline")
    args = ap.parse_args(argv)
    check_args(args)
    t0 = time.time()
    deadline = t0 + args.minutes * 60 if args.minutes else math.inf
    torch.set_num_threads(args.threads)
    device = TT.pick_device(args.device).type
    data = Path(args.data_dir)
    if args.model and (args.baseline or args.candidate):
        raise SystemExit("give --model, or --baseline and/or --candidate, not both")
    if args.baseline and args.baseline_json:
        raise SystemExit("give --baseline or --baseline-json, not both")
    results = []
    if args.baseline_json:
        old = read_baseline_json(args.baseline_json)
        results.append((f"baseline: `{Path(old['model']).name}`", old))
    todo = ([("baseline", args.baseline)] if args.baseline else []) + \
        ([("candidate", args.candidate)] if args.candidate else [])
    if not todo and not results:
        todo = [("model", args.model or str(HERE.parent / "diffusiongemma" / "assets" / "tiny-kjv"))]
    for label, path in todo:  # the candidate gets what the baseline left of the budget
        res = evaluate(path, data, args, device, deadline=deadline, option=f"--{label}")
        results.append((f"{label}: `{Path(path).name}`", res))
    md = markdown(results, data, args, args.sample_chars)
    print("\n" + md)
    out = results[0][1] if len(results) == 1 else {label: r for label, r in results}  # one model: its dict
    if args.json:  # through a temporary file; a full disk names the file and leaves no .tmp
        TT.write_file_atomic(Path(args.json), (json.dumps(out, indent=1, default=str) + "\n").encode(),
                             "the --json file")
    if args.markdown:
        TT.write_file_atomic(Path(args.markdown), (md + "\n").encode(), "the --markdown file")
    return out


def cli(argv=None) -> int:
    """``main`` as a command: 0 when done, 2 with one line naming the option or file (no traceback), 130 when
    interrupted."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("evaluate_tiny.py: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, ArithmeticError, MemoryError, KeyError) as exc:
        kind = "" if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: "
        print(f"evaluate_tiny.py: error: {kind}{' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
