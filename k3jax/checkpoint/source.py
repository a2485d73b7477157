"""CheckpointSource: fills module parameters straight from checkpoint slices.

Each parameter is assembled by ``pipeline.place_blocks``: for every
distinct device block this process holds, ``_read_block`` reads exactly that
block's region of the stored tensors into one host buffer in the STORED
orientation ([out, in] per weight, experts stacked, zero padding written):
each stored piece (one expert's slice, one tensor's slice) is read once,
straight into its place, by a pool of worker threads (pieces of one block in
parallel, a large piece split into chunks), and checked there (NaN / inf on
the bits, MXFP4 scales). The block goes to its devices without a host copy,
and the parameter's device op (``device_op``) runs there: the transpose of a
parameter held [in, out], the word interleave of packed MXFP4 expert codes
(held [E, out, in/2]). A parameter held as stored (1-D tensors) is the block
itself: nothing but the transfer happens to it, and none on a CPU device,
which aliases the block. With
``read_ahead`` a thread reads the blocks in the order they will be placed,
into reused staging buffers those that are copied and dropped (transposed
ones; on an accelerator, all; the pipeline module says how reading
overlaps the device work). No process ever materialises a whole
layer, nor even its whole share of one parameter.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.host import Workers, aligned_empty, first_nonfinite
from k3jax.checkpoint.names import TensorRef, layer_prefix, layer_tensors, mxfp4_names
from k3jax.checkpoint.pipeline import (
    BlockKey,
    DeviceOp,
    InFlight,
    Prefetcher,
    Staging,
    block_key,
    block_nbytes,
    devices_copy_blocks,
    interleave_codes,
    local_blocks,
    place_blocks,
    swap_last_axes,
)
from k3jax.checkpoint.reader import FLOAT_DTYPES, STORED_DTYPES, CheckpointError, CheckpointReader
from k3jax.modules.params import ParamDecl
from pallas_kernels.mxfp4 import BLOCK_SIZE, SCALE_NAN, dequant_numpy, validate_scales


def device_op(ref: TensorRef) -> DeviceOp | None:
    """What the devices do to a block of ``ref`` read as stored: transpose a
    weight stored [out, in] (and MXFP4 scales), interleave packed MXFP4 codes
    into the word layout Mxfp4Weights holds; nothing to the rest."""
    if ref.transpose:
        return swap_last_axes
    return interleave_codes if ref.packed else None


class CheckpointSource:
    """A ParamSource for layer ``layer`` of the checkpoint behind ``reader``.

    ``on_block(nbytes)``, when given, is called after each device block is
    read. ``workers`` (default: a pool of one thread per core) read the
    pieces of a block; ``staging`` (default: its own) holds the reused
    buffers of the blocks read ahead that are transposed on the devices.
    Call ``close()`` after the last parameter."""

    def __init__(self, reader: CheckpointReader, layer: int,
                 on_block: Callable[[int], None] | None = None, workers: Workers | None = None,
                 staging: Staging | None = None):
        """Raises CheckpointError for a layer index out of range."""
        cfg = reader.config
        if not 0 <= layer < cfg.num_hidden_layers:
            raise CheckpointError(f"layer {layer} is out of range: {reader.directory} has "
                                  f"{cfg.num_hidden_layers} layers (0..{cfg.num_hidden_layers - 1})")
        self.reader = reader
        self.layer = layer
        self.is_moe = cfg.is_moe_layer(layer)
        self.prefix = layer_prefix(layer, self.is_moe)
        self.tensors = layer_tensors(self.is_moe)
        self.on_block = on_block
        self._own_workers = workers is None
        self.workers = Workers() if workers is None else workers
        self._own_staging = staging is None
        self.staging = Staging() if staging is None else staging
        self._in_flight = InFlight()
        self._prefetch: Prefetcher | None = None
        self._stored: dict[str, dict[int | None, bool]] = {}   # decl name -> _check's answer

    @property
    def experts_are_mxfp4(self) -> bool:
        """Whether this (MoE) layer stores ALL its routed experts as MXFP4 (a
        layer mixing plain and MXFP4 experts can only be loaded dequantized)."""
        return self.is_moe and all(
            self.reader.has(mxfp4_names(self.tensors[w].name(self.prefix, e))[0])
            for w in ("w1_ELF", "w3_ELF", "w2_EFL") for e in range(self.reader.config.num_experts))

    def check(self, decls: Sequence[ParamDecl]) -> None:
        """Validate every stored tensor behind ``decls`` (names, shapes and
        dtypes, from the file headers) before any tensor data is read."""
        for decl in decls:
            self._stored[decl.name] = self._check(decl, self.tensors[decl.name])

    def read_ahead(self, decls: Sequence[ParamDecl], mesh) -> list[BlockKey]:
        """Start reading the blocks of ``decls`` (checked, in the order they
        will be asked for, on ``mesh``) on a thread, so that reading overlaps
        the transfer and transposes of the blocks before, within the
        Prefetcher's byte budget, in staging buffers those that are copied
        and dropped (those a device op changes; on an accelerator, all). Returns the
        blocks' keys in that order."""
        copied = devices_copy_blocks(mesh)
        plan = []
        for decl in decls:
            ref = self.tensors[decl.name]
            sharding = NamedSharding(mesh, decl.spec)
            for index, _ in local_blocks(decl.shape, sharding):
                plan.append(((decl.name, block_key(index, decl.shape)),
                             block_nbytes(index, decl.shape, decl.dtype),
                             device_op(ref) is not None or copied,
                             (decl, ref, self._stored[decl.name], index)))
        self._prefetch = Prefetcher(self._read_counted, plan, self.staging)
        self._in_flight.on_drop = self._prefetch.release
        return [key for key, *_ in plan]

    def read_blocks(self, decls: Sequence[ParamDecl], mesh) -> int:
        """Read every block of ``decls`` on ``mesh`` as ``read_ahead`` and
        placing would (same thread, workers, checks and staging buffers),
        drop each, and close: the host side of a load alone. Returns the
        bytes read."""
        total = 0
        try:
            for key in self.read_ahead(decls, mesh):
                block = self._prefetch.take(key)
                total += block.nbytes
                self._prefetch.release(block)
        finally:
            self.close()
        return total

    def _read_counted(self, decl, ref, stored, index, into: np.ndarray | None = None
                      ) -> np.ndarray:
        block = self._read_block(decl, ref, stored, index, into)
        if self.on_block is not None:
            self.on_block(block.nbytes)
        return block

    def __call__(self, decl: ParamDecl, sharding: NamedSharding) -> jax.Array:
        ref = self.tensors[decl.name]
        if decl.name not in self._stored:
            self._stored[decl.name] = self._check(decl, ref)
        stored = self._stored[decl.name]

        def read(index):
            if self._prefetch is not None:
                return self._prefetch.take((decl.name, block_key(index, decl.shape)))
            return self._read_counted(decl, ref, stored, index)
        return place_blocks(decl.shape, sharding, read, device_op=device_op(ref),
                            in_flight=self._in_flight)

    def close(self) -> None:
        """Wait for the device work of the last block and drop it; stop the
        workers and free the staging buffers when this source made them."""
        try:
            if self._prefetch is not None:
                self._prefetch.close()
            self._in_flight.replace(None, [])
        finally:
            self._prefetch = None
            self._in_flight.on_drop = None
            if self._own_workers:
                self.workers.close()
            if self._own_staging:
                self.staging.clear()

    # -- validation -------------------------------------------------------------
    def _stored_shape(self, decl: ParamDecl, ref: TensorRef) -> tuple[int, ...]:
        """Shape of one stored tensor: unpadded, per expert, [out, in]."""
        shape = list(decl.shape)
        if decl.padding is not None:
            shape[decl.padding.axis] = decl.padding.real
        if ref.per_expert:
            shape = shape[1:]
        return tuple(reversed(shape)) if ref.transpose else tuple(shape)

    def _check(self, decl: ParamDecl, ref: TensorRef) -> dict[int | None, bool]:
        """Validate every stored tensor behind ``decl``; map expert -> is MXFP4."""
        out, *rest = self._stored_shape(decl, ref)
        experts = range(decl.shape[0]) if ref.per_expert else [None]
        stored = {}
        for e in experts:
            name = ref.name(self.prefix, e)
            if ref.packed:
                self.reader.check(name, (out, *rest), {"U8"})
                stored[e] = False
                continue
            if self.reader.has(name) or not ref.per_expert:
                self.reader.check(name, (out, *rest), FLOAT_DTYPES)
                stored[e] = False
                continue
            packed, scale = mxfp4_names(name)
            if not (self.reader.has(packed) or self.reader.has(scale)):
                raise CheckpointError(f"missing tensor {self.reader.full_name(name)} (nor its MXFP4 "
                                      f"form {packed.rsplit('.', 1)[-1]}/_scale) in {self.reader.directory}")
            (n_in,) = rest
            if n_in % BLOCK_SIZE:
                raise CheckpointError(f"tensor {self.reader.full_name(packed)}: MXFP4 needs the input "
                                      f"width {n_in} to be a multiple of {BLOCK_SIZE}")
            self.reader.check(packed, (out, n_in // 2), {"U8"})
            self.reader.check(scale, (out, n_in // BLOCK_SIZE), {"U8"})
            stored[e] = True
        return stored

    # -- reading one device block ------------------------------------------------
    def _read_block(self, decl: ParamDecl, ref: TensorRef, stored: dict, index,
                    into: np.ndarray | None = None) -> np.ndarray:
        """The block ``index`` of ``decl``, with its last two axes swapped when
        ``ref.transpose`` (the stored [out, in] orientation), as one aligned
        host array (a view of the aligned uint8 buffer ``into`` when given,
        else fresh); padding entries are zero."""
        ranges = [range(*s.indices(n)) for s, n in zip(index, decl.shape)]
        nd = len(ranges)

        def host(items):   # per-axis items of the trailing axes, param -> stored order
            items = list(items)
            if ref.transpose:
                items[-2:] = items[-2:][::-1]
            return items
        shape = host([len(r) for r in ranges])
        if into is None:
            out = aligned_empty(shape, decl.dtype, zero=decl.padding is not None)
        else:
            out = into[:math.prod(shape) * np.dtype(decl.dtype).itemsize].view(decl.dtype)
            out = out.reshape(shape)
            if decl.padding is not None:
                out.fill(0)
        keep: list = [slice(None)] * nd               # param coordinates
        src_ranges = list(ranges)
        if decl.padding is not None:       # padded axis: real entries -> stored rows
            ax = decl.padding.axis
            size = decl.shape[ax]
            src = [decl.padding.source_index(i, size) for i in ranges[ax]]
            real = [j for j, s in enumerate(src) if s is not None]
            if not real:
                return out
            src_ranges[ax] = range(src[real[0]], src[real[-1]] + 1)
            keep[ax] = (slice(real[0], real[-1] + 1) if real[-1] - real[0] + 1 == len(real)
                        else np.array(real))
        inner = slice(1, None) if ref.per_expert else slice(None)
        inner_keep = tuple(host(keep[inner]))
        index_of = [slice(r.start, r.stop) for r in host(src_ranges[inner])]
        if ref.per_expert:
            self.workers.run([functools.partial(self._fill, ref.name(self.prefix, e), stored[e],
                                                index_of, out[j], inner_keep, None)
                              for j, e in enumerate(src_ranges[0])])
        else:
            self._fill(ref.name(self.prefix), stored[None], index_of, out, inner_keep, self.workers)
        return out

    def _fill(self, name: str, is_mxfp4: bool, index: list[slice], dest: np.ndarray,
              keep: tuple, workers: Workers | None) -> None:
        """Read stored region ``index`` of ``name`` (decoding MXFP4) into
        ``dest[keep]``, and check it; straight into place when it can be."""
        if is_mxfp4:
            dest[keep] = self._read_mxfp4(name, index)   # casts to dest.dtype
            return
        stored_dtype = STORED_DTYPES[self.reader.info(name)[0]]
        target = dest[keep] if all(isinstance(k, slice) for k in keep) else None
        direct = (target is not None and stored_dtype == dest.dtype
                  and target.strides[-1] == dest.itemsize)
        block = self.reader.read(name, index, out=target if direct else None, workers=workers)
        if name.endswith(".weight_scale"):   # packed MXFP4 scales: reject NaN bytes here too
            self._validate_scales(name, block)
        elif block.dtype != np.uint8:
            self._check_finite(name, block, index, workers)
        if not direct:
            dest[keep] = block                           # casts to dest.dtype

    def _check_finite(self, name: str, block: np.ndarray, index: list[slice],
                      workers: Workers | None = None) -> None:
        """Reject NaN or inf weights, naming the tensor and the first bad element."""
        bad = first_nonfinite(block, workers)
        if bad is not None:
            at = [int(i) + s.start for i, s in zip(bad, index)]
            raise CheckpointError(f"tensor {self.reader.full_name(name)} holds NaN or inf "
                                  f"(the first at index {at})")

    def _validate_scales(self, scale_name: str, scales: np.ndarray) -> None:
        if scales.dtype == np.uint8 and (scales.size == 0 or scales.max() < SCALE_NAN):
            return                                     # no NaN byte: skip the full scan
        try:
            validate_scales(scales)
        except ValueError as e:
            raise CheckpointError(f"tensor {self.reader.full_name(scale_name)}: {e}") from None

    def _read_mxfp4(self, name: str, index: list[slice]) -> np.ndarray:
        """Rows ``index[0]`` and inputs ``index[1]`` of an MXFP4 weight, decoded."""
        rows, cols = index
        packed_name, scale_name = mxfp4_names(name)
        first_block = cols.start // BLOCK_SIZE
        last_block = math.ceil(cols.stop / BLOCK_SIZE)
        packed = self.reader.read(packed_name, [rows, slice(first_block * BLOCK_SIZE // 2,
                                                            last_block * BLOCK_SIZE // 2)])
        scales = self.reader.read(scale_name, [rows, slice(first_block, last_block)])
        self._validate_scales(scale_name, scales)
        values = dequant_numpy(packed, scales)
        offset = first_block * BLOCK_SIZE
        return values[:, cols.start - offset: cols.stop - offset]
