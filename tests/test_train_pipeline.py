"""The training pipeline end to end on the CPU, test-sized (examples/prepare_data.py, train_tiny.py,
evaluate_tiny.py, pipeline.py), so a GPU run of the same code cannot fail on a typo.

The corpus is ``examples/kjv_sample.tsv`` (218 KJV verses: Genesis 1-3, Ruth 1, Psalm 23, Jonah 1, Matthew 5,
Mark 1), so nothing needs the Debian package; the model is train_tiny's ``test`` preset (about 50 k
parameters at a 512-id tokenizer). Checked here:

* a run interrupted after 3 steps and resumed from its state file ends with the same weights, optimizer
  moments and losses, bit for bit, as an uninterrupted 6-step run (one CPU thread: deterministic);
* a run without a step limit stops inside its ``--minutes`` budget, its final evaluation and save included;
* bf16 storage: the saved file holds bfloat16 tensors, equal to the trained fp32 weights rounded; the
  project's loader and transformers both load it, and ``diffusiongemma generate`` answers from it;
* ``pipeline.py`` (data, train, evaluate, pack) writes its few files, and the evaluation has every measure,
  finite, for the old and the new model, with ten samples each (seeds 0-9).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SAMPLE = EXAMPLES / "kjv_sample.tsv"
sys.path.insert(0, str(EXAMPLES))
import prepare_data as PD  # noqa: E402
import train_tiny as TT  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kjv_sample")
    PD.main(["--verses", str(SAMPLE), "--data-dir", str(d), "--vocab-size", str(VOCAB)])
    return d


@pytest.fixture(autouse=True)
def torch_state():
    """train() sets torch's thread count and seeds its global generator: put both back."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


def cfg(data_dir, out, **kw) -> TT.TrainConfig:
    base = dict(data_dir=str(data_dir), out=str(out), log=str(out) + ".log", preset="test", device="cpu",
                batch_size=4, max_steps=6, warmup_steps=2, lr=3e-3, log_every=1, eval_every=3,
                eval_batches=1, minutes=2.0, save_every_minutes=10.0, storage="fp32", seed=5)
    return TT.TrainConfig(**{**base, **kw})


def losses(log: Path) -> list:
    """(step, loss) of every training line of a log, in order."""
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("step "):
            f = line.split()
            out.append((int(f[1]), float(f[f.index("loss") + 1])))
    return out


def test_sample_data_splits(data_dir):
    tsv = [ln.split("\t")[0] for ln in SAMPLE.read_text().splitlines()]
    test_verses = (data_dir / "kjv_test.txt").read_text().splitlines()
    assert len(test_verses) == len(tsv) // PD.TEST_EVERY
    ch_train = (data_dir / "kjv_chapters_train.txt").read_text()
    ch_test = (data_dir / "kjv_chapters_test.txt").read_text().splitlines()
    # the held-out books are whole chapters of the test split; no test verse is in the training text
    assert len(ch_test) == 3  # Ruth 1, Jonah 1, Mark 1
    assert all(v not in ch_train for v in test_verses)
    assert "Naomi" in "".join(ch_test) and "Naomi" not in ch_train
    assert json.loads((data_dir / "tokenizer.json").read_text())["model"]["vocab"].__len__() + 3 == VOCAB


