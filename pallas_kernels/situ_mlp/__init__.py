"""Fused dense/shared MLP up-projection with SiTU-GLU; see api.py."""

from pallas_kernels.situ_mlp.api import situ_mlp_up

__all__ = ["situ_mlp_up"]
