"""The semantics documents (docs/SPEC.md, docs/TRAINING.md) are executable and complete.

(a) Every ``>>>`` example in ``docs/*.md`` runs under ``doctest`` and prints what the document says; the two
    semantics documents must contain examples.
(b) Every citation of a section or trap anywhere in the project's sources resolves to a definition in
    ``docs/``: a heading ``## 7.3 ...`` (or ``### 7.3``) defines section 7.3 of its document, and a row
    ``| T18 | ...`` of the trap table in docs/SPEC.md defines trap T18.
(c) Every test a document names as ``tests/test_x.py::test_name`` exists, and every trap names one.

Citation forms recognised (the paragraph sign followed by a dotted number):

* a document name, then the sign: ``SPEC``, ``SPEC.md``, ``TRAINING``, ``TRAINING.md``;
* a chain continuing such a citation: ``, `` / ``-`` / ``and`` / ``or`` then the sign and a number;
* a bare sign: inside docs/SPEC.md or docs/TRAINING.md it is that document; elsewhere it belongs to the
  document named last before it in the same file (a bare sign with no document named before it is an
  error: a reader cannot tell which document it means);
* traps: ``trap T7``, ``traps T5/T6``, ``traps T2, T5, T6`` (any capitalisation), and inside docs/SPEC.md
  every ``T`` followed by digits (that document uses the letter-digit form only for traps).
"""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SEMANTICS = {"SPEC": DOCS / "SPEC.md", "TRAINING": DOCS / "TRAINING.md"}
SCANNED_DIRS = ("reference", "fast", "weights_converter", "diffusiongemma", "tests", "examples", "benchmarks",
                "docs")
SCANNED_FILES = ("README.md",)
SUFFIXES = {".py", ".pyx", ".pxd", ".md", ".cu", ".cuh", ".h", ".sh"}  # sources; never generated C
SKIPPED_DIRS = {"__pycache__", "build", "dist", ".hypothesis", ".pytest_cache", "data"}

SIGN = "\u00a7"
NUMBER = r"\d+(?:\.\d+)*"
DOC_NAME = r"\b(SPEC|TRAINING)(?:\.md)?"
JOIN = r"\s*(?:,|-|\u2013|/|\band\b|\bor\b)\s*"
# a document name followed by one section number and any chain of further ones
EXPLICIT = re.compile(DOC_NAME + r"\s*(" + SIGN + r"\s*" + NUMBER + r"(?:" + JOIN + SIGN + r"\s*" + NUMBER + r")*)")
SECTION = re.compile(SIGN + r"\s*(" + NUMBER + r")")
MENTION = re.compile(DOC_NAME)
TRAP_LIST = re.compile(r"\btraps?\s+(T\d+(?:" + JOIN + r"T\d+)*)", re.IGNORECASE)
TRAP_ID = re.compile(r"\bT(\d+)\b")
HEADING = re.compile(r"^#{1,6}\s+(" + NUMBER + r")\.?\s", re.MULTILINE)
TRAP_ROW = re.compile(r"^\|\s*T(\d+)\s*\|", re.MULTILINE)
TEST_REF = re.compile(r"\btests/(test_\w+\.py)::(test_\w+)")


# ------------------------------------------------------------------------------------------------ collecting
def defined_sections(text: str) -> set[str]:
    """Section numbers a document defines by its headings (``## 7.3 Title`` or ``## 7. Title``)."""
    return set(HEADING.findall(text))


def defined_traps(text: str) -> set[str]:
    """Trap ids (``T18``) a document defines by its trap-table rows."""
    return {f"T{n}" for n in TRAP_ROW.findall(text)}


