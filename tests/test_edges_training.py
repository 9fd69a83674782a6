"""The training scripts at their edges (examples/train_tiny.py, evaluate_tiny.py, pipeline.py, prepare_data.py):
bad options, files and faults that ended in a traceback, a hang, a renamed data folder or a half-written file.

* every option is range-checked before anything is read or written, with one line naming it (exit status 2);
* ``--out`` naming a file, the data folder or a folder inside it, or a folder that is not a checkpoint, is
  refused before anything is touched;
* an empty, blank or binary corpus, a damaged tokenizer or state file are named with their file;
* ``--resume`` reads safetensors plus JSON and never unpickles (a pickled state is refused by name);
* a full disk while saving names the file, keeps the old checkpoint and state, and leaves no ``.tmp``;
* a run whose budget ends before its first step does not overwrite ``--out``;
* the CPU command of examples/README.md runs as written there.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import evaluate_tiny as ET  # noqa: E402
import pipeline as PL  # noqa: E402
import prepare_data as PD  # noqa: E402
import train_tiny as TT  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("kjv_sample") / "data"
    PD.main(["--verses", str(EXAMPLES / "kjv_sample.tsv"), "--data-dir", str(d), "--vocab-size", "512"])
    return d


@pytest.fixture(autouse=True)
def torch_state():
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)


def small(data_dir, out, **kw) -> TT.TrainConfig:
    base = dict(data_dir=str(data_dir), out=str(out), log=str(out) + ".log", preset="test", device="cpu",
                batch_size=2, max_steps=2, warmup_steps=1, log_every=1, eval_every=2, eval_batches=1, minutes=2.0,
                storage="fp32", seed=3)
    return TT.TrainConfig(**{**base, **kw})


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys, rc: int, script: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"{script}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ================================================================================================ options
@pytest.mark.parametrize("option, value, pattern", [
    ("--log-every", "0", r"--log-every must be an integer >= 1, got 0"),
    ("--eval-batches", "0", r"--eval-batches must be an integer in \[1, 1024\], got 0"),
    ("--eval-batches", str(10**9), r"--eval-batches must be an integer in \[1, 1024\]"),
    ("--batch-size", "0", r"--batch-size must be an integer in \[1, 4096\], got 0"),
    ("--batch-size", "-1", r"--batch-size must be an integer in \[1, 4096\], got -1"),
    ("--batch-size", str(10**9), r"--batch-size must be an integer in \[1, 4096\], got 1000000000"),
    ("--max-context", "-5", r"--max-context must be an integer in \[0, 8192\]"),
    ("--max-context", str(10**12), r"--max-context must be an integer in \[0, 8192\]"),
    ("--short-context", "300", r"--short-context \(300\) must not exceed --max-context \(224\)"),
    ("--seed", "-1", r"--seed must be an integer in \[0, 4294967295\], got -1"),
    ("--minutes", "0", r"--minutes must be in \(0, 525600\], got 0.0"),
    ("--minutes", "-1", r"--minutes must be in \(0, 525600\], got -1.0"),
    ("--minutes", "nan", r"--minutes must be a finite number, got nan"),
    ("--max-minutes", "inf", r"--minutes must be a finite number, got inf"),
    ("--eps", "0", r"--eps must be in \(0, 1\), got 0.0"),
    ("--eps", "1.5", r"--eps must be in \(0, 1\), got 1.5"),
    ("--max-steps", "-1", r"--max-steps must be an integer >= 0, got -1"),
    ("--session-steps", "-3", r"--session-steps must be an integer >= 0"),
    ("--lr", "0", r"--lr must be in \(0, 1\], got 0.0"),
    ("--p-short", "2", r"--p-short must be in \[0, 1\], got 2.0"),
    ("--grad-clip", "-1", r"--grad-clip must be in \(0, inf\)"),
    ("--save-every-minutes", "0", r"--save-every-minutes must be in \(0, inf\)"),
    ("--threads", "0", r"--threads must be an integer in \[1, "),
    ("--threads", str(10**6), r"--threads must be an integer in \[1, "),
    ("--preset", "huge", r"--preset must be one of cpu-max, cpu-mid, shipped, test, got 'huge'"),
    ("--device", "tpu", r"--device must be one of auto, cpu, cuda, got 'tpu'"),
    ("--data", "words", r"--data must be one of chapters, verses"),
    ("--storage", "f16", r"--storage must be one of fp32, bf16"),
])
def test_train_options_are_range_checked_by_name(data_dir, tmp_path, capsys, option, value, pattern):
    argv = ["--data-dir", str(data_dir), "--out", str(tmp_path / "m"), "--log", str(tmp_path / "log.txt"),
            "--preset", "test", "--device", "cpu", "--max-steps", "1", "--minutes", "0.2",  # if a check is missed
            option, value]
    err = one_line_error(capsys, TT.main(argv), "train_tiny.py")
    assert re.search(pattern, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written: not the log, not --out


@pytest.mark.parametrize("option, value, pattern", [
    ("--batches", "0", r"--batches must be an integer in \[1, 1024\], got 0"),
    ("--batch-size", "-1", r"--batch-size must be an integer in \[1, 4096\], got -1"),
    ("--batch-size", str(10**9), r"--batch-size must be an integer in \[1, 4096\]"),
    ("--seeds", "0", r"--seeds must be an integer in \[1, 1000\], got 0"),
    ("--samples", str(10**9), r"--samples must be an integer in \[0, 1000\]"),
    ("--max-new-tokens", "0", r"--max-new-tokens must be an integer in \[1, 65536\], got 0"),
    ("--seed", "-1", r"--seed must be an integer in \[0, 4294967295\], got -1"),
    ("--minutes", "nan", r"--minutes must be a finite number >= 0 \(0: no budget\), got nan"),
    ("--minutes", "-1", r"--minutes must be a finite number >= 0"),
    ("--threads", "0", r"--threads must be an integer in \[1, "),
    ("--device", "tpu", r"--device must be auto, cpu or cuda, got 'tpu'"),
])
def test_evaluate_options_are_range_checked_by_name(data_dir, capsys, option, value, pattern):
    err = one_line_error(capsys, ET.cli(["--data-dir", str(data_dir), "--model", str(data_dir / "none"), option,
                                         value]), "evaluate_tiny.py")  # a missed check ends at the missing model
    assert re.search(pattern, err), err


def test_evaluate_names_a_damaged_baseline_json_and_a_broken_checkpoint(data_dir, tmp_path, capsys):
    bad = tmp_path / "old.json"
    bad.write_text("{not json")
    err = one_line_error(capsys, ET.cli(["--data-dir", str(data_dir), "--baseline-json", str(bad), "--candidate",
                                         str(tmp_path)]), "evaluate_tiny.py")
    assert f"--baseline-json {bad}: not a JSON file of evaluate_tiny.py" in err
    bad.write_text('{"x": 1}')
    err = one_line_error(capsys, ET.cli(["--data-dir", str(data_dir), "--baseline-json", str(bad)]), "evaluate_tiny.py")
    assert "not the measures of evaluate_tiny.py --json" in err
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "diffusion_gemma", "text_config": 7}')
    err = one_line_error(capsys, ET.cli(["--data-dir", str(data_dir), "--candidate", str(broken), "--batches", "1"]),
                         "evaluate_tiny.py")
    assert f"--candidate {broken}: not a checkpoint transformers can load" in err


def test_pipeline_and_prepare_options_are_named(tmp_path):
    for argv, pattern in ((["--minutes", "0"], r"--minutes must be a finite number > 0, got 0.0"),
                          (["--minutes", "nan"], r"--minutes must be a finite number > 0, got nan"),
                          (["--minutes", "1", "--eval-minutes", "5"], r"--eval-minutes must be a number in \[0, "),
                          (["--verses", str(tmp_path / "none.tsv")], r"--verses .*none.tsv: no such file")):
        with pytest.raises(ValueError, match=pattern):
            PL.main(["--out", str(tmp_path / "o"), *argv])
    tiny = tmp_path / "v.tsv"
    tiny.write_text("Ge1:1\tIn the beginning God created the heaven and the earth.\n")
    with pytest.raises(ValueError, match=r"--vocab-size 4096: the training text yields a tokenizer of only \d+ ids"):
        PD.main(["--verses", str(tiny), "--data-dir", str(tmp_path / "d"), "--vocab-size", "4096"])
    tiny.write_bytes(b"Ge1:1\t\xff\xfe\x00binary\n")
    with pytest.raises(ValueError, match=r"v\.tsv: not UTF-8 text"):
        PD.read_verses_tsv(tiny)


# ================================================================================================ --out
def test_out_that_is_a_file_or_inside_the_data_folder_is_refused_untouched(data_dir, tmp_path, capsys):
    before = snapshot(data_dir)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    cases = [(a_file, "is a file"), (data_dir, "is inside the data folder"),
             (data_dir / "sub", "is inside the data folder"), (data_dir.parent, "holds the data folder")]
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"\xff\xd8")
    cases.append((other, "is a folder with other files"))
    for out, why in cases:
        rc = TT.main(["--data-dir", str(data_dir), "--out", str(out), "--log", str(tmp_path / "log.txt"),
                      "--preset", "test", "--device", "cpu", "--max-steps", "1"])
        err = one_line_error(capsys, rc, "train_tiny.py")
        assert f"--out {out}: {why}" in err, err
    assert snapshot(data_dir) == before and a_file.read_text() == "keep me" and (other / "a.jpg").exists()
    assert not (tmp_path / "log.txt").exists()


# ================================================================================================ files
@pytest.mark.parametrize("content, pattern", [
    (b"", r"kjv_chapters_train.txt: empty: no text"),
    (b"\n  \n\t\n", r"kjv_chapters_train.txt: only blank lines: no text"),
    (b"\x00\x01\x02 binary", r"kjv_chapters_train.txt: a binary file \(NUL byte at 0\)"),
    (b"\xff\xfe\xfa", r"kjv_chapters_train.txt: not UTF-8 text \(byte 0\)"),
])
def test_an_empty_blank_or_binary_corpus_is_named(data_dir, tmp_path, content, pattern):
    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    (d / "kjv_chapters_train.txt").write_bytes(content)
    with pytest.raises(ValueError, match=pattern):
        TT.train(small(d, tmp_path / "m"))
    assert not (tmp_path / "m").exists()


def test_a_damaged_tokenizer_is_named(data_dir, tmp_path):
    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    text = (d / "tokenizer.json").read_text()
    (d / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"tokenizer.json: not a readable tokenizer"):
        TT.train(small(d, tmp_path / "m"))


class _Boom:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code from a data file ran"))


def test_resume_never_unpickles_and_names_a_foreign_state(data_dir, tmp_path):
    marker = tmp_path / "ran.txt"
    old = tmp_path / "m.train_state.pt"
    with open(old, "wb") as f:
        pickle.dump({"cfg": _Boom(str(marker))}, f)
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match=r"m\.train_state\.pt: a pickled training state .* unpickling runs code"):
        TT.train(small(data_dir, tmp_path / "new", resume=str(tmp_path / "m")))
    torch.save({"cfg": {}}, tmp_path / "zip.train_state.safetensors")  # torch's zip format under our name
    with pytest.raises(ValueError, match=r"zip\.train_state\.safetensors: a pickled training state"):
        TT.train(small(data_dir, tmp_path / "new", resume=str(tmp_path / "zip.train_state.safetensors")))
    assert not marker.exists()
    junk = tmp_path / "junk.train_state.safetensors"
    junk.write_bytes(os.urandom(64))
    with pytest.raises(ValueError, match=r"junk\.train_state\.safetensors: not a training state"):
        TT.train(small(data_dir, tmp_path / "new", resume=str(junk)))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(junk), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not a training state of this script \(format 'pt'"):
        TT.train(small(data_dir, tmp_path / "new", resume=str(junk)))
    assert not (tmp_path / "new").exists()


def test_a_damaged_state_is_named(data_dir, tmp_path):
    TT.train(small(data_dir, tmp_path / "m", max_steps=1))
    path = TT.state_path(tmp_path / "m")
    tensors, info = TT.load_state(path)
    info["cfg"]["batch_size"] = -4  # a setting out of range, as a damaged or edited file may hold
    TT.save_state(path, tensors, info)
    with pytest.raises(ValueError, match=rf"--resume {re.escape(str(path))}: --batch-size must be an integer in"):
        TT.train(small(data_dir, tmp_path / "m", resume=str(tmp_path / "m")))
    info["cfg"]["batch_size"] = 2
    info.pop("numpy_rng")
    TT.save_state(path, tensors, info)
    with pytest.raises(ValueError, match=r"the state's settings lack \['numpy_rng'\]"):
        TT.train(small(data_dir, tmp_path / "m", resume=str(tmp_path / "m")))


# ================================================================================================ faults
def _no_tmp(folder: Path) -> list:
    return [p.name for p in folder.iterdir() if ".tmp" in p.name or ".trial" in p.name]


def test_a_full_disk_while_saving_the_checkpoint_is_named_and_keeps_the_old_one(data_dir, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    TT.train(small(data_dir, tmp_path / "m", max_steps=1))
    before = snapshot(tmp_path / "m")
    real = PreTrainedModel.save_pretrained
    calls = []

    def full_disk(self, folder, *a, **kw):
        calls.append(folder)
        if len(calls) == 1:  # the trial save at step 0 works; the real one hits a full disk half-way
            return real(self, folder, *a, **kw)
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(OSError, match=rf"cannot write the checkpoint {re.escape(str(tmp_path / 'm'))}: No space "
                                      r"left on device; the previous one is kept"):
        TT.train(small(data_dir, tmp_path / "m", max_steps=2, seed=4))
    assert snapshot(tmp_path / "m") == before and _no_tmp(tmp_path) == []


def test_a_full_disk_while_saving_the_state_is_named_and_leaves_no_tmp(data_dir, tmp_path, monkeypatch, capsys):
    TT.train(small(data_dir, tmp_path / "m", max_steps=1))
    state = TT.state_path(tmp_path / "m").read_bytes()
    capsys.readouterr()  # what that run printed (transformers' save bars) is not the command's
    real_fsync = os.fsync
    final = str(TT.state_path(tmp_path / "m")) + ".tmp"

    def full_disk(fd):  # the disk is full when the run writes its state under the final name (the step-0 trial
        if os.readlink(f"/proc/self/fd/{fd}") == final:  # save writes other names, however many there are)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    monkeypatch.setattr(TT, "_T_START", 0.0)  # imported long ago (a long test session): the budget counts from main's call
    rc = TT.main(["--data-dir", str(data_dir), "--out", str(tmp_path / "m"), "--log", str(tmp_path / "m.log"),
                  "--preset", "test", "--device", "cpu", "--max-steps", "2", "--batch-size", "2", "--eval-batches",
                  "1", "--minutes", "2"])
    err = one_line_error(capsys, rc, "train_tiny.py")
    assert f"cannot write the training state {TT.state_path(tmp_path / 'm')}: No space left on device" in err
    assert TT.state_path(tmp_path / "m").read_bytes() == state and _no_tmp(tmp_path) == []


def test_a_run_with_no_time_to_train_leaves_out_as_it_was(data_dir, tmp_path):
    TT.train(small(data_dir, tmp_path / "m", max_steps=1))
    before, state = snapshot(tmp_path / "m"), TT.state_path(tmp_path / "m").read_bytes()
    out = TT.train(small(data_dir, tmp_path / "m", max_steps=0, minutes=0.001, seed=9))
    assert out["saved"] is False and out["session_steps"] == 0
    assert snapshot(tmp_path / "m") == before and TT.state_path(tmp_path / "m").read_bytes() == state
    assert "nothing saved" in (tmp_path / "m.log").read_text() and _no_tmp(tmp_path) == []


def test_init_from_a_broken_checkpoint_is_named(data_dir, tmp_path):
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"--init-from {re.escape(str(broken))}: not a checkpoint transformers can "
                                         "load"):
        TT.train(small(data_dir, tmp_path / "m", init_from=str(broken)))


# ================================================================================================ README
def readme_cpu_command() -> list[str]:
    """The CPU pipeline command of examples/README.md, as written there (one line in a code block)."""
    lines = [ln.strip() for ln in (EXAMPLES / "README.md").read_text().splitlines()
             if ln.strip().startswith("python examples/pipeline.py") and "--device cpu" in ln]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def test_the_readme_cpu_command_names_the_shipped_sample():
    argv = readme_cpu_command()
    assert argv[:2] == ["python", "examples/pipeline.py"] and argv[argv.index("--out") + 1] == "OUT"
    assert argv[argv.index("--verses") + 1] == "examples/kjv_sample.tsv"
    minutes = float(argv[argv.index("--minutes") + 1])
    assert minutes <= 1.0  # the suite runs it: it must stay short
    assert f"--minutes {minutes:g}" in (EXAMPLES / "README.md").read_text()


@pytest.mark.slow
def test_the_readme_cpu_command_runs_as_written(tmp_path):
    """The line from examples/README.md, with OUT a temporary folder, run from another folder than the
    repository (its paths are the repository's: the command is given from there, so they are made absolute
    here the way a shell in the repository would see them)."""
    argv = readme_cpu_command()
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    cmd = [sys.executable, str(ROOT / argv[1])] + [str(ROOT / a) if a.startswith("examples/") else a for a in argv[2:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    minutes = float(argv[argv.index("--minutes") + 1])
    assert summary["status"] == "ok" and summary["seconds"] <= minutes * 60, summary
    assert summary["steps"] >= 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "evaluation.json", "evaluation.md", "model.tar", "pipeline.log", "summary.json", "train_log.txt"]
    assert "| measure | baseline: `tiny-kjv` | candidate: `tiny-kjv-new` |" in (tmp_path / "out" / "evaluation.md").read_text()
    assert (tmp_path / "dg_work" / "data" / "tokenizer.json").is_file()  # the sample did not go to examples/data
