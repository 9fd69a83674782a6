"""docs/SPEC.md read as its first readers read it (tests/spec_reading.py defines the measures).

* Part I (the idea, §0) points at nothing in Part II (the porters' material): no section pointer and no trap.
* The idea itself (§0.1-§0.7) is mostly prose, and Part I comes before every rounding detail.
* Every code name the SPEC or a docstring of the reference mentions in backticks as a dotted name
  (``sampling.entropy_bound_accept``, ``Model.denoise``, ``reference.cache.KVCache``, ``torch.topk``) exists:
  it is imported and looked up attribute by attribute. Names that are not code (file names, checkpoint
  tensor names, attributes of an instance such as ``config.vocab_size``) are left out by the rules below.
"""

from __future__ import annotations

import ast
import functools
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from tests.spec_reading import ROOT, SPEC_PATH, part_text, parts, sections
from tests.test_docs import TRAP_ROW, citations

SPEC = SPEC_PATH.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ no forward references
def forward_references(text: str) -> list[str]:
    """Pointers from Part I to a section or trap defined in Part II: '§13' / 'trap T6' with their line."""
    where = parts(text)
    part_two = {number for number, part in where.items() if part.startswith("Part II")}
    trap_section = next(s.number for s in sections(text) if any(TRAP_ROW.match(line) for line in s.lines))
    first = part_text(text, "Part I")
    found = []
    for line, _, what in citations(first, "SPEC"):
        if what.startswith("T") and trap_section in part_two:
            found.append(f"Part I line {line}: trap {what} (the traps are §{trap_section}, Part II)")
        elif what in part_two:
            found.append(f"Part I line {line}: §{what} is in Part II")
    return found


def test_part_one_points_at_nothing_in_part_two():
    where = parts(SPEC)
    assert where["0.5"].startswith("Part I") and where["8.6"].startswith("The model")
    assert where["13"].startswith("Part II") and where["17"].startswith("Part II")
    assert not forward_references(SPEC), "\n".join(forward_references(SPEC))


def test_a_forward_reference_is_caught():
    planted = SPEC.replace("### 0.4 Renoising\n", "### 0.4 Renoising\n\nSee §11.2 and trap T20.\n", 1)
    found = forward_references(planted)
    assert len(found) == 2 and "§11.2" in found[0] and "T20" in found[1], found


def test_part_one_comes_first_and_the_idea_is_mostly_prose():
    order = [s.number for s in sections(SPEC)]
    assert order[0] == "0" and order.index("0.7") < order.index("1") < order.index("10") < order.index("17")
    idea = [s for s in sections(SPEC) if s.number in {"0"} | {f"0.{i}" for i in range(1, 8)}]
    prose = sum(s.counts()[0] for s in idea)
    numerics = sum(s.counts()[1] for s in idea)
    assert len(idea) == 8 and prose / (prose + numerics) >= 0.85, (prose, numerics)
    # no rounding rule in the idea: float32 / float64 / bfloat16 and "rounding" appear from §1 on only
    idea_text = "\n".join(line for s in idea for line in s.lines)
    assert not re.search(r"float(32|64)|bfloat16|round", idea_text), re.findall(r".*(?:float|round).*", idea_text)


def test_the_measure_counts_code_tables_and_formulas_as_numerics():
    from tests.spec_reading import Section

    sample = Section("9.9", "sample", "Part I", ["A sentence of prose (see §8.6 and trap T13).", "",
                                                "| a | table |", "```python", ">>> 1 + 1", "2", "```",
                                                "τ_n = t_min + (t_max − t_min)·n/N", "β is 0.1 nats."])
    assert sample.counts() == (1, 5)