def citations(text: str, own_doc: str | None) -> list[tuple[int, str, str]]:
    """Every citation in ``text`` as (line, document, what): what is a section number or a trap id.

    ``own_doc``: the document a bare sign means in this file ("SPEC"/"TRAINING" for the documents
    themselves), or None (then the last document named earlier in the file; "?" when none was).
    """
    found: list[tuple[int, str, str]] = []
    line_of = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
    covered: set[int] = set()  # start offsets of signs already attributed by an explicit citation
    for m in EXPLICIT.finditer(text):
        for s in SECTION.finditer(m.group(2)):
            found.append((line_of(m.start(2) + s.start()), m.group(1), s.group(1)))
            covered.add(m.start(2) + s.start())
    mentions = [(m.start(), m.group(1)) for m in MENTION.finditer(text)]
    for s in SECTION.finditer(text):
        if s.start() in covered:
            continue
        doc = own_doc
        if doc is None:
            earlier = [name for pos, name in mentions if pos < s.start()]
            doc = earlier[-1] if earlier else "?"
        found.append((line_of(s.start()), doc, s.group(1)))
    trap_spans = []
    for m in TRAP_LIST.finditer(text):
        trap_spans.append(m.span(1))
        for t in TRAP_ID.finditer(m.group(1)):
            found.append((line_of(m.start(1) + t.start()), "SPEC", f"T{t.group(1)}"))
    if own_doc == "SPEC":
        for t in TRAP_ID.finditer(text):
            if not any(a <= t.start() < b for a, b in trap_spans):
                found.append((line_of(t.start()), "SPEC", f"T{t.group(1)}"))
    return found


def scanned_files() -> list[Path]:
    """The project's source and documentation files, build outputs and data folders left out."""
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for top in SCANNED_DIRS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
            files += [Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix in SUFFIXES]
    return files


def own_document(path: Path) -> str | None:
    """"SPEC" or "TRAINING" when ``path`` is that document (a bare sign there means itself), else None."""
    for name, doc in SEMANTICS.items():
        if path.resolve() == doc.resolve():
            return name
    return None


def unresolved(files: list[Path], definitions: dict[str, set[str]], root: Path = ROOT) -> list[str]:
    """'file:line: DOC what' (paths relative to ``root``) for each citation the definitions lack."""
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for line, doc, what in citations(text, own_document(path)):
            if doc == "?":
                problems.append(f"{path.relative_to(root)}:{line}: {SIGN}{what} names no document (write SPEC "
                                f"{SIGN}{what} or TRAINING.md {SIGN}{what})")
            elif what not in definitions[doc]:
                shown = f"trap {what}" if what.startswith("T") else SIGN + what
                problems.append(f"{path.relative_to(root)}:{line}: {doc} {shown} is not defined in "
                                f"docs/{doc}.md")
    return problems


def load_definitions() -> dict[str, set[str]]:
    spec = SEMANTICS["SPEC"].read_text(encoding="utf-8")
    training = SEMANTICS["TRAINING"].read_text(encoding="utf-8")
    return {"SPEC": defined_sections(spec) | defined_traps(spec), "TRAINING": defined_sections(training)}


