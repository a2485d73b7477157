"""One layer compiled for H200 GPUs without a GPU: what the GPU compiler allocates,
schedules and builds (``k3jax compile``).

The layer is built with the real modules on compile-only H200 devices
(``k3jax.tools.aot.h200_mesh``) with abstract weights (``AbstractSource``: nothing is
allocated) and its forward x_TD [T, D] -> y_TD [T, D] goes through XLA's GPU
pipeline (and, with the Pallas backend, Mosaic GPU and ptxas), with
``k3jax.tools.aot.GPU_COMPILER_OPTIONS``. The report:

    per_device_bytes   from the compiler's buffer assignment (memory_analysis):
                       weights      argument bytes of the parameters (the
                                    arguments less x's shard);
                       activations  argument bytes of the input x_TD (its shard);
                       outputs      the output y_TD's shard;
                       temporaries  XLA's temp buffers (peak of the schedule).
    planner_weight_bytes   the planner's bytes of this layer (k3jax.tools.plan);
                       ``weights`` must equal it.
    fits_h200          all layers' weights (planner) + this layer's activations,
                       outputs and temporaries <= the target's device memory.
    collectives        the schedule (k3jax.tools.hlo_schedule), in order.
    kernels            each Mosaic GPU kernel's ptxas report (Pallas backend).
    peer_kernels       the peer, tokamax.ragged_dot's Mosaic GPU kernel, compiled
                       for the shapes of each of our grouped launches (Pallas
                       backend; k3jax.tools.kernel_ptxas.tokamax_peer_reports): a
                       labelled comparison, not part of the layer.
    flops, bytes_accessed  XLA's HloCostAnalysis of the compiled module (dots,
                       elementwise and memory traffic of XLA's own ops; Mosaic
                       kernels are custom calls it does not see into).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.config import K3Config
from k3jax.formats import ExpertStorage, Mxfp4Format
from k3jax.layout import NODE, Layout, ParallelConfig, make_layout
from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.modules import AbstractSource, build_layer
from k3jax.tools.aot import (
    GPU_COMPILER_OPTIONS,
    PtxasReport,
    h200_mesh,
    h200_target_config,
    ptxas_dump,
)
from k3jax.tools.hlo_schedule import ScheduledCollective, collective_schedule, collective_table
from k3jax.tools.kernel_ptxas import PeerKernel, grouped_launches, tokamax_peer_reports
from k3jax.tools.kernel_sass import DEQUANT_KERNELS
from k3jax.tools.plan import EXPERT_DTYPES, WEIGHT_DTYPES, model_bytes, plan_layer_bytes
from pallas_kernels.mxfp4 import Mxfp4Dequant
from pallas_kernels.selfcheck import gate

BACKENDS = ("xla", "pallas")
BYTE_KINDS = ("weights", "activations", "outputs", "temporaries")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the GPU compiler made of one layer's forward (module docstring)."""

    cfg: K3Config
    parallel: ParallelConfig
    layout: Layout                   # the one the layer was built from
    layer: int
    tokens: int
    backend: str
    dtype: str
    expert_dtype: str
    per_device_bytes: dict[str, int]
    planner_weight_bytes: int
    model_weight_bytes: int          # planner: every layer's weights, per device
    device_memory_bytes: int         # the target's
    collectives: tuple[ScheduledCollective, ...]
    kernels: tuple[PtxasReport, ...]
    peer_kernels: tuple[PeerKernel, ...]
    flops: float
    bytes_accessed: float
    compile_seconds: float
    hlo_text: str = dataclasses.field(repr=False, compare=False)
    collective_axes: tuple[tuple[str, ...], ...] = ()   # the mesh axes each collective spans

    def axes_of_collectives(self) -> tuple[tuple[str, ...], ...]:
        """The mesh axes each collective spans, in schedule order (crossing
        nodes exactly when NODE is among them)."""
        return self.collective_axes or tuple(() for _ in self.collectives)

    @property
    def needed_bytes(self) -> int:
        """All layers' weights + this layer's activations, outputs and temporaries."""
        b = self.per_device_bytes
        return self.model_weight_bytes + b["activations"] + b["outputs"] + b["temporaries"]

    @property
    def fits_h200(self) -> bool:
        return self.needed_bytes <= self.device_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "layer": self.layer, "kind": "moe" if self.cfg.is_moe_layer(self.layer) else "dense",
            "tokens": self.tokens, "backend": self.backend, "dtype": self.dtype,
            "expert_dtype": self.expert_dtype,
            "mxfp4_dequant": (lay.experts.dequant.value if isinstance(lay.experts, Mxfp4Format)
                              else None),
            "layout": {**dataclasses.asdict(self.parallel),
                       "shared_overlap": self.parallel.shared_overlap.value,
                       "ep_dispatch": self.parallel.ep_dispatch.value,
                       "ep_dispatch_resolved": lay.ep_dispatch.value,
                       "mesh": dict(self.parallel.axis_sizes),
                       "overlap_forms": lay.overlap_forms(),
                       "shared_overlaps_routed": lay.shared_overlaps_routed},
            "per_device_bytes": dict(self.per_device_bytes),
            "planner_weight_bytes": self.planner_weight_bytes,
            "fits_h200": self.fits_h200,
            "fit": {"model_weight_bytes": self.model_weight_bytes,
                    "needed_bytes": self.needed_bytes,
                    "device_memory_bytes": self.device_memory_bytes},
            "collectives": [{**row, "axes": list(axes), "crosses_nodes": NODE in axes}
                            for row, axes in zip(collective_table(list(self.collectives)),
                                                 self.axes_of_collectives())],
            "kernels": [self._kernel_dict(k) for k in self.kernels],
            "peer_kernels": [_peer_dict(p) for p in self.peer_kernels],
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "target": target_summary(),
            "compile_seconds": round(self.compile_seconds, 2),
        }

    @property
    def x_planes(self) -> int:
        """bf16 planes per x tile in the MXFP4 kernels (2 for float32 x)."""
        return 2 if self.dtype == "float32" else 1

    def dequant_sass_per_weight(self, k: PtxasReport) -> float | None:
        """SASS instructions per weight element in a dequantizing kernel's
        K step (k3jax.tools.kernel_sass); None for the other kernels."""
        return None if k.k_step is None else round(k.k_step.per_weight(self.x_planes), 3)

    def _kernel_dict(self, k: PtxasReport) -> dict[str, Any]:
        """One kernels entry; a dequantizing kernel's also holds
        dequant_sass_per_weight and its K step's counted SASS (kernel_sass)."""
        out: dict[str, Any] = {"name": k.name, "registers": k.registers,
                               "spill_bytes": k.spill_bytes, "smem_bytes": k.smem_bytes,
                               "grid": list(k.grid)}
        if DEQUANT_KERNELS.match(k.name) and k.k_step is None:
            out["dequant_sass_per_weight"] = None   # no K-step loop in the cubin to count
        if k.k_step is not None:
            out["dequant_sass_per_weight"] = self.dequant_sass_per_weight(k)
            out["k_step_sass"] = {"instructions": k.k_step.instructions,
                                  "weights": k.k_step.mma_weights // self.x_planes,
                                  "by_opcode": dict(k.k_step.by_opcode)}
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _peer_dict(p: PeerKernel) -> dict[str, Any]:
    """One peer_kernels entry: the peer, our launch it stands beside, its ptxas
    report (or the peer's error for shapes it rejects)."""
    out: dict[str, Any] = {"peer": p.peer, "for": dataclasses.asdict(p.launch)}
    if p.report is None:
        return {**out, "error": p.error}
    return {**out, "name": p.report.name, "registers": p.report.registers,
            "spill_bytes": p.report.spill_bytes, "smem_bytes": p.report.smem_bytes,
            "grid": list(p.report.grid)}


