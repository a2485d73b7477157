"""load_layer / load_layers: checkpoint layers as modules, placed by the layout."""

from __future__ import annotations

import enum
import os
from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
from jax.sharding import NamedSharding

from k3jax.checkpoint.host import Workers
from k3jax.checkpoint.pipeline import Staging, block_nbytes, local_blocks
from k3jax.checkpoint.reader import CheckpointReader
from k3jax.checkpoint.source import CheckpointSource
from k3jax.choices import as_choice
from k3jax.formats import ExpertStorage, dequantized_form
from k3jax.layout import ParallelConfig, make_layout, make_mesh
from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.layout.user_mesh import check_mesh
from k3jax.modules import KimiMLP, KimiMoE, build_layer, layer_decls
from k3jax.modules.params import ParamDecl
from pallas_kernels.backend import Backend


class Mxfp4Mode(enum.Enum):
    """How routed experts stored in a codec's tensors (MXFP4) are held:
    PACKED in that format, or dequantized to the layout's dtype on load.
    ``load_layer(..., mxfp4=)`` takes a member or its value."""

    PACKED = "packed"
    DEQUANTIZE = "dequantize"


def load_layer(checkpoint: str | os.PathLike | CheckpointReader, layer: int,
               parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
               dtype=jnp.float32, backend: Backend = "auto",
               mxfp4: Mxfp4Mode | str = "packed", progress: bool = False,
               workers: int | None = None,
               expert_placement: ExpertPlacement | None = None) -> KimiMLP | KimiMoE:
    """Layer ``layer`` (0 = dense MLP, >= 1 = MoE for K3) of a checkpoint
    directory, each device's shard read straight from the files.

    Every tensor the layer needs is checked (name, shape, dtype, from the
    file headers) before any data is read. Routed experts stored in a codec
    format's tensors (k3jax.formats; MXFP4 in K3's checkpoint) stay packed
    in device memory in that format (``mxfp4="packed"``, 0.53125 B per
    parameter for MXFP4, dequantized in the forward) or are dequantized to
    ``dtype`` on load (``"dequantize"``). ``progress`` shows a bar on a terminal's stderr, in
    bytes read. ``workers`` threads read (default: one per core this process
    may use). The Layout is made here, once, from the checkpoint's config,
    ``mesh`` (which resolves ``backend``), ``dtype`` and the expert format
    ("mxfp4" for packed MXFP4 experts, "mxfp4-dequant" for MXFP4 experts
    dequantized on load, "dense" for float experts) with the static facts
    its stored bytes decide (MXFP4: the in-kernel dequant the scale bytes
    allow; each process reads its blocks first, and every process takes the
    fact all of them agree on); the module reads it. Raises
    k3jax.layout.LayoutError when ``parallel`` cannot hold the layer (its
    subclass ExpertShardError when only the packed format cannot:
    ``mxfp4="dequantize"`` avoids it), CheckpointError for a checkpoint
    problem (no module is returned then). With ``parallel.redundant_experts``
    the routed experts fill E + R slots, placed by ``expert_placement`` (or
    for uniform load, k3jax.layout.redundant): each slot holds its logical
    expert's tensors, each read from disk once per process."""
    (module,) = load_layers(checkpoint, [layer], parallel, mesh, dtype=dtype, backend=backend,
                            mxfp4=mxfp4, progress=progress, workers=workers,
                            expert_placements=None if expert_placement is None
                            else {layer: expert_placement})
    return module


def load_layers(checkpoint: str | os.PathLike | CheckpointReader, layers: Sequence[int],
                parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
                dtype=jnp.float32, backend: Backend = "auto",
                mxfp4: Mxfp4Mode | str = "packed", progress: bool = False,
                workers: int | None = None,
                expert_placements: Mapping[int, ExpertPlacement] | None = None
                ) -> list[KimiMLP | KimiMoE]:
    """``load_layer`` for each of ``layers``, in order, on one mesh: the
    headers of every tensor of every layer are checked before any data is
    read, and one progress bar (bytes) covers all of them. A checkpoint
    problem in any layer raises before any module is returned.
    ``expert_placements``: {MoE layer index: its ExpertPlacement} (a layer
    not in it, with ``parallel.redundant_experts``: placed for uniform load)."""
    reader, layers, mesh, mxfp4 = _open(checkpoint, layers, parallel, mesh, mxfp4)
    pool, staging = Workers(workers), Staging()
    try:
        plans = _plan(reader, layers, parallel, mesh, dtype, backend, mxfp4, pool, staging,
                      placements=expert_placements)
        if not progress:
            return _build(plans, mesh, None)
        from tqdm import tqdm
        total = sum(local_bytes(decls, mesh) for _, _, decls, _ in plans)
        desc = (f"loading layer {layers[0]}" if len(layers) == 1
                else f"loading {len(layers)} layers")
        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                  disable=None, leave=False) as bar:
            return _build(plans, mesh, bar.update)
    finally:
        pool.close()
        staging.clear()


