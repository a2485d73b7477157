"""The folders' contract: data flows one way, config -> layout -> modules ->
kernels, and the tools stand beside that line. Read from the source
(tests/import_graph.py), imports inside functions included."""

from __future__ import annotations

import ast

import import_graph as ig


def test_the_library_never_imports_its_tools_cli_benchmarks_or_scripts():
    graph = ig.import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() if ig.is_library(m)
                   for t in targets if ig.is_beside_the_library(t))
    assert not wrong, "library modules import tools / cli / benchmarks / scripts:\n" + "\n".join(wrong)


def test_pallas_kernels_never_imports_k3jax():
    graph = ig.import_graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("pallas_kernels")
                   for t in targets if t.startswith("k3jax"))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_among_the_projects_modules():
    cycle = ig.find_cycle(ig.import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert ig.find_cycle(graph) == ["a", "b", "c", "a"]
    assert ig.find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_imports_inside_functions():
    graph = ig.import_graph()
    # k3jax.cli.latency imports the latency models inside its functions only
    assert "k3jax.tools.layer_latency" in graph["k3jax.cli.latency"]


def test_the_library_layers_run_one_way():
    """config -> layout -> modules: the layout never imports the modules,
    ops or parallel blocks, and config imports nothing of the project."""
    graph = ig.import_graph()
    assert not {t for t in graph["k3jax.config"] if t.startswith(("k3jax", "pallas_kernels"))}
    layout = {m for m in graph if m.startswith("k3jax.layout")}
    wrong = sorted(f"{m} -> {t}" for m in layout for t in graph[m]
                   if t.startswith(("k3jax.modules", "k3jax.ops", "k3jax.parallel",
                                    "k3jax.checkpoint", "k3jax.grads")))
    assert not wrong, "\n".join(wrong)


BACKEND_NAMES = {"xla", "pallas", "interpret", "triton", "auto"}


def _names_a_backend(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES
    return (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts)
            and all(isinstance(e, ast.Constant) and e.value in BACKEND_NAMES for e in node.elts))


def backend_name_comparisons() -> list[str]:
    """Every comparison (==, !=, in, not in, is, is not) with a backend name
    ("xla", "pallas", "interpret", "triton", "auto"), or a tuple of them, as
    one operand, in the project's non-test code: "file:line: expression"."""
    hits = []
    for package in ig.PACKAGES:
        for path in sorted((ig.ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and (
                        _names_a_backend(node.left) or any(map(_names_a_backend, node.comparators))):
                    hits.append(f"{path.relative_to(ig.ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_backends_are_typed_values_not_names_compared_across_the_code():
    """Backends are chosen by KernelBackend / Family / BackendName values
    (pallas_kernels.backend parses the names once); what compares a name
    literally is a result row's key, a platform or a dtype "auto"."""
    hits = backend_name_comparisons()
    assert len(hits) <= 12, "\n".join(hits)
    assert not [h for h in hits if h.startswith(("pallas_kernels", "k3jax/layout", "k3jax/modules",
                                                 "k3jax/ops", "k3jax/parallel", "k3jax/formats"))]


def test_the_counter_sees_a_planted_comparison():
    tree = ast.parse('if backend == "xla" or impl in ("pallas", "interpret"): pass')
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert len(compares) == 2 and all(
        _names_a_backend(c.left) or any(map(_names_a_backend, c.comparators)) for c in compares)


def test_every_source_file_is_at_most_450_lines():
    long = [f"{p.relative_to(ig.ROOT)} ({n})" for package in ig.PACKAGES
            for p in sorted((ig.ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 450]
    assert not long, long


def test_the_readme_is_at_most_200_lines():
    assert len((ig.ROOT / "README.md").read_text().splitlines()) <= 200
