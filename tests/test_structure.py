"""The package's structure (issue 33): no import cycle, imports inside functions only for optional
dependencies, no compiled state hidden on models, small files and functions.

Imports are read from the source (``ast``), module-level and function-level alike. A function may
import only an optional dependency (:data:`OPTIONAL`) or a module of ours that needs one at import
(Triton: the fast path's kernels and steps), which the code enters only where it chose that path.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specpilot"
OPTIONAL = {"triton", "transformers", "openai", "datasets", "fla", "tokenizers"}
# What the report environment (envs/report.yaml: table, figures, memory merge) holds besides the
# standard library. A module that does not import torch at import time runs there and at planning
# time, so it may import torch, a module of ours that does, or another package outside this set
# inside the one function that needs it.
REPORT_ENV = {"pandas", "matplotlib", "numpy"}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, inside a function?, line) for every import of ``path``; ``from X import y``
    counts as an import of ``X.y`` when that is a module of ours, else of ``X``."""
    mod, is_pkg = _module_name(path), path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, in_func: bool):
        for child in ast.iter_child_nodes(node):
            inner = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, in_func, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(mod, is_pkg, child)
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in MODULES else base, in_func, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return out


FILES = sorted(p for p in SRC.rglob("*.py"))
MODULES = {_module_name(p): p for p in FILES}


def _ours(name: str) -> str | None:
    """The module of ours an imported name refers to (its longest known prefix), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in MODULES:
            return cand
    return None


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for name, _, _ in _imports(p):
            t = _ours(name)
            if t and t != m:
                g[m].add(t)
                # importing a.b.c runs a and a.b first (their __init__ files), unless m is inside them
                parts = t.split(".")
                for n in range(1, len(parts)):
                    pkg = ".".join(parts[:n])
                    if pkg in MODULES and not (m == pkg or m.startswith(pkg + ".")):
                        g[m].add(pkg)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def _stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names


def _gated(packages) -> set[str]:
    """Our modules that import one of ``packages`` at import time (directly or through another)."""
    direct = {m for m, p in MODULES.items() if any(not f and n.split(".")[0] in packages for n, f, _ in _imports(p))}
    gated, changed = set(direct), True
    while changed:
        changed = False
        for m, p in MODULES.items():
            if m not in gated and any(not f and _ours(n) in gated for n, f, _ in _imports(p)):
                gated.add(m)
                changed = True
    return gated


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles (module- and function-level imports): {cycles}"


def test_the_cycle_finder_finds_a_planted_cycle():
    """Negative control: a cycle through a function-level import is found."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]


def _triton_gated() -> set[str]:
    return _gated(OPTIONAL)


def test_imports_inside_functions_are_optional_dependencies_only():
    """Imports sit at module level, except: an optional dependency (or a module of ours that imports
    one), and, in a module that runs without torch, what the report environment does not hold."""
    gated, torch_gated = _triton_gated(), _gated({"torch"})
    bad = []
    for m, p in MODULES.items():
        for name, in_func, line in _imports(p):
            if not in_func or name.split(".")[0] in OPTIONAL or _ours(name) in gated:
                continue
            if m not in torch_gated:
                ours = _ours(name)
                if ours in torch_gated or (ours is None and not _stdlib(name)
                                           and name.split(".")[0] not in REPORT_ENV):
                    continue
            bad.append(f"{p.relative_to(SRC.parent)}:{line} imports {name} inside a function")
    assert not bad, "\n".join(bad)


def test_no_registry_on_models():
    """Compiled state is held by the backend, never hidden in a model's ``__dict__``."""
    bad = [f"{p.relative_to(SRC.parent)}:{i}" for p in FILES
           for i, line in enumerate(p.read_text().splitlines(), 1) if "__dict__" in line]
    assert not bad, f"__dict__ used at {bad}"


@pytest.mark.parametrize("path", [p for p in FILES if "kernels" not in p.relative_to(SRC).parts],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_small_files_and_functions(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= MAX_FILE_LINES, f"{path.name}: {len(lines)} lines > {MAX_FILE_LINES}"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
