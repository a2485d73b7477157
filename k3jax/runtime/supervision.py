"""Supervision of a multi-process worker: a clear error when a peer dies.

When a peer dies (or hangs), the coordination service stops hearing its
heartbeats and XLA ends every survivor with a CHECK failure: SIGABRT, exit
code 134 and a long C++ stack trace; there is no Python hook. So a
multi-process ``k3jax run`` is a small supervisor: :func:`supervise` starts
the real work in a child Python (``python -c ... MODULE:FUNCTION PAYLOAD``,
see :func:`child_main`), passes its output through (minus gloo's connection
chatter), and when the child dies that way it stores the XLA log in a file
and prints one line that says which peer was lost (:func:`explain_abort`),
then exits 1. Detection takes about the heartbeat timeout
(``K3JAX_HEARTBEAT_TIMEOUT``). The child dies with its supervisor
(PR_SET_PDEATHSIG), so killing either ends the process.

A worker that fails on its own exits at once (:func:`abandon`) rather than
waiting for its peers at JAX's shutdown barrier, so the peers see it as dead
and stop too, instead of hanging in a collective. Its one-line error
(``PROG: error: ...``) passes through; the supervisor adds none of its own.

Ctrl-C (or SIGTERM) is passed on to the worker; a worker still running
INTERRUPT_GRACE_S later (blocked in C++, where Python never sees the
signal) is killed, and the supervisor exits 130.

Exit codes of :func:`supervise`: the worker's own code; 1 after an XLA abort;
130 after an interrupt; 128 + N when the worker was killed by signal N.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from k3jax.runtime.startup import ProcessSpec, heartbeat_timeout_s

INTERRUPT_GRACE_S = 3.0
"""How long a worker may take to stop after Ctrl-C before it is killed."""
STEP_S = 0.2

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


def child_main() -> None:
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


# Loggers of the distributed runtime whose warnings precede XLA's abort.
_RUNTIME_LOGGERS = ("coordination_service", "preemption_sync_manager", "client.h", "grpc")
# An abseil log line: "<W|E|F>MMDD hh:mm:ss.micros  THREAD FILE:LINE] message".
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


def _wait(child: subprocess.Popen, interrupted: list[float]) -> int:
    """The child's exit code; a child still running INTERRUPT_GRACE_S after
    a forwarded SIGINT / SIGTERM (blocked in C++, where the signal does not
    reach Python) is killed."""
    while True:
        try:
            return child.wait(timeout=STEP_S)
        except subprocess.TimeoutExpired:
            if interrupted and time.monotonic() - interrupted[0] > INTERRUPT_GRACE_S:
                child.kill()


def supervise(target: str, payload: dict, spec: ProcessSpec, prog: str) -> int:
    """Run ``target(payload)`` ("module:function", JSON payload) in a child
    Python and turn XLA's abort on a lost peer into a one-line error.

    stdout passes through (without gloo's per-rank connection lines); stderr
    passes through until XLA starts its fatal report, which goes to a log
    file instead. Returns the exit code for this process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "from k3jax.runtime.supervision import child_main; child_main()",
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
    interrupted: list[float] = []

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)
            interrupted.append(time.monotonic())

    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, forward)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        code = _wait(child, interrupted)
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
    if code < 0 and interrupted:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        print(f"{prog}: error: {where}: its worker was killed by signal {name}",
              file=sys.stderr, flush=True)
        return 128 - code
    return code
