"""The JAX platform and XLA flags of a ``k3jax`` process, decided before jax
is imported.

With the CUDA plugin installed (the gpu-compile extra) on a machine without a
GPU, jax's default platform search tries CUDA first and prints a long "Jax
plugin configuration error ... cuInit(0) failed" traceback before falling
back to the CPU. Without an NVIDIA device node there is no GPU to find, so the
CLI asks for the CPU directly. A JAX_PLATFORMS the user set is never changed.

XLA_FLAGS gets k3jax.xla_options.GPU_XLA_FLAGS (no collective combining,
so the shared expert's collectives can overlap the routed experts on a GPU),
except a flag the user already set.

On CPU devices a jax array lives in memory that XLA's CPU client gets from
malloc, which glibc backs with 4 KiB pages unless told otherwise (numpy
asks for transparent huge pages itself; XLA does not). Every first touch of
a 4 KiB page faults, and on a virtual machine a fault is costly: the
loader's on-device transposes, which write fresh XLA buffers, are bound by
them there (BENCHMARKS.md, "The pipelined loader"). glibc reads its malloc
tunables once, at process start, so the ``k3jax`` command re-executes itself
with ``glibc.malloc.hugetlb=1`` added to GLIBC_TUNABLES (``huge_page_environ``)
when it will run on CPU devices and the kernel's THP mode is ``madvise``.
A GLIBC_TUNABLES that already names ``glibc.malloc.hugetlb`` stands (set it
to 0 to opt out).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from k3jax.xla_options import with_gpu_flags

NVIDIA_DEVICE_NODE = Path("/dev/nvidiactl")
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
HUGE_PAGE_GLIBC = (2, 35)
"""The first glibc with the glibc.malloc.hugetlb tunable."""
REEXECUTED = "K3JAX_HUGE_PAGES_REEXECUTED"
"""Set in the re-executed process's environment: it never re-executes again."""


def default_jax_platforms(environ: MutableMapping[str, str] = os.environ,
                          device_node: Path = NVIDIA_DEVICE_NODE) -> str | None:
    """Set JAX_PLATFORMS=cpu in ``environ`` when it is unset and no NVIDIA
    device node exists. Returns the value now in force (None: jax decides)."""
    if "JAX_PLATFORMS" not in environ and not device_node.exists():
        environ["JAX_PLATFORMS"] = "cpu"
    return environ.get("JAX_PLATFORMS")


def default_xla_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add GPU_XLA_FLAGS to ``environ``'s XLA_FLAGS (a flag already set
    stands). Returns the new value."""
    environ["XLA_FLAGS"] = with_gpu_flags(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]


def huge_page_environ(environ: Mapping[str, str] = os.environ,
                      thp_mode_file: Path = THP_MODE_FILE,
                      libc: tuple[str, str] = platform.libc_ver()) -> dict[str, str] | None:
    """The environment to re-execute the process with so that glibc's malloc
    asks for transparent huge pages (GLIBC_TUNABLES gains
    ``glibc.malloc.hugetlb=1``), or None when that would change nothing:
    the process will not run on CPU devices alone (JAX_PLATFORMS in
    ``environ`` is not ``cpu``), the C library is not glibc >= 2.35
    (``libc`` as platform.libc_ver() gives it), the kernel's THP mode
    (``thp_mode_file``) is not ``madvise`` (``always`` backs malloc's memory
    with huge pages already, ``never`` with none), GLIBC_TUNABLES already
    names the tunable, or the process is the re-executed one."""
    if environ.get("JAX_PLATFORMS") != "cpu" or REEXECUTED in environ:
        return None
    name, version = libc
    try:
        if name != "glibc" or tuple(int(v) for v in version.split(".")[:2]) < HUGE_PAGE_GLIBC:
            return None
        mode = thp_mode_file.read_text()
    except (OSError, ValueError):
        return None
    if "[madvise]" not in mode:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=", 1)[0] == HUGE_PAGE_TUNABLE for t in tunables.split(":")):
        return None
    return {**environ, REEXECUTED: "1",
            "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{HUGE_PAGE_TUNABLE}=1"]))}