def target_summary() -> dict[str, Any]:
    """The H200 target's name and the numbers the report depends on."""
    text = "\n".join(line.split("#")[0] for line in h200_target_config().splitlines())

    def field(name: str) -> str:
        m = re.search(rf"\b{name}: ([^\s}}]+)", text)
        if m is None:
            raise ValueError(f"the H200 target has no {name}")
        return m.group(1).strip('"')

    cc = re.search(r"cuda_compute_capability \{ major: (\d+)(?: minor: (\d+))? \}", text)
    return {"device": re.search(r'device_description_str: "([^"]*)"', text).group(1),
            "compute_capability": f"sm_{cc.group(1)}{cc.group(2) or 0}a",
            "core_count": int(field("core_count")),
            "shared_memory_per_block_optin": int(field("shared_memory_per_block_optin")),
            "device_memory_bytes": int(field("device_memory_size")),
            "memory_bandwidth_bytes_per_s": int(field("memory_bandwidth"))}


def _check(cfg: K3Config, layer: int, backend: str, dtype: str, expert_dtype: str) -> None:
    if not 0 <= layer < cfg.num_hidden_layers:
        raise ValueError(f"layer {layer} is out of range: the model has layers 0.."
                         f"{cfg.num_hidden_layers - 1}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype not in WEIGHT_DTYPES or expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES} and expert dtype one of "
                         f"{EXPERT_DTYPES}, got {dtype!r} / {expert_dtype!r}")
    if cfg.is_moe_layer(layer) and expert_dtype not in ("mxfp4", dtype):
        raise ValueError(f"float experts are compiled in the layer's dtype: expert dtype "
                         f"{expert_dtype} needs dtype {expert_dtype} (or mxfp4 experts)")