def read_layers(checkpoint: str | os.PathLike | CheckpointReader, layers: Sequence[int],
                parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
                dtype=jnp.float32, mxfp4: Mxfp4Mode | str = "packed",
                workers: int | None = None, host_ops: bool | None = None,
                expert_placements: Mapping[int, ExpertPlacement] | None = None) -> int:
    """The host side of ``load_layers`` alone: every block this process's
    devices would hold is read, checked and dropped exactly as loading does
    (headers first, the read-ahead thread, the worker pool, the staging
    buffers, the first read of a packed format's bytes that decides its
    facts, e.g. MXFP4 scales and their dequant), and nothing is placed on a device. Returns the bytes placing
    reads (the scales' first read not counted).
    ``k3jax load-bench`` times it as the loader's host-side peer: on an
    accelerator the device work (transfer, transposes) runs beside it; on
    CPU devices it includes the parameters' ops, which run on the host as
    blocks are read (k3jax.checkpoint.slabs). ``host_ops=False`` reads every
    block as stored instead, as for an accelerator, and ``True`` applies the
    ops on the host whatever the devices (None: as loading would)."""
    reader, layers, mesh, mxfp4 = _open(checkpoint, layers, parallel, mesh, mxfp4)
    pool, staging = Workers(workers), Staging()
    try:
        return sum(source.read_blocks(decls, mesh) for _, _, decls, source in
                   _plan(reader, layers, parallel, mesh, dtype, "xla", mxfp4, pool, staging,
                         agree=False, host_ops=host_ops, placements=expert_placements))
    finally:
        pool.close()
        staging.clear()


def _open(checkpoint, layers, parallel, mesh, mxfp4):
    """(reader, layers as a list, mesh, Mxfp4Mode), the arguments checked."""
    mxfp4 = as_choice(Mxfp4Mode, mxfp4, "mxfp4")
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("no layers given")
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    mesh = make_mesh(parallel) if mesh is None else check_mesh(mesh, parallel, "load_layers")
    return reader, layers, mesh, mxfp4


def _plan(reader, layers, parallel, mesh, dtype, backend, mxfp4, pool, staging,
          agree: bool = True, host_ops: bool | None = None, placements=None) -> list:
    """[(layer, layout, decls, source)], every tensor's header checked; the
    layouts of layers whose format reads facts off its stored bytes (MXFP4:
    the dequant its scale bytes allow) carry them (this process's blocks
    read first, CheckpointSource.stored_fact; the facts agreed across
    processes unless ``agree`` is False: nothing is placed then)."""
    plans, facts = [], {}
    for layer in layers:
        source = CheckpointSource(reader, layer, workers=pool, staging=staging, host_ops=host_ops)
        codec = source.experts_codec
        experts = (ExpertStorage.DENSE if codec is None
                   else codec if mxfp4 is Mxfp4Mode.PACKED else dequantized_form(codec))
        placement = (placements or {}).get(layer) if reader.config.is_moe_layer(layer) else None
        layout = make_layout(reader.config, parallel, mesh, backend=backend, experts=experts,
                             dtype=dtype, expert_placement=placement)
        decls = layer_decls(layout, layer)
        source.check(decls)
        if layout.experts.fact_params:   # the same layers on every process: the same count
            facts.setdefault(layout.experts.name, {})[len(plans)] = source.stored_fact(
                layout.experts, decls, mesh)
        plans.append((layer, layout, decls, source))
    for name in sorted(facts):   # every process agrees in the same order
        fmt = next(plans[i][1].experts for i in facts[name])
        local = facts[name]
        agreed = fmt.agree_facts(list(local.values())) if agree else list(local.values())
        for i, fact in zip(local, agreed):
            layer, layout, decls, source = plans[i]
            plans[i] = (layer, make_layout(reader.config, parallel, mesh, backend=backend,
                                           experts=layout.experts.with_fact(fact), dtype=dtype,
                                           expert_placement=layout.expert_placement),
                        decls, source)
    return plans


def _build(plans, mesh, on_block: Callable[[int], None] | None) -> list[KimiMLP | KimiMoE]:
    modules = []
    for layer, layout, decls, source in plans:
        source.on_block = on_block
        try:
            source.read_ahead(decls, mesh)
            modules.append(build_layer(layout, layer, mesh, source=source))
        finally:
            source.close()
    return modules


def local_bytes(decls: Sequence[ParamDecl], mesh) -> int:
    """Bytes of the distinct blocks of ``decls`` that this process's devices hold."""
    return sum(block_nbytes(index, d.shape, d.dtype)
               for d in decls for index, _ in local_blocks(d.shape, NamedSharding(mesh, d.spec)))
