"""The project's import graph, read from the source with ``ast`` (nothing is
imported): every ``import`` and ``from ... import`` statement, at module level
or inside a function, is an edge from the module that holds it to the project
module it names.

An edge goes to the most specific project module a statement names:
``from a.b import c`` goes to ``a.b.c`` when that is a module, else to ``a.b``
(a name defined in ``a/b.py`` or ``a/b/__init__.py``). The parent packages
Python initialises on the way are not edges of their own: a package's
``__init__`` has its own edges to what it imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("k3jax", "pallas_kernels", "scripts", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """{dotted name: file} of every module in PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[module_name(path)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a project module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def _targets(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> Iterable[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    yield target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                target = full if full in modules else _resolve(source, modules)
                if target:
                    yield target


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports} (self-imports dropped)."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for t in _targets(tree, name, is_package, modules) if t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}   # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def is_library(module: str) -> bool:
    """The installed library a user imports: k3jax outside its tools and CLI,
    and pallas_kernels."""
    if module.startswith("pallas_kernels"):
        return True
    return module.startswith("k3jax") and not is_beside_the_library(module)


def is_beside_the_library(module: str) -> bool:
    """What inspects or drives the library: its tools, its CLI (``python -m
    k3jax`` included), the benchmarks and the table-writing scripts."""
    return (module.split(".")[0] in ("benchmarks", "scripts") or module == "k3jax.__main__"
            or module.startswith(("k3jax.tools", "k3jax.cli")))