def test_bad_verses_file_is_named(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("Ge1:1\tIn the beginning\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad.tsv:2"):
        PD.read_verses_tsv(bad)


def test_resume_equals_uninterrupted_run(data_dir, tmp_path):
    full = TT.train(cfg(data_dir, tmp_path / "full"))
    assert full["step"] == 6 and full["stop"] == "max_steps"
    part = TT.train(cfg(data_dir, tmp_path / "part", session_steps=3))
    assert part["step"] == 3 and part["stop"] == "session_steps"
    # the resumed run takes its settings from the state; only the budget, paths and cadence come from now
    resumed = TT.train(cfg(data_dir, tmp_path / "part", resume=str(tmp_path / "part"), lr=1.0, seed=99))
    assert resumed["step"] == 6 and resumed["session_steps"] == 3
    (ta, a), (tb, b) = TT.load_state(TT.state_path(tmp_path / "full")), TT.load_state(TT.state_path(tmp_path / "part"))
    assert ta.keys() == tb.keys() and any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in ta)
    for k in ta:  # weights, AdamW's step and moments, the random states
        assert torch.equal(ta[k], tb[k]), k
    assert losses(tmp_path / "full.log") == losses(tmp_path / "part.log")
    assert [e["loss"] for e in a["evals"]] == [e["loss"] for e in b["evals"]]
    # and the training moved the weights (a run that skipped its steps would also "match")
    init = TT.build_model(TT.ModelSpec(**a["spec"]), 5).state_dict()
    assert not torch.equal(init["lm_head.weight"], ta["model/lm_head.weight"])


