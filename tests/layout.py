"""Static facts about the source tree, for tests/test_layout.py and the file table of docs/SPEC.md (before SPEC §1).

    project_imports()   {module: {imported project modules}}, function-local imports included
    cycles(graph)        the import cycles of a graph (strongly connected components of 2+ modules, or a
                         module importing itself)
    rail_lines(path)     lines of a specification file that keep a run honest but compute nothing: each
                         ``raise`` statement, the ``if`` header that guards only raises, and each call of a
                         ``check_*`` function standing as a statement
    semantic_share(path) 1 - rail lines / code lines (blank and comment lines not counted)

Run ``python -m tests.layout`` to print the table.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> installed package
PACKAGES = {"reference": "diffusiongemma.reference", "fast": "diffusiongemma.fast",
            "weights_converter": "diffusiongemma.weights_converter", "diffusiongemma": "diffusiongemma"}
SPEC_FILES = ("config.py", "weights.py", "primitives.py", "masks.py", "cache.py", "layers.py", "model.py",
              "sampling.py", "step.py", "draws.py", "generation_config.py", "stages.py", "generate.py", "noising.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    name = ".".join([PACKAGES[parts[0]]] + parts[1:])
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def source_files() -> list[Path]:
    files = []
    for folder in PACKAGES:
        files += [p for p in (ROOT / folder).rglob("*.py") if "assets" not in p.parts]
    return sorted(files)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def project_imports() -> dict[str, set[str]]:
    """Every project module and the project modules it imports anywhere in its body."""
    files = source_files()
    modules = {module_name(p): p for p in files}
    extensions = {module_name(p.with_suffix(".py")) for folder in PACKAGES for p in (ROOT / folder).rglob("*.pyx")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    known = set(modules) | extensions
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, is_package)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                while target and target not in known:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != module and target in modules:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _code_lines(tree: ast.AST, text: str) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    source = text.splitlines()
    return {n for n in lines if source[n - 1].strip() and not source[n - 1].strip().startswith("#")}


def rail_lines(path: Path) -> set[int]:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    rails: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            rails.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.If) and node.body and all(isinstance(s, ast.Raise) for s in node.body):
            rails.update(range(node.lineno, node.body[0].lineno))
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "id", getattr(node.value.func, "attr", "")).startswith("check_")):
            rails.update(range(node.lineno, node.end_lineno + 1))
    return rails & _code_lines(tree, text)


def semantic_share(path: Path) -> float:
    text = path.read_text(encoding="utf-8")
    code = _code_lines(ast.parse(text), text)
    return 1.0 - len(rail_lines(path)) / max(len(code), 1)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


if __name__ == "__main__":
    for name in SPEC_FILES:
        path = ROOT / "reference" / name
        print(f"| `reference/{name}` | {line_count(path)} | {semantic_share(path):.0%} |")
    for folder in ("support", "variants"):
        files = sorted((ROOT / "reference" / folder).glob("*.py"))
        print(f"| `reference/{folder}/` ({len(files)} files) | {sum(line_count(p) for p in files)} | rails / variants |")
