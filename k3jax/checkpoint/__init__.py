"""Checkpoints: tensor names (one table), sliced safetensors reading, MXFP4
tensors (codes + scales; the codec is pallas_kernels.mxfp4), loading layers
straight onto devices, saving a layer (``save_layer``: what ``load_layer``
reads back bit-exact), and synthetic writing."""

from k3jax.checkpoint.load import Mxfp4Mode, load_layer, load_layers, read_layers
from k3jax.checkpoint.reader import CheckpointError, CheckpointReader
from k3jax.checkpoint.save import checkpoint_tensors, save_layer
from k3jax.checkpoint.source import CheckpointSource
from k3jax.checkpoint.writer import make_synthetic_checkpoint, synthetic_tensors, write_checkpoint

__all__ = ["load_layer", "load_layers", "read_layers", "save_layer", "checkpoint_tensors",
           "CheckpointError", "CheckpointReader", "CheckpointSource", "Mxfp4Mode",
           "make_synthetic_checkpoint", "synthetic_tensors", "write_checkpoint"]
