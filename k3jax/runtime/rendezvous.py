"""Joining a multi-process run, with word of who is missing.

``jax.distributed.initialize`` blocks in C++ until every process has
registered, silently, and when one never comes XLA aborts the process with a
line that does not say which. So before it, the processes meet on the
coordinator's port over plain TCP (:func:`join`):

- process 0 listens on the coordinator's port (every address, as jax's
  coordination service does), and each other process connects, retrying
  until process 0 is up, and says who it is (``k3jax-join 1 ID P``);
- every REPORT_S seconds each process prints one line: process 0 the
  processes not yet joined and the address, the others what they wait for
  (the coordinator, or the processes process 0 still misses);
- when all P have joined, process 0 tells each to go on and closes the port,
  which jax's coordination service then takes over;
- at the deadline (K3JAX_INIT_TIMEOUT) each raises JoinError with one
  line: process 0 names the processes that never joined, the others that the
  coordinator could not be resolved, could not be reached (and why), or was
  lost; two processes with one id, or with different process counts, are
  named too.

Everything waits in short steps, so Ctrl-C ends it at once.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterable

MAGIC = "k3jax-join 1"
REPORT_S = 10.0
STEP_S = 0.25
HELLO_TIMEOUT_S = 5.0
TIMEOUT_ENV = "K3JAX_INIT_TIMEOUT"


class JoinError(RuntimeError):
    """The processes could not all join; the message is one line naming why."""


def format_ids(ids: Iterable[int], limit: int = 8) -> str:
    """Process ids as words, runs as ranges ("process 3", "processes 1,
    4-7"): at most ``limit`` runs, then the count of all."""
    ids = sorted(set(ids))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    if len(runs) > limit:
        parts.append(f"... ({len(ids)} in all)")
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(parts)


def _say(spec, text: str, out) -> None:
    print(f"{spec.tag} {text}", file=out, flush=True)


def _split(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port)


def join(spec, timeout_s: float, *, report_s: float = REPORT_S, out=None,
         clock: Callable[[], float] = time.monotonic) -> None:
    """Return once all ``spec.num_processes`` processes have joined at
    ``spec.coordinator``; JoinError (module docstring) otherwise. ``spec``:
    a k3jax.runtime.startup.ProcessSpec (coordinator, num_processes,
    process_id, is_leader, tag); waiting lines go to ``out`` (stderr)."""
    out = sys.stderr if out is None else out
    if spec.is_leader:
        _lead(spec, timeout_s, report_s, out, clock)
    else:
        _follow(spec, timeout_s, report_s, out, clock)


def _listen(spec) -> socket.socket:
    _, port = _split(spec.coordinator)
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as e:
        raise JoinError(f"process 0 of {spec.num_processes} cannot listen on port {port} "
                               f"for the run at {spec.coordinator}: {e.strerror or e} (another "
                               f"program holds the port? give --coordinator-address another "
                               f"port)") from None


def _hello(conn: socket.socket) -> tuple[int, int] | None:
    """(process id, process count) from a joining process, or None."""
    conn.settimeout(HELLO_TIMEOUT_S)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 256:
            piece = conn.recv(256)
            if not piece:
                return None
            data += piece
        words = data.decode("ascii").split()
        if " ".join(words[:2]) != MAGIC or len(words) != 4:
            return None
        return int(words[2]), int(words[3])
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass


def _lead(spec, timeout_s: float, report_s: float, out, clock) -> None:
    server = _listen(spec)
    lead = f"process 0 of {spec.num_processes}"
    joined: dict[int, socket.socket] = {}
    start = clock()
    next_report = start + report_s
    error = None
    try:
        server.settimeout(STEP_S)
        while len(joined) < spec.num_processes - 1:
            now = clock()
            missing = [p for p in range(1, spec.num_processes) if p not in joined]
            if now - start >= timeout_s:
                error = (f"{format_ids(missing)} never joined the run at {spec.coordinator} "
                         f"(waited {timeout_s:g} s; ${TIMEOUT_ENV} sets it)")
                raise JoinError(f"{lead}: {error}")
            if now >= next_report:
                next_report += report_s
                _say(spec, f"waiting for {format_ids(missing)} of {spec.num_processes} to join at "
                           f"{spec.coordinator} ({now - start:.0f} s of {timeout_s:g} s)", out)
                for conn in joined.values():
                    _send(conn, "wait " + ",".join(map(str, missing)))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            who = _hello(conn)
            if who is None:          # not a k3jax process: not ours to answer
                conn.close()
                continue
            pid, count = who
            if count != spec.num_processes:
                error = (f"process {pid} was started with --num-processes {count}, process 0 "
                         f"with {spec.num_processes}: start every process with the same count")
            elif not 0 < pid < spec.num_processes:
                error = (f"a process joined with --process-id {pid}, outside 1..{spec.num_processes - 1}")
            elif pid in joined:
                error = f"two processes were started with --process-id {pid}"
            if error:
                _send(conn, "error " + error)
                conn.close()
                raise JoinError(f"{lead}: {error}")
            conn.settimeout(STEP_S)
            joined[pid] = conn
        for conn in joined.values():
            _send(conn, "go")
        for conn in joined.values():   # each closes first: its end keeps the TIME_WAIT
            try:
                conn.settimeout(HELLO_TIMEOUT_S)
                conn.recv(16)
            except OSError:
                pass
    except BaseException:
        for conn in joined.values():
            _send(conn, "error " + (error or "process 0 stopped before every process joined"))
        raise
    finally:
        for conn in joined.values():
            conn.close()
        server.close()


def _connect(addresses, deadline: float, clock) -> tuple[socket.socket | None, str]:
    """A connection to one of ``addresses`` (getaddrinfo's), or (None, why not)."""
    why = "no address"
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(max(0.05, min(2.0, deadline - clock())))
        try:
            sock.connect(address)
            return sock, ""
        except OSError as e:
            why = e.strerror or type(e).__name__.lower()
            sock.close()
    return None, why


def _follow(spec, timeout_s: float, report_s: float, out, clock) -> None:
    host, port = _split(spec.coordinator)
    who = f"process {spec.process_id} of {spec.num_processes}"
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise JoinError(f"{who} cannot resolve the coordinator's host {host!r} in "
                               f"--coordinator-address {spec.coordinator}: "
                               f"{getattr(e, 'strerror', None) or e}") from None
    start = clock()
    deadline = start + timeout_s
    next_report = start + report_s
    sock, why = None, ""
    while sock is None:
        sock, why = _connect(addresses, deadline, clock)
        now = clock()
        if sock is not None:
            break
        if now >= deadline:
            raise JoinError(f"{who} could not reach the coordinator (process 0) at "
                                   f"{spec.coordinator} in {timeout_s:g} s: {why} (is process "
                                   f"0 running there, and the port open to this host?)")
        if now >= next_report:
            next_report += report_s
            _say(spec, f"waiting for the coordinator (process 0) at {spec.coordinator}: {why} "
                       f"({now - start:.0f} s of {timeout_s:g} s)", out)
        time.sleep(STEP_S)
    missing = "the other processes"
    with sock:
        _send(sock, f"{MAGIC} {spec.process_id} {spec.num_processes}")
        sock.settimeout(STEP_S)
        buffer = b""
        while True:
            now = clock()
            if now >= deadline:
                raise JoinError(f"{who} joined the run at {spec.coordinator}, but "
                                       f"{missing} never joined (waited {timeout_s:g} s; "
                                       f"${TIMEOUT_ENV} sets it)")
            if now >= next_report:
                next_report += report_s
                _say(spec, f"joined at {spec.coordinator}; waiting for {missing} "
                           f"({now - start:.0f} s of {timeout_s:g} s)", out)
            try:
                piece = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError as e:
                piece, why = b"", e.strerror or str(e)
            if not piece:
                raise JoinError(f"{who} lost the coordinator (process 0) at "
                                       f"{spec.coordinator} before every process joined"
                                       + (f": {why}" if why else ""))
            buffer += piece
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text == "go":
                    return
                if text.startswith("error "):
                    raise JoinError(f"{who}: {text[6:]}")
                if text.startswith("wait "):
                    ids = [int(i) for i in text[5:].split(",") if i.isdigit()]
                    missing = format_ids(ids) if ids else missing
