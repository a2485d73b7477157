"""JAX's platform on import (k3jax/__init__.py): the CPU where the user chose
nothing (JAX_PLATFORMS unset) and the machine has no NVIDIA GPU, so that
jax's first use prints no CUDA plugin error even with the CUDA plugin
installed (the gpu-compile extra); a chosen platform is never changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import k3jax

REPO = Path(__file__).resolve().parents[1]


def test_the_cpu_where_nothing_was_chosen_and_no_gpu_exists(tmp_path):
    env: dict[str, str] = {}
    assert k3jax.default_to_cpu(env, (str(tmp_path / "nvidiactl"),)) == "cpu"
    assert env == {"JAX_PLATFORMS": "cpu"}


def test_a_chosen_platform_or_a_gpu_device_node_changes_nothing(tmp_path):
    for chosen in ("cuda", "", "cpu"):
        env = {"JAX_PLATFORMS": chosen}
        assert k3jax.default_to_cpu(env, (str(tmp_path / "nvidiactl"),)) == chosen
        assert env == {"JAX_PLATFORMS": chosen}
    node = tmp_path / "nvidia0"
    node.touch()
    env = {}
    assert k3jax.default_to_cpu(env, (str(tmp_path / "nvidiactl"), str(node))) is None
    assert env == {}


def test_import_and_first_jax_use_print_no_cuda_error(tmp_path):
    """In a fresh process without JAX_PLATFORMS: ``import k3jax, jax;
    jax.devices()``, and jax imported first. On a machine without an NVIDIA
    device node: the CPU, and no plugin error on stderr; with one, jax decides."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(REPO)
    no_gpu = not any(os.path.exists(node) for node in k3jax.NVIDIA_DEVICE_NODES)
    for imports in ("k3jax, jax", "jax, k3jax"):
        code = (f"import os, {imports}; jax.devices(); "
                "print(os.environ.get('JAX_PLATFORMS'), jax.config.jax_platforms)")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        if no_gpu:
            assert proc.stdout.split() == ["cpu", "cpu"], proc.stdout
            assert "cuInit" not in proc.stderr and "CUDA" not in proc.stderr, proc.stderr
        else:
            assert proc.stdout.split()[0] == "None", proc.stdout


def test_importing_k3jax_does_not_import_jax(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(REPO)
    code = "import sys, k3jax; print('jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr
