"""load_layer: one checkpoint layer as a module, placed by the layout."""

from __future__ import annotations

import os
from typing import Literal

import jax.numpy as jnp

from k3jax.checkpoint.reader import CheckpointReader
from k3jax.checkpoint.source import CheckpointSource
from k3jax.layout import ParallelConfig, make_layout, make_mesh
from k3jax.modules import KimiMLP, KimiMoE, build_layer
from k3jax.modules.moe import ExpertStorage, moe_decls
from k3jax.modules.params import ParamDecl, ParamSource
from pallas_kernels.backend import Backend

Mxfp4Mode = Literal["packed", "dequantize"]


def load_layer(checkpoint: str | os.PathLike | CheckpointReader, layer: int,
               parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
               dtype=jnp.float32, backend: Backend = "auto",
               mxfp4: Mxfp4Mode = "packed", progress: bool = False) -> KimiMLP | KimiMoE:
    """Layer ``layer`` (0 = dense MLP, >= 1 = MoE for K3) of a checkpoint
    directory, each device's shard read straight from the files.

    MXFP4 routed experts stay packed in device memory (``mxfp4="packed"``,
    0.53125 B per parameter, dequantized in the forward) or are dequantized
    to ``dtype`` on load (``"dequantize"``). ``progress`` shows a bar on a
    terminal's stderr, one step per parameter."""
    if mxfp4 not in ("packed", "dequantize"):
        raise ValueError(f"mxfp4 must be 'packed' or 'dequantize', got {mxfp4!r}")
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    source = CheckpointSource(reader, layer)
    layout = make_layout(reader.config, parallel)
    mesh = make_mesh(parallel) if mesh is None else mesh
    packed = source.experts_are_mxfp4 and mxfp4 == "packed"
    experts = ExpertStorage.MXFP4 if packed else ExpertStorage.DENSE
    if not progress:
        return build_layer(layout, layer, mesh, source=source, dtype=dtype, backend=backend,
                           experts=experts)
    from tqdm import tqdm
    count = 3 + (len(moe_decls(layout, jnp.dtype(dtype), experts)) if source.is_moe else 0)
    with tqdm(total=count, desc=f"loading layer {layer}", unit="param", disable=None,
              leave=False) as bar:
        return build_layer(layout, layer, mesh, source=_WithProgress(source, bar), dtype=dtype,
                           backend=backend, experts=experts)


class _WithProgress:
    """A ParamSource that advances ``bar`` after each parameter it fills."""

    def __init__(self, inner: ParamSource, bar):
        self.inner, self.bar = inner, bar

    def __call__(self, decl: ParamDecl, sharding):
        self.bar.set_postfix_str(decl.name, refresh=False)
        value = self.inner(decl, sharding)
        self.bar.update(1)
        return value
