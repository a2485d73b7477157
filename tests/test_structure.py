"""The folders' contract: data flows one way, config -> layout -> modules ->
kernels, and the tools stand beside that line. Read from the source
(tests/import_graph.py), imports inside functions included."""

from __future__ import annotations

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