def test_resume_needs_a_state(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no training state"):
        TT.train(cfg(data_dir, tmp_path / "m", resume=str(tmp_path / "nothing")))


def test_time_budget_is_kept(data_dir, tmp_path):
    minutes = 0.12  # 7.2 s, setup included
    t0 = time.time()
    out = TT.train(cfg(data_dir, tmp_path / "m", max_steps=0, minutes=minutes, eval_every=0,
                       eval_every_minutes=0.02, save_every_minutes=0.04, log_every=5), t0=t0)
    took = time.time() - t0
    assert out["stop"] == "time budget"
    assert out["step"] > 3  # it trained, not only set up
    assert took <= minutes * 60, f"{took:.2f} s for a {minutes * 60:.1f} s budget"
    assert (tmp_path / "m" / "model.safetensors").is_file() and TT.state_path(tmp_path / "m").is_file()
    assert out["evals"][-1]["step"] == out["step"]  # the final evaluation is logged


def test_bf16_autocast_path_runs(data_dir, tmp_path):
    """The GPU's bf16 autocast, taken on the CPU (--amp bf16): the same step in bf16 trains, with finite
    losses that differ from the fp32 run's (so autocast was on)."""
    fp32 = TT.train(cfg(data_dir, tmp_path / "a", max_steps=2, eval_every=1))
    bf16 = TT.train(cfg(data_dir, tmp_path / "b", max_steps=2, eval_every=1, amp="bf16"))
    la, lb = [e["loss"] for e in fp32["evals"]], [e["loss"] for e in bf16["evals"]]
    assert all(math.isfinite(x) for x in lb) and len(lb) == 3
    assert la != lb and max(abs(x - y) for x, y in zip(la, lb)) < 0.1
    assert "bf16 autocast" in (tmp_path / "b.log").read_text()


def test_bf16_storage_loads_everywhere(data_dir, tmp_path):
    from safetensors import safe_open
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusiongemma.checkpoint import load_checkpoint

    TT.train(cfg(data_dir, tmp_path / "m", max_steps=2, storage="bf16"))
    state = {k[len("model/"):]: v for k, v in TT.load_state(TT.state_path(tmp_path / "m"))[0].items()
             if k.startswith("model/")}
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    shared = [k for k in saved if k in state]
    assert len(shared) > len(saved) // 2
    for k in shared:
        assert torch.equal(saved[k], state[k].to(torch.bfloat16)), k
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, state["lm_head.weight"].to(torch.bfloat16).float())
    assert not torch.equal(hf.lm_head.weight, state["lm_head.weight"])  # it was rounded
    load_checkpoint(str(tmp_path / "m"))  # the project's loader widens bf16
    ids = []
    for backend in ("reference", "cpu"):  # the NumPy specification and the compiled path (auto's pick)
        proc = subprocess.run([sys.executable, "-m", "diffusiongemma", "generate", "And God said", "-m",
                               str(tmp_path / "m"), "--seed", "0", "-n", "16", "--json", "--backend", backend],
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        d = json.loads(proc.stdout)
        assert d["canvases"] >= 1 and d["backend"] == backend
        ids.append(d["token_ids"])
    assert ids[0] == ids[1]


def test_pipeline_end_to_end(data_dir, tmp_path):
    import pipeline as PL

    base = tmp_path / "old"
    TT.train(cfg(data_dir, base, max_steps=2))
    out = tmp_path / "out"
    summary = PL.main(["--minutes", "2", "--out", str(out), "--work", str(tmp_path / "work"), "--preset", "test",
                       "--data-dir", str(data_dir), "--device", "cpu", "--baseline", str(base),
                       "--eval-minutes", "0.9",
                       "--train-args", "--batch-size 4 --max-steps 8 --eval-every 4 --eval-batches 1 --log-every 4",
                       "--eval-args", "--batches 1 --batch-size 4 --samples 1 --max-new-tokens 16"])
    assert summary["status"] == "ok", (out / "pipeline.log").read_text()[-3000:]
    assert summary["seconds"] <= 120 and summary["steps"] == 8
    files = sorted(p.name for p in out.iterdir())
    assert files == ["evaluation.json", "evaluation.md", "model.tar", "pipeline.log", "summary.json",
                     "train_log.txt"]
    with tarfile.open(out / "model.tar") as tf:
        names = set(tf.getnames())
    assert {"tiny-kjv-new/model.safetensors", "tiny-kjv-new/tokenizer.json",
            "tiny-kjv-new/generation_config.json"} <= names
    ev = json.loads((out / "evaluation.json").read_text())
    assert len(ev) == 2
    for label, r in ev.items():
        for v in (r["running"]["tokens"], r["running"]["ar"], r["verses_in_context"]["tokens"],
                  r["bigram_share"], r["real_word_share"], r["mean_canvases"], r["unigram_entropy"]):
            assert isinstance(v, float) and math.isfinite(v), (label, v)
        assert [x["seed"] for x in r["default_runs"]] == list(range(10))
        assert all(1 <= x["canvases"] <= 2 for x in r["default_runs"])  # 16 tokens, canvas 8
        assert 0 <= r["bigram_share"] <= 1 and r["generated_bigrams"] > 0
    md = (out / "evaluation.md").read_text()
    assert "| measure | baseline: `old` | candidate: `tiny-kjv-new` |" in md
    for row in ("canvas CE on real tokens", "bigrams found in the corpus", "corpus words",
                "canvases filled per run"):
        assert row in md
    assert sum(line.startswith("seed ") for line in md.splitlines()) == 20  # ten samples per model
    log = (out / "train_log.txt").read_text()
    assert "eval        8  heldout loss" in log

    # the GPU script's form: the shipped model's stored measures beside the unpacked new model
    import evaluate_tiny as ET

    with tarfile.open(out / "model.tar") as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    res = ET.main(["--baseline-json", str(EXAMPLES / "eval_tiny-kjv.json"), "--candidate",
                   str(tmp_path / "unpacked" / "tiny-kjv-new"), "--data-dir", str(data_dir), "--batches", "1",
                   "--batch-size", "4", "--samples", "0", "--seeds", "2", "--max-new-tokens", "8",
                   "--markdown", str(tmp_path / "cmp.md")])
    md = (tmp_path / "cmp.md").read_text()
    assert "| measure | baseline: `tiny-kjv` | candidate: `tiny-kjv-new` |" in md
    assert "| 2.797 |" in md  # the shipped model's held-out canvas CE, as examples/README.md quotes it
    assert len(res) == 2


def test_word_measures():
    import evaluate_tiny as ET

    words, bigrams = {"and", "god", "said", "let"}, {("and", "god"), ("god", "said")}
    m = ET.word_measures(["And God said, let", "god xyzzy"], words, bigrams)
    assert m["generated_words"] == 6 and m["generated_bigrams"] == 4
    assert m["real_word_share"] == pytest.approx(5 / 6)
    assert m["bigram_share"] == pytest.approx(2 / 4)  # "and god", "god said"; not "said let", "god xyzzy"
    assert np.isnan(ET.word_measures([""], words, bigrams)["bigram_share"])
