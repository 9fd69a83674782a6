"""docs/SPEC.md measured the way a reader meets it, for tests/test_spec_reading.py and docs/READING.md.

    python -m tests.spec_reading        # prints the per-section table of docs/READING.md

* **Parts.** The SPEC has three parts, each opened by a top-level heading: ``# Part I: ...`` (§0), ``# The
  model and the sampler`` (§1-§9) and ``# Part II: ...`` (§10 on). ``parts`` maps every section number to its
  part, so that a test can refuse a pointer from Part I into Part II (a reader of the idea must not need the
  porters' material).
* **Concept share.** Every non-blank line of a section, headings left out, is either *numerics* or *prose*.
  Numerics: a line inside a code block (``>>>`` examples included), a table row, or a line holding a formula
  or a number with a fractional part: one of ``= ≤ ≥ · × √ Σ ∈ ^`` or a superscript minus, or a digit, a point
  and a digit, or a number in exponent form (``1e-6``), once section and trap pointers, arXiv ids and version
  numbers (``5.24.0``) are taken out. Every other line is prose. The concept share of a section is
  prose / (prose + numerics). It is crude on purpose: a reader feels the same difference between a paragraph
  and a table of roundings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC_PATH = ROOT / "docs" / "SPEC.md"

PART_HEADING = re.compile(r"^# (?!DiffusionGemma)(.+)$", re.MULTILINE)  # the title is not a part
SECTION_HEADING = re.compile(r"^(#{2,3}) (\d+(?:\.\d+)*)\.? (.+)$")
FENCE = re.compile(r"^\s*```")
NOT_NUMERICS = re.compile(r"§\s*\d+(?:\.\d+)*|\bT\d+\b|arXiv \d+\.\d+|\b\d+\.\d+\.\d+\b|\(\d+(?:\.\d+)?\)")
NUMERICS = re.compile(r"[=≤≥·×√Σ∈^⁻]|\d\.\d|\d[eE][-+]?\d")


@dataclass
class Section:
    number: str  # "8.6"
    title: str
    part: str  # the part heading's text
    lines: list[str]  # the section's own lines, its heading excluded (subsections not included)

    def counts(self) -> tuple[int, int]:
        """(prose lines, numerics lines) as the module docstring defines them."""
        prose = numerics = 0
        in_code = False
        for line in self.lines:
            if FENCE.match(line):
                in_code = not in_code
                continue
            if not line.strip():
                continue
            if in_code or line.lstrip().startswith("|") or NUMERICS.search(NOT_NUMERICS.sub("", line)):
                numerics += 1
            else:
                prose += 1
        return prose, numerics


def sections(text: str) -> list[Section]:
    """Every numbered section (## and ###) in document order, with the part it sits in."""
    found: list[Section] = []
    part = ""
    in_code = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if not in_code and line.startswith("# ") and PART_HEADING.match(line):
            part = line[2:].strip()
            found.append(Section("", part, part, []))  # the part's opening belongs to no section
            continue
        m = None if in_code else SECTION_HEADING.match(line)
        if m:
            found.append(Section(m.group(2), m.group(3).strip(), part, []))
        elif not in_code and line.startswith("## "):  # an unnumbered heading ends the section before it
            found.append(Section("", line[3:].strip(), part, []))
        elif found:
            found[-1].lines.append(line)
    return [s for s in found if s.number]


def parts(text: str) -> dict[str, str]:
    """{section number: the part it belongs to}."""
    return {s.number: s.part for s in sections(text)}


def part_text(text: str, starts_with: str) -> str:
    """The text of the part whose heading starts with ``starts_with`` (up to the next part heading)."""
    heads = [m for m in PART_HEADING.finditer(text)]
    for i, m in enumerate(heads):
        if m.group(1).startswith(starts_with):
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            return text[m.start():end]
    raise ValueError(f"no part heading starting with {starts_with!r}")


def table(text: str) -> str:
    """The Markdown table docs/READING.md shows: one row per section, then one per part."""
    rows = ["| section | title | part | prose lines | numerics lines | concept share |", "|---|---|---|---|---|---|"]
    totals: dict[str, list[int]] = {}
    for s in sections(text):
        prose, numerics = s.counts()
        total = totals.setdefault(s.part, [0, 0])
        total[0] += prose
        total[1] += numerics
        share = f"{prose / (prose + numerics):.0%}" if prose + numerics else "-"
        rows.append(f"| §{s.number} | {s.title} | {s.part.split(':')[0]} | {prose} | {numerics} | {share} |")
    idea = [s.counts() for s in sections(text) if s.number == "0" or re.fullmatch(r"0\.[1-7]", s.number)]
    prose, numerics = sum(c[0] for c in idea), sum(c[1] for c in idea)
    rows.append(f"| §0-§0.7 | the idea alone | Part I | {prose} | {numerics} | {prose / (prose + numerics):.0%} |")
    for part, (prose, numerics) in totals.items():
        rows.append(f"| all | | {part.split(':')[0]} | {prose} | {numerics} | {prose / (prose + numerics):.0%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(SPEC_PATH.read_text(encoding="utf-8")))
