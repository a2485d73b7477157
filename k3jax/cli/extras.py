"""Which optional extras (pyproject.toml's [project.optional-dependencies]) a
``k3jax`` sub-command needs beyond the core install: one table, read by the
CLI (a missing extra is a one-line usage error, exit 2) and by bin/k3jax,
which installs the extras a command line needs before running it:

    python -I k3jax/cli/extras.py SUB-COMMAND [FLAGS]   # prints them, comma-separated
    python -m k3jax.cli.extras SUB-COMMAND [FLAGS]     # the same, from an install

    sub-command                                 --backend   extras
    compile                                     any         gpu-compile
    compile                                     pallas      tokamax (the peer kernel)
    compile, run, bench, selfcheck, tune        triton      triton
    run, make-checkpoint, plan, latency, ...    otherwise   none (the core)

The torch extra serves no sub-command: the torch reference (k3jax.reference)
and the test suite use it. This file imports only the standard library, so
any Python 3.12 runs it as a script before anything is installed (``-I``:
without its own folder on sys.path).
"""

from __future__ import annotations

import importlib.metadata
import sys

ANY = "*"
EXTRAS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("compile", ANY, ("gpu-compile",)),
    ("compile", "pallas", ("tokamax",)),
    ("compile", "triton", ("triton",)),
    ("run", "triton", ("triton",)),
    ("bench", "triton", ("triton",)),
    ("selfcheck", "triton", ("triton",)),
    ("tune", "triton", ("triton",)),
)
"""(sub-command, --backend value or ANY, the extras it needs)."""

PROBES = {
    "gpu-compile": ("jax-cuda13-plugin", "nvidia-cuda-nvcc"),
    "triton": ("jax-triton", "triton"),
    "tokamax": ("tokamax",),
    "torch": ("torch",),
}
"""extra -> the distributions whose presence shows it is installed."""


def needed(command: str | None, backend: str | None = None) -> tuple[str, ...]:
    """The extras ``k3jax COMMAND --backend BACKEND`` needs, in table order."""
    out: list[str] = []
    for name, on, extras in EXTRAS:
        if name == command and on in (ANY, backend):
            out += [e for e in extras if e not in out]
    return tuple(out)


def installed(extra: str) -> bool:
    """Whether every distribution of ``extra`` (PROBES) is installed."""
    for dist in PROBES[extra]:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


def missing_message(command: str | None, backend: str | None = None) -> str | None:
    """One line naming the extras ``k3jax COMMAND`` (with ``--backend
    BACKEND``) needs and lacks, and how to install them; None when nothing
    is missing."""
    missing = [e for e in needed(command, backend) if not installed(e)]
    if not missing:
        return None
    what = f"k3jax {command} --backend {backend}" if set(missing) - set(needed(command)) \
        else f"k3jax {command}"
    extras = f"the {missing[0]} extra" if len(missing) == 1 else f"the extras {', '.join(missing)}"
    return (f"{what} needs {extras}, not installed: pip install 'k3jax[{','.join(missing)}]' "
            f"(bin/k3jax installs what a command needs)")


def parse_argv(argv: list[str]) -> tuple[str | None, str | None]:
    """(sub-command, --backend value) of a ``k3jax`` command line, read
    without its parser (``--backend X`` or ``--backend=X``; None where absent)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    backend = None
    for i, arg in enumerate(argv):
        if arg == "--backend" and i + 1 < len(argv):
            backend = argv[i + 1]
        elif arg.startswith("--backend="):
            backend = arg.split("=", 1)[1]
    return command, backend


def main(argv: list[str]) -> int:
    """Print the extras the ``k3jax`` command line ``argv`` needs,
    comma-separated (an empty line: the core only)."""
    print(",".join(needed(*parse_argv(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
