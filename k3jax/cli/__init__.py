"""The ``k3jax`` command: one sub-module per sub-command, each with
``add_parser(subparsers)`` and ``main(args) -> int``, imported by
``build_parser`` (so that ``entry`` decides the process's environment before
anything imports jax).

Exit status, with a one-line message on stderr for each error: 2 for usage
(flags, their values and combinations, a layout the model cannot be split
over, an output path that cannot be written, more than the machine can
simulate, environment variables), 1 for bad data (input files, config files,
checkpoints, peer processes) and for work that fails; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from k3jax.cli import interrupt
from k3jax.cli.platforms import default_jax_platforms, default_xla_flags, huge_page_environ

default_jax_platforms()   # before the sub-commands import jax
default_xla_flags()

COMMANDS = ("run", "make_checkpoint", "plan", "bench", "compile", "latency", "balance",
            "load_bench", "selfcheck", "tune")
"""The sub-command modules of k3jax.cli, in the order --help lists them."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3jax", description="The Kimi K3 MoE block in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"k3jax.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, check the environment variables, run the sub-command.
    Exit status: 0, 1 (bad data: files, checkpoints, peers; or a failure of
    the work), 2 (usage: flags, environment variables; argparse's errors
    raise SystemExit(2)), 130 (interrupted)."""
    try:
        from k3jax.cli.common import UsageError
        from k3jax.cli.environment import check_environment

        parser = build_parser()
        args = parser.parse_args(argv)
        prog = args.prog = parser.prog + " " + args.command
        try:
            check_environment()
        except UsageError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        from k3jax.cli.extras import missing_message
        if missing := missing_message(args.command, getattr(args, "backend", None)):
            print(f"{prog}: error: {missing}", file=sys.stderr)   # an optional extra: exit 2
            return 2
        return args.main(args, prog)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``k3jax`` process (the console script and ``python -m k3jax``):
    first re-executed once with huge pages for malloc where
    ``huge_page_environ`` says so (before any buffer is allocated), then
    ``main()``, with Ctrl-C ending it within seconds (k3jax.cli.interrupt)."""
    environ = huge_page_environ()
    if environ is not None:
        try:
            os.execve(sys.executable, sys.orig_argv, environ)
        except OSError as e:   # run on, with 4 KiB pages
            print(f"k3jax: could not re-execute with {environ['GLIBC_TUNABLES']} ({e}); "
                  "continuing without huge pages", file=sys.stderr)
    interrupt.install()
    sys.exit(main())


if __name__ == "__main__":
    entry()
