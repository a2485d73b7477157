"""Every Mosaic GPU kernel configuration compiles for the H200 (sm_90a) through
ptxas without a GPU, with 0 spill bytes: the configurations
benchmarks/gpu_kernels.py times (grouped sweep, jax's Mosaic ragged_dot peers,
MLP sweep), tokamax.ragged_dot at the headline shapes (5 configurations, 12-25 s
each on the loaded machine) and every distinct kernel of
benchmarks/gpu_kernel_checks.py (benchmarks/compile_table.py lists them). The ptxas is the nvidia-cuda-nvcc
wheel's (k3jax.aot.pin_wheel_ptxas).

A configuration that spills today is named in KNOWN_SPILLS with the reason
(BENCHMARKS.md, "Compiled for H200"). The test fails on a spill not in the
table and on an entry that no longer spills, so the table cannot go stale.
Each configuration compiles once per process: about 3 s each on an idle
2-core machine (4-5 minutes for the 83), 10-60 s each on the loaded shared
machine (the 83 took 50 minutes there on 2026-12-01).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "benchmarks"))

import compile_table  # noqa: E402

from k3jax.aot import PtxasReport, pin_wheel_ptxas  # noqa: E402

pytestmark = pytest.mark.compile

# Measured 2026-12-01 (benchmarks/compile_table.py --kernels; BENCHMARKS.md):
# every k3jax tile is spill-free; the only spills are jax's own kernel's.
_PEER = ("jax's ragged_dot_mgpu peer (not k3jax's kernel), block_m 128 at EP 8: 255 "
         "registers, 84 B + 84 B of spill")
KNOWN_SPILLS: dict[str, str] = {
    **{f"down ep=8 tokens={t} (peer: jax Mosaic)": _PEER for t in (1024, 4096, 16384)},
}

CONFIGS = {c.name: c for c in compile_table.kernel_configs()}


@functools.cache
def reports(name: str) -> tuple[PtxasReport, ...]:
    return tuple(compile_table.compile_kernel(CONFIGS[name]))


def test_the_configuration_list_is_the_benchmarks():
    """102 configurations: 36 grouped, 18 jax Mosaic peers, 15 MLP, 5 tokamax
    peers (issue 12), 28 check kernels (14 at commit 3233f01; issue 12 added
    the >= 1000-tile, 3-CTA and split-K cases, 4 forcing the decode kernel and
    6 the decode kernel in CTA clusters: 2 overhanging N, 1 with 192
    accumulator registers a thread)."""
    names = list(CONFIGS)
    assert len(names) == len(set(names))
    assert sum(n.startswith(("gate_up_situ", "down")) and "peer" not in n for n in names) == 36
    assert sum("(peer: jax Mosaic)" in n for n in names) == 18
    assert sum("(peer: tokamax)" in n for n in names) == 5
    assert sum(n.startswith("situ_mlp_up") and "peer" not in n for n in names) == 15
    assert sum(n.startswith("check ") for n in names) == 28
    assert set(KNOWN_SPILLS) <= set(CONFIGS), set(KNOWN_SPILLS) - set(CONFIGS)


def test_ptxas_is_the_wheels():
    assert "nvidia" in str(pin_wheel_ptxas())
    assert os.environ["PATH"].split(os.pathsep)[0] == str(pin_wheel_ptxas().parent)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiles_for_sm90a_without_spills(name):
    found = reports(name)
    assert found, f"{name}: no Mosaic GPU kernel was compiled"
    for r in found:
        assert 0 < r.registers <= 255, r
        assert 0 < r.smem_bytes <= 232_448, r          # the H200's opt-in SMEM per block
        assert r.grid and all(g >= 1 for g in r.grid), r
    spilled = [r for r in found if r.spill_bytes]
    if name in KNOWN_SPILLS:
        assert spilled, (f"{name} no longer spills: remove it from KNOWN_SPILLS "
                         f"({KNOWN_SPILLS[name]!r}) and from BENCHMARKS.md")
    else:
        assert not spilled, [(r.name, r.registers, r.spill_store_bytes, r.spill_load_bytes,
                              r.warnings) for r in spilled]
