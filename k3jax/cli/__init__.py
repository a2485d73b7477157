"""The ``k3jax`` command: one sub-module per sub-command, each with
``add_parser(subparsers)`` and ``main(args) -> int``, imported by
``build_parser`` (so that ``entry`` decides the process's environment before
anything imports jax).

Usage errors exit 2 with a one-line message; runtime errors exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from k3jax.cli.platforms import default_jax_platforms, default_xla_flags, huge_page_environ

default_jax_platforms()   # before the sub-commands import jax
default_xla_flags()

COMMANDS = ("run", "make_checkpoint", "plan", "bench", "compile", "latency", "load_bench",
            "selfcheck", "tune")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.main(args, parser.prog + " " + args.command)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``k3jax`` process (the console script and ``python -m k3jax``):
    first re-executed once with huge pages for malloc where
    ``huge_page_environ`` says so (before any buffer is allocated), then
    ``main()``."""
    environ = huge_page_environ()
    if environ is not None:
        try:
            os.execve(sys.executable, sys.orig_argv, environ)
        except OSError as e:   # run on, with 4 KiB pages
            print(f"k3jax: could not re-execute with {environ['GLIBC_TUNABLES']} ({e}); "
                  "continuing without huge pages", file=sys.stderr)
    sys.exit(main())


if __name__ == "__main__":
    entry()