def _cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) by XLA's HloCostAnalysis of the compiled module.
    A compile-only executable has no cost_analysis(); the analysis itself runs
    on the CPU client (jax private API: jax 0.11.2)."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


@dataclasses.dataclass(frozen=True)
class AbstractLayer:
    """One layer built on a mesh with abstract weights (nothing allocated):
    the mesh, the Layout (resolved for the token count), the routed experts'
    storage, the module, and the input spec x_TD [tokens, hidden] (rows
    sharded as ``layout.x_TD`` where the row shards divide tokens, else
    replicated)."""

    mesh: Mesh | AbstractMesh
    layout: Layout
    experts: ExpertStorage
    module: nnx.Module
    x_TD: jax.ShapeDtypeStruct


def abstract_layer(cfg: K3Config, parallel: ParallelConfig, layer: int, *, tokens: int,
                   backend: str, dtype: str, expert_dtype: str,
                   mxfp4_dequant: Mxfp4Dequant = Mxfp4Dequant.FAST,
                   expert_placement: ExpertPlacement | None = None) -> AbstractLayer:
    """Check the arguments (ValueError) and build layer ``layer`` abstractly for
    ``tokens`` global rows on the compile-only H200 mesh; layout errors raise
    ``k3jax.layout.LayoutError``."""
    _check(cfg, layer, backend, dtype, expert_dtype)
    return layer_on_mesh(cfg, parallel, layer, h200_mesh(parallel), tokens=tokens,
                         backend=backend, dtype=dtype, expert_dtype=expert_dtype,
                         mxfp4_dequant=mxfp4_dequant, expert_placement=expert_placement)


def layer_on_mesh(cfg: K3Config, parallel: ParallelConfig, layer: int,
                  mesh: Mesh | AbstractMesh, *, tokens: int, backend: str, dtype: str,
                  expert_dtype: str, mxfp4_dequant: Mxfp4Dequant = Mxfp4Dequant.FAST,
                  expert_placement: ExpertPlacement | None = None) -> AbstractLayer:
    """Layer ``layer`` built on ``mesh`` with abstract weights (nothing
    allocated) and the input spec for ``tokens`` global rows; the Layout
    resolved for ``tokens`` (Layout.for_tokens). MoE layers keep MXFP4
    experts packed when ``expert_dtype`` is "mxfp4", their scale bytes
    assumed to allow ``mxfp4_dequant`` (abstract weights hold no bytes:
    FAST, the case of real checkpoints, unless told), their redundant slots
    (``parallel.redundant_experts``) placed by ``expert_placement`` (None:
    for uniform load). What ``compile``,
    ``selfcheck`` and the Triton report trace."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    experts = (ExpertStorage.MXFP4 if expert_dtype == "mxfp4" and cfg.is_moe_layer(layer)
               else ExpertStorage.DENSE)
    fmt = Mxfp4Format(dequant=mxfp4_dequant) if experts is ExpertStorage.MXFP4 else experts
    layout = make_layout(cfg, parallel, mesh, backend=backend, experts=fmt,
                         dtype=jnp.dtype(dtype), expert_placement=expert_placement)
    module = build_layer(layout, layer, mesh, source=AbstractSource())
    spec = layout.x_TD if tokens % layout.row_shards == 0 else P()
    x_TD = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.dtype(dtype),
                                sharding=NamedSharding(mesh, spec))
    return AbstractLayer(mesh=mesh, layout=layout.for_tokens(tokens), experts=experts,
                         module=module, x_TD=x_TD)


def shard_bytes(tree) -> int:
    """Per-device bytes of a pytree of sharded arrays or ShapeDtypeStructs."""
    return sum(math.prod(a.sharding.shard_shape(tuple(a.shape))) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


def compiled_bytes(compiled, input_bytes: int) -> dict[str, int]:
    """The compiler's per-device bytes (BYTE_KINDS): the arguments less the
    ``input_bytes`` of the activation inputs are the weights."""
    mem = compiled.memory_analysis()
    return {"weights": mem.argument_size_in_bytes - input_bytes, "activations": input_bytes,
            "outputs": mem.output_size_in_bytes, "temporaries": mem.temp_size_in_bytes}


def planner_bytes(cfg: K3Config, parallel: ParallelConfig, layer: int, *, dtype: str,
                  expert_dtype: str) -> tuple[int, int]:
    """The planner's per-device weight bytes: (this layer's, all layers')."""
    layer_bytes = sum(plan_layer_bytes(cfg, parallel, layer, dtype=dtype,
                                       expert_dtype=expert_dtype).values())
    return layer_bytes, model_bytes(cfg, parallel, dtype=dtype, expert_dtype=expert_dtype)[0]["total"]


