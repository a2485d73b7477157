"""CheckpointSource: fills module parameters straight from checkpoint slices.

Each parameter is assembled by ``place_blocks``: for every distinct device
block this process holds, ``_read_block`` reads exactly that block's region
of the stored tensors (safetensors slicing), transposes, fills experts in
place, dequantizes MXFP4 and writes the zero padding; the block goes to its
devices before the next is read. No process ever materialises a whole layer,
nor even its whole share of one parameter.
"""

from __future__ import annotations

import gc
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.names import TensorRef, layer_prefix, layer_tensors, mxfp4_names
from k3jax.checkpoint.reader import FLOAT_DTYPES, CheckpointError, CheckpointReader
from k3jax.modules.params import ParamDecl
from pallas_kernels.mxfp4 import BLOCK_SIZE, dequant_numpy, validate_scales


def local_blocks(shape: Sequence[int], sharding: NamedSharding
                 ) -> list[tuple[tuple[slice, ...], list[jax.Device]]]:
    """The distinct blocks of ``shape`` that this process's devices hold under
    ``sharding``: (index, the devices holding it)."""
    shape = tuple(shape)
    groups: dict[tuple, tuple[tuple[slice, ...], list[jax.Device]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape))
        groups.setdefault(key, (index, []))[1].append(device)
    return list(groups.values())


def place_blocks(shape: Sequence[int], sharding: NamedSharding, read) -> jax.Array:
    """``jax.make_array_from_callback(shape, sharding, read)``, one block at a time.

    Each distinct block among this process's devices is read once, put on
    the devices that hold it, and dropped before the next is read: host memory
    beyond the device buffers peaks near one block. (make_array_from_callback
    keeps every local block of the parameter on the host until all are read,
    and reads a block once per device when it is replicated over a mesh axis.)"""
    shape = tuple(shape)
    arrays = []
    for index, devices in local_blocks(shape, sharding):
        block = read(index)
        placed = [jax.device_put(block, d) for d in devices]   # the CPU may alias the block
        jax.block_until_ready(placed)   # copied to an accelerator before the block is dropped
        arrays += placed
        del block, placed
        gc.collect(0)   # jax drops its reference to a copied host block in a gc hook (jax#14882)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


class CheckpointSource:
    """A ParamSource for layer ``layer`` of the checkpoint behind ``reader``.

    ``on_block(nbytes)``, when given, is called after each device block is read."""

    def __init__(self, reader: CheckpointReader, layer: int,
                 on_block: Callable[[int], None] | None = None):
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

    def __call__(self, decl: ParamDecl, sharding: NamedSharding) -> jax.Array:
        ref = self.tensors[decl.name]
        if decl.name not in self._stored:
            self._stored[decl.name] = self._check(decl, ref)
        stored = self._stored[decl.name]

        def read(index):
            block = self._read_block(decl, ref, stored, index)
            if self.on_block is not None:
                self.on_block(block.nbytes)
            return block
        return place_blocks(decl.shape, sharding, read)

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
    def _read_block(self, decl: ParamDecl, ref: TensorRef, stored: dict, index) -> np.ndarray:
        ranges = [range(*s.indices(n)) for s, n in zip(index, decl.shape)]
        block_shape = tuple(len(r) for r in ranges)
        out = np.zeros(block_shape, dtype=np.dtype(decl.dtype))
        keep = [slice(None)] * len(ranges)
        src_ranges = list(ranges)
        if decl.padding is not None:       # padded axis: real entries -> stored rows
            ax = decl.padding.axis
            size = decl.shape[ax]
            src = [decl.padding.source_index(i, size) for i in ranges[ax]]
            real = [j for j, s in enumerate(src) if s is not None]
            if not real:
                return out
            src_ranges[ax] = range(src[real[0]], src[real[-1]] + 1)
            keep[ax] = np.array(real)
        if ref.per_expert and isinstance(keep[0], slice):  # expert by expert, into the block
            rest = tuple(keep[1:])
            for j, e in enumerate(src_ranges[0]):
                out[j][rest] = self._read_2d(ref.name(self.prefix, e), stored[e], ref.transpose,
                                             src_ranges[1:])
            return out
        out[tuple(keep)] = self._read_logical(ref, stored, src_ranges)   # casts to out.dtype
        return out

    def _read_logical(self, ref: TensorRef, stored: dict, ranges: Sequence[range]) -> np.ndarray:
        """The unpadded parameter region ``ranges`` ([in, out] orientation)."""
        if ref.per_expert:
            return np.stack([self._read_2d(ref.name(self.prefix, e), stored[e], ref.transpose,
                                           ranges[1:]) for e in ranges[0]])
        return self._read_2d(ref.name(self.prefix), stored[None], ref.transpose, ranges)

    def _read_2d(self, name: str, is_mxfp4: bool, transpose: bool, ranges) -> np.ndarray:
        stored_ranges = list(reversed(ranges)) if transpose else list(ranges)
        index = [slice(r.start, r.stop) for r in stored_ranges]
        if is_mxfp4:
            block = self._read_mxfp4(name, index)
        else:
            block = self.reader.read(name, index)
            if name.endswith(".weight_scale"):   # packed MXFP4 scales: reject NaN bytes here too
                self._validate_scales(name, block)
            elif block.dtype != np.uint8:
                self._check_finite(name, block, index)
        return block.T if transpose else block

    def _check_finite(self, name: str, block: np.ndarray, index: list[slice]) -> None:
        """Reject NaN or inf weights, naming the tensor and the first bad element.
        (min and max carry NaN and inf through without a temporary array.)"""
        if block.size and not (np.isfinite(block.min()) and np.isfinite(block.max())):
            at = [int(i) + s.start for i, s in zip(np.argwhere(~np.isfinite(block))[0], index)]
            raise CheckpointError(f"tensor {self.reader.full_name(name)} holds NaN or inf "
                                  f"(the first at index {at})")

    def _validate_scales(self, scale_name: str, scales: np.ndarray) -> None:
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
