"""What this machine can hold, checked before anything is allocated or
started: simulated CPU devices, and arrays read or built in memory.

Simulated CPU devices each cost XLA threads and memory when its CPU client
starts (about 75 KB of resident memory each at start, measured, and more
once a program runs on them), and the client starts them all at once, in C++,
where Ctrl-C does not reach. So a device count is checked against
``max_simulated_devices`` first: at most MAX_SIMULATED_DEVICES in one
process, and no more than the available memory at
SIMULATED_DEVICE_BYTES each.
"""

from __future__ import annotations

import os

MAX_SIMULATED_DEVICES = 2048
"""The most simulated CPU devices one process starts: XLA:CPU (jaxlib
0.11.2) runs no program on more ("Multiprocess computations aren't
implemented on the CPU backend" from 2049 up; measured), and 100,000 took
minutes and over 6 GB before that error could come."""
SIMULATED_DEVICE_BYTES = 1 << 20
"""The memory budgeted per simulated CPU device (start-up plus a small
program's buffers and threads)."""
MEMINFO = "/proc/meminfo"


def available_memory_bytes(meminfo: str = MEMINFO) -> int | None:
    """The memory a new allocation can get without swapping (MemAvailable of
    /proc/meminfo; else free pages x page size), or None when unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def max_simulated_devices(available: int | None = None) -> int:
    """How many simulated CPU devices one process may start here."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return MAX_SIMULATED_DEVICES
    return max(1, min(MAX_SIMULATED_DEVICES, available // SIMULATED_DEVICE_BYTES))


def device_count_problem(count: int, available: int | None = None) -> str | None:
    """Why this process cannot start ``count`` simulated CPU devices, or None."""
    limit = max_simulated_devices(available)
    if count <= limit:
        return None
    available = available_memory_bytes() if available is None else available
    memory = "" if available is None else f" of the {available / 2**30:.1f} GiB available"
    return (f"{count:,} devices: one process here simulates at most {limit:,} CPU devices "
            f"({SIMULATED_DEVICE_BYTES >> 20} MiB budgeted each{memory}; never more than "
            f"{MAX_SIMULATED_DEVICES:,})")


def memory_problem(nbytes: int, what: str, available: int | None = None) -> str | None:
    """Why ``nbytes`` of ``what`` cannot be held in memory here, or None."""
    available = available_memory_bytes() if available is None else available
    if available is None or nbytes <= available:
        return None
    return (f"{what} needs {nbytes / 1e9:.2f} GB of memory, and {available / 1e9:.2f} GB is "
            f"available")
