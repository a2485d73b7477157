"""The ``auto`` shared-expert form: a pure lookup in the committed table, the
data file k3jax/data/shared_overlap_table.json (written by ``python -m
scripts.write_overlap_table`` from the whole-layer latency model), read
once, on the first lookup.

``pick(tp, dp, tokens)`` -> (form, scatter dtype) for the MoE layer's shared
expert, ``pick(..., layer="dense")`` for the dense layer's MLP:

    form           "none" | "ring" | "weights" (SharedOverlap's values)
    scatter dtype  "float32" | "bfloat16": the reduce-scatter's dtype of the
                   token-side forms (none, ring); "float32" for weights,
                   which has no scatter

``tokens`` is the layer's static global token count. A (tp, dp) the table
does not hold (more GPUs than one node, tp 1, a tp the table skips) gets
FALLBACK, the sharded form k3jax used before ``auto``.
"""

from __future__ import annotations

import bisect
import functools
import importlib.resources
import json

FALLBACK = ("ring", "float32")
LAYERS = ("moe", "dense")
TABLE_FILE = "shared_overlap_table.json"
"""The committed table's file name in k3jax's data folder."""


def table_file():
    """The committed table's file (an importlib.resources Traversable): the
    package's data/shared_overlap_table.json, in a checkout or an installed wheel."""
    return importlib.resources.files("k3jax") / "data" / TABLE_FILE


@functools.cache
def table() -> dict[tuple[str, int, int], tuple[tuple[int, str, str], ...]]:
    """The committed table: (layer, tp, dp) -> ((first token count, form,
    scatter dtype), ...)."""
    doc = json.loads(table_file().read_text(encoding="utf-8"))
    return {(row["layer"], row["tp"], row["dp"]): tuple(tuple(pick) for pick in row["picks"])
            for row in doc["table"]}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"shared_overlap_choice.pick: {name} must be an integer >= 1, got {value!r}")


def pick(tp: int, dp: int, tokens: int, *, layer: str = "moe") -> tuple[str, str]:
    """(form, scatter dtype) for ``tokens`` global tokens, SP over dp x tp
    (module docstring). ValueError on tp, dp or tokens below 1 or an unknown layer."""
    for name, value in (("tp", tp), ("dp", dp), ("tokens", tokens)):
        _positive(name, value)
    if layer not in LAYERS:
        raise ValueError(f"shared_overlap_choice.pick: layer must be one of {LAYERS}, got {layer!r}")
    entries = table().get((layer, tp, dp))
    if entries is None:
        return FALLBACK
    firsts = [first for first, _, _ in entries]
    _, form, scatter = entries[max(bisect.bisect_right(firsts, tokens) - 1, 0)]
    return form, scatter


def first_tokens(tp: int, dp: int, *, layer: str = "moe") -> tuple[int, ...]:
    """The token counts at which the pick for (tp, dp) changes (its entries'
    first token counts; (1,) for a layout the table does not hold): ``pick``
    at each of them gives every form the table can choose there."""
    entries = table().get((layer, tp, dp))
    return (1,) if entries is None else tuple(first for first, _, _ in entries)


def tabulated() -> tuple[tuple[int, int], ...]:
    """The (tp, dp) layouts the table holds (the rest get FALLBACK)."""
    return tuple(sorted({(tp, dp) for _, tp, dp in table()}))


__all__ = ["FALLBACK", "LAYERS", "TABLE_FILE", "first_tokens", "pick", "table", "table_file", "tabulated"]
