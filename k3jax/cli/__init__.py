"""The ``k3jax`` command: one sub-module per sub-command, each with
``add_parser(subparsers)`` and ``main(args) -> int``.

Usage errors exit 2 with a one-line message; runtime errors exit 1.
"""

from __future__ import annotations

import argparse
import sys

from k3jax.cli.platforms import default_jax_platforms, default_xla_flags

default_jax_platforms()   # before the sub-commands import jax
default_xla_flags()

from k3jax.cli import bench, compile, latency, load_bench, make_checkpoint, plan, run, selfcheck, tune  # noqa: E402

COMMANDS = (run, make_checkpoint, plan, bench, compile, latency, load_bench, selfcheck, tune)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k3jax", description="The Kimi K3 MoE block in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.main(args, parser.prog + " " + args.command)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
