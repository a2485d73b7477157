"""The persistent warp-specialized loop the Mosaic grouped kernels share.

A kernel is one CTA per SM (or per cluster) of ``num_compute_wgs`` consumer
warpgroups plus one TMA producer warpgroup. Every warpgroup walks the same
linear tile sequence (nd_loop over "sm"); a tile is a (K range, work item,
N-block) of the schedule table meta_4W (schedule.work_items_4W). For a tile
with rows of a group the producer streams its operands through an SMEM ring
(``Pipeline``: the operand BlockSpecs, stages, producer registers) while the
consumers run the kernel's MMA step into f32 register accumulators and its
epilogue.

Everything a kernel varies is a static Python value or callable, evaluated
once while tracing: the tile order (index -> split, item, N-block), the SMEM
scratch, the MMA step and compute context, the tail-item store. Nothing
branches at run time on which kernel this is.

K ranges (split-K): each of the <= 2 distinct K-range lengths gets its own
static pipeline (a static trip count; a traced one costs registers).

Chained tiles (no_drain): the kernel's refs start with bounds_2C, each CTA's
first and last tile that runs a matmul. That tile's pipeline runs as START,
the last as STOP, the ones between as STEADY (the producer streams the next
tile's first stages during the previous tile's last MMAs and epilogue), one
static pipeline per state chosen by one lax.switch. A CTA whose only matmul
tile ran as START quiesces the ring by hand after the loop (jax has no state
that is both START and STOP).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import interpret_compat
from pallas_kernels.grouped_matmul.schedule import X_ROW_ALIGN, k_range, k_range_lengths
from pallas_kernels.hardware import H200

# Interpret mode simulates every "SM" on the CPU: keep it small but > 1 so the
# persistent loop really strides over several work items per CTA.
INTERPRET_NUM_SMS = 4
START, STEADY, STOP = (plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY,
                       plgpu.PipelinePipeline.STOP)


def num_sms(interpret) -> int:
    """Persistent grid size: the device's SM count (H200.num_sms when the
    device reports none), or INTERPRET_NUM_SMS in interpret mode."""
    if interpret:
        return INTERPRET_NUM_SMS
    return int(getattr(jax.devices()[0], "core_count", 0) or H200.num_sms)


def interpret_params(interpret) -> plgpu.InterpretGPUParams | None:
    """None (compile for the GPU), or the GPU interpret-mode parameters to use."""
    if not interpret:
        return None
    interpret_compat.install()
    return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()


def memory_registers(num_compute_wgs: int) -> int:
    """Registers per thread of the TMA producer warpgroup (setmaxnreg); the
    consumers share the rest of 512. One consumer needs <= 256, so the
    producer gets 240 there; with 2 or 3 consumers 40 (more made the fused
    two-consumer tiles spill)."""
    return 240 if num_compute_wgs == 1 else 40


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One tile's warp-specialized K pipeline: ``in_specs(first_k_step)`` gives
    the operand BlockSpecs (x planes first, then the weight operands) for K
    steps from first_k_step; ``max_concurrent_steps`` SMEM stages."""

    in_specs: Callable[[Any], list[plgpu.BlockSpec]]
    num_compute_wgs: int
    max_concurrent_steps: int
    memory_registers: int

    def emit(self, step_fn, compute_context, num_k_steps: int, first_k_step=0,
             pipeline_state: plgpu.PipelinePipeline | None = None):
        """pipeline_state None drains the ring after the tile; START / STEADY /
        STOP chain a CTA's tiles."""
        return plgpu.emit_pipeline_warp_specialized(
            step_fn, grid=(num_k_steps,), memory_registers=self.memory_registers,
            in_specs=self.in_specs(first_k_step), wg_axis="wg",
            num_compute_wgs=self.num_compute_wgs,
            max_concurrent_steps=self.max_concurrent_steps, compute_context=compute_context,
            pipeline_state=pipeline_state)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One tile of the loop as the kernel's callbacks see it (traced scalars):
    its K range (None without split-K), work item, N-block, the item's table
    column (offset None where the kernel does not read it), the warpgroup,
    the output refs and the SMEM scratch refs by name."""

    wg: Any
    split: Any
    item: Any
    n_block: Any
    group: Any
    x_row0: Any
    offset: Any
    count: Any
    o_gmems: tuple
    scratch: Mapping[str, Any]


def launch_dims(x_MK, w_GKNs) -> tuple[int, int, int, int, int]:
    """(m, k, n, num_groups, num_weights) of an [m, k] x num_weights x [G, k, n]
    grouped launch (the weights share one shape)."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKNs[0].shape
    return m, k, n, num_groups, len(w_GKNs)


def kernel_epilogue(epilogue: Callable, split_k: int, out_dtype) -> tuple[Callable, Any]:
    """(what the kernel applies to its f32 accumulators, the dtype it stores):
    with split_k > 1 the accumulators themselves as f32 partials (the launcher
    sums the K ranges, then applies ``epilogue``), else ``(epilogue(*accs),)``
    in out_dtype."""
    if split_k > 1:
        return (lambda *accs: accs), jnp.float32
    return (lambda *accs: (epilogue(*accs),)), out_dtype


def step_operands(rest: tuple, num_x: int, refs_per_w: int) -> tuple[tuple, list, Any]:
    """A pipeline step's arguments ``(*smem tiles, accs)`` split by role: the
    ``num_x`` x tiles (planes), for each accumulator its weight's
    ``refs_per_w`` SMEM refs (bf16 planes, or packed + scales), the accumulators.
    The SMEM tiles are in BlockSpec order: x planes first, then the weights."""
    smems, accs = rest[:-1], rest[-1]
    w_refs = [smems[num_x + i * refs_per_w:num_x + (i + 1) * refs_per_w]
              for i in range(len(accs))]
    return smems[:num_x], w_refs, accs


def scoped_accumulators(shape: tuple[int, int], count: int,
                        finish: Callable[[list], None]) -> Callable:
    """The compute_context of ``Pipeline.emit``: ``count`` f32 WGMMA register
    accumulators of ``shape`` live for the tile's whole K pipeline, then
    ``finish(accs)`` reads them (epilogue and store) in the same scope."""
    def compute_context(run_pipeline):
        accs = [plgpu.ACC(shape, jnp.float32)] * count

        @functools.partial(pl.run_scoped, accs=accs)
        def _acc_scope(accs):
            run_pipeline(tuple(accs))
            finish(accs)

    return compute_context


# tile -> (mma step_fn, compute_context, tail store or None)
TileBody = Callable[[Tile], tuple[Callable, Callable, Callable | None]]
# num_items -> (number of linear tiles, index -> (split | None, item, n_block));
# called inside the CTA's scope, after the warpgroup index.
TileOrder = Callable[[int], tuple[int, Callable]]


