"""Backend selection shared by every kernel in ``pallas_kernels``: typed values.

A resolved backend is a ``KernelBackend(family, interpret)``: its ``Family``
(XLA: the plain-XLA reference; MOSAIC: the Mosaic GPU (sm_90) kernels;
TRITON: the Triton kernels through jax-triton, CUDA sm_80 and newer) and,
for MOSAIC only, whether it runs in the Mosaic GPU interpret mode (CPU ok).
Its ``name`` is the user-facing one ("xla", "pallas", "interpret",
"triton"): reports, cache keys and the selfcheck's names print it.

Users name a backend "auto" | "xla" | "pallas" | "interpret" | "triton", or
the same as a ``BackendName`` member, or pass a ``KernelBackend``;
``parse_backend`` reads any of these (an unknown name is a ValueError that
lists the choices) and ``resolve`` turns one into a ``KernelBackend``.
"auto" picks MOSAIC (not interpreted) on a Hopper GPU, TRITON on other
CUDA GPUs of compute capability >= 8.0 (when jax-triton is installed),
XLA elsewhere. Code compares families and the interpret flag, never names.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
from typing import Literal, Sequence, Union

import jax


class Family(enum.Enum):
    """A kernel family: which implementation of an op runs."""

    XLA = "xla"
    MOSAIC = "mosaic"
    TRITON = "triton"


@dataclasses.dataclass(frozen=True)
class KernelBackend:
    """A resolved backend: ``family`` and, for MOSAIC only, ``interpret``
    (the Mosaic GPU interpret mode). Hashable; ``name`` / str() give the
    user-facing name."""

    family: Family
    interpret: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.family, Family):
            raise TypeError(f"KernelBackend: family must be a Family, got {self.family!r}")
        if self.interpret and self.family is not Family.MOSAIC:
            raise ValueError(f"KernelBackend: interpret mode is the Mosaic kernels' only, "
                             f"not {self.family.name}'s")

    @property
    def name(self) -> str:
        """"xla" | "pallas" | "interpret" | "triton" (the parse table's name)."""
        return _NAME_OF[self].value

    def __str__(self) -> str:
        return self.name


XLA = KernelBackend(Family.XLA)
PALLAS = KernelBackend(Family.MOSAIC)
INTERPRET = KernelBackend(Family.MOSAIC, interpret=True)
TRITON = KernelBackend(Family.TRITON)


class BackendName(enum.Enum):
    """The user-facing backend names, in enum form."""

    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"
    INTERPRET = "interpret"
    TRITON = "triton"


# The parse table: every user-facing name and the backend it names (AUTO: none
# until the devices are known, ``resolve``).
_PARSE: dict[BackendName, KernelBackend | None] = {
    BackendName.AUTO: None,
    BackendName.XLA: XLA,
    BackendName.PALLAS: PALLAS,
    BackendName.INTERPRET: INTERPRET,
    BackendName.TRITON: TRITON,
}
_NAME_OF: dict[KernelBackend, BackendName] = {b: n for n, b in _PARSE.items() if b is not None}

CHOICES: tuple[str, ...] = tuple(n.value for n in BackendName)

# What the public ops accept as ``backend=`` (the names are CHOICES).
Backend = Union[Literal["auto", "xla", "pallas", "interpret", "triton"], BackendName,
                KernelBackend]
# A resolved backend's name, as k3jax's layout keeps it (resolve_backend).
ResolvedBackend = Literal["xla", "pallas", "interpret", "triton"]


def parse_backend(backend: Backend) -> BackendName:
    """The BackendName of ``backend`` (a name, a BackendName or a
    KernelBackend); anything else raises ValueError listing CHOICES."""
    if isinstance(backend, KernelBackend):
        return _NAME_OF[backend]
    if isinstance(backend, BackendName):
        return backend
    try:
        return BackendName(backend)
    except (ValueError, TypeError):
        raise ValueError(f"backend={backend!r} is not one of {CHOICES}") from None


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


def choose_backend(description: DeviceDescription) -> KernelBackend:
    """What "auto" resolves to on a device described by ``description``."""
    capability = cuda_capability(description)
    if capability is None:
        return XLA
    if capability // 10 == 9:
        return PALLAS
    if capability >= 80 and description.triton_installed:
        return TRITON
    return XLA


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


def resolve(backend: Backend, devices: Sequence[jax.Device] | None = None) -> KernelBackend:
    """The KernelBackend that runs for ``backend`` on ``devices`` ("auto"
    looks at them; None: this process's first device, for an op called on
    its own). A KernelBackend is returned as it is."""
    if isinstance(backend, KernelBackend):
        return backend
    named = _PARSE[parse_backend(backend)]
    if named is not None:
        return named
    return choose_backend(describe_devices(jax.devices()[:1] if devices is None else devices))


def resolve_backend(backend: Backend,
                    devices: Sequence[jax.Device] | None = None) -> ResolvedBackend:
    """``resolve(backend, devices).name``: the resolved backend's name, for
    callers that keep it as text (k3jax.layout.make_layout resolves once,
    from its mesh's devices, and passes that name to the ops)."""
    return resolve(backend, devices).name  # type: ignore[return-value]
