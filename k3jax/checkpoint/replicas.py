"""Redundant expert slots in the loader: each logical expert's region is
read from disk once per process, whatever number of slots hold it.

A device block of a routed-expert parameter with redundant slots
(ParamDecl.slots) holds some slots; CheckpointSource reads one logical
expert a job and ``ReplicaCache.fill_slots`` writes its region into the
first of that expert's slots in the block and copies it into the others.
An expert with slots in other blocks too keeps its region here (a host copy
as read: stored orientation, padding entries zero) until as many slots have
taken it as it has in all, or the source closes, so the blocks of this
process's other devices copy it instead of reading it again. The copies
held at once are at most the regions of the experts with several slots
(R at most), one region each: a whole expert's, or a slab's.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import numpy as np

from k3jax.formats.decl import ParamDecl


class _Region:
    """One region of a logical expert, read once, kept for its other slots."""

    def __init__(self):
        self.lock = threading.Lock()
        self.value: np.ndarray | None = None
        self.taken = 0


class ReplicaCache:
    """The regions of logical experts whose slots span several blocks
    (module docstring); thread-safe (the loader's workers fill in parallel)."""

    def __init__(self):
        self._regions: dict[tuple, _Region] = {}
        self._lock = threading.Lock()

    def jobs(self, decl: ParamDecl, slots: range, out: np.ndarray, keep: tuple, check,
             fill_of: Callable[[int], Callable[..., None]]) -> list[Callable[[], None]]:
        """One job per logical expert of the block ``out`` holding ``decl``'s
        slots ``slots`` (the block's axis 0): ``fill_slots`` with
        ``fill_of(expert)``, a ``functools.partial(CheckpointSource._fill,
        name, codec, index)`` for that expert's tensor."""
        slots_of: dict[int, list[int]] = {}
        for j, s in enumerate(slots):
            slots_of.setdefault(s if decl.slots is None else decl.slots[s], []).append(j)
        return [functools.partial(self.fill_slots, fill_of(e), [out[j] for j in js], keep, check,
                                  decl, e) for e, js in slots_of.items()]

    def fill_slots(self, fill: Callable[..., None], dests: list[np.ndarray], keep: tuple,
                   check, decl: ParamDecl, expert: int) -> None:
        """Fill logical ``expert``'s region into each of ``dests`` (its slots
        in this block, in ``decl``'s stored orientation) at ``keep``:
        ``fill(dest, keep, workers, check)`` reads it into the first (or the
        region kept from an earlier block is copied there), the rest copy it."""
        total = 1 if decl.slots is None else decl.slots.count(expert)
        first = dests[0]
        if total > len(dests):
            self._fill_kept(fill, first, keep, check, total, len(dests))
        else:
            fill(first, keep, None, check)
        for dest in dests[1:]:
            dest[keep] = first[keep]

    def _fill_kept(self, fill, dest, keep, check, total: int, taking: int) -> None:
        name, _, index = fill.args   # functools.partial(CheckpointSource._fill, name, codec, index)
        key = (name, tuple((s.start, s.stop) for s in index))
        with self._lock:
            region = self._regions.setdefault(key, _Region())
        with region.lock:
            if region.value is None:
                fill(dest, keep, None, check)
                region.value = np.array(dest[keep])
            else:
                dest[keep] = region.value
            region.taken += taking
            if region.taken >= total:
                with self._lock:
                    self._regions.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._regions.clear()


__all__ = ["ReplicaCache"]
