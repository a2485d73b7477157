"""Multi-process runs: start-up, agreement between processes, and a clear
error when a peer dies.

Start-up. Each process is told the coordinator ``HOST:PORT``, the number of
processes P and its own id I, by flags or by the environment variables
``JAX_COORDINATOR_ADDRESS`` (jax 0.11.2 reads this one itself),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (k3jax reads these; jax only
auto-detects P and I under Slurm, Open MPI, Kubernetes or Cloud TPU).
:func:`initialize` turns on gloo CPU collectives and calls
``jax.distributed.initialize`` with a short heartbeat timeout
(``K3JAX_HEARTBEAT_TIMEOUT``, default 10 s). On the CPU each process
simulates N / P devices; the caller sets ``jax_num_cpu_devices`` first.

Agreement. :func:`check_agreement` publishes each process's identity of the
run (flags, config, checkpoint fingerprint, input hash, or the error that
stopped it) in the coordination service's key-value store, reads every
other process's, and raises :class:`ProcessMismatchError` naming each item
that differs and its value on each process. It needs no devices, so it works
even when the processes would build different meshes.

Peer death. When a peer dies (or hangs), the coordination service stops
hearing its heartbeats and XLA ends every survivor with a CHECK failure:
SIGABRT, exit code 134 and a long C++ stack trace; there is no Python hook.
So a multi-process ``k3jax run`` is a small supervisor: :func:`supervise`
starts the real work in a child Python, passes its output through (minus
gloo's connection chatter), and when the child dies that way it stores the
XLA log in a file and prints one line that says which peer was lost, then
exits 1. Detection takes about the heartbeat timeout (7-11 s measured for a
killed peer, about 1 s when the coordinator's process dies). The child dies
with its supervisor (PR_SET_PDEATHSIG), so killing either ends the process.

A worker that fails on its own exits at once (:func:`abandon`) rather than
waiting for its peers at JAX's shutdown barrier, so the peers see it as dead
and stop too, instead of hanging in a collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping

import numpy as np

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_HEARTBEAT = "K3JAX_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "K3JAX_INIT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 10
DEFAULT_INIT_TIMEOUT_S = 300
_AGREEMENT_KEY = "k3jax/agreement/"


class DistributedError(RuntimeError):
    """A multi-process run cannot go on; the message is one clear line."""


class ProcessMismatchError(DistributedError):
    """The processes were started with different flags or files (every
    process raises it, with the same message)."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Where this process sits in a multi-process run."""

    coordinator: str      # HOST:PORT of the coordination service (run by process 0)
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def tag(self) -> str:
        return f"[process {self.process_id}/{self.num_processes}]"


# -- flags and environment ----------------------------------------------------------

def add_distributed_flags(p) -> None:
    g = p.add_argument_group("multi-process (one process per host; see README 'Multi-host')")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help=f"process 0's address, reachable from every process "
                        f"(default: ${ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, metavar="P",
                   help=f"number of processes (default: ${ENV_NUM_PROCESSES}, else 1)")
    g.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process, 0..P-1; process 0 writes the output "
                        f"(default: ${ENV_PROCESS_ID})")


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
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
        num_processes = _env_int(environ, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(environ, ENV_PROCESS_ID)
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
    value = _env_int(environ, name)
    if value is None:
        return default
    if value < 1:
        raise ValueError(f"${name} must be a positive number of seconds, got {value}")
    return value


def heartbeat_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    return _timeout_env(environ, ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S)


def init_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    return _timeout_env(environ, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S)


# -- inside a worker ------------------------------------------------------------------

def initialize(spec: ProcessSpec) -> None:
    """Join the run: gloo CPU collectives, then ``jax.distributed.initialize``
    (blocks until all processes have connected, at most K3JAX_INIT_TIMEOUT s).
    Call before JAX's backend starts, after setting ``jax_num_cpu_devices``."""
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_preemption_service", False)  # unused; noisy when a peer dies
    init_s, heartbeat_s = init_timeout_s(), heartbeat_timeout_s()
    try:
        jax.distributed.initialize(spec.coordinator, num_processes=spec.num_processes,
                                   process_id=spec.process_id, initialization_timeout=init_s,
                                   heartbeat_timeout_seconds=heartbeat_s)
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"process {spec.process_id} of {spec.num_processes} could not join "
                               f"the run at {spec.coordinator} (waited up to {init_s} s for all "
                               f"processes; ${ENV_INIT_TIMEOUT} sets it): {first}") from None


