"""The layout the README and docs/SPEC.md's file table describe, held against the tree.

* no import cycle anywhere in the project, function-local imports included;
* imports follow the stated direction (reference <- fast <- fast/gpu; reference <- weights_converter; the
  package root on top; inside the reference, no specification file or rail imports a variant);
* the SPEC's file table lists every specification file with its size and semantic share (>= 90 %), as measured;
* the § pointers of ``reference/__init__.py`` name the sections the SPEC's file table gives for those files, and those
  sections exist under the titles the table gives;
* importing ``reference`` bare from the repository root is refused, naming ``diffusiongemma.reference``.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.layout import ROOT, SPEC_FILES, cycles, line_count, project_imports, semantic_share

SPEC = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")


def _layer(module: str) -> str:
    if module.endswith(".cli") or ".cli." in module:  # a command line sits on top, whatever package holds it
        return "root"
    for prefix, layer in (("diffusiongemma.reference.variants", "variants"),
                          ("diffusiongemma.reference.support", "support"), ("diffusiongemma.reference", "spec"),
                          ("diffusiongemma.fast.gpu", "gpu"), ("diffusiongemma.fast", "fast"),
                          ("diffusiongemma.weights_converter", "converter")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "root" if module != "diffusiongemma" else "namespace"


# what each layer may import (besides itself and the bare ``diffusiongemma`` namespace, for __version__)
ALLOWED = {"spec": {"support"}, "support": {"spec"}, "variants": {"spec", "support"},
           "fast": {"spec", "support", "variants"}, "gpu": {"spec", "support", "variants", "fast"},
           "converter": {"spec", "support"}, "namespace": {"root"},
           "root": {"spec", "support", "variants", "fast", "gpu", "converter", "namespace"}}


def test_no_import_cycle():
    graph = project_imports()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 200, "the import scan found too little"
    assert not cycles(graph), f"import cycles: {cycles(graph)}"


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = project_imports()
    graph["diffusiongemma.reference.cache"].add("diffusiongemma.reference.model")  # model imports cache
    assert ["diffusiongemma.reference.cache", "diffusiongemma.reference.model"] in cycles(graph)


def test_imports_follow_the_stated_direction():
    bad = []
    for module, targets in project_imports().items():
        mine = _layer(module)
        for target in targets:
            theirs = _layer(target)
            if module == "diffusiongemma.reference" and theirs == "variants":  # the package map registers them
                continue
            if theirs != mine and theirs not in ALLOWED[mine] and theirs != "namespace":
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not bad, "imports against the README's direction:\n" + "\n".join(sorted(bad))


def _spec_table() -> dict[str, tuple[int, int, str, str]]:
    """The SPEC's file table: file -> (lines, semantic share %, section, section title)."""
    rows = re.findall(r"^\| `reference/([a-z_]+\.py)` \| (\d+) \| (\d+) % \| §([\d.]+) ([^|]+?) \|", SPEC, re.M)
    return {name: (int(lines), int(share), section, title.strip()) for name, lines, share, section, title in rows}


def test_spec_table_lists_every_specification_file_as_measured():
    table = _spec_table()
    assert set(table) == set(SPEC_FILES) == {p.name for p in (ROOT / "reference").glob("*.py")} - {"__init__.py"}
    for name, (lines, share, _, _) in table.items():
        path = ROOT / "reference" / name
        measured = semantic_share(path) * 100
        assert abs(line_count(path) - lines) <= max(10, lines // 10), (name, line_count(path), lines)
        assert abs(measured - share) <= 2, (name, measured, share)
        assert measured >= 90, f"reference/{name} is {measured:.0f} % semantics (checks belong in support/)"


def test_section_pointers_name_their_sections():
    headings = dict(re.findall(r"^#{2,3} (\d+(?:\.\d+)*)\.? (.+)$", SPEC, re.M))
    table = _spec_table()
    for name, (_, _, section, title) in table.items():
        assert section in headings, f"the SPEC's file table points reference/{name} at §{section}, which is not a section"
        assert headings[section].strip().lower() == title.lower(), (name, section, headings[section], title)
    init = (ROOT / "reference" / "__init__.py").read_text(encoding="utf-8")
    for name, (_, _, section, _) in table.items():
        line = re.search(rf"^    {name[:-3]}\s.*$", init, re.M)
        assert line, f"reference/__init__.py does not list {name}"
        assert f"§{section}" in line.group(0), f"reference/__init__.py points {name} elsewhere than §{section}"


@pytest.mark.parametrize("package", ["reference", "fast", "weights_converter"])
def test_a_bare_import_from_the_repository_root_is_refused(package):
    run = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert run.returncode != 0 and f"diffusiongemma.{package}" in run.stderr, run.stderr[-500:]
