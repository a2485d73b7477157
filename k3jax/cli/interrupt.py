"""Ctrl-C ends the ``k3jax`` process within a few seconds.

Python turns SIGINT into KeyboardInterrupt only when the main thread next
runs Python code; a thread blocked in C++ (XLA starting its devices,
compiling, a collective) may not get there for minutes. ``install`` adds a
watcher thread that hears every signal through ``signal.set_wakeup_fd``: if
the process is still running GRACE_S after a SIGINT, it prints
"interrupted" and exits with status 130 at once. A KeyboardInterrupt raised
inside a callback Python cannot raise from (XLA's garbage-collection hook)
is not printed: the watcher ends the process instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 3.0


_installed: list[bool] = []


def install(grace_s: float = GRACE_S) -> bool:
    """Start the watcher (module docstring), once per process; False where
    it cannot be installed (not the main thread)."""
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:
        os.close(read_end)
        os.close(write_end)
        return False

    def watch() -> None:
        while True:
            try:
                data = os.read(read_end, 64)
            except OSError:
                return
            if signal.SIGINT in data:
                time.sleep(grace_s)
                try:
                    print("interrupted", file=sys.stderr, flush=True)
                finally:
                    os._exit(130)

    threading.Thread(target=watch, name="k3jax-interrupt", daemon=True).start()
    previous_hook = sys.unraisablehook

    def unraisable(info) -> None:   # Ctrl-C inside a callback: the watcher ends the process
        if not isinstance(info.exc_value, KeyboardInterrupt):
            previous_hook(info)
    sys.unraisablehook = unraisable
    _installed.append(True)
    return True
