"""ptxas reports (registers, spills, warnings) of Mosaic GPU kernels compiled
for one H200 without a GPU (deviceless, via k3jax.tools.aot).

    reports = ptxas_reports(fn, *abstract_args)   # [PtxasReport, ...]
    launches = grouped_launches(jax.jit(fn).trace(*args).jaxpr)
    peers = tokamax_peer_reports(launches)       # [PeerKernel, ...]

The compile runs with the compile-only H200 as the default device and its
abstract mesh in scope: kernels that read the SM count (``get_num_sms``) or
pick their implementation from the default device (tokamax) see an H200.
Processes must run with JAX_PLATFORMS=cpu (see k3jax/tools/aot.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from k3jax.tools.aot import PtxasReport, h200_topology, ptxas_dump


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
    benchmarks.kernel_sweep) for x [m, k] @ w [G, k, n] on one H200."""
    from k3jax.tools.peers import tokamax_ragged_dot
    return ptxas_reports(tokamax_ragged_dot, jax.ShapeDtypeStruct((m, k), dtype),
                         jax.ShapeDtypeStruct((num_groups, k, n), dtype),
                         jax.ShapeDtypeStruct((num_groups,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class GroupedLaunch:
    """One launch of our Mosaic grouped kernel (grouped_matmul_m* /
    grouped_situ_glu_m*, situ_mlp_up included) in a traced program: its
    operand shapes as the kernel receives them (per device inside shard_map;
    x padded to whole tiles only when it has fewer rows than one tile or a
    row count not a multiple of 8). dtype: the inputs' (float32 runs as two
    bf16 planes)."""

    kernel: str
    m: int
    k: int
    n: int
    groups: int
    num_weights: int
    dtype: str


# The primitive plgpu.kernel binds (jax 0.11.2); its "name" param is our kernel_name.
_MOSAIC_KERNEL_PRIMITIVE = "mpmd_map"
# Our float grouped kernels: the row-major tiles (mosaic_sm90: "..._m64") and
# the swap-AB tiles (mosaic_sm90_swap_ab: "..._swap_ab_t16"). The
# MXFP4 kernels ("..._mxfp4_m64") are left out: no peer takes MXFP4 on sm_90.
_GROUPED_KERNELS = re.compile(r"grouped_(matmul|situ_glu)_(m|swap_ab_t)\d+")


def grouped_launches(jaxpr: jax_core.Jaxpr) -> list[GroupedLaunch]:
    """Our grouped kernels' launches in ``jaxpr`` (nested jaxprs included:
    jit, shard_map, custom_vjp, control flow), distinct shapes in program order."""
    found: dict[GroupedLaunch, None] = {}

    def walk(jp: jax_core.Jaxpr) -> None:
        for eqn in jp.eqns:
            name = eqn.params.get("name") if eqn.primitive.name == _MOSAIC_KERNEL_PRIMITIVE else None
            if isinstance(name, str) and _GROUPED_KERNELS.match(name):
                avals = [v.aval for v in eqn.invars]
                x = next(a for a in avals if a.ndim == 2 and a.dtype != jnp.int32)
                ws = [a for a in avals if a.ndim == 3]
                planes = 2 if avals.count(x) == 2 else 1
                found[GroupedLaunch(kernel=name, m=x.shape[0], k=x.shape[1], n=ws[0].shape[2],
                                    groups=ws[0].shape[0], num_weights=len(ws) // planes,
                                    dtype="float32" if planes == 2 else jnp.dtype(x.dtype).name
                                    )] = None
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax_core.Jaxpr):
                        walk(sub)

    walk(jaxpr)
    return list(found)


TOKAMAX_PEER = "tokamax.ragged_dot (Mosaic GPU, tokamax 0.0.17)"


@dataclasses.dataclass(frozen=True)
class PeerKernel:
    """A peer library's kernel compiled for the shapes of one of our launches:
    ``launch.num_weights`` calls of it replace our launch (the fused gate/up
    is two ragged_dots, then the SiTU in XLA: k3jax.tools.peers).
    report is None when the peer rejected the shapes (error: its message)."""

    peer: str
    launch: GroupedLaunch
    report: PtxasReport | None
    error: str | None = None


def tokamax_peer_reports(launches: list[GroupedLaunch]) -> list[PeerKernel]:
    """tokamax.ragged_dot's Mosaic GPU kernel compiled (one H200, sm_90a) for
    each launch's x [m, k] @ w [groups, k, n] in the launch's dtype; a shape
    tokamax rejects (e.g. K not a multiple of its 64-wide tiles) gives an
    entry with the error instead."""
    out = []
    for launch in launches:
        try:
            reports = tokamax_ragged_dot_reports(launch.m, launch.k, launch.n, launch.groups,
                                                 jnp.dtype(launch.dtype))
        except (ValueError, NotImplementedError) as e:  # tokamax's "cannot do this shape"
            out.append(PeerKernel(TOKAMAX_PEER, launch, None, f"{type(e).__name__}: {e}"))
            continue
        out += [PeerKernel(TOKAMAX_PEER, launch, report) for report in reports]
    return out


__all__ = ["GroupedLaunch", "PeerKernel", "TOKAMAX_PEER", "grouped_launches", "ptxas_reports",
           "tokamax_peer_reports", "tokamax_ragged_dot_reports"]
