"""A clean install: the wheel built from this tree (``pip wheel``, not
editable) holds the packages k3jax and pallas_kernels only, with every data
file their code reads, and from that install alone (PYTHONPATH at a
``pip install --target`` folder, not at the repository; the working folder
outside it; jax and the other dependencies from the test environment) each
sub-command's smallest run exits 0. Where the machine has no NVIDIA GPU the
runs go without JAX_PLATFORMS and must print no CUDA plugin error
(k3jax/__init__.py chooses the CPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import k3jax
from k3jax.cli import extras
from k3jax.layout import ep_dispatch_choice, shared_overlap_choice
from pallas_kernels.grouped_matmul import tile_choice

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("k3jax", "pallas_kernels")
NO_GPU = not any(os.path.exists(node) for node in k3jax.NVIDIA_DEVICE_NODES)
TIMEOUT_S = 300
PLUGIN_ERRORS = ("cuInit", "plugin configuration error", "CUDA_ERROR")


def _source_files() -> list[str]:
    """The tree as a clone with the working changes has it: tracked and
    untracked files git does not ignore (every file but the virtual
    environment, caches and build outputs where git is absent)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
        names = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(REPO).parts)
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return [n for n in names if (REPO / n).is_file()]


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the folder it is installed into with ``--target``), built
    from a copy of the tree (so the build writes nothing into the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    src, dist, target = root / "src", root / "dist", root / "target"
    for name in _source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    proc = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                                 str(src)], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("k3jax-*.whl")
    proc = subprocess.run(pip + ["install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return wheel, target


def _environ(target: Path, cache: Path) -> dict[str, str]:
    """The test environment less the repository: PYTHONPATH at ``target``
    only; JAX_PLATFORMS removed where there is no NVIDIA GPU (else cpu)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(target)
    env["K3JAX_CACHE_DIR"] = str(cache)
    if not NO_GPU:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(argv: list[str], target: Path, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=_environ(target, cwd / "cache"), capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd)
    if NO_GPU:
        assert not any(e in proc.stderr for e in PLUGIN_ERRORS), proc.stderr
    return proc


def _k3jax(target: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script (its shebang: this Python)."""
    return _run([str(target / "bin" / "k3jax"), *argv], target, cwd)


def test_the_wheel_holds_the_two_packages_and_all_their_files(install):
    wheel, _ = install
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == set(PACKAGES) and len(dist_info) == 1, sorted(tops)
    for package in PACKAGES:        # every module and every data file (data/*) of the tree
        files = {n for n in _source_files() if n.startswith(f"{package}/")
                 and (n.endswith(".py") or n.startswith(f"{package}/data/"))}
        assert files <= set(names), sorted(files - set(names))
    for table in ("k3jax/data/ep_dispatch_table.json", "k3jax/data/shared_overlap_table.json",
                  "pallas_kernels/data/tile_table.json"):
        assert table in names


def test_python_imports_the_installed_copy(install, tmp_path):
    _, target = install
    code = ("import k3jax, k3jax.cli, pallas_kernels, jax; jax.devices(); "
            "print(k3jax.__file__); print(pallas_kernels.__file__)")
    proc = _run([sys.executable, "-c", code], target, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [Path(p).parent.parent for p in proc.stdout.split()] == [target, target], proc.stdout


def test_the_installed_copy_reads_its_own_tables(install, tmp_path):
    """The three committed tables, read from the install's data folders, as
    the checkout reads them."""
    _, target = install
    code = ("import json\n"
            "from k3jax.layout import ep_dispatch_choice as e, shared_overlap_choice as s\n"
            "from pallas_kernels.grouped_matmul import tile_choice as t\n"
            "print(json.dumps([[str(m.table_file()) for m in (e, s, t)],\n"
            "                  [sorted(map(list, e.table())), sorted(map(list, s.table())),\n"
            "                   len(t.tiles())], e.pick(16, 2, 64), s.pick(2, 1, 64)]))\n")
    proc = _run([sys.executable, "-c", code], target, tmp_path)
    assert proc.returncode == 0, proc.stderr
    files, sizes, dispatch, overlap = json.loads(proc.stdout)
    assert all(Path(f).is_relative_to(target) for f in files), files
    assert sizes == [sorted(map(list, ep_dispatch_choice.table())),
                     sorted(map(list, shared_overlap_choice.table())), len(tile_choice.tiles())]
    assert dispatch == ep_dispatch_choice.pick(16, 2, 64)
    assert tuple(overlap) == shared_overlap_choice.pick(2, 1, 64)


@pytest.fixture(scope="module")
def checkpoint(install, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """``k3jax make-checkpoint`` of the installed copy: (its process, the directory)."""
    _, target = install
    cwd = tmp_path_factory.mktemp("make_checkpoint")
    return _k3jax(target, "make-checkpoint", "--preset", "tiny", "--num-layers", "2", "ckpt",
                  cwd=cwd), cwd / "ckpt"


def test_make_checkpoint(checkpoint):
    proc, path = checkpoint
    assert proc.returncode == 0, proc.stderr
    assert (path / "config.json").exists() and list(path.glob("*.safetensors"))


TINY_SP_EP = ["--preset", "tiny", "--tp", "2", "--sequence-parallel", "--expert-parallel",
              "--shard-shared-expert", "--tokens", "64"]
COMMANDS = {
    "run": ["run"],
    "load-bench": ["load-bench", "--checkpoint", "{checkpoint}", "--repeat", "1"],
    "plan": ["plan", *TINY_SP_EP],
    "compile": ["compile", "--preset", "tiny", "--layer", "0", "--expert-dtype", "bfloat16"],
    "latency": ["latency", "--tp", "4", "--tokens", "8", "--layer", "moe"],
    "bench": ["bench", "--preset", "tiny", "--tokens", "8", "--repeats", "1", "--warmup", "1",
              "--devices", "2", "--skip-moe-layer", "--no-progress"],
    "selfcheck": ["selfcheck", "--preset", "tiny", "--layer", "0", "--tokens", "8",
                  "--backend", "interpret"],
    "tune": ["tune", "--preset", "tiny", "--layer", "0", "--tokens", "8"],
}
"""Each sub-command's smallest run (make-checkpoint: the checkpoint fixture)."""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_sub_command_runs_from_the_install(name, install, request, tmp_path):
    _, target = install
    argv = COMMANDS[name]
    if "{checkpoint}" in argv:
        path = request.getfixturevalue("checkpoint")[1]
        argv = [str(path) if a == "{checkpoint}" else a for a in argv]
    proc = _k3jax(target, *argv, cwd=tmp_path)
    if missing := extras.missing_message(name):     # an extra this environment lacks: exit 2
        assert proc.returncode == 2 and missing in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    if name == "plan":              # the auto shared-expert form, from the committed table
        form, scatter = shared_overlap_choice.pick(2, 1, 64)
        assert f"overlap auto -> {form} ({scatter} scatter) at 64 tokens" in proc.stdout, proc.stdout
    if name == "selfcheck":         # the interpret-mode kernels of the installed pallas_kernels
        assert " ok " in proc.stdout, proc.stdout
