"""CheckpointSource: fills module parameters straight from checkpoint slices.

Each parameter is assembled by ``pipeline.place_blocks``: for every
distinct device block this process holds, ``_read_block`` reads exactly that
block's region of the stored tensors into one host buffer in the STORED
orientation ([out, in] per weight, experts stacked, zero padding written):
each stored piece (one expert's slice, one tensor's slice) is read once,
straight into its place, by a pool of worker threads (pieces of one block in
parallel, a large piece split into chunks), and checked there (NaN / inf on
the bits; a format's raw tensors by its check, e.g. MXFP4 scales). On an
accelerator the block goes to its devices and the parameter's device op
(``device_op``) runs there: the transpose of a parameter held [in, out],
the word interleave of a packed format's expert codes (held [E, out, in/2]).
A float expert weight stored in a codec format's tensors (k3jax.formats:
e.g. MXFP4 codes and scales) is decoded by that format as it is read. On
CPU devices the same op runs on the host as the block is read
(``host_op``, k3jax.checkpoint.slabs: slab by slab, each result written
once into the block, which is then the parameter and which the devices
alias). A parameter held as stored (1-D tensors) is the block itself:
nothing but the transfer happens to it, and none on a CPU device, which
aliases the block. With ``read_ahead`` a thread reads the blocks in the
order they will be placed, into reused staging buffers those that are
copied and dropped (those a device op changes; on an accelerator, all; the
pipeline module says how reading overlaps the device work). No process ever
materialises a whole layer, nor even its whole share of one parameter.
Redundant expert slots: each expert read once (k3jax.checkpoint.replicas).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.host import Workers, aligned_empty, first_nonfinite
from k3jax.checkpoint.names import TensorRef, layer_prefix, layer_tensors
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
from k3jax.checkpoint.replicas import ReplicaCache
from k3jax.checkpoint.slabs import INTERLEAVE, TRANSPOSE, HostOp, slabs
from k3jax.formats import WeightFormat, codecs
from k3jax.formats.dense import PARAM_NAMES as DENSE_EXPERTS
from k3jax.modules.params import ParamDecl


def device_op(ref: TensorRef) -> DeviceOp | None:
    """What the devices do to a block of ``ref`` read as stored: transpose a
    weight stored [out, in] (and a packed format's scales), interleave a
    packed format's codes into the word layout its kernels read; nothing to
    the rest."""
    if ref.transpose:
        return swap_last_axes
    return interleave_codes if ref.interleave else None


def host_op(ref: TensorRef) -> HostOp | None:
    """``device_op(ref)`` as the host runs it on CPU devices, slab by slab
    as the block is read (k3jax.checkpoint.slabs); the same bytes result."""
    if ref.transpose:
        return TRANSPOSE
    return INTERLEAVE if ref.interleave else None


def ops_on_host(mesh) -> bool:
    """Whether the parameters' ops run on the host as blocks are read (CPU
    devices, which alias a host block) rather than on the devices after it
    is copied there (accelerators)."""
    return not devices_copy_blocks(mesh)


def _host_device(device: jax.Device) -> jax.Device:
    """Where a host op for a block on ``device`` computes: ``device`` when it
    is a CPU device, else this process's first CPU device."""
    return device if device.platform == "cpu" else jax.local_devices(backend="cpu")[0]


def _block_shape(index, shape) -> tuple[int, ...]:
    """The extents of the block ``index`` (slices) of an array of ``shape``."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _slabs_of(index, decl: ParamDecl, ref: TensorRef, op: HostOp) -> list[tuple[tuple, tuple]]:
    """[(the slab as slices of the block, the slab as an index of ``decl``)]
    for block ``index`` of ``decl`` under ``ref``'s host op ``op``."""
    shape = _block_shape(index, decl.shape)
    starts = [s.indices(n)[0] for s, n in zip(index, decl.shape)]
    return [(part, tuple(slice(a + p.indices(n)[0], a + p.indices(n)[1])
                         for a, p, n in zip(starts, part, shape)))
            for part in slabs(shape, np.dtype(decl.dtype).itemsize,
                              -1 if ref.transpose else -2, op.slab_bytes)]


