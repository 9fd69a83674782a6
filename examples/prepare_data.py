"""Fetch the King James Bible from Debian, split it into verses, and train a small BPE tokenizer.

Source: Debian package ``bible-kjv-text`` (source package ``bible-kjv``, version 4.38 in bookworm).
Its copyright file states that the copyright of the King James Version text (1611) has expired; the
package's compressed data file is readable only with the ``bible`` program from the ``bible-kjv``
package (GPL-2+), which this script downloads the same way and runs once to dump the text. Neither
package is installed system-wide: both are fetched with ``apt-get download`` and unpacked with
``dpkg -x`` under ``examples/data/`` (gitignored). Only the derived plain text and the tokenizer
trained from it are used later; the ``bible`` binary is never shipped.

Outputs (all under ``--data-dir``, default ``examples/data``):

* ``kjv_verses.tsv``: one verse per line, ``<reference>\\t<text>`` (31 102 lines).
* ``kjv_train.txt`` / ``kjv_test.txt``: verse texts; the test split is every 50th verse
  (verse index i with ``i % 50 == 49``), the train split is the rest.
* ``kjv_chapters_train.txt`` / ``kjv_chapters_test.txt``: running text, one chapter per line (its
  verses joined by single spaces, no verse numbers, no end-of-verse marks). The test split is the whole
  books in ``HELDOUT_BOOKS`` (Ruth, Jonah, Mark, Philippians: 28 chapters, 915 verses, about 3% of the
  text); the train split is every other chapter *without* the verse-test verses above (so neither split
  leaks into the other, and the verse test split stays unseen by a model trained on chapters).
* ``tokenizer.json``: byte-level BPE (``tokenizers``), 4096 ids in total. Ids 0..4 are the Gemma
  special tokens ``<pad> <eos> <bos> <unk> <mask>``; the last three ids (4093..4095) are reserved
  as ``<eoi> <boi> <image>`` so the model's image ids never collide with a text token. ``encode``
  prepends ``<bos>`` unless called with ``add_special_tokens=False``.
* ``tokenizer_config.json``: the special-token names (bos/eos/pad/unk/mask) for transformers.

Usage: ``python examples/prepare_data.py`` (idempotent: re-uses the cached download).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma ids 0..4
IMAGE_SPECIALS = ["<eoi>", "<boi>", "<image>"]  # ids V-3, V-2, V-1 (see hf config in train_tiny.py)
VOCAB_SIZE = 4096
TEST_EVERY = 50  # verse i is held out when i % TEST_EVERY == TEST_EVERY - 1
HELDOUT_BOOKS = ("Ruth", "Jonah", "Mark", "Phi")  # running-text test split (book codes of `bible -f`)


def _run(cmd: list[str], cwd: Path) -> None:
    """Run ``cmd`` in ``cwd``; raise RuntimeError with its stderr when it fails."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def fetch_debian(pkg: str, raw_dir: Path) -> Path:
    """Download ``pkg``'s .deb with apt-get (if not cached) and unpack it; return the unpack dir."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    debs = sorted(raw_dir.glob(f"{pkg}_*.deb"))
    if not debs:
        _run(["apt-get", "download", pkg], cwd=raw_dir)
        debs = sorted(raw_dir.glob(f"{pkg}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {pkg} produced no .deb in {raw_dir}")
    out = raw_dir / pkg
    if not out.exists():
        _run(["dpkg", "-x", str(debs[-1]), str(out)], cwd=raw_dir)
    return out


def dump_verses(raw_dir: Path) -> list[tuple[str, str]]:
    """Return all KJV verses as (reference, text), Genesis 1:1 to Revelation 22:21."""
    text_pkg = fetch_debian("bible-kjv-text", raw_dir)
    prog_pkg = fetch_debian("bible-kjv", raw_dir)
    proc = subprocess.run(
        [str(prog_pkg / "usr/bin/bible"), "-p", str(text_pkg / "usr/lib"), "-f", "gen1:1-rev22:21"],
        capture_output=True, text=True, check=True)
    verses = []
    for line in proc.stdout.splitlines():
        ref, _, text = line.partition(" ")
        if text.strip():
            verses.append((ref, text.strip()))
    if len(verses) != 31102:
        raise RuntimeError(f"expected 31102 KJV verses, got {len(verses)}")
    return verses


def split_ref(ref: str) -> tuple[str, int, int]:
    """``"1Sm3:10"`` -> ``("1Sm", 3, 10)`` (book code, chapter, verse); ValueError on another shape."""
    import re

    m = re.fullmatch(r"(\d?[A-Za-z]+)(\d+):(\d+)", ref)
    if m is None:
        raise ValueError(f"unexpected verse reference {ref!r} in the bible -f output")
    return m.group(1), int(m.group(2)), int(m.group(3))


def chapters(verses: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Running text per chapter: (train chapters, test chapters), each a list of strings.

    Test: every chapter of ``HELDOUT_BOOKS``. Train: every other chapter, its verse-test verses
    (index i with i % TEST_EVERY == TEST_EVERY - 1) left out.
    """
    train, test, cur, key = [], [], [], None
    for i, (ref, text) in enumerate(verses + [("End0:0", "")]):
        book, chap, _ = split_ref(ref)
        if (book, chap) != key:
            if cur:
                (test if key[0] in HELDOUT_BOOKS else train).append(" ".join(cur))
            cur, key = [], (book, chap)
        if not text or (book not in HELDOUT_BOOKS and i % TEST_EVERY == TEST_EVERY - 1):
            continue
        cur.append(text)
    if len(verses) == 31102 and len(train) + len(test) != 1189:
        raise RuntimeError(f"expected 1189 KJV chapters, got {len(train) + len(test)}")
    return train, test


