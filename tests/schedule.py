"""The order in which bin/test hands files to its xdist workers: the costliest
first, by the seconds each test took in a measured full run.

``--dist loadscope`` gives a worker one file (a scope) at a time, in the order
of the collected items when ``--no-loadscope-reorder`` is given (bin/test
gives it; xdist's own reordering sorts by the number of tests, not their
time). Ordering the files longest first (the longest-processing-time rule)
keeps both of the 2-core machine's workers busy to the end, instead of one
worker starting a 15-minute file when the other has nothing left.

tests/test_seconds.json holds {test node id: seconds} for the tests that took
at least MIN_SECONDS (setup + call + teardown) in a full run: written by

    bin/test --all -q --durations=0 -p no:cacheprovider > run.log
    python tests/schedule.py run.log           # rewrites tests/test_seconds.json

A test it does not name counts UNLISTED_SECONDS. A stale table only costs
balance, never a test: every collected item still runs.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parent / "test_seconds.json"
MIN_SECONDS = 1.0
"""Tests under this (setup + call + teardown) are left out of the table."""
UNLISTED_SECONDS = 0.1
"""The cost of a test the table does not name."""

_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def scope_of(nodeid: str) -> str:
    """xdist loadscope's work unit: the node id up to its last ``::``."""
    return nodeid.rsplit("::", 1)[0]


def load_table(path: Path = TABLE) -> dict[str, float]:
    """{node id: seconds}; {} when the table is missing."""
    return json.loads(path.read_text()) if path.exists() else {}


def costliest_scopes_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """Indices into ``nodeids`` that put their scopes in order of total
    seconds, largest first (ties: first collected first), keeping each
    scope's items together and in their collected order."""
    by_scope: dict[str, list[int]] = defaultdict(list)
    for i, nodeid in enumerate(nodeids):
        by_scope[scope_of(nodeid)].append(i)
    cost = {s: sum(seconds.get(nodeids[i], UNLISTED_SECONDS) for i in idx)
            for s, idx in by_scope.items()}
    first = {s: idx[0] for s, idx in by_scope.items()}
    order = sorted(by_scope, key=lambda s: (-cost[s], first[s]))
    return [i for s in order for i in by_scope[s]]


class CostliestFirst:
    """The pytest plugin (tests/conftest.py registers it): after -m has
    deselected, the items in costliest_scopes_first's order. Every worker
    collects the same order, as xdist requires."""

    def __init__(self):
        self.seconds = load_table()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        order = costliest_scopes_first([item.nodeid for item in items], self.seconds)
        items[:] = [items[i] for i in order]


def parse_durations(text: str) -> dict[str, float]:
    """{node id: setup + call + teardown seconds} from pytest's
    ``--durations=0`` report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if m := _DURATION.match(line):
            seconds[m.group(3)] += float(m.group(1))
    return dict(seconds)


def write_table(seconds: dict[str, float], path: Path = TABLE) -> int:
    """Write the tests of at least MIN_SECONDS, rounded to 0.1 s, sorted by
    node id; returns how many."""
    kept = {k: round(v, 1) for k, v in sorted(seconds.items()) if v >= MIN_SECONDS}
    path.write_text(json.dumps(kept, indent=0) + "\n")
    return len(kept)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/schedule.py DURATIONS_LOG  (pytest --durations=0 output)",
              file=sys.stderr)
        return 2
    try:
        seconds = parse_durations(Path(argv[0]).read_text())
    except OSError as e:
        print(f"schedule: cannot read {argv[0]}: {e.strerror}", file=sys.stderr)
        return 2
    if not seconds:
        print(f"schedule: {argv[0]} has no --durations=0 report", file=sys.stderr)
        return 2
    n = write_table(seconds)
    print(f"{TABLE}: {n} tests of >= {MIN_SECONDS} s, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