# ------------------------------------------------------------------------------------------------ (a) examples
DOC_FILES = sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_document_examples_run(path):
    """Every ``>>>`` example of the document prints what the document shows."""
    # a Markdown fence line ends the expected output like a blank line would
    text = re.sub(r"^[ \t]*```\w*[ \t]*$", "", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    test = doctest.DocTestParser().get_doctest(text, {"__name__": f"docs.{path.stem}"}, path.name, str(path), 0)
    if path in SEMANTICS.values():
        assert test.examples, f"{path.name} has no runnable examples"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    printing = np.get_printoptions()  # an example may change how NumPy prints; keep that local
    try:
        runner.run(test, out=report.append)
    finally:
        np.set_printoptions(**printing)
    assert runner.failures == 0, "".join(report)


# ------------------------------------------------------------------------------------------------ (b) citations
def test_semantics_documents_define_sections_and_traps():
    definitions = load_definitions()
    assert {"7.3", "8.2", "13", "14"} <= definitions["SPEC"]
    assert {f"T{i}" for i in range(1, 25)} <= definitions["SPEC"]
    assert {"2.3", "8.1", "8.2", "9", "10"} <= definitions["TRAINING"]


def test_every_citation_resolves():
    """Each cited section or trap in the sources, tests, examples, benchmarks and docs is defined."""
    files = scanned_files()
    assert len(files) > 50, f"only {len(files)} files scanned: the scan is broken"
    total = sum(len(citations(p.read_text(encoding="utf-8", errors="replace"), own_document(p))) for p in files)
    assert total > 100, f"only {total} citations found: the collector is broken"
    problems = unresolved(files, load_definitions())
    assert not problems, "citations that docs/ does not define:\n" + "\n".join(problems)


def test_collector_reports_what_is_not_defined(tmp_path):
    """Negative control: the collector sees each citation form and reports undefined ones."""
    sign = SIGN
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join([
        f"# SPEC {sign}7.3 and SPEC {sign}99.1",  # one defined, one not
        f"# TRAINING.md {sign}9-{sign}98",  # a chain: the second is not defined
        f"# trap T6; traps T5/T{77}",  # a list: T77 is not defined
        f"# later, bare {sign}2.3 belongs to TRAINING (named last)",
    ]), encoding="utf-8")
    orphan = tmp_path / "orphan.py"
    orphan.write_text(f"# a bare {sign}4 with no document named before it\n", encoding="utf-8")
    defs = {"SPEC": {"7.3", "T5", "T6"}, "TRAINING": {"9", "2.3"}}
    found = citations(sample.read_text(encoding="utf-8"), None)
    assert (1, "SPEC", "7.3") in found and (2, "TRAINING", "98") in found and (4, "TRAINING", "2.3") in found
    problems = unresolved([sample, orphan], defs, root=tmp_path)
    assert len(problems) == 4, problems
    assert any("99.1" in p for p in problems) and any("98" in p for p in problems)
    assert any("T77" in p for p in problems) and any("names no document" in p for p in problems)


# ------------------------------------------------------------------------------------------------ (c) tests named
def test_named_tests_exist_and_every_trap_names_one():
    spec = SEMANTICS["SPEC"].read_text(encoding="utf-8")
    missing = []
    for path in SEMANTICS.values():
        for file, name in TEST_REF.findall(path.read_text(encoding="utf-8")):
            source = ROOT / "tests" / file
            if not source.is_file() or not re.search(rf"^\s*def {name}\(", source.read_text(encoding="utf-8"),
                                                     re.MULTILINE):
                missing.append(f"{path.name}: tests/{file}::{name}")
    assert not missing, "named tests that do not exist:\n" + "\n".join(missing)
    rows = [line for line in spec.splitlines() if TRAP_ROW.match(line)]
    assert len(rows) >= 24
    without = [line.split("|")[1].strip() for line in rows if not TEST_REF.search(line)]
    assert not without, f"traps without a pinning test: {without}"


def test_readme_folder_map_matches_the_tree():
    """Every file the README's folder map names exists in its folder, and every module of the specification
    and of the fast paths is named there (the map is how a reader finds things)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Map of the folders"):readme.index("### One canvas, in file order")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows, "no folder rows in the README's map"
    missing, unnamed = [], []
    for row in rows:
        folder = re.match(r"\| `([^`]+)/`", row).group(1)
        names = set(re.findall(r"`([A-Za-z_][\w./-]*\.(?:py|pyx|md|sh))`", row))
        for name in names:
            candidates = [root / folder / name, root / name] + [d / name for d in (root / folder).iterdir() if d.is_dir()]
            if not any(p.exists() for p in candidates):
                missing.append(f"{folder}/{name}")
        if folder in ("reference", "fast", "fast/gpu"):
            for path in sorted((root / folder).glob("*.py*")):
                if path.suffix in (".py", ".pyx") and path.name != "__init__.py" and path.name not in names:
                    unnamed.append(f"{folder}/{path.name}")
    assert not missing, f"the README's map names files that do not exist: {missing}"
    assert not unnamed, f"modules the README's map does not name: {unnamed}"
