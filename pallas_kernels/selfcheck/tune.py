"""Tuning on request: time a few candidate tilings of one kernel
configuration on this device, check each against XLA, keep the fastest.

Candidates (Mosaic backends, dense weights): the committed table's pick for
the launch, the picks of the nearest other M buckets of the same (op, K, N,
groups, num_weights, dtype) and, for grouped ops, the row-major kernel: at
most MAX_CANDIDATES, the committed pick first (tile_choice.neighbours; the
table's own ranking lives in analysis/, which the runtime does not import).
MXFP4 weights and the Triton backend have one tiling here: nothing to tune.

Each candidate is checked (check.run_check with its own launcher,
launch.tiling_launcher) and, when
it passes, timed: the median of K3JAX_TUNE_REPEATS (default 20) runs after
one untimed run. The pick is the fastest that passed; ``install`` makes it
the launch's tiling in this process (tile_choice.set_tuned). In interpret
mode the times mean nothing, but the mechanism runs end to end.
"""

from __future__ import annotations

import json
import os

from pallas_kernels.backend import Family
from pallas_kernels.selfcheck.cache import CheckResult
from pallas_kernels.selfcheck.check import run_check
from pallas_kernels.selfcheck.config import (
    KernelConfig,
    describe_tiles,
    mxfp4_dtypes,
    positive_env,
    table_key,
)
from pallas_kernels.selfcheck.launch import committed_entry, tiling_launcher

TUNE_ENV = "K3JAX_AUTOTUNE"
REPEATS_ENV = "K3JAX_TUNE_REPEATS"
DEFAULT_REPEATS = 20
MAX_CANDIDATES = 3


def requested() -> bool:
    """K3JAX_AUTOTUNE=1."""
    return os.environ.get(TUNE_ENV, "0").strip() == "1"


def repeats() -> int:
    return positive_env(REPEATS_ENV, DEFAULT_REPEATS, int, "a positive integer")


def candidates(config: KernelConfig) -> list[dict]:
    """Table entries ({"kernel": ..., **fields}) to time (module docstring); [] when
    there is nothing to tune."""
    from pallas_kernels.grouped_matmul import tile_choice

    if (config.backend.family is not Family.MOSAIC or config.w_dtype in mxfp4_dtypes()
            or config.m == 0):
        return []
    op, m, k, n, groups, num_weights, dtype = table_key(config)
    found = tile_choice.neighbours(op, m, k, n, groups, num_weights, dtype, MAX_CANDIDATES + 1)
    if op == "grouped":
        found = [*found, None]   # the row-major kernel
    entries: list[dict] = [committed_entry(config)]
    for cfg in found:
        entry = tile_choice.entry_of(cfg, op)
        if entry not in entries:
            entries.append(entry)
    return entries[:MAX_CANDIDATES]


def label(entry: dict, op: str) -> str:
    from pallas_kernels.grouped_matmul import tile_choice
    return describe_tiles(entry["kernel"], tile_choice.row_config(entry))


def tune(config: KernelConfig, *, timeout_s: float, perturb: bool) -> CheckResult | None:
    """Check and time every candidate; the fastest passing one as the
    configuration's result (``tuned`` set, every candidate's time in
    ``timings_us``), the committed pick's failure when none passes, or None
    when there is nothing to tune."""
    entries = candidates(config)
    if not entries:
        return None
    table_op = table_key(config)[0]
    results = [(entry, run_check(config, timeout_s=timeout_s, perturb=perturb,
                                 launch=tiling_launcher(config, entry), repeats=repeats()))
               for entry in entries]
    passed = [(r.timings_us["median_us"], i) for i, (_, r) in enumerate(results) if r.ok]
    seconds = sum(r.seconds for _, r in results)
    timings = {label(e, table_op): r.timings_us["median_us"] for e, r in results if r.ok}
    if not passed:
        first = results[0][1]
        return CheckResult(first.verdict, first.max_rel_err, seconds, first.error,
                           timings_us=timings)
    _, best = min(passed)
    entry, result = results[best]
    return CheckResult("ok", result.max_rel_err, seconds, None, tuned=label(entry, table_op),
                       tuned_entry=entry, timings_us=timings)


def install(config: KernelConfig, result: CheckResult) -> None:
    """Make ``result``'s tuned pick this launch's tiling in this process."""
    from pallas_kernels.grouped_matmul import tile_choice

    if result.tuned_entry is not None and result.ok:
        tile_choice.set_tuned(*table_key(config), tile_choice.row_config(result.tuned_entry))


def export_text(picks: dict[tuple, dict], environment: dict[str, str]) -> str:
    """A JSON document in the committed tile table's format
    (pallas_kernels/data/tile_table.json: rows ``{"key": [op, M bucket, K,
    N, groups, num_weights, dtype], "entry": {"kernel": ..., **the config's
    fields}}``) holding ``picks`` (table_key -> tuned_entry), for review and
    merging into the committed table."""
    doc = {"generated_by": "k3jax tune --export",
           "description": ["Tuned tile picks, measured on: "
                           + ", ".join(f"{k} {v}" for k, v in sorted(environment.items()))],
           "key_fields": ["op", "m_bucket", "k", "n", "groups", "num_weights", "dtype"],
           "tiles": [{"key": list(key), "entry": picks[key]} for key in sorted(picks)]}
    return json.dumps(doc, indent=1) + "\n"
