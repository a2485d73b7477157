"""load_layer: one checkpoint layer as a module, placed by the layout."""

from __future__ import annotations

import math
import os
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.reader import CheckpointReader
from k3jax.checkpoint.source import CheckpointSource, local_blocks
from k3jax.layout import ExpertStorage, ParallelConfig, make_layout, make_mesh
from k3jax.modules import KimiMLP, KimiMoE, build_layer, layer_decls
from pallas_kernels.backend import Backend

Mxfp4Mode = Literal["packed", "dequantize"]


def load_layer(checkpoint: str | os.PathLike | CheckpointReader, layer: int,
               parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
               dtype=jnp.float32, backend: Backend = "auto",
               mxfp4: Mxfp4Mode = "packed", progress: bool = False) -> KimiMLP | KimiMoE:
    """Layer ``layer`` (0 = dense MLP, >= 1 = MoE for K3) of a checkpoint
    directory, each device's shard read straight from the files.

    Every tensor the layer needs is checked (name, shape, dtype, from the
    file headers) before any data is read. MXFP4 routed experts stay packed
    in device memory (``mxfp4="packed"``, 0.53125 B per parameter,
    dequantized in the forward) or are dequantized to ``dtype`` on load
    (``"dequantize"``). ``progress`` shows a bar on a terminal's stderr, in
    bytes read. The Layout is made here, once, from the checkpoint's config,
    ``mesh`` (which resolves ``backend``), ``dtype`` and the expert storage
    (ExpertStorage.MXFP4 for packed MXFP4 experts, MXFP4_DEQUANT for MXFP4
    experts dequantized on load, DENSE for float experts); the module reads
    it. Raises k3jax.layout.LayoutError when ``parallel`` cannot hold the
    layer (its subclass Mxfp4ShardError when only packed MXFP4 cannot:
    ``mxfp4="dequantize"`` avoids it), CheckpointError for a checkpoint problem."""
    if mxfp4 not in ("packed", "dequantize"):
        raise ValueError(f"mxfp4 must be 'packed' or 'dequantize', got {mxfp4!r}")
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    source = CheckpointSource(reader, layer)
    experts = ExpertStorage.DENSE
    if source.experts_are_mxfp4:
        experts = ExpertStorage.MXFP4 if mxfp4 == "packed" else ExpertStorage.MXFP4_DEQUANT
    mesh = make_mesh(parallel) if mesh is None else mesh
    layout = make_layout(reader.config, parallel, mesh, backend=backend, experts=experts,
                         dtype=dtype)
    decls = layer_decls(layout, layer)
    source.check(decls)
    if not progress:
        return build_layer(layout, layer, mesh, source=source)
    from tqdm import tqdm
    total = sum(math.prod(len(range(*s.indices(n))) for s, n in zip(index, d.shape))
                * np.dtype(d.dtype).itemsize
                for d in decls for index, _ in local_blocks(d.shape, NamedSharding(mesh, d.spec)))
    with tqdm(total=total, desc=f"loading layer {layer}", unit="B", unit_scale=True,
              unit_divisor=1024, disable=None, leave=False) as bar:
        source.on_block = bar.update
        return build_layer(layout, layer, mesh, source=source)
