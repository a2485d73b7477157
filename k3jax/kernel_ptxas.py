"""ptxas reports (registers, spills, warnings) of Mosaic GPU kernels compiled
for one H200 without a GPU (deviceless, via k3jax.aot).

    reports = ptxas_reports(fn, *abstract_args)   # [PtxasReport, ...]

The compile runs with the compile-only H200 as the default device and its
abstract mesh in scope: kernels that read the SM count (``get_num_sms``) or
pick their implementation from the default device (tokamax) see an H200.
Processes must run with JAX_PLATFORMS=cpu (see k3jax/aot.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from k3jax.aot import PtxasReport, h200_topology, ptxas_dump


def ptxas_reports(fn: Callable, *arg_specs: jax.ShapeDtypeStruct) -> list[PtxasReport]:
    """Compile jax.jit(fn) for one H200 and return each Mosaic kernel's ptxas report.

    arg_specs: ShapeDtypeStructs without sharding (placed on the one device).
    """
    device = h200_topology(1).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in arg_specs]
    mesh = jax.sharding.Mesh([device], ("x",))
    with ptxas_dump() as reports, jax.default_device(device), \
            jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        jax.jit(fn).lower(*specs).compile()
        return reports()


def tokamax_ragged_dot_reports(m: int, k: int, n: int, num_groups: int,
                               dtype=jnp.bfloat16) -> list[PtxasReport]:
    """ptxas reports of tokamax.ragged_dot's Mosaic GPU kernel (the peer in
    benchmarks/gpu_kernels.py) for x [m, k] @ w [G, k, n] on one H200."""
    from pallas_kernels.peers import tokamax_ragged_dot
    return ptxas_reports(tokamax_ragged_dot, jax.ShapeDtypeStruct((m, k), dtype),
                         jax.ShapeDtypeStruct((num_groups, k, n), dtype),
                         jax.ShapeDtypeStruct((num_groups,), jnp.int32))


__all__ = ["ptxas_reports", "tokamax_ragged_dot_reports"]