# ------------------------------------------------------------------------------------------ code names exist
DOTTED = re.compile(r"``?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?")
NOT_CODE_SUFFIX = re.compile(r"\.(py|pyx|pxd|cpp|cu|cuh|h|json|md|sh|txt|npz|gguf|safetensors)$")
# first components that name an instance or a checkpoint tensor, not a module or class
INSTANCE_ROOTS = {"self", "config", "cache", "model", "sampler_config", "final_carry", "generation_config"}
TENSOR_ROOTS = {"router", "experts", "self_attn", "mlp", "lm_head"}
# other implementations' code that the README does not install
FOREIGN_ROOTS = {"jax", "lax", "mx", "mlx", "diffusers", "BlockRefinementScheduler"}
# names a docstring still mentions although they are gone, each to be fixed in the file named (an entry
# that resolves is an error: the exemption must never hide a name that exists)
KNOWN_STALE: set[tuple[str, str]] = set()  # (file, name) pairs exempted while a stale name awaits its fix


def _project_namespaces() -> dict[str, object]:
    """First components a project name may start with: modules (by short name) and their public classes
    and functions, the project's packages, torch and numpy, and transformers' DiffusionGemma modules' names."""
    import numpy
    import torch
    import transformers.models.diffusion_gemma as upstream

    import os

    import ml_dtypes  # the bfloat16 rounding of the reference's bfloat16 run

    roots: dict[str, object] = {"torch": torch, "numpy": numpy, "np": numpy, "nn": torch.nn, "os": os,
                                "ml_dtypes": ml_dtypes}
    import diffusiongemma

    packages = ["diffusiongemma.reference", "diffusiongemma.reference.support", "diffusiongemma.reference.variants"]
    for package_name in packages:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__):
            try:
                module = importlib.import_module(f"{package_name}.{info.name}")
            except ImportError:  # an optional back end (e.g. CuPy) that this machine lacks
                continue
            roots.setdefault(info.name, module)
            for attr, value in vars(module).items():
                if isinstance(value, type) and getattr(value, "__module__", "").startswith("diffusiongemma"):
                    roots.setdefault(attr, value)
    roots["diffusiongemma"] = diffusiongemma
    roots["reference"] = importlib.import_module("diffusiongemma.reference")
    roots["fast"] = importlib.import_module("diffusiongemma.fast")
    roots["torch.distributions"] = torch.distributions
    roots["Categorical"] = torch.distributions.Categorical
    for info in pkgutil.iter_modules(upstream.__path__):
        module = importlib.import_module(f"{upstream.__name__}.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, type):
                roots.setdefault(attr, value)
    return roots


def resolves(name: str, roots: dict[str, object]) -> bool:
    """True when ``name`` is an attribute chain from a known root (a dataclass field counts as an attribute;
    a submodule is imported when the chain reaches it)."""
    head, *rest = name.split(".")
    if head not in roots:
        return False
    obj = roots[head]
    for attr in rest:
        if hasattr(obj, "__path__"):  # a package: its submodule wins over a same-named attribute
            try:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")
                continue
            except ImportError:
                pass
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return attr is rest[-1]
        return False
    return True


def is_code_name(name: str) -> bool:
    head = name.split(".")[0]
    return not (NOT_CODE_SUFFIX.search(name) or name.endswith(".weight") or head in INSTANCE_ROOTS
                or head in TENSOR_ROOTS or head in FOREIGN_ROOTS or name.startswith(("model.decoder", "model.encoder")))


def docstring_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                names |= set(DOTTED.findall(doc))
    return names


def spec_names(text: str) -> set[str]:
    return set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", text))


def unresolved_names(sources: dict[str, set[str]], roots: dict[str, object]) -> list[str]:
    return sorted(f"{where}: {name}" for where, names in sources.items() for name in names
                  if is_code_name(name) and not resolves(name, roots) and (where, name) not in KNOWN_STALE)


def named_sources() -> dict[str, set[str]]:
    sources = {"docs/SPEC.md": spec_names(SPEC)}
    for path in sorted((ROOT / "reference").rglob("*.py")):
        sources[str(path.relative_to(ROOT))] = docstring_names(path)
    return sources


def test_every_code_name_in_the_spec_and_the_reference_docstrings_exists():
    sources, roots = named_sources(), _project_namespaces()
    checked = sum(is_code_name(n) for names in sources.values() for n in names)
    assert checked > 60, f"only {checked} code names found: the collector is broken"
    missing = unresolved_names(sources, roots)
    assert not missing, "code names that do not exist:\n" + "\n".join(missing)
    hidden = [f"{where}: {name}" for where, name in sorted(KNOWN_STALE) if resolves(name, roots)]
    assert not hidden, f"KNOWN_STALE exempts names that exist: {hidden}"


def test_a_stale_name_is_caught():
    roots = _project_namespaces()
    planted = {"docs/SPEC.md": {"sampling.entropy_bound_accept", "sampling.entropy_bound_reject",
                                "Model.denoise", "Model.undenoise", "torch.topk", "stages.Semantics.replace",
                                "reference.cache.KVCache", "reference.cache.KVCash", "config.vocab_size",
                                "GenerationResult.stop_reasons", "EntropyBoundSampler.accept_canvas"}}
    assert unresolved_names(planted, roots) == ["docs/SPEC.md: Model.undenoise", "docs/SPEC.md: reference.cache.KVCash",
                                                "docs/SPEC.md: sampling.entropy_bound_reject"]


@pytest.mark.parametrize("name", ["semantics.VariantBackend"])
def test_known_stale_names_do_not_resolve(name):
    """The entries of KNOWN_STALE are really stale (so the exemption hides nothing that exists)."""
    assert not resolves(name, _project_namespaces())


# ------------------------------------------------------------------------------------------ Part I as it is read
# Part I is read in order, figures included: each picture's drawn text and its JSON sit where the picture is
# linked. tests/test_figures.py holds the JSON to the reference; here it is read for what it says.
FIGURE_LINK = re.compile(r"!\[[^\]]*\]\(figures/(\w+)\.png\)")
# words that belong to Part II or to the compiled paths, not to the idea
PART_TWO_WORDS = re.compile(r"\btraps?\b|\bfast paths?\b|\bring slots?\b|\bring\b|\bpeers?\b|\bporters?\b|"
                            r"\bbfloat16\b|\bcuda\b|\bcython\b", re.IGNORECASE)


def figure_text(name: str) -> str:
    """What a reader of figure ``name`` sees: every text the drawing puts on the picture, then the keys and
    string values of its committed JSON."""
    import json

    from matplotlib.text import Text

    from diffusiongemma import figures

    data = json.loads((ROOT / "docs" / "figures" / f"{name}.json").read_text(encoding="utf-8"))
    fig = figures.draw(name, data)
    try:
        drawn = [t.get_text() for t in fig.findobj(Text) if t.get_text().strip()]
    finally:
        figures._plt().close(fig)

    def strings(x):
        if isinstance(x, dict):
            return [s for k, v in x.items() for s in [k, *strings(v)]]
        if isinstance(x, list):
            return [s for v in x for s in strings(v)]
        return [x] if isinstance(x, str) else []

    return "\n".join(drawn + strings(data))


@functools.lru_cache(maxsize=1)
def part_one_as_read() -> str:
    """Part I with each linked figure's text spliced in after its link."""
    text = part_text(SPEC, "Part I")
    return FIGURE_LINK.sub(lambda m: m.group(0) + "\n[figure]\n" + figure_text(m.group(1)) + "\n[/figure]\n", text)


def part_two_words(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in PART_TWO_WORDS.finditer(text)]


def test_part_one_and_its_figures_point_at_nothing_in_part_two():
    read = part_one_as_read()
    assert read.count("[figure]") == 7, "Part I should show its seven figures"
    assert not forward_references(SPEC.replace(part_text(SPEC, "Part I"), read)), \
        forward_references(SPEC.replace(part_text(SPEC, "Part I"), read))
    assert not part_two_words(read), part_two_words(read)


def test_a_part_two_word_in_a_figure_is_caught():
    planted = part_one_as_read().replace("[/figure]", "held in slot 3 of the fast paths' ring (trap T23)\n[/figure]", 1)
    assert len(part_two_words(planted)) == 3, part_two_words(planted)
    assert len(forward_references(SPEC.replace(part_text(SPEC, "Part I"), planted))) == 1


# ------------------------------------------------------------------------------------------ pointers into a section
# "§8.2 step 3", "§17 items 1, 2, 4", "§4.1 steps 1–4": numbered items of that section; "§8.2 j": its lettered
# sub-step. Each must exist, not just the heading (the heading of §0.2 exists, its item 1 never did).
ITEM_POINTER = re.compile(r"(?<!\.md )(?<!TRAINING )§\s*(\d+(?:\.\d+)*)(?: step \d+)?\s+(?:items?|steps?)\s+"
                          r"(\d+(?:\s*(?:,|–|-|and)\s*\d+)*)")
LETTER_POINTER = re.compile(r"(?<!\.md )(?<!TRAINING )§\s*(\d+(?:\.\d+)*)\s+([a-z])\b(?![\w'’-])")


def section_lines(text: str) -> dict[str, list[str]]:
    return {s.number: s.lines for s in sections(text)}


def broken_item_pointers(text: str) -> list[str]:
    lines_of = section_lines(text)
    problems = []
    for m in ITEM_POINTER.finditer(text):
        number, items = m.group(1), m.group(2)
        wanted: list[int] = []
        for part in re.split(r"\s*(?:,|and)\s*", items):
            ends = [int(n) for n in re.split(r"\s*[–-]\s*", part) if n]
            wanted += list(range(ends[0], ends[-1] + 1))
        have = {int(k) for line in lines_of.get(number, []) for k in re.findall(r"^\s*(\d+)\.\s", line)}
        missing = [k for k in wanted if k not in have]
        if missing:
            problems.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}: §{number} has no "
                            f"numbered item {missing}")
    for m in LETTER_POINTER.finditer(text):
        number, letter = m.groups()
        if not any(re.match(rf"^\s*\*\s*{letter}\.\s", line) for line in lines_of.get(number, [])):
            problems.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}: §{number} has no "
                            f"sub-step {letter}")
    return problems


