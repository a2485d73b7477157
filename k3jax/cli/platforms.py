"""The JAX platform and XLA flags of a ``k3jax`` process, decided before jax
is imported.

With the CUDA plugin installed (the gpu-compile extra) on a machine without a
GPU, jax's default platform search tries CUDA first and prints a long "Jax
plugin configuration error ... cuInit(0) failed" traceback before falling
back to the CPU. Without an NVIDIA device node there is no GPU to find, so the
CLI asks for the CPU directly. A JAX_PLATFORMS the user set is never changed.

XLA_FLAGS gets k3jax.xla_options.OVERLAP_XLA_FLAGS (no collective combining,
so the shared expert's collectives can overlap the routed experts on a GPU),
except a flag the user already set.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from k3jax.xla_options import with_overlap_flags

NVIDIA_DEVICE_NODE = Path("/dev/nvidiactl")


def default_jax_platforms(environ: MutableMapping[str, str] = os.environ,
                          device_node: Path = NVIDIA_DEVICE_NODE) -> str | None:
    """Set JAX_PLATFORMS=cpu in ``environ`` when it is unset and no NVIDIA
    device node exists. Returns the value now in force (None: jax decides)."""
    if "JAX_PLATFORMS" not in environ and not device_node.exists():
        environ["JAX_PLATFORMS"] = "cpu"
    return environ.get("JAX_PLATFORMS")


def default_xla_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add OVERLAP_XLA_FLAGS to ``environ``'s XLA_FLAGS (a flag already set
    stands). Returns the new value."""
    environ["XLA_FLAGS"] = with_overlap_flags(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]
