"""sm_90a compile check of the backward kernels (no GPU: k3jax/tools/aot.py compiles
for a compile-only H200 through ptxas): the tgmm kernel
(pallas_kernels/grouped_matmul/mosaic_sm90_tgmm.py) in its two tile configs
(bf16: 4 stages; float32 bf16x3: 2 stages) at K3 expert shapes uses no more
than 255 registers and spills 0 bytes.

The other backward kernels are the forward grouped kernels (recompute, and dx
on the transposed weights): their configs are the forward's, checked with the
forward. ``python tests/kernels/test_kernels_vjp_compile.py`` prints the ptxas
table of every kernel in jax.grad of each op at K3 shapes (decode and prefill,
bf16), forward kernels included (~45 s per op and regime on 2 cores).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_cache import kernel_reports

from benchmarks import compile_table
from k3jax.layout import ParallelConfig
from k3jax.tools.aot import h200_mesh, ptxas_dump
from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_mlp_up

pytestmark = pytest.mark.compile

SITU = {"beta": 4.0, "linear_beta": 25.0}
# K3 at EP 8: 112 local experts, latent 3584, intermediate 3072; decode: M / G < 128.
DECODE, PREFILL = (300, 112), (4096, 28)
LATENT, INTER, HIDDEN, DENSE_INTER = 3584, 3072, 7168, 6144


def _spec(mesh, shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def compile_reports(fn, *shapes_dtypes):
    """ptxas reports of every Mosaic kernel in jit(fn) compiled for one H200."""
    mesh = h200_mesh(ParallelConfig())
    with ptxas_dump() as reports:
        jax.jit(fn).lower(*(_spec(mesh, *sd) for sd in shapes_dtypes)).compile()
        return reports()


@pytest.mark.parametrize("dtype,m,g", [(jnp.bfloat16, *DECODE), (jnp.float32, *PREFILL)],
                         ids=["bf16-decode", "f32-prefill"])
def test_tgmm_compiles_for_sm90a_without_spills(dtype, m, g):
    """benchmarks/compile_table.py's tgmm configuration of these shapes, compiled
    once per test run (tests/compile_cache.py)."""
    (config,) = [c for c in compile_table.kernel_configs() if c.name.startswith("tgmm ")
                 and [s.shape for s in c.arg_specs] == [(m, LATENT), (m, INTER), (g,)]
                 and c.arg_specs[0].dtype == dtype]
    reports = kernel_reports(config.name)
    assert len(reports) == 1, reports
    (report,) = reports
    assert report.spill_bytes == 0 and report.registers <= 255, report
    assert not report.warnings, report.warnings


def _grad(fn, num_args):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), tuple(range(num_args)))


def ptxas_table() -> list[tuple[str, str, int, int]]:
    """(op, regime, registers, spill bytes) of every kernel in jax.grad at K3 shapes, bf16."""
    rows = []
    for regime, (m, g) in (("decode", DECODE), ("prefill", PREFILL)):
        cases = {
            "grouped_situ_glu": (_grad(lambda x, a, b, s: grouped_situ_glu(
                x, a, b, s, backend="pallas", **SITU), 3),
                [((m, LATENT),), ((g, LATENT, INTER),), ((g, LATENT, INTER),),
                 ((g,), jnp.int32)]),
            "grouped_matmul": (_grad(lambda x, w, s: grouped_matmul(x, w, s, backend="pallas"), 2),
                               [((m, INTER),), ((g, INTER, LATENT),), ((g,), jnp.int32)]),
            "situ_mlp_up": (_grad(lambda x, a, b: situ_mlp_up(x, a, b, backend="pallas", **SITU),
                                  3),
                            [((m, HIDDEN),), ((HIDDEN, DENSE_INTER),), ((HIDDEN, DENSE_INTER),)]),
        }
        for op, (fn, args) in cases.items():
            for report in compile_reports(fn, *args):
                rows.append((op, regime, report.registers, report.spill_bytes))
    return rows


if __name__ == "__main__":
    for row in ptxas_table():
        print("%-17s %-8s registers %3d  spill bytes %d" % row)