def _client():
    from jax._src import distributed as jax_distributed  # the client jax.distributed started
    client = jax_distributed.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialized")
    return client


def fingerprint_array(x: np.ndarray) -> str:
    """dtype, shape and a content hash: equal only for equal arrays."""
    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]
    return f"{x.dtype}{list(x.shape)} sha256:{digest}"


def check_agreement(spec: ProcessSpec, items: Mapping[str, str] | None,
                    error: str | None = None) -> None:
    """Compare ``items`` (what must be equal, by name) across all processes.

    A process that could not compute its items passes ``error`` instead;
    every process then reports it. Raises ProcessMismatchError, the same in
    every process, naming what differs and each process's value."""
    client = _client()
    mine = json.dumps({"error": error, "items": dict(items or {})}, sort_keys=True)
    client.key_value_set(f"{_AGREEMENT_KEY}{spec.process_id}", mine)
    timeout_ms = init_timeout_s() * 1000
    views = {}
    for p in range(spec.num_processes):
        views[p] = json.loads(client.blocking_key_value_get(f"{_AGREEMENT_KEY}{p}", timeout_ms))
    message = describe_disagreement(views)
    if message:
        raise ProcessMismatchError(message)


def describe_disagreement(views: Mapping[int, Mapping]) -> str | None:
    """One line naming each failed process and each differing item, or None."""
    failed = [f"process {p} failed: {v['error']}" for p, v in sorted(views.items()) if v["error"]]
    if failed:
        return "; ".join(failed)
    names: list[str] = []
    for v in views.values():
        names += [n for n in v["items"] if n not in names]
    differing = []
    for name in names:
        values = {p: v["items"].get(name, "(missing)") for p, v in sorted(views.items())}
        if len(set(values.values())) > 1:
            differing.append(f"{name} (" + ", ".join(f"process {p}: {val}"
                                                     for p, val in values.items()) + ")")
    if not differing:
        return None
    return ("the processes disagree on " + "; ".join(differing)
            + "; start every process with the same flags, checkpoint files and input")


_PEER_LOSS = re.compile(r"gloo|nccl|connection (?:reset|closed|refused)|socket closed|broken pipe|"
                        r"unavailable", re.IGNORECASE)


def explain_error(error: BaseException, spec: ProcessSpec) -> str:
    """The message for an error raised in a worker: a collective that failed
    because a peer went away says so (gloo reports a dead peer as a reset
    connection, often before the heartbeat check notices)."""
    text = str(error).strip() or type(error).__name__
    if not _PEER_LOSS.search(text):
        return text
    first = text.splitlines()[0]
    first = first[:200] + "..." if len(first) > 200 else first
    return (f"process {spec.process_id} of {spec.num_processes} stopped because a collective "
            f"with its peers failed (most likely a peer process died or the network failed): "
            f"{first}")


def replicated(x: np.ndarray, mesh):
    """The same host array on every device of ``mesh`` (every process passes
    its own, equal, copy)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, PartitionSpec()),
                                        lambda index: x[index])


def gather(array) -> np.ndarray:
    """The whole global ``array`` on every process (a collective: every
    process must call it)."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def abandon(code: int) -> None:
    """Exit now. Once this process has joined a run, a normal exit would wait
    at JAX's shutdown barrier for peers that may be stuck waiting for this
    process; leaving at once lets their heartbeat check end them instead."""
    import jax
    sys.stdout.flush()
    sys.stderr.flush()
    if jax.distributed.is_initialized():
        os._exit(code)
    sys.exit(code)


def _child_main() -> None:
    """The supervised child: ``python -c ... MODULE:FUNCTION PAYLOAD_JSON``."""
    target, payload = sys.argv[1], json.loads(sys.argv[2])
    module, _, function = target.partition(":")
    try:
        code = getattr(importlib.import_module(module), function)(payload)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        abandon(130)
    except SystemExit:       # abandon()'s own exit, with the worker's code
        raise
    except BaseException:  # noqa: BLE001 - a bug: report it, and do not hang the peers
        traceback.print_exc()
        abandon(1)
    sys.exit(code)


_RUNTIME_LOGGERS = ("coordination_service", "preemption_sync_manager", "client.h", "grpc")

# -- the supervisor -----------------------------------------------------------------

