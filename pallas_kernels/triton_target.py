"""Which CUDA compute capability the Triton kernels are lowered for.

On a GPU, jax-triton asks the device (``None`` here). Without one (lowering
or compiling for CUDA on a CPU host), it must be told: ``with
triton_target(80): jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_CAPABILITY: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "triton_compute_capability", default=None)

MIN_CAPABILITY = 80  # mma.sync bf16 and cp.async: Ampere and newer


def target_capability() -> int | None:
    """The capability set by ``triton_target`` (e.g. 80, 90), or None (ask the GPU)."""
    return _CAPABILITY.get()


@contextlib.contextmanager
def triton_target(capability: int) -> Iterator[None]:
    """Lower Triton kernels for compute capability ``capability`` (major * 10 + minor)."""
    if not isinstance(capability, int) or capability < MIN_CAPABILITY:
        raise ValueError(f"Triton kernels target compute capability >= {MIN_CAPABILITY} "
                         f"(sm_80), got {capability!r}")
    token = _CAPABILITY.set(capability)
    try:
        yield
    finally:
        _CAPABILITY.reset(token)
