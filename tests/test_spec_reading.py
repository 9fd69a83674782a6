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
