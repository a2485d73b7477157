"""``k3jax tune``: for every kernel launch of one layer, time the candidate
tilings on this device, check each against XLA and cache the fastest
(pallas_kernels.selfcheck.tune); ``--export`` writes the picks in the
committed tile table's format."""

from __future__ import annotations

import argparse

from k3jax.cli.common import check_output, report_errors
from k3jax.cli.selfcheck import add_flags, layer_checks, print_checks


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="time candidate tilings of a layer's kernels, keep the fastest",
                       description="Time the candidate tilings of every kernel launch of one "
                                   "layer on this device, check each against XLA, and cache the "
                                   "fastest: later runs on this machine use it. Timings in "
                                   "interpret mode mean nothing.")
    add_flags(p)
    p.add_argument("--export", metavar="TILES.json",
                   help="write the tuned picks in the format of "
                        "pallas_kernels/data/tile_table.json")
    p.set_defaults(main=main)


def main(args: argparse.Namespace, prog: str) -> int:
    return report_errors(lambda: _tune(args), prog)


def _tune(args: argparse.Namespace) -> int:
    check_output(args.export, "--export")
    records = layer_checks(args, tune=True)
    code = print_checks(args, records)
    if args.export:
        export(args.export, records)
    return code


def export(path: str, records) -> int:
    """Write the tuned picks of ``records`` to ``path``; how many."""
    from k3jax.files import atomic_write
    from pallas_kernels.selfcheck import tune
    from pallas_kernels.selfcheck.config import environment

    picks = {tune.table_key(r.config): r.result.tuned_entry for r in records
             if r.result is not None and r.result.ok and r.result.tuned_entry is not None}
    atomic_write(path, lambda f: f.write(tune.export_text(picks, environment())), mode="w")
    return len(picks)