def test_every_item_and_step_pointer_names_an_existing_item():
    assert len(ITEM_POINTER.findall(SPEC)) >= 5 and len(LETTER_POINTER.findall(SPEC)) >= 4  # the scan sees them
    assert not broken_item_pointers(SPEC), "\n".join(broken_item_pointers(SPEC))


def test_a_pointer_to_a_missing_item_is_caught():
    planted = SPEC.replace("### 0.4 Renoising\n", "### 0.4 Renoising\n\nAs §0.2 item 1, §8.2 step 9 and §8.2 q "
                                                  "and §17 items 1–3 say.\n", 1)
    found = broken_item_pointers(planted)
    assert len(found) == 3, found
    assert "§0.2 has no numbered item [1]" in found[0] and "[9]" in found[1] and "sub-step q" in found[2], found


# ------------------------------------------------------------------------------------------ defined before use
# Each term of Part I is defined where it is first met, in bold; it must not be met earlier, in the text or in
# a figure. (use pattern, definition as written)
TERMS = {
    "V": (r"(?<![\w'’])V(?![\w'’])", "**V**"),
    "C": (r"(?<![\w'’])C(?![\w'’+#])", "**C**"),
    "N": (r"(?<![\w'’])N(?![\w'’])", "**N**"),
    "W": (r"(?<![\w'’])W(?![\w'’])", "**W**"),
    "β": (r"β", "**β**"),
    "γ": (r"γ", "**γ**"),
    "z (logits)": (r"(?<![\w'’])z(?![\w'’̂])", "**z**"),
    "τ": (r"τ", "**τ**"),
    "ẑ": (r"ẑ|z\u0302", "**ẑ**"),
    "26B-A4B": (r"26 ?B\b", "**26B-A4B**"),
    "mixture of experts": (r"mixture of\s+experts|\bMoE\b|\bexperts?\b", "**mixture of\nexperts**"),
    "sliding": (r"\bsliding\b", "**sliding**"),
    "full (layer)": (r"\bfull\b", "**full**"),
    "stable": (r"\bstab(?:le|ility)\b", "**stable**"),
    "renoising": (r"\brenois", "**renoising**"),
    "draft": (r"\bdrafts?\b", "**draft**"),
    "self-conditioning": (r"(?i)self-conditioning", "**Self-conditioning**"),
    **{f"({letter})": (rf"\((?:[a-k], )*{letter}(?:, [a-k])*\)|# \({letter}", f"**({letter})**")
       for letter in "abcdefghij"},
}