# An abseil log line: "F1129 14:33:22.976084   14292 client.h:86] ...".
_LOG_LINE = re.compile(r"^([WEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+([\w.+-]+):\d+\]")
# gloo prints "[Gloo] Rank R is connected to N peer ranks. Expected number of
# connected peer ranks is : N" once per local device, from several threads, one
# piece per write, so the pieces of these lines interleave.
_GLOO_PIECES = ("Expected number of connected peer ranks is : ", "[Gloo] Rank ",
                " is connected to ", " peer ranks. ")


def _strip_gloo_chatter(line: str, after_chatter: bool) -> tuple[str | None, bool]:
    """(``line`` without gloo's connection chatter or None if nothing else is
    left, whether it held chatter). A bare newline right after chatter is a
    piece of it too."""
    rest = line
    for piece in _GLOO_PIECES:
        rest = rest.replace(piece, "")
    if rest == line:
        return (None, after_chatter) if after_chatter and not line.strip() else (line, False)
    return (None, True) if re.fullmatch(r"[\d\s]*", rest) else (rest, True)


def _starts_fatal_log(line: str) -> bool:
    """A fatal log line, or a warning from the distributed runtime (they
    precede XLA's abort; held back, and shown if no abort follows)."""
    m = _LOG_LINE.match(line)
    return bool(m) and (m.group(1) == "F" or m.group(2).startswith(_RUNTIME_LOGGERS))


def explain_abort(log: str, spec: ProcessSpec) -> str:
    """Why XLA ended this process, from its log: which peer was lost."""
    m = re.search(r"stopped sending heartbeats\):\s*((?:\d+[\s,]*)+)", log)
    if m:
        ids = sorted({int(i) for i in re.findall(r"\d+", m.group(1))})
        who = ", ".join(f"process {i}" for i in ids)
        verb = "has" if len(ids) == 1 else "have"
        return (f"{who} {verb} stopped responding (no heartbeat for {heartbeat_timeout_s()} s: "
                f"killed, crashed or hung)")
    if re.search(r"Failed to send RPC to coordination service|leader task|"
                 r"coordination service.*(?:unavailable|shut ?down)", log, re.IGNORECASE):
        return (f"it lost the coordinator at {spec.coordinator}: process 0 died or the "
                f"network failed")
    for line in log.splitlines():
        if _LOG_LINE.match(line) and line.startswith("F"):
            text = line.split("] ", 1)[-1]
            return "XLA stopped it: " + (text[:200] + "..." if len(text) > 200 else text)
    return "it crashed inside XLA (abort)"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def supervise(target: str, payload: dict, spec: ProcessSpec, prog: str) -> int:
    """Run ``target(payload)`` ("module:function", JSON payload) in a child
    Python and turn XLA's abort on a lost peer into a one-line error.

    stdout passes through (without gloo's per-rank connection lines); stderr
    passes through until XLA starts its fatal report, which goes to a log
    file instead. Returns the exit code for this process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "from k3jax.distributed import _child_main; _child_main()",
           target, json.dumps(payload)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads yet
    held: list[str] = []
    reported = []   # the worker printed its own error line

    def pump_out():
        after_chatter = False
        for raw in iter(child.stdout.readline, b""):
            line, after_chatter = _strip_gloo_chatter(raw.decode(errors="replace"), after_chatter)
            if line is not None:
                sys.stdout.write(line)
                sys.stdout.flush()

    def pump_err():
        for raw in iter(child.stderr.readline, b""):
            line = raw.decode(errors="replace")
            if line.startswith(f"{prog}: error:"):   # the worker's own one-line error
                reported.append(line)
            elif held or _starts_fatal_log(line):
                held.append(line)
                continue
            sys.stderr.write(line)
            sys.stderr.flush()

    pumps = [threading.Thread(target=f, daemon=True) for f in (pump_out, pump_err)]
    for t in pumps:
        t.start()
    previous = {}

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        code = child.wait()
        for t in pumps:
            t.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    log = "".join(held)
    where = f"process {spec.process_id} of {spec.num_processes}"
    if code in (134, -signal.SIGABRT):
        if not reported:  # else the worker's own error line already says why
            fd, path = tempfile.mkstemp(prefix=f"k3jax-p{spec.process_id}-", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(log)
            print(f"{prog}: error: {where} stopped because {explain_abort(log, spec)} "
                  f"(XLA's report: {path})", file=sys.stderr, flush=True)
        return 1
    if held and not (reported and code):  # no abort after all: show what was held back
        sys.stderr.write(log)                # (but not the runtime's noise after an error line)
        sys.stderr.flush()
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        print(f"{prog}: error: {where}: its worker was killed by signal {name}",
              file=sys.stderr, flush=True)
        return 128 - code
    return code
