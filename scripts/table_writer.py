"""What the committed tables' writers (write_dispatch_table, write_overlap_table,
write_tile_table) share: the data folders the JSON tables live in, the token
grid of the two latency tables, the JSON layout (one row a line), writing a
file whole or not at all, and the command line (``--out``, checked before any
work)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from k3jax.files import atomic_write

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K3JAX_DATA = os.path.join(REPO, "k3jax", "data")
"""k3jax's data folder: the EP dispatch and shared-overlap tables."""
PALLAS_KERNELS_DATA = os.path.join(REPO, "pallas_kernels", "data")
"""pallas_kernels' data folder: the tile table."""

TOKEN_GRID = tuple(2 ** i for i in range(15))          # 1 .. 16384
"""The token counts the latency tables are computed at: the pick at 2^i holds
for 2^i <= tokens < 2^(i + 1) (the last for every larger count)."""


def render_json(doc: dict, one_item_a_line: tuple[str, ...]) -> str:
    """``doc`` (an object of JSON values) as JSON text: one field a line, and
    the list fields named in ``one_item_a_line`` (the rows, the header's
    lines) one item a line, so that a changed pick is a one-line diff."""
    fields = []
    for name, value in doc.items():
        if name in one_item_a_line and value:
            items = ",\n".join(f"    {json.dumps(item)}" for item in value)
            fields.append(f"  {json.dumps(name)}: [\n{items}\n  ]")
        else:
            fields.append(f"  {json.dumps(name)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def write_source(path: str, source: str) -> None:
    """``source`` into ``path`` through a temporary file renamed over it:
    an interrupted run leaves the committed table as it was."""
    atomic_write(path, lambda f: f.write(source), mode="w")


def write_timed(path: str, make_source: Callable[[], str], log=print) -> str:
    """``make_source()`` (the model's sweep and its rendering) written to
    ``path`` by write_source; logs the seconds it took. Returns the text."""
    t0 = time.perf_counter()
    source = make_source()
    write_source(path, source)
    log(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return source


def main(write: Callable[[str], object], description: str, default: str, argv=None) -> int:
    """``--out PATH`` (default ``default``; its folder must exist, else a
    usage error, exit 2), then ``write(PATH)``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=default, help="where to write (default: the committed table)")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: the folder does not exist")
    write(args.out)
    return 0
