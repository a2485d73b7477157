"""Start-up of a multi-process run: where this process sits, and joining.

Each process is told the coordinator ``HOST:PORT``, the number of processes P
and its own id I, by flags or by the environment variables
``JAX_COORDINATOR_ADDRESS`` (jax reads this one itself), ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` (k3jax reads these; jax only auto-detects P and I under
Slurm, Open MPI, Kubernetes or Cloud TPU). Flags win over the environment.

Invariants of a :class:`ProcessSpec`: ``num_processes >= 2`` or
``process_id > 0`` (a single-process run has no spec: ``spec_from_args``
returns None), ``0 <= process_id < num_processes``, and ``coordinator`` is
``HOST:PORT`` with ``0 < PORT < 65536``. Process 0 runs the coordination
service and writes the run's output.

:func:`initialize` first has every process meet on the coordinator's port
(:mod:`k3jax.runtime.rendezvous`: lines naming who is missing, a one-line
error at the timeout), then turns on gloo CPU collectives and calls
``jax.distributed.initialize`` with a heartbeat timeout
(``K3JAX_HEARTBEAT_TIMEOUT``, default 10 s) and a start-up timeout
(``K3JAX_INIT_TIMEOUT``, default 300 s). On the CPU each process simulates
N / P devices; the caller sets ``jax_num_cpu_devices`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_HEARTBEAT = "K3JAX_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "K3JAX_INIT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 10
DEFAULT_INIT_TIMEOUT_S = 300


class DistributedError(RuntimeError):
    """A multi-process run cannot go on; the message is one clear line."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a multi-process run (invariants: module docstring)."""

    coordinator: str      # HOST:PORT of the coordination service (run by process 0)
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def tag(self) -> str:
        return f"[process {self.process_id}/{self.num_processes}]"


def add_distributed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (one process per host; see docs/multihost.md)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help=f"process 0's address, reachable from every process "
                        f"(default: ${ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, metavar="P",
                   help=f"number of processes (default: ${ENV_NUM_PROCESSES}, else 1)")
    g.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process, 0..P-1; process 0 writes the output "
                        f"(default: ${ENV_PROCESS_ID})")


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """The integer in ``environ[name]`` (None when unset or blank); ValueError
    naming the variable otherwise."""
    text = environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {text!r}") from None


def spec_from_args(coordinator: str | None, num_processes: int | None, process_id: int | None,
                   environ: Mapping[str, str] = os.environ) -> ProcessSpec | None:
    """The multi-process set-up from flags, falling back to the environment;
    None for a single-process run. Raises ValueError (a usage error) on an
    incomplete or inconsistent set-up, or a bad $K3JAX_HEARTBEAT_TIMEOUT /
    $K3JAX_INIT_TIMEOUT."""
    from_flags = any(v is not None for v in (coordinator, num_processes, process_id))
    if num_processes is None:
        num_processes = env_int(environ, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = env_int(environ, ENV_PROCESS_ID)
    if coordinator is None:
        coordinator = environ.get(ENV_COORDINATOR) or None
    if num_processes is None or (num_processes == 1 and not from_flags):
        if from_flags:
            raise ValueError(f"--coordinator-address and --process-id need --num-processes "
                             f"(or ${ENV_NUM_PROCESSES})")
        return None
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if num_processes == 1 and process_id in (None, 0):
        return None
    if process_id is None:
        raise ValueError(f"--num-processes {num_processes} needs --process-id (or ${ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
    if coordinator is None:
        raise ValueError(f"--num-processes {num_processes} needs --coordinator-address HOST:PORT "
                         f"(or ${ENV_COORDINATOR})")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator-address must be HOST:PORT, got {coordinator!r}")
    heartbeat_timeout_s(environ)   # a bad timeout is a usage error now, not in the worker
    init_timeout_s(environ)
    return ProcessSpec(coordinator, num_processes, process_id)


def _timeout_env(environ: Mapping[str, str], name: str, default: int) -> int:
    value = env_int(environ, name)
    if value is None:
        return default
    if value < 1:
        raise ValueError(f"${name} must be a positive number of seconds, got {value}")
    return value


def heartbeat_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds without a heartbeat after which the coordination service
    declares a process dead (``K3JAX_HEARTBEAT_TIMEOUT``)."""
    return _timeout_env(environ, ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S)


def init_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds a process waits for all others, at start-up and in the
    agreement check (``K3JAX_INIT_TIMEOUT``)."""
    return _timeout_env(environ, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S)


def initialize(spec: ProcessSpec) -> None:
    """Join the run: meet every process on the coordinator's port
    (k3jax.runtime.rendezvous: a line every 10 s names who is missing, and a
    timeout names them), then gloo CPU collectives and
    ``jax.distributed.initialize`` (at most K3JAX_INIT_TIMEOUT s each).
    Call before JAX's backend starts, after setting ``jax_num_cpu_devices``.
    Raises DistributedError naming this process and the coordinator."""
    import jax

    from k3jax.runtime import rendezvous
    init_s, heartbeat_s = init_timeout_s(), heartbeat_timeout_s()
    try:
        rendezvous.join(spec, init_s)
    except rendezvous.JoinError as e:
        raise DistributedError(str(e)) from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_preemption_service", False)  # unused; noisy when a peer dies
    try:
        jax.distributed.initialize(spec.coordinator, num_processes=spec.num_processes,
                                   process_id=spec.process_id, initialization_timeout=init_s,
                                   heartbeat_timeout_seconds=heartbeat_s)
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"process {spec.process_id} of {spec.num_processes} could not join "
                               f"the run at {spec.coordinator} (waited up to {init_s} s for all "
                               f"processes; ${ENV_INIT_TIMEOUT} sets it): {first}") from None
