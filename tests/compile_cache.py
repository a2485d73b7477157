"""One deviceless sm_90a compile per kernel configuration per test run, shared
by every test and every pytest-xdist worker that asks for it.

    reports = kernel_reports("down ep=16 tokens=16")   # benchmarks/compile_table.py's config
    reports = cached_reports("my key", lambda: ptxas_reports(fn, *specs))

The ptxas reports (k3jax.tools.aot.PtxasReport) are kept in memory and, when
``$K3JAX_TEST_CACHE`` names a folder, as one JSON file per entry there: a
worker takes the entry's file lock, reads the file if another worker wrote it,
else compiles and writes it atomically, so concurrent askers wait for one
compile instead of repeating it. tests/conftest.py points the variable at a
folder of this run (beside every xdist worker's basetemp) unless it is set.

An entry's file name hashes its key with source_key(): the contents of every
file that shapes a kernel or its compile (pallas_kernels/, benchmarks/, the
compile helpers and target of k3jax/, this file) and the versions of jax,
jaxlib, the CUDA plugin, ptxas's wheel and tokamax. A folder kept across runs
therefore never answers for changed sources; a failed compile is not kept.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path

from k3jax.files import atomic_write
from k3jax.tools.aot import PtxasReport
from k3jax.tools.kernel_sass import KStepSass

CACHE_ENV = "K3JAX_TEST_CACHE"
REPO = Path(__file__).resolve().parent.parent
# What a kernel's compile depends on, relative to the repository.
SOURCE_TREES = ("pallas_kernels", "benchmarks")
SOURCE_FILES = ("k3jax/tools/aot.py", "k3jax/tools/kernel_ptxas.py", "k3jax/tools/kernel_sass.py",
                "k3jax/tools/triton_compile.py", "k3jax/tools/peers.py", "k3jax/xla_options.py",
                "k3jax/data/h200.txtpb", "k3jax/layout/layout.py", "tests/compile_cache.py")
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "nvidia-cuda-nvcc", "nvidia-cuda-nvdisasm",
            "tokamax")

_memory: dict[str, tuple[PtxasReport, ...]] = {}


def run_folder(basetemp: Path, xdist_worker: bool) -> Path:
    """The cache folder of one pytest run: beside the workers' basetemps
    (their common parent) under xdist, inside the basetemp without it."""
    return (basetemp.parent if xdist_worker else basetemp) / "k3jax-compile-cache"


@functools.cache
def source_key() -> str:
    """sha256 over SOURCE_TREES' .py files, SOURCE_FILES and PACKAGES' versions."""
    h = hashlib.sha256()
    paths = sorted(p for tree in SOURCE_TREES for p in (REPO / tree).rglob("*.py")
                   if "__pycache__" not in p.parts)
    for path in paths + [REPO / f for f in SOURCE_FILES]:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    for package in PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{package}=={version}\0".encode())
    return h.hexdigest()


def _to_json(key: str, reports: tuple[PtxasReport, ...]) -> str:
    return json.dumps({"key": key, "reports": [dataclasses.asdict(r) for r in reports]})


def _k_step(d: dict | None) -> KStepSass | None:
    if d is None:
        return None
    return KStepSass(**{**d, "nested_trips": tuple(d["nested_trips"]),
                        "by_opcode": tuple(tuple(kv) for kv in d["by_opcode"])})


def _from_json(text: str) -> tuple[PtxasReport, ...]:
    return tuple(PtxasReport(**{**r, "warnings": tuple(r["warnings"]), "grid": tuple(r["grid"]),
                                "k_step": _k_step(r.get("k_step"))})
                 for r in json.loads(text)["reports"])


def cached_reports(key: str, compile: Callable[[], list[PtxasReport]]) -> tuple[PtxasReport, ...]:
    """``compile()``'s reports for ``key``, compiled at most once per run (per
    process without ``$K3JAX_TEST_CACHE``). Keys name what is compiled; one key,
    one compile function."""
    digest = hashlib.sha256(f"{key}\0{source_key()}".encode()).hexdigest()[:32]
    if digest in _memory:
        return _memory[digest]
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        _memory[digest] = tuple(compile())
        return _memory[digest]
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"{digest}.json"
    with open(Path(folder) / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # released when the file closes
        if path.exists():
            reports = _from_json(path.read_text())
        else:
            reports = tuple(compile())
            atomic_write(str(path), lambda f: f.write(_to_json(key, reports)), mode="w")
    _memory[digest] = reports
    return reports


@functools.cache
def _configs() -> dict:
    from benchmarks import compile_table
    return {c.name: c for c in compile_table.kernel_configs()}


def kernel_reports(name: str) -> tuple[PtxasReport, ...]:
    """The reports of benchmarks/compile_table.py's configuration ``name``
    (compile_table.compile_kernel), compiled at most once per run."""
    from benchmarks import compile_table
    configs = _configs()
    if name not in configs:
        raise KeyError(f"{name!r} is not a configuration of benchmarks/compile_table.py")
    return cached_reports(f"compile_table {name}", lambda: compile_table.compile_kernel(configs[name]))