def undefined_before_use(text: str) -> list[str]:
    text = re.sub(r"^#{1,6} .*$", lambda m: " " * len(m.group(0)), text, flags=re.MULTILINE)  # not the headings
    problems = []
    for term, (use, definition) in TERMS.items():
        where = text.find(definition)
        if where < 0:
            problems.append(f"{term}: never defined ({definition!r} is not in Part I)")
            continue
        first = re.search(use, text)
        if first and first.start() < where:
            line = text.count("\n", 0, first.start()) + 1
            context = text[max(0, first.start() - 40):first.end() + 20].replace("\n", " ")
            problems.append(f"{term}: used on line {line} ({context!r}) before its definition on line "
                            f"{text.count(chr(10), 0, where) + 1}")
    return problems


def test_part_one_defines_each_term_before_use_figures_included():
    assert not undefined_before_use(part_one_as_read()), "\n".join(undefined_before_use(part_one_as_read()))


def test_a_term_used_before_its_definition_is_caught():
    read = part_one_as_read()
    early = read.replace("### 0.1 Why a canvas", "The stop test compares with γ at step (i).\n\n### 0.1 Why a canvas",
                         1)
    assert sorted(f.split(":")[0] for f in undefined_before_use(early)) == ["(i)", "γ"], undefined_before_use(early)
    # the first figure (the block timeline, §0.3) comes before the mixture of experts is introduced
    assert read.index("[figure]") < read.index("**mixture of\nexperts**")
    in_figure = read.replace("[figure]", "[figure]\n2 of 8 experts", 1)
    assert [f.split(":")[0] for f in undefined_before_use(in_figure)] == ["mixture of experts"]


