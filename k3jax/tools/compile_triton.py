"""The Triton kernels of one layer, compiled without a GPU for a chosen
compute capability: registers, spill bytes and shared memory per launch.

The layer's forward is traced on an abstract mesh with backend "triton" while
pallas_kernels.selfcheck.gate collects its launches (per-device shapes, no
check run); each launch is planned as the dispatch plans it
(triton_sm80.plan) and compiled through Triton's pipeline and the wheel's
ptxas (k3jax.tools.triton_compile.compile_cubin).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.layout import ParallelConfig, abstract_mesh
from k3jax.tools.compile import layer_on_mesh

if TYPE_CHECKING:   # triton is imported only where a kernel is compiled
    from k3jax.tools.triton_compile import CubinReport

CAPABILITIES = (80, 89, 90, 100)


def tiles_text(tiles) -> str:
    """A TritonTiles as the report prints it: block m x n x k, warps, stages."""
    return (f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}, {tiles.num_warps} warps, "
            f"{tiles.num_stages} stages")


def kernel_json(r: CubinReport) -> dict:
    """One launch's triton_compile.CubinReport as JSON: ``config`` its
    selfcheck name, the compiler's registers / spill / shared bytes, the SMEM
    limit at its capability and its tiles."""
    return {**{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "tiles"},
            "smem_limit": r.smem_limit, "tiles": tiles_text(r.tiles)}


def layer_launches(cfg: K3Config, parallel: ParallelConfig, layer: int, *, tokens: int,
                   dtype: str, expert_dtype: str):
    """The selfcheck KernelConfigs of every Triton launch of the layer's forward."""
    from pallas_kernels.selfcheck import gate

    mesh = abstract_mesh(parallel)
    built = layer_on_mesh(cfg, parallel, layer, mesh, tokens=tokens, backend="triton",
                          dtype=dtype, expert_dtype=expert_dtype)
    module, x_TD = built.module, built.x_TD
    graph, state = nnx.split(module)
    jax.clear_caches()   # a launch traced before (this process) would not be collected again
    with gate.collecting() as found, jax.sharding.use_abstract_mesh(mesh):
        jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD)).trace(state, x_TD)
    return found


def compile_launch(config, capability: int) -> CubinReport:
    """Plan one collected launch as the Triton dispatch does and compile it:
    its triton_compile.CubinReport (``config`` the selfcheck name)."""
    from k3jax.tools import triton_compile
    from pallas_kernels.grouped_matmul import triton_sm80

    mxfp4 = config.w_dtype == "mxfp4"
    fused = config.op != "grouped_matmul"
    act = {} if not fused else dict(beta=config.beta, linear_beta=config.linear_beta)
    launch = triton_sm80.plan(num_rows=config.m, k=config.k, n=config.n, num_groups=config.groups,
                              x_dtype=config.x_dtype, fused=fused, mxfp4=mxfp4, **act)
    kernel_config = triton_compile.KernelConfig(config.name, launch, jnp.dtype(config.x_dtype),
                                                mxfp4)
    return triton_compile.compile_cubin(kernel_config, capability)


def compile_layer_triton(cfg: K3Config, parallel: ParallelConfig, layer: int, *, tokens: int,
                         dtype: str, expert_dtype: str, capability: int) -> list[CubinReport]:
    """Every Triton launch of the layer, compiled for sm_``capability``."""
    if capability not in CAPABILITIES:
        raise ValueError(f"compute capability {capability} is not one of {CAPABILITIES}")
    return [compile_launch(c, capability)
            for c in layer_launches(cfg, parallel, layer, tokens=tokens, dtype=dtype,
                                    expert_dtype=expert_dtype)]


@dataclasses.dataclass(frozen=True)
class TritonCompileReport:
    """``k3jax compile --backend triton``'s result: the layer, its layout and
    every Triton launch's triton_compile.CubinReport."""

    layer: int
    tokens: int
    parallel: ParallelConfig
    capability: int
    kernels: tuple[CubinReport, ...]

    def to_json(self) -> str:
        import json
        return json.dumps({"layer": self.layer, "tokens": self.tokens, "backend": "triton",
                           "layout": self.parallel.describe(),
                           "compute_capability": self.capability,
                           "kernels": [kernel_json(k) for k in self.kernels]}, indent=1)


def print_report(report: TritonCompileReport, file=None) -> None:
    """The human form: one row per launch."""
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=200)
    table = Table(title=f"Triton kernels of layer {report.layer}, {report.tokens} tokens, "
                        f"{report.parallel.describe()} (Triton + ptxas, sm_{report.capability})")
    for column, justify in (("launch", "left"), ("kernel", "left"), ("tiles", "left"),
                            ("registers", "right"), ("spill st/ld bytes", "right"),
                            ("shared bytes (limit)", "right")):
        table.add_column(column, justify=justify)
    for k in report.kernels:
        table.add_row(k.config, k.kernel, tiles_text(k.tiles), str(k.registers),
                      f"{k.spill_store_bytes}/{k.spill_load_bytes}",
                      f"{k.shared_bytes:,} ({k.smem_limit:,})")
    console.print(table)
