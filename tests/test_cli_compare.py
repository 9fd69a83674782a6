"""``diffusiongemma compare``'s report: short by default (the first differing tensors, a few agreeing ones
before the first divergence, the verdict), ``--full`` every tensor, ``--summary`` only the verdict."""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiongemma.cli.main import main
from diffusiongemma.trace import Trace, write_trace
from diffusiongemma.trace.compare import SHORT_CONTEXT, SHORT_FAILING

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "golden", "tiny-b",
                      "golden.trace")


def table_rows(out: str) -> list[str]:
    """The per-tensor rows of a report (a row ends with OK / NOT OK)."""
    return [line for line in out.splitlines() if line.endswith(" OK") and not line.startswith("RESULT")]


@pytest.fixture(scope="module")
def changed(tmp_path_factory):
    """The golden trace with every float32 tensor of the canvases shifted (the encoder K/V before them agree)."""
    with Trace(GOLDEN) as trace:
        header = dict(trace.header)
        tensors = {name: trace.get(name) for name in trace.shapes}
    names = [name for name, value in tensors.items() if name.startswith("canvas") and value.dtype == np.float32]
    assert len(names) > 2 * SHORT_FAILING
    for name in names:
        tensors[name] = tensors[name] + np.float32(0.01)
    path = str(tmp_path_factory.mktemp("compare") / "changed.trace")
    write_trace(path, header, tensors)
    return path, len(tensors)


def test_short_by_default(changed, capsys):
    path, n_tensors = changed
    assert main(["compare", GOLDEN, path, "--only", "forward"]) == 1
    out = capsys.readouterr().out
    rows = table_rows(out)
    failing = [row for row in rows if row.endswith("NOT OK")]
    assert len(failing) == SHORT_FAILING and len(rows) == SHORT_FAILING + SHORT_CONTEXT, out
    assert "more differing tensor(s) not shown; --full lists every tensor" in out
    assert "RESULT: NOT OK. First divergence: canvas0." in out
    assert main(["compare", GOLDEN, GOLDEN]) == 0
    agreeing = capsys.readouterr().out
    assert not table_rows(agreeing) and agreeing.strip().splitlines()[-1].startswith("RESULT: OK")


def test_full_lists_every_tensor_and_summary_none(changed, capsys):
    path, _ = changed
    assert main(["compare", GOLDEN, path, "--only", "forward", "--full"]) == 1
    full = capsys.readouterr().out
    assert len(table_rows(full)) > SHORT_FAILING + SHORT_CONTEXT and "--full lists" not in full
    assert main(["compare", GOLDEN, path, "--only", "forward", "--summary"]) == 1
    summary = capsys.readouterr().out
    assert not table_rows(summary) and "RESULT: NOT OK" in summary
    with pytest.raises(SystemExit):
        main(["compare", GOLDEN, path, "--full", "--summary"])