# ------------------------------------------------------------------------------------------ §0.8 and the check
def test_the_worked_step_explains_each_block_in_order():
    """§0.8: the letters are defined before the first code block, the commented blocks follow them in order,
    and a line of commentary (not code) comes before every code block."""
    lines = next(s for s in sections(SPEC) if s.number == "0.8").lines
    text = "\n".join(lines)
    assert text.index("**(j)**") < text.index("```python")
    opened = [i for i, line in enumerate(lines) if line.startswith("```python")]
    assert len(opened) >= 7
    for i in opened:
        before = next(line for line in reversed(lines[:i]) if line.strip())
        assert not before.startswith("```"), f"code block on line {i} of §0.8 has no commentary before it"
        assert "Look at" in "\n".join(lines[max(0, i - 8):i]) or i == opened[0] or \
            re.search(r"\b(look|Look)\b", "\n".join(lines[max(0, i - 8):i])), f"no 'look at' before block {i}"
    letters = [m.group(1) for line in lines for m in re.finditer(r"^\(([a-k])\)", line)]
    assert letters == sorted(letters) and len(letters) >= 6, letters


def test_part_one_ends_with_a_check_whose_answers_the_examples_compute():
    last = [s for s in sections(SPEC) if s.part.startswith("Part I:")][-1]
    text = "\n".join(last.lines)
    questions = [int(n) for n in re.findall(r"^(\d+)\. ", text, re.MULTILINE)]
    assert questions == list(range(1, len(questions) + 1)) and len(questions) >= 5, questions
    code = text[text.index("```python"):]
    answered = {int(n) for n in re.findall(r"# (\d+)\b", code)}
    assert answered == set(questions), f"questions without a computed answer: {set(questions) - answered}"
