"""Test session set-up: 8 simulated CPU devices before JAX's backend starts.

Tests that need 8 devices use the ``eight_devices`` fixture, which FAILS (never
skips) when fewer devices exist.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny shapes: XLA:CPU's LLVM optimisation costs more than it saves (about 40%
# of the suite's CPU time). Subprocesses started by tests inherit it.
_FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _FAST_CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_CPU_FLAGS).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture
def eight_devices():
    devices = jax.devices()
    assert len(devices) >= 8, f"these tests need 8 devices, found {len(devices)}: {devices}"
    return devices[:8]


def pytest_configure(config):
    config.addinivalue_line("markers", "compile: deviceless H200 compiles")