def persistent_body(*, pipeline: Pipeline, num_x: int, num_w: int, num_k_steps: int,
                    split_k: int | None, x_tile_rows: int, w_tile_cols: int,
                    scratch: Mapping[str, Any], tile_order: TileOrder, tile_body: TileBody,
                    no_drain: bool, read_offset: bool = True,
                    w_n_axes: Sequence[int] | None = None):
    """Kernel body(meta_4W, [bounds_2C,] *x_refs, *w_refs, *o_refs).

    num_x x refs [M_pad, K_pad] and num_w weight refs [G, ., N] (or [G, N, .]
    where ``w_n_axes``, one axis per weight ref, says N is axis 1; None: all
    axis 2). The pipeline slices x rows [x_row0, x_row0 + x_tile_rows) and
    weight N entries [n_block * w_tile_cols, + w_tile_cols) of group
    max(group, 0); every ref after them is an output. A tile runs its matmul when count > 0 and
    group >= 0 (and, with split-K, its K range has the pipeline's length);
    split_k None: one K range of num_k_steps from step 0.
    """
    lengths = [num_k_steps] if split_k is None else k_range_lengths(num_k_steps, split_k)
    w_n_axes = tuple(w_n_axes) if w_n_axes is not None else (2,) * num_w
    if len(w_n_axes) != num_w or not set(w_n_axes) <= {1, 2}:
        raise ValueError(f"w_n_axes must give axis 1 or 2 for each of {num_w} weight refs, "
                         f"got {w_n_axes}")

    def body(meta_gmem, *refs):
        bounds_gmem, refs = (refs[0], refs[1:]) if no_drain else (None, refs)
        x_gmems, w_gmems = refs[:num_x], refs[num_x:num_x + num_w]
        o_gmems = refs[num_x + num_w:]
        num_items = meta_gmem.shape[1]

        def ignore(*_, **__):
            return None
        allocs = pipeline.emit(ignore, ignore, num_k_steps).get_allocations(
            *x_gmems, *[w.at[0] for w in w_gmems])

        @functools.partial(pl.run_scoped, allocs=allocs, **scratch, collective_axes="wg")
        def _scope(allocs, **scratch_refs):
            wg = lax.axis_index("wg")  # consumers 0..num_compute_wgs-1, producer last
            num_tiles, coords = tile_order(num_items)

            # Static shapes only: a traced item count in the tile order's
            # divisions costs registers.
            @plgpu.nd_loop((num_tiles,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                split, item, n_block = coords(info.index[0])
                group = meta_gmem[0, item]
                x_row0 = meta_gmem[1, item]
                offset = meta_gmem[2, item] if read_offset else None
                count = meta_gmem[3, item]
                tile = Tile(wg=wg, split=split, item=item, n_block=n_block, group=group,
                            x_row0=x_row0, offset=offset, count=count, o_gmems=o_gmems,
                            scratch=scratch_refs)
                mma, compute_context, tail = tile_body(tile)
                if split is None:
                    first, steps = 0, None
                else:
                    first, steps = k_range(split, num_k_steps, split_k)

                for length in lengths:
                    runs = (count > 0) & (group >= 0)
                    if steps is not None:
                        runs = runs & (steps == length)

                    @pl.when(runs)
                    def _matmul(length=length):
                        rows = pl.ds(pl.multiple_of(x_row0, X_ROW_ALIGN), x_tile_rows)
                        cols = pl.ds(n_block * w_tile_cols, w_tile_cols)

                        def run(pipeline_state):
                            pipeline.emit(mma, compute_context, length, first_k_step=first,
                                          pipeline_state=pipeline_state)(
                                *[x.at[rows, :] for x in x_gmems],
                                *[w.at[jnp.maximum(group, 0), :, cols] if axis == 2
                                  else w.at[jnp.maximum(group, 0), cols, :]
                                  for w, axis in zip(w_gmems, w_n_axes)],
                                allocations=allocs)

                        if no_drain:  # one switch: no value stays live across the states
                            state = chain_state(info.index[0], bounds_gmem, lax.axis_index("sm"))
                            lax.switch(state, [functools.partial(run, st)
                                               for st in (START, STEADY, STOP)])
                        else:
                            run(None)

                if tail is not None:
                    tail()

            if no_drain:
                sm = lax.axis_index("sm")
                first, last = bounds_gmem[0, sm], bounds_gmem[1, sm]

                # The producer waits for the consumers' release of the last
                # max_concurrent_steps steps, as STOP's quiesce does (the
                # num_steps % stages == 0 steps end on slot stages - 1), so the
                # ring's barriers leave the scope with every phase observed.
                @pl.when((wg == pipeline.num_compute_wgs) & (first >= 0) & (first == last))
                def _quiesce():
                    quiesce_ring(allocs, pipeline.max_concurrent_steps)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def chain_state(tile, bounds_gmem, cta) -> jax.Array:
    """0 / 1 / 2 = START / STEADY / STOP: linear tile ``tile``'s place in the
    chain of pipelines of CTA (or cluster) ``cta``, whose first and last
    matmul tiles are bounds_gmem[:, cta] (schedule.chain_bounds_2C)."""
    return jnp.where(tile == bounds_gmem[0, cta], int(START),
                     jnp.where(tile == bounds_gmem[1, cta], int(STOP), int(STEADY)))


def quiesce_ring(allocs: dict, stages: int) -> None:
    """The producer's wait for the consumers' release of the ring's last
    ``stages`` steps (jax's STOP quiesce). ``allocs`` is the pipeline's
    get_allocations() dict; its "flat_consumed_barrier_refs" key is jax
    0.11.2's, so a rename fails loudly here."""
    for barrier in allocs["flat_consumed_barrier_refs"]:
        for slot in range(stages):
            plgpu.barrier_wait(barrier.at[slot])


def store_rows(o_smem, o_gmem, *, row0, offset, count, col0, block_n: int, max_rows: int):
    """TMA-store rows [offset, offset + count) of o_smem to o_gmem[row0 + offset...].

    TMA needs static box sizes, so count is written as a sum of powers of two
    (one descriptor per power, each issued only when that bit of count is set).
    """
    rows = 1 << int(math.log2(max_rows))
    start = offset
    while rows >= 1:
        @pl.when((count & rows) != 0)
        def _store(rows=rows, start=start):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(start, rows)],
                o_gmem.at[pl.ds(row0 + start, rows), pl.ds(col0, block_n)])
        start = start + (count & rows)
        rows //= 2


def launch(body, *, out_type, grid: tuple[int, ...], interpret, num_compute_wgs: int | None = None,
           kernel_name: str | None = None, approx_math: bool = False, cluster: int = 1):
    """plgpu.kernel over a persistent grid named "sm" (clusters of ``cluster``
    CTAs named "cluster" when > 1), warpgroup semantics; num_compute_wgs
    consumers + 1 producer warpgroups named "wg" (None: one warpgroup).
    approx_math: PTX's approximate exp / tanh in the epilogue."""
    kwargs: dict[str, Any] = {}
    if cluster > 1:
        kwargs.update(cluster=(cluster,), cluster_names=("cluster",))
    if num_compute_wgs is not None:
        kwargs.update(num_threads=num_compute_wgs + 1, thread_name="wg")
    if kernel_name is not None:
        kwargs.update(kernel_name=kernel_name)
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=("sm",), **kwargs,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx_math),
        interpret=interpret_params(interpret))
