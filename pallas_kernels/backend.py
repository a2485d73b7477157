"""Backend selection shared by every kernel in ``pallas_kernels``.

"xla" runs the plain-XLA reference, "pallas" the Mosaic GPU (sm_90) kernel,
"interpret" the same kernel through the Mosaic GPU interpret mode (CPU ok),
"triton" the Triton kernels through jax-triton (CUDA sm_80 and newer), and
"auto" picks "pallas" on a Hopper GPU, "triton" on other CUDA GPUs of
compute capability >= 8.0 (when jax-triton is installed), "xla" elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Literal, Sequence, get_args

import jax

Backend = Literal["auto", "xla", "pallas", "interpret", "triton"]
ResolvedBackend = Literal["xla", "pallas", "interpret", "triton"]

_VALID: tuple[str, ...] = get_args(Backend)


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What "auto" looks at: ``platform`` as jax.default_backend() names it
    ("gpu", "cpu", "tpu"); ``compute_capability`` the device's, "9.0" style on CUDA
    ("" when it reports none; ROCm reports "gfx..." names); ``triton_installed``
    whether jax-triton can be imported."""

    platform: str
    compute_capability: str
    triton_installed: bool


def cuda_capability(description: DeviceDescription) -> int | None:
    """major * 10 + minor (e.g. 90) of a CUDA GPU, None for anything else."""
    if description.platform != "gpu":
        return None
    major, _, minor = description.compute_capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        return None
    return int(major) * 10 + int(minor)


def choose_backend(description: DeviceDescription) -> ResolvedBackend:
    """What "auto" resolves to on a device described by ``description``."""
    capability = cuda_capability(description)
    if capability is None:
        return "xla"
    if capability // 10 == 9:
        return "pallas"
    if capability >= 80 and description.triton_installed:
        return "triton"
    return "xla"


def describe_devices(devices: Sequence[jax.Device]) -> DeviceDescription:
    """The description of ``devices`` (one kind of device: a mesh mixing
    platforms or compute capabilities has no single backend)."""
    devices = list(devices)
    if not devices:
        raise ValueError("describe_devices: no devices")
    kinds = {(d.platform, _capability(d)) for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"the devices mix platforms / compute capabilities {sorted(kinds)}; "
                         f"one backend cannot serve them all")
    (platform, capability), = kinds
    return DeviceDescription(platform=_PLATFORM.get(platform, platform),
                             compute_capability=capability,
                             triton_installed=importlib.util.find_spec("jax_triton") is not None)


# jax.Device.platform names a CUDA / ROCm device "cuda" / "rocm"; DeviceDescription
# uses jax.default_backend()'s "gpu" for both.
_PLATFORM = {"cuda": "gpu", "rocm": "gpu"}


def _capability(device: jax.Device) -> str:
    return str(getattr(device, "compute_capability", "") or "")


def resolve_backend(backend: Backend,
                    devices: Sequence[jax.Device] | None = None) -> ResolvedBackend:
    """Map a user-facing backend name to the implementation that will run on
    ``devices`` ("auto" looks at them; None: this process's first device, for
    an op called on its own). k3jax.layout.make_layout resolves once, from
    its mesh's devices; the modules pass that resolved name to the ops."""
    if backend not in _VALID:
        raise ValueError(
            f"backend={backend!r} is not one of {_VALID}")
    if backend != "auto":
        return backend  # type: ignore[return-value]
    return choose_backend(describe_devices(jax.devices()[:1] if devices is None else devices))