class CheckpointSource:
    """A ParamSource for layer ``layer`` of the checkpoint behind ``reader``.

    ``on_block(nbytes)``, when given, is called after each device block is
    read. ``workers`` (default: a pool of one thread per core) read the
    pieces of a block, or its slabs; ``staging`` (default: its own) holds
    the reused buffers: those of the blocks read ahead that a device op
    changes, and the slab buffers of the host ops. ``host_ops`` says where
    the parameters' ops run: on the host as blocks are read (True), on the
    devices (False), or as ``ops_on_host`` says for the mesh (None).
    Call ``close()`` after the last parameter."""

    def __init__(self, reader: CheckpointReader, layer: int,
                 on_block: Callable[[int], None] | None = None, workers: Workers | None = None,
                 staging: Staging | None = None, host_ops: bool | None = None):
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
        self.host_ops = host_ops
        self._in_flight = InFlight()
        self._prefetch: Prefetcher | None = None
        self._stored: dict[str, dict[int | None, WeightFormat | None]] = {}   # _check's answers
        self._facts: list | None = None   # stored_fact's, one per stored piece
        self._fact_of: Callable[[np.ndarray], Any] | None = None
        self._replicas = ReplicaCache()   # regions of experts in redundant slots

    @property
    def experts_codec(self) -> WeightFormat | None:
        """The codec format (k3jax.formats.codecs) in whose tensors this MoE
        layer stores ALL its routed experts, or None (float experts; a layer
        mixing float and encoded experts can only be loaded dequantized)."""
        if not self.is_moe:
            return None
        names = [self.tensors[w].name(self.prefix, e) for w in DENSE_EXPERTS
                 for e in range(self.reader.config.num_experts)]
        return next((fmt for fmt in codecs()
                     if all(self.reader.has(fmt.stored_names(n)[0]) for n in names)), None)

    def check(self, decls: Sequence[ParamDecl]) -> None:
        """Validate every stored tensor behind ``decls`` (names, shapes and
        dtypes, from the file headers) before any tensor data is read."""
        for decl in decls:
            self._stored[decl.name] = self._check(decl, self.tensors[decl.name])

    def stored_fact(self, fmt: WeightFormat, decls: Sequence[ParamDecl], mesh) -> Any:
        """The static fact of ``fmt`` (e.g. the in-kernel dequant a packed
        format's scale bytes allow) that the stored bytes of its
        ``fact_params`` among ``decls`` (checked) decide on this process:
        every block of theirs this process's devices hold on ``mesh`` is
        read (on the workers, checked as placing checks it), passed to
        ``fmt.fact_of`` and dropped (zero padding is not stored: it does not
        count); ``fmt.combine_facts`` of them. None when ``decls`` hold none
        of them. Placing reads them again. Each process sees its own blocks
        only: the loader agrees the fact across processes (fmt.agree_facts)."""
        fact_decls = [d for d in decls if d.name in fmt.fact_params]
        if not fact_decls:
            return None
        self._facts, self._fact_of = [], fmt.fact_of   # _fill adds each stored piece's
        try:
            for decl in fact_decls:
                ref = self.tensors[decl.name]
                for index, _ in local_blocks(decl.shape, NamedSharding(mesh, decl.spec)):
                    self._read_block(decl, ref, self._stored[decl.name], index)
            return fmt.combine_facts(self._facts)
        finally:
            self._facts = self._fact_of = None

    def read_ahead(self, decls: Sequence[ParamDecl], mesh) -> list[BlockKey]:
        """Start reading the blocks of ``decls`` (checked, in the order they
        will be asked for, on ``mesh``) on a thread, so that reading overlaps
        the transfer and device work of the blocks before, within the
        Prefetcher's byte budget, in staging buffers those that are copied
        and dropped (those a device op changes; on an accelerator, all; a
        block changed by its host op is the parameter). The host ops are
        compiled here first, for every slab shape the blocks have, so that
        no read waits for XLA. Returns the blocks' keys in that order."""
        copied = devices_copy_blocks(mesh)
        plan, compile_for = [], set()
        for decl in decls:
            ref = self.tensors[decl.name]
            sharding = NamedSharding(mesh, decl.spec)
            on_host = self._on_host(ref, mesh)
            for index, devices in local_blocks(decl.shape, sharding):
                plan.append(((decl.name, block_key(index, decl.shape)),
                             block_nbytes(index, decl.shape, decl.dtype),
                             copied or (device_op(ref) is not None and not on_host),
                             (decl, ref, self._stored[decl.name], index,
                              _host_device(devices[0]) if on_host else None)))
                if on_host:
                    op = host_op(ref)
                    compile_for |= {(op, _block_shape(sub, decl.shape), np.dtype(decl.dtype),
                                     _host_device(devices[0]))
                                    for _, sub in _slabs_of(index, decl, ref, op)}
        for op, shape, dtype, device in compile_for:
            op.compile(shape, dtype, device)
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

    def _on_host(self, ref: TensorRef, mesh) -> bool:
        """Whether ``ref``'s op (if any) runs on the host as its blocks are read."""
        on_host = ops_on_host(mesh) if self.host_ops is None else self.host_ops
        return on_host and host_op(ref) is not None

    def _read_counted(self, decl, ref, stored, index, op_device: jax.Device | None = None,
                      into: np.ndarray | None = None) -> np.ndarray:
        block = self._read_block(decl, ref, stored, index, into, op_device)
        if self.on_block is not None:
            self.on_block(block.nbytes)
        return block

    def __call__(self, decl: ParamDecl, sharding: NamedSharding) -> jax.Array:
        ref = self.tensors[decl.name]
        if decl.name not in self._stored:
            self._stored[decl.name] = self._check(decl, ref)
        stored = self._stored[decl.name]

        on_host = self._on_host(ref, sharding.mesh)
        op_device = (_host_device(min(sharding.addressable_devices, key=lambda d: d.id))
                     if on_host else None)

        def read(index):
            if self._prefetch is not None:
                return self._prefetch.take((decl.name, block_key(index, decl.shape)))
            return self._read_counted(decl, ref, stored, index, op_device)
        return place_blocks(decl.shape, sharding, read,
                            device_op=None if on_host else device_op(ref),
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
            self._replicas.clear()

    # -- validation -------------------------------------------------------------
    def _stored_shape(self, decl: ParamDecl, ref: TensorRef) -> tuple[int, ...]:
        """Shape of one stored tensor: unpadded, per expert, [out, in]."""
        shape = list(decl.shape)
        if decl.padding is not None:
            shape[decl.padding.axis] = decl.padding.real
        if ref.per_expert:
            shape = shape[1:]
        return tuple(reversed(shape)) if ref.transpose else tuple(shape)

    def _check(self, decl: ParamDecl, ref: TensorRef) -> dict[int | None, WeightFormat | None]:
        """Validate every stored tensor behind ``decl``; map expert -> the
        codec format its float weight is stored in (None: as stored)."""
        out, *rest = self._stored_shape(decl, ref)
        experts = range(decl.num_logical) if ref.per_expert else [None]   # logical experts
        stored = {}
        for e in experts:
            name = ref.name(self.prefix, e)
            stored[e] = None
            if ref.raw:
                self.reader.check(name, (out, *rest), set(ref.dtypes))
                continue
            if self.reader.has(name) or not ref.per_expert:
                self.reader.check(name, (out, *rest), FLOAT_DTYPES)
                continue
            fmt = next((f for f in codecs() if any(map(self.reader.has, f.stored_names(name)))),
                       None)
            if fmt is None:
                forms = "; ".join(f"{f.name}: " + ", ".join(n.rsplit(".", 1)[-1]
                                                           for n in f.stored_names(name))
                                  for f in codecs())
                raise CheckpointError(f"missing tensor {self.reader.full_name(name)} (nor its "
                                      f"encoded forms, {forms}) in {self.reader.directory}")
            try:
                fmt.check_stored(self.reader.check, name, out, *rest)
            except ValueError as err:
                raise CheckpointError(f"tensor {self.reader.full_name(fmt.stored_names(name)[0])}: "
                                      f"{err}") from None
            stored[e] = fmt
        return stored

    # -- reading one device block ------------------------------------------------
    def _read_block(self, decl: ParamDecl, ref: TensorRef, stored: dict, index,
                    into: np.ndarray | None = None,
                    op_device: jax.Device | None = None) -> np.ndarray:
        """The block ``index`` of ``decl`` as one aligned host array: as
        stored (``_read_stored``), or, with ``op_device``, the parameter's
        block itself with ``ref``'s host op applied slab by slab by the
        workers, in fresh memory (``into`` is not used then)."""
        op = host_op(ref) if op_device is not None else None
        if op is None:
            return self._read_stored(decl, ref, stored, index, into, self.workers)
        out = aligned_empty(_block_shape(index, decl.shape), decl.dtype)   # each slab writes its part
        self.workers.run([functools.partial(self._slab, decl, ref, stored, sub, out[part], op,
                                            op_device)
                          for part, sub in _slabs_of(index, decl, ref, op)])
        return out

    def _slab(self, decl: ParamDecl, ref: TensorRef, stored: dict, index, dest: np.ndarray,
              op: HostOp, device: jax.Device) -> None:
        """Read the sub-block ``index`` of ``decl`` as stored into a slab
        buffer (on this thread alone) and write ``op``'s result into ``dest``."""
        buffer = self.staging.slabs.take(dest.nbytes)
        try:
            op.apply(self._read_stored(decl, ref, stored, index, buffer, None), dest, device)
        finally:
            self.staging.slabs.give(buffer)

    def _read_stored(self, decl: ParamDecl, ref: TensorRef, stored: dict, index,
                     into: np.ndarray | None, workers: Workers | None) -> np.ndarray:
        """The block ``index`` of ``decl``, with its last two axes swapped when
        ``ref.transpose`` (the stored [out, in] orientation), as one aligned
        host array (a view of the aligned uint8 buffer ``into`` when given,
        else fresh), read by ``workers`` (None: this thread); padding
        entries are zero."""
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
        if ref.per_expert:   # a job per logical expert, filling its slots (checkpoint.replicas)
            jobs = self._replicas.jobs(decl, src_ranges[0], out, inner_keep, ref.check, lambda e: (
                functools.partial(self._fill, ref.name(self.prefix, e), stored[e], index_of)))
            if workers is None:
                for job in jobs:
                    job()
            else:
                workers.run(jobs)
        else:
            self._fill(ref.name(self.prefix), stored[None], index_of, out, inner_keep, workers,
                       ref.check)
        return out

    def _fill(self, name: str, codec: WeightFormat | None, index: list[slice], dest: np.ndarray,
              keep: tuple, workers: Workers | None,
              check: Callable[[np.ndarray], None] | None = None) -> None:
        """Read stored region ``index`` of ``name`` (decoded by ``codec``
        when its float weight is stored in that format's tensors) into
        ``dest[keep]``, and check it (a raw tensor by ``check``, a float one
        for NaN / inf); straight into place when it can be."""
        if codec is not None:   # casts to dest.dtype
            dest[keep] = codec.decode(self._read_checked, name, *index)
            return
        stored_dtype = STORED_DTYPES[self.reader.info(name)[0]]
        target = dest[keep] if all(isinstance(k, slice) for k in keep) else None
        direct = (target is not None and stored_dtype == dest.dtype
                  and target.strides[-1] == dest.itemsize)
        block = self.reader.read(name, index, out=target if direct else None, workers=workers)
        if check is not None:   # a format's raw tensor: its own check, here too
            self._check_block(name, block, check)
            if self._fact_of is not None:   # inside stored_fact
                self._facts.append(self._fact_of(block))
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

    def _check_block(self, name: str, block: np.ndarray, check: Callable[[np.ndarray], None]) -> None:
        """A format's ``check`` of a stored block; its ValueError names the tensor."""
        try:
            check(block)
        except ValueError as e:
            raise CheckpointError(f"tensor {self.reader.full_name(name)}: {e}") from None

    def _read_checked(self, name: str, index: list[slice],
                      check: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Region ``index`` of tensor ``name`` as stored, passed to ``check``
        (a codec's reader, WeightFormat.decode)."""
        block = self.reader.read(name, index)
        if check is not None:
            self._check_block(name, block, check)
        return block
