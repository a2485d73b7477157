"""Checkpoints: tensor names (one table), sliced safetensors reading, MXFP4
tensors (codes + scales; the codec is pallas_kernels.mxfp4), loading layers
straight onto devices, and synthetic writing."""

from k3jax.checkpoint.load import load_layer, load_layers, read_layers
from k3jax.checkpoint.reader import CheckpointError, CheckpointReader
from k3jax.checkpoint.source import CheckpointSource
from k3jax.checkpoint.writer import make_synthetic_checkpoint, synthetic_tensors, write_checkpoint

__all__ = ["load_layer", "load_layers", "read_layers", "CheckpointError", "CheckpointReader",
           "CheckpointSource", "make_synthetic_checkpoint", "synthetic_tensors", "write_checkpoint"]
