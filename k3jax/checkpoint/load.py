"""load_layer: one checkpoint layer as a module, placed by the layout."""

from __future__ import annotations

import os

import jax.numpy as jnp

from pallas_kernels.backend import Backend

from k3jax.checkpoint.reader import CheckpointReader
from k3jax.checkpoint.source import CheckpointSource
from k3jax.layout import ParallelConfig, make_layout, make_mesh
from k3jax.modules import KimiMLP, KimiMoE, build_layer


def load_layer(checkpoint: str | os.PathLike | CheckpointReader, layer: int,
               parallel: ParallelConfig = ParallelConfig(), mesh=None, *,
               dtype=jnp.float32, backend: Backend = "auto") -> KimiMLP | KimiMoE:
    """Layer ``layer`` (0 = dense MLP, >= 1 = MoE for K3) of a checkpoint
    directory, each device's shard read straight from the files."""
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    source = CheckpointSource(reader, layer)
    layout = make_layout(reader.config, parallel)
    mesh = make_mesh(parallel) if mesh is None else mesh
    return build_layer(layout, layer, mesh, source=source, dtype=dtype, backend=backend)