def train_tokenizer(train_texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on ``train_texts``; return a ``tokenizers.Tokenizer`` with exactly
    ``vocab_size`` ids (Gemma specials at 0..4, image specials at the top three ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(IMAGE_SPECIALS), special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer=trainer)
    tok.add_special_tokens(IMAGE_SPECIALS)
    add_bos_post_processor(tok)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"--vocab-size {vocab_size}: the training text yields a tokenizer of only "
                         f"{tok.get_vocab_size()} ids (every merge it has); give --vocab-size "
                         f"{tok.get_vocab_size()} or less (512 suits examples/kjv_sample.tsv)")
    for i, name in enumerate(SPECIALS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special {name} got id {tok.token_to_id(name)}, wanted {i}")
    return tok


def add_bos_post_processor(tok) -> None:
    """Make ``encode(text)`` (add_special_tokens=True, the default) prepend ``<bos>`` (id 2), as the
    Gemma tokenizer does; ``add_special_tokens=False`` gives the bare ids. Training data is encoded bare
    and gets its ``<bos>`` explicitly (examples/train_tiny.py)."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", SPECIALS.index("<bos>"))])


TOKENIZER_CONFIG = {  # read by transformers' PreTrainedTokenizerFast and by the command line
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
    "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": True,
    "model_max_length": 4096}


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so no partial file is left behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_verses_tsv(path: Path) -> list[tuple[str, str]]:
    """Verses from a ``<reference>\\t<text>`` file (the format of ``kjv_verses.tsv``), e.g. the small
    sample ``examples/kjv_sample.tsv`` the tests train on. Raises ValueError naming the file and line when
    a line has no tab, an empty text or a reference that is not ``<book><chapter>:<verse>``."""
    verses = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if "\0" in text:
        raise ValueError(f"{path}: a binary file (NUL byte), not '<reference>\\t<text>' lines")
    for n, line in enumerate(text.splitlines(), 1):
        ref, tab, text = line.partition("\t")
        if not tab or not text.strip():
            raise ValueError(f"{path}:{n}: expected '<reference>\\t<text>', got {line[:60]!r}")
        try:
            split_ref(ref)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        verses.append((ref, text.strip()))
    if not verses:
        raise ValueError(f"{path}: no verses")
    return verses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--verses", default="", help="read the verses from this <reference>\\t<text> file instead "
                    "of the Debian package (a small sample for tests: examples/kjv_sample.tsv)")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                    help="tokenizer ids in total (a small sample cannot fill 4096)")
    args = ap.parse_args(argv)
    if not 16 <= args.vocab_size <= 1_000_000:
        raise ValueError(f"--vocab-size must be an integer in [16, 1000000], got {args.vocab_size}")
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    verses = read_verses_tsv(Path(args.verses)) if args.verses else dump_verses(data / "raw")
    _write_atomic(data / "kjv_verses.tsv", "".join(f"{r}\t{t}\n" for r, t in verses))
    train = [t for i, (_, t) in enumerate(verses) if i % TEST_EVERY != TEST_EVERY - 1]
    test = [t for i, (_, t) in enumerate(verses) if i % TEST_EVERY == TEST_EVERY - 1]
    _write_atomic(data / "kjv_train.txt", "\n".join(train) + "\n")
    _write_atomic(data / "kjv_test.txt", "\n".join(test) + "\n")
    ch_train, ch_test = chapters(verses)
    _write_atomic(data / "kjv_chapters_train.txt", "\n".join(ch_train) + "\n")
    _write_atomic(data / "kjv_chapters_test.txt", "\n".join(ch_test) + "\n")
    tok = train_tokenizer(train, args.vocab_size)
    tok.save(str(data / "tokenizer.json"))
    _write_atomic(data / "tokenizer_config.json", json.dumps(TOKENIZER_CONFIG, indent=1) + "\n")
    print(f"{len(train)} train verses, {len(test)} test verses, tokenizer {tok.get_vocab_size()} ids "
          f"-> {data}; running text: {len(ch_train)} train chapters, {len(ch_test)} test chapters")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"prepare_data.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