def compile_layer(cfg: K3Config, parallel: ParallelConfig, layer: int, *, tokens: int,
                  backend: str = "xla", dtype: str = "bfloat16", expert_dtype: str = "mxfp4",
                  compiler_options: dict | None = None,
                  mxfp4_dequant: Mxfp4Dequant = Mxfp4Dequant.FAST,
                  expert_placement: ExpertPlacement | None = None) -> CompileReport:
    """Compile layer ``layer``'s forward on ``tokens`` global rows for
    ``parallel.num_devices`` H200s (module docstring). Layout errors raise
    ``k3jax.layout.LayoutError``; bad arguments ValueError; a missing CUDA
    plugin or ptxas ``k3jax.tools.aot.GpuCompileUnavailable``."""
    built = abstract_layer(cfg, parallel, layer, tokens=tokens, backend=backend, dtype=dtype,
                           expert_dtype=expert_dtype, mxfp4_dequant=mxfp4_dequant,
                           expert_placement=expert_placement)
    options = GPU_COMPILER_OPTIONS if compiler_options is None else compiler_options
    mesh, layout, x_TD = built.mesh, built.layout, built.x_TD
    graph, state = nnx.split(built.module)
    fn = jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD), compiler_options=options)

    t0 = time.perf_counter()
    # gate.collecting: the check on first use cannot run these kernels here (no GPU); without
    # it, every launch would fail its check and trace its XLA fallback instead
    with (ptxas_dump() as reports, gate.collecting(),
          jax.sharding.use_abstract_mesh(mesh.abstract_mesh)):
        traced = fn.trace(state, x_TD)
        compiled = traced.lower().compile()
        kernels = tuple(reports())
    seconds = time.perf_counter() - t0
    peers = tuple(tokamax_peer_reports(grouped_launches(traced.jaxpr))) if kernels else ()

    per_device = compiled_bytes(compiled, shard_bytes(x_TD))
    planner, model = planner_bytes(cfg, parallel, layer, dtype=dtype, expert_dtype=expert_dtype)
    text = compiled.as_text()
    schedule = tuple(collective_schedule(text))
    flops, bytes_accessed = _cost(compiled)
    return CompileReport(cfg=cfg, parallel=parallel, layout=layout, layer=layer, tokens=tokens,
                         backend=backend, dtype=dtype, expert_dtype=expert_dtype, per_device_bytes=per_device,
                         planner_weight_bytes=planner, model_weight_bytes=model,
                         device_memory_bytes=target_summary()["device_memory_bytes"],
                         collectives=schedule, kernels=kernels,
                         peer_kernels=peers,
                         flops=flops, bytes_accessed=bytes_accessed, compile_seconds=seconds,
                         hlo_text=text,
                         collective_axes=tuple(collective_mesh_axes(c, mesh) for c in schedule))


def collective_mesh_axes(c: ScheduledCollective, mesh: Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` along which one replica group of ``c`` varies,
    in mesh order: those the HLO names (less any of size 1, which join no
    two devices), or, from the group's device ids, every axis on which two
    of its devices' mesh coordinates differ."""
    if c.group_axes:
        return tuple(a for a in mesh.axis_names if a in c.group_axes and mesh.shape[a] > 1)
    where = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    coords = np.array([where[d] for d in c.group_devices if d in where])
    if len(coords) < 2:
        return ()
    return tuple(a for i, a in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1)


__all__ = ["BACKENDS", "BYTE_KINDS", "CompileReport", "collective_mesh_axes", "compile_layer",
           "target_summary"]
