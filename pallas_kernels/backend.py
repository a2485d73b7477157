"""Backend selection shared by every kernel in ``pallas_kernels``.

"xla" runs the plain-XLA reference, "pallas" the Mosaic GPU (sm_90) kernel,
"interpret" the same kernel through the Mosaic GPU interpret mode (CPU ok),
and "auto" picks "pallas" on a Hopper GPU and "xla" everywhere else.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

Backend = Literal["auto", "xla", "pallas", "interpret"]
ResolvedBackend = Literal["xla", "pallas", "interpret"]

_VALID: tuple[str, ...] = get_args(Backend)


def _device_is_hopper(device: jax.Device) -> bool:
    """True when ``device`` reports compute capability 9.x (sm_90, H100/H200)."""
    capability = str(getattr(device, "compute_capability", "") or "")
    return capability.split(".")[0] == "9"


def resolve_backend(backend: Backend) -> ResolvedBackend:
    """Map a user-facing backend name to the implementation that will run."""
    if backend not in _VALID:
        raise ValueError(
            f"backend={backend!r} is not one of {_VALID}")
    if backend != "auto":
        return backend  # type: ignore[return-value]
    if jax.default_backend() == "gpu" and _device_is_hopper(jax.devices()[0]):
        return "pallas"
    return "xla"
