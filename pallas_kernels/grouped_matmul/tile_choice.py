"""The launchers' tile choice: a lookup in the committed table, the data file
pallas_kernels/data/tile_table.json (written by ``python -m
scripts.write_tile_table``), read once, on the first lookup.

Key: (op, M bucket, K, N, groups, num_weights, dtype name), op "grouped"
(grouped_matmul: num_weights 1; grouped_situ_glu: 2) or "mlp" (situ_mlp_up:
one group, two weights). A launch of M rows takes the table's row with the
smallest M >= M among the rows of its (op, K, N, groups, num_weights, dtype);
a launch past the largest, or of a shape the table lacks, gets the kernels'
static default tiling (None here: mosaic_sm90's default_config).

Grouped rows hold a swap-AB tiling (mosaic_sm90_swap_ab.SwapABConfig) or the
row-major kernel (None); MLP rows a mosaic_sm90.TileConfig.
"""

from __future__ import annotations

import bisect
import functools
import importlib.resources
import json

from pallas_kernels.grouped_matmul import mosaic_sm90, mosaic_sm90_swap_ab

ROW_MAJOR = "row_major"   # a grouped row's "kernel": mosaic_sm90's default tiles
SWAP_AB = "swap_ab"       # a grouped row's "kernel": mosaic_sm90_swap_ab with the row's fields
MLP = "mlp"               # an MLP row's "kernel": mosaic_sm90 with the row's TileConfig fields
TABLE_FILE = "tile_table.json"
"""The committed table's file name in pallas_kernels' data folder."""


def table_file():
    """The committed table's file (an importlib.resources Traversable): the
    package's data/tile_table.json, in a checkout or an installed wheel."""
    return importlib.resources.files("pallas_kernels") / "data" / TABLE_FILE


@functools.cache
def tiles() -> dict[tuple, dict]:
    """The committed table, {key: entry} in the file's order: key (op, M
    bucket, K, N, groups, num_weights, dtype name), entry {"kernel": ...,
    **config fields} (row_config reads it)."""
    doc = json.loads(table_file().read_text(encoding="utf-8"))
    return {tuple(row["key"]): row["entry"] for row in doc["tiles"]}


def row_config(entry: dict) -> mosaic_sm90_swap_ab.SwapABConfig | mosaic_sm90.TileConfig | None:
    """The config of one table entry ({"kernel": ..., **config fields})."""
    fields = {key: value for key, value in entry.items() if key != "kernel"}
    kind = entry["kernel"]
    if kind == ROW_MAJOR:
        if fields:
            raise ValueError(f"tile table: a row_major entry takes no fields, got {entry!r}")
        return None
    if kind == SWAP_AB:
        return mosaic_sm90_swap_ab.SwapABConfig(**fields)
    if kind == MLP:
        return mosaic_sm90.TileConfig(**fields)
    raise ValueError(f"tile table: unknown kernel {kind!r} in {entry!r}")


@functools.cache
def _index() -> dict[tuple, tuple[list[int], list]]:
    """(op, K, N, groups, num_weights, dtype) -> (sorted M buckets, their configs)."""
    by_shape: dict[tuple, list[tuple[int, object]]] = {}
    for (op, m, k, n, groups, num_weights, dtype), entry in tiles().items():
        by_shape.setdefault((op, k, n, groups, num_weights, dtype), []).append((m, row_config(entry)))
    return {shape: ([m for m, _ in sorted(rows, key=lambda r: r[0])],
                    [cfg for _, cfg in sorted(rows, key=lambda r: r[0])])
            for shape, rows in by_shape.items()}


_TUNED: dict[tuple, object] = {}


def set_tuned(op: str, m: int, k: int, n: int, groups: int, num_weights: int, dtype: str,
              config: object) -> None:
    """Make ``config`` (a row_config result) the pick for launches of exactly
    this shape in this process, ahead of the committed table: a tuned pick
    measured on this machine (pallas_kernels.selfcheck.tune)."""
    _TUNED[(op, m, k, n, groups, num_weights, dtype)] = config


def clear_tuned() -> None:
    _TUNED.clear()


def lookup(op: str, m: int, k: int, n: int, groups: int, num_weights: int,
           dtype: str, *, tuned: bool = True) -> tuple[bool, object]:
    """(found, config): the table's config for an M-row launch (module
    docstring), or with ``tuned`` a tuned pick for this exact shape (set_tuned)."""
    if tuned and (op, m, k, n, groups, num_weights, dtype) in _TUNED:
        return True, _TUNED[(op, m, k, n, groups, num_weights, dtype)]
    rows = _index().get((op, k, n, groups, num_weights, dtype))
    if rows is None:
        return False, None
    buckets, configs = rows
    i = bisect.bisect_left(buckets, m)
    if i == len(buckets):
        return False, None
    return True, configs[i]


def grouped_config(m: int, k: int, n: int, num_groups: int, num_weights: int,
                   dtype: str, *, tuned: bool = True) -> mosaic_sm90_swap_ab.SwapABConfig | None:
    """The grouped launch's swap-AB tiling, or None for mosaic_sm90's
    row-major default tiles (also for shapes the table lacks)."""
    return lookup("grouped", m, k, n, num_groups, num_weights, dtype, tuned=tuned)[1]


def mlp_config(tokens: int, d: int, f: int, dtype: str, *,
               tuned: bool = True) -> mosaic_sm90.TileConfig | None:
    """situ_mlp_up's tiles, or None (mosaic_sm90's default) for shapes the table lacks."""
    return lookup("mlp", tokens, d, f, 1, 2, dtype, tuned=tuned)[1]


def neighbours(op: str, m: int, k: int, n: int, groups: int, num_weights: int,
               dtype: str, count: int) -> list[object]:
    """The committed configs of the ``count`` M buckets nearest to ``m``
    among the rows of this (op, K, N, groups, num_weights, dtype), nearest
    first (the launch's own bucket among them): tuning candidates."""
    rows = _index().get((op, k, n, groups, num_weights, dtype))
    if rows is None:
        return []
    buckets, configs = rows
    order = sorted(range(len(buckets)), key=lambda i: (abs(buckets[i] - m), buckets[i] < m))
    return [configs[i] for i in order[:count]]


def entry_of(config: object, op: str) -> dict:
    """The table entry ({"kernel": ..., **fields}) of a row_config result."""
    import dataclasses

    if config is None:
        return {"kernel": ROW_MAJOR}
    kind = MLP if op == "mlp" else SWAP_AB
    return {"kernel": kind, **dataclasses.asdict(config)}


__all__ = ["MLP", "ROW_MAJOR", "SWAP_AB", "TABLE_FILE", "clear_tuned", "entry_of", "grouped_config",
           "lookup", "mlp_config", "neighbours", "row_config", "set_tuned", "table_file", "tiles"]
