"""Test session set-up: 8 simulated CPU devices before JAX's backend starts.

Tests that need 8 devices use the ``mesh8`` fixture, which FAILS (never
skips) when fewer devices exist.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture
def eight_devices():
    devices = jax.devices()
    assert len(devices) >= 8, f"these tests need 8 devices, found {len(devices)}: {devices}"
    return devices[:8]
