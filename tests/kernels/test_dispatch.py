"""The kernels' dispatch structure: typed backends and one table per op.

Every op's dispatch.py holds exactly one implementation per kernel family
(XLA, MOSAIC, TRITON); every user-facing backend name parses (also in enum
form and as a resolved KernelBackend) and prints back as itself; an unknown
name's error lists the choices; and the first-use check sits below the
public ops: no selfcheck module imports an api module, and the import graph
of pallas_kernels (imports inside functions included, read with ast) has no
cycle.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_mlp_up
from pallas_kernels.backend import (
    CHOICES,
    INTERPRET,
    PALLAS,
    TRITON,
    XLA,
    BackendName,
    Family,
    KernelBackend,
    parse_backend,
    resolve,
    resolve_backend,
)
from pallas_kernels.grouped_matmul import dispatch as grouped_dispatch
from pallas_kernels.selfcheck.config import KernelConfig
from pallas_kernels.situ_mlp import dispatch as mlp_dispatch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pallas_kernels"
TABLES = {"grouped_matmul": grouped_dispatch, "situ_mlp": mlp_dispatch}
NAMED = {"xla": XLA, "pallas": PALLAS, "interpret": INTERPRET, "triton": TRITON}


@pytest.mark.parametrize("op", sorted(TABLES))
def test_every_ops_table_holds_exactly_the_three_families(op):
    table = TABLES[op].IMPLEMENTATIONS
    assert set(Family) == {Family.XLA, Family.MOSAIC, Family.TRITON}
    assert set(table) == set(Family) and len(table) == 3
    for backend in NAMED.values():
        entry = TABLES[op].kernels(backend)
        assert isinstance(entry, table[backend.family]) and entry.backend == backend
        hash(entry)   # a static argument of the custom VJPs


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_name_parses_resolves_and_prints_as_itself(name):
    member = BackendName(name)
    assert parse_backend(name) is member
    assert parse_backend(member) is member
    assert parse_backend(NAMED[name]) is member
    for form in (name, member, NAMED[name]):
        assert resolve(form) == NAMED[name]
        assert resolve_backend(form) == name
    assert NAMED[name].name == str(NAMED[name]) == name
    assert NAMED[name].interpret == (name == "interpret")


def test_auto_parses_and_resolves_by_the_devices():
    assert parse_backend("auto") is parse_backend(BackendName.AUTO) is BackendName.AUTO
    assert CHOICES == ("auto", "xla", "pallas", "interpret", "triton")
    if jax.default_backend() == "cpu":
        assert resolve("auto") == XLA and resolve_backend("auto") == "xla"


@pytest.mark.parametrize("bad", ["cuda", "Pallas", "", None, 3])
def test_an_unknown_name_lists_the_choices(bad):
    with pytest.raises(ValueError) as info:
        parse_backend(bad)
    message = str(info.value)
    assert f"backend={bad!r} is not one of" in message
    assert all(repr(choice) in message for choice in CHOICES), message
    with pytest.raises(ValueError, match="is not one of"):
        resolve(bad)


def test_interpret_is_a_mode_of_mosaic_only():
    assert INTERPRET.family is PALLAS.family is Family.MOSAIC
    with pytest.raises(ValueError, match="interpret mode"):
        KernelBackend(Family.TRITON, interpret=True)
    with pytest.raises(TypeError, match="Family"):
        KernelBackend("xla")


def test_kernel_configs_keep_their_names_and_cache_keys_in_any_form():
    """A KernelConfig reads a backend name or a KernelBackend alike and
    prints it by its name: its ``name`` and its cache key's JSON keep the text."""
    fields = dict(op="grouped_matmul", m=16, k=32, n=32, groups=4, x_dtype="float32",
                  w_dtype="float32", tiles="row_major")
    by_name = KernelConfig(**fields, backend="interpret")
    assert by_name == KernelConfig(**fields, backend=INTERPRET)
    assert by_name.backend is not None and by_name.backend.interpret
    assert by_name.name.endswith(":row_major:interpret")
    assert by_name.to_json()["backend"] == "interpret"
    assert KernelConfig(**by_name.to_json()) == by_name
    assert dataclasses.replace(by_name, backend="triton").backend == TRITON
    for unchecked in ("xla", "auto", XLA):
        with pytest.raises(ValueError, match="is not one of"):
            KernelConfig(**fields, backend=unchecked)


def test_the_public_ops_take_a_name_an_enum_or_a_resolved_backend():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.float32)
    sizes = jnp.array([4, 2], jnp.int32)
    forms = ("xla", BackendName.XLA, XLA)
    outs = [grouped_matmul(x, w, sizes, backend=b) for b in forms]
    outs += [grouped_situ_glu(x, w, w, sizes, beta=4.0, linear_beta=25.0, backend=b)
             for b in forms]
    outs += [situ_mlp_up(x, w[0], w[1], beta=4.0, linear_beta=None, backend=b) for b in forms]
    for i in range(0, len(outs), 3):
        for other in outs[i + 1:i + 3]:
            np.testing.assert_array_equal(np.asarray(other), np.asarray(outs[i]))
    with pytest.raises(ValueError, match="is not one of"):
        grouped_matmul(x, w, sizes, backend="gpu")


# ------------------------------------------------------------------ the import graph

def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pallas_kernels modules ``name`` imports, at module level or in a
    function: ``from x import y`` names x.y where that is a module, else x
    (a package: its __init__); ``import a.b`` names a.b."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}
    return {t for t in found if t in modules and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_selfcheck_never_imports_an_api_module():
    graph = _graph()
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items()
                   if m.startswith("pallas_kernels.selfcheck")
                   for t in targets if t.rsplit(".", 1)[-1] == "api")
    assert not wrong, "\n".join(wrong)
    # ... and it reaches the kernels through the ops' dispatch tables
    assert {"pallas_kernels.grouped_matmul.dispatch",
            "pallas_kernels.situ_mlp.dispatch"} <= graph["pallas_kernels.selfcheck.launch"]


def test_no_import_cycle_in_pallas_kernels():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_the_graph_reader_sees_imports_inside_functions():
    graph = _graph()
    # dispatch.triton_kernels imports the Triton kernels on first use only
    assert "pallas_kernels.grouped_matmul.triton_sm80" in \
        graph["pallas_kernels.grouped_matmul.dispatch"]
    assert "pallas_kernels.selfcheck.gate" in graph["pallas_kernels.grouped_matmul.api"]
