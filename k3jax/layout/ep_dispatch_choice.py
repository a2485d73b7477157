"""The ``auto`` way of moving routed rows under expert parallelism
(EpDispatch.AUTO): a pure lookup in the committed table, the data file
k3jax/data/ep_dispatch_table.json (written by ``python -m
scripts.write_dispatch_table`` from the dispatch latency model, a model's
prediction), read once, on the first lookup.

``pick(ep, nodes, tokens)`` -> one of FORMS (EpDispatch's values):

    "gather"        one all-gather of the rows over every EP device
    "hierarchical"  the same gather over NODE first, then inside the node
    "all-to-all"    dropless ragged all-to-all, between nodes then inside

``tokens`` is the layer's static global token count; ``ep`` the EP size
(dp x tp), ``nodes`` how many nodes it spans. An (ep, nodes) the table does
not hold gets ``fallback(nodes)``: FALLBACK_MULTI_NODE ("hierarchical",
each row crossing the inter-node link once per node) over several nodes,
FALLBACK_ONE_NODE ("gather") on one. The caller (Layout.for_tokens) still
replaces a form its layout cannot run.
"""

from __future__ import annotations

import bisect
import functools
import importlib.resources
import json

FORMS = ("gather", "hierarchical", "all-to-all")
FALLBACK_ONE_NODE = "gather"
FALLBACK_MULTI_NODE = "hierarchical"
TABLE_FILE = "ep_dispatch_table.json"
"""The committed table's file name in k3jax's data folder."""


def table_file():
    """The committed table's file (an importlib.resources Traversable): the
    package's data/ep_dispatch_table.json, in a checkout or an installed wheel."""
    return importlib.resources.files("k3jax") / "data" / TABLE_FILE


@functools.cache
def table() -> dict[tuple[int, int], tuple[tuple[int, str], ...]]:
    """The committed table: (ep, nodes) -> ((first token count, form), ...)."""
    doc = json.loads(table_file().read_text(encoding="utf-8"))
    return {(row["ep"], row["nodes"]): tuple((first, form) for first, form in row["picks"])
            for row in doc["table"]}


def _check(ep: int, nodes: int, tokens: int | None = None) -> None:
    values = (("ep", ep), ("nodes", nodes)) + ((("tokens", tokens),) if tokens is not None else ())
    for name, value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"ep_dispatch_choice: {name} must be an integer >= 1, got {value!r}")
    if ep % nodes:
        raise ValueError(f"ep_dispatch_choice: nodes {nodes} must divide ep {ep} (each node holds "
                         f"the same number of EP devices)")


def fallback(nodes: int) -> str:
    """The form for an (ep, nodes) the table does not hold."""
    return FALLBACK_MULTI_NODE if nodes > 1 else FALLBACK_ONE_NODE


def pick(ep: int, nodes: int, tokens: int) -> str:
    """The form for ``tokens`` global tokens, EP over ``ep`` devices on
    ``nodes`` nodes (module docstring). ValueError on a value below 1 or
    ``nodes`` not dividing ``ep``."""
    _check(ep, nodes, tokens)
    entries = table().get((ep, nodes))
    if entries is None:
        return fallback(nodes)
    firsts = [first for first, _ in entries]
    return entries[max(bisect.bisect_right(firsts, tokens) - 1, 0)][1]


def first_tokens(ep: int, nodes: int) -> tuple[int, ...]:
    """The token counts at which the pick for (ep, nodes) changes (its
    entries' first token counts; (1,) for a layout the table does not hold):
    ``pick`` at each of them gives every form the table can choose there."""
    _check(ep, nodes)
    entries = table().get((ep, nodes))
    return (1,) if entries is None else tuple(first for first, _ in entries)


def tabulated() -> tuple[tuple[int, int], ...]:
    """The (ep, nodes) layouts the table holds (the rest get ``fallback``)."""
    return tuple(sorted(table()))


__all__ = ["FALLBACK_MULTI_NODE", "FALLBACK_ONE_NODE", "FORMS", "TABLE_FILE", "fallback",
           "first_tokens", "pick", "table", "table_file", "tabulated"]
