"""Evaluate the tiny KJV DiffusionGemma: held-out losses and a few samples from ``model.generate``.

Prints:

* held-out objective (prompt = <bos> + first words of a test verse, response = its rest): the training loss pieces (canvas CE with the self-conditioning coin, encoder AR CE)
  on test-split verses (every 50th verse, never trained on), with draws from a fixed seed;
* canvas CE at fixed corruption rates t (0.25 / 0.5 / 0.75 / 0.999; 0.999 is almost "from scratch");
* a unigram baseline: the entropy (nats/token) of the training-split token frequencies, i.e. the CE of
  a model that knows nothing but how common each token is;
* samples from ``model.generate`` with the checkpoint's default sampler settings (generation_config.json),
  their tokens per decoder forward, how many ended with ``<eos>``, and the share of generated words
  that are real corpus words (any verse, case-insensitive, punctuation stripped).

Usage::

    OMP_NUM_THREADS=1 python examples/evaluate_tiny.py --model diffusiongemma/assets/tiny-kjv
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import train_tiny as TT  # noqa: E402  (same folder; importing it has no side effects)

PROMPTS = ["In the beginning God", "And the LORD said unto Moses,", "Blessed are the",
           "The LORD is my shepherd;", "And Jesus answered and said unto them,"]
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def corpus_words(data_dir: Path) -> set:
    """Lower-cased words of every KJV verse (train and test)."""
    text = (data_dir / "kjv_verses.tsv").read_text(encoding="utf-8")
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
    k = TT.select_canvas(noise["u_blk"], TT.num_canvases(R, C))
    y = TT.canvas_targets(x, P, R, k, C)
    fill = (k[:, None] * C + torch.arange(C)[None, :]) >= R[:, None]
    x_noisy, _ = TT.corrupt(y, TT.time_from_uniform(noise["u_t"]), noise["u_cor"], noise["r"])
    L = P + k * C
    kw = dict(decoder_input_ids=x_noisy, decoder_attention_mask=TT.decoder_masks(L, valid, C, W),
              decoder_position_ids=L[:, None] + torch.arange(C)[None, :])
    enc = model.model.encoder(input_ids=x, attention_mask=valid.long(), cache=DynamicCache())
    ar = TT.ar_loss(TT.softcap_logits(model, enc.last_hidden_state), x, valid)
    z1 = model(cache=enc.cache, **kw).logits
    z = model(cache=enc.cache, self_conditioning_logits=z1, self_conditioning_mask=TT.self_cond_mask(noise["u_sc"]),
              **kw).logits
    ce = torch.nn.functional.cross_entropy(z.transpose(1, 2), y, reduction="none")  # (B, C)
    return ce, fill, ar.item()


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


@torch.no_grad()
def sample(model, tokenizer, prompt: str, seed: int):
    """Generate a continuation of ``prompt`` (with <bos>); return (text, tokens/forward, ended_with_eos)."""
    ids = torch.tensor([[TT.BOS_ID] + tokenizer.encode(prompt, add_special_tokens=False).ids])
    torch.manual_seed(seed)
    out = model.generate(ids)
    new = out.sequences[0, ids.shape[1]:].tolist()
    ended = TT.EOS_ID in new
    if ended:
        new = new[:new.index(TT.EOS_ID)]
    new = [t for t in new if t != TT.PAD_ID]
    return tokenizer.decode(new), float(out.tokens_per_forward.float().mean()), ended


def main(argv=None) -> dict:
    from tokenizers import Tokenizer
    from transformers import DiffusionGemmaForBlockDiffusion

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(HERE.parent / "cli" / "assets" / "tiny-kjv"))
    ap.add_argument("--data-dir", default=str(HERE / "data"))
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=6, help="extra prompts taken from test verses")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    data = Path(args.data_dir)
    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    test_plain, test_spaced = TT.load_verses(str(data), "test", tokenizer)
    train_plain, _ = TT.load_verses(str(data), "train", tokenizer)

    res = {"model": args.model}
    res["unigram_entropy"] = unigram_entropy(train_plain, model.config.text_config.vocab_size)
    h = heldout_losses(model, test_plain, test_spaced, args.batches, args.batch_size, args.seed)
    res["heldout"] = h
    print(f"unigram baseline CE       {res['unigram_entropy']:.4f} nats/token")
    print(f"held-out canvas CE        {h['all']:.4f}   (t ~ U(0.001, 1), self-cond coin; all positions)")
    print(f"  on real verse tokens    {h['tokens']:.4f}")
    print(f"  on the EOS fill         {h['fill']:.4f}")
    print(f"held-out encoder AR CE    {h['ar']:.4f}")
    for t in (0.25, 0.5, 0.75, 0.999):
        d = heldout_losses(model, test_plain, test_spaced, args.batches, args.batch_size, args.seed, t)
        res[f"heldout_t{t}"] = d
        print(f"held-out canvas CE @ t={t:<5} all {d['all']:.4f}  real tokens {d['tokens']:.4f}")

    words = corpus_words(data)
    rng = np.random.default_rng(args.seed)
    test_lines = (data / "kjv_test.txt").read_text(encoding="utf-8").splitlines()
    prompts = list(PROMPTS)
    for i in rng.choice(len(test_lines), size=args.samples, replace=False):
        prompts.append(" ".join(test_lines[i].split()[:4]))
    samples, tpf, ended, gen_words = [], [], 0, []
    for j, p in enumerate(prompts):
        text, f, e = sample(model, tokenizer, p, args.seed + j)
        samples.append({"prompt": p, "continuation": text, "tokens_per_forward": f, "eos": e})
        tpf.append(f)
        ended += e
        gen_words += [w.lower() for w in WORD.findall(text)]
        print(f"\n[{p}] ->{'' if text.startswith(' ') else ' '}{text}{'  <eos>' if e else ''}  "
              f"(tokens/forward {f:.2f})")
    real = float(np.mean([w in words for w in gen_words])) if gen_words else float("nan")
    res.update(samples=samples, mean_tokens_per_forward=float(np.mean(tpf)), eos_share=ended / len(prompts),
               real_word_share=real, generated_words=len(gen_words))
    print(f"\nmean tokens per forward   {res['mean_tokens_per_forward']:.3f}")
    print(f"samples ending in <eos>   {ended}/{len(prompts)}")
    print(f"real corpus words         {real:.3f} of {len(gen_words)} generated words")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
