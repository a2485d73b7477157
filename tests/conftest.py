"""Test session set-up: 8 simulated CPU devices before JAX's backend starts.

Tests that need 8 devices use the ``eight_devices`` fixture, which FAILS (never
skips) when fewer devices exist.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny shapes: XLA:CPU's LLVM optimisation costs more than it saves.
# Subprocesses started by tests inherit it.
_FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _FAST_CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_CPU_FLAGS).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from pallas_kernels import interpret_compat  # noqa: E402

# Interpret-mode kernels on up to 8 devices: XLA:CPU's pools hold their waits.
interpret_compat.reserve_pool_threads(8)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavy interpret-mode and multi-process runs")


@pytest.fixture
def eight_devices():
    devices = jax.devices()
    assert len(devices) >= 8, f"these tests need 8 devices, found {len(devices)}: {devices}"
    return devices[:8]


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_folder(tmp_path_factory):
    """tests/compile_cache.py's folder: one per run, shared by its xdist
    workers (an exported $K3JAX_TEST_CACHE is kept)."""
    import compile_cache
    os.environ.setdefault(compile_cache.CACHE_ENV, str(compile_cache.run_folder(
        tmp_path_factory.getbasetemp(), xdist_worker="PYTEST_XDIST_WORKER" in os.environ)))
