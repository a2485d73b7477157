"""Grouped (ragged, MoE) matmul and fused gate/up + SiTU-GLU; see api.py."""

from pallas_kernels.grouped_matmul.api import grouped_matmul, grouped_situ_glu

__all__ = ["grouped_matmul", "grouped_situ_glu"]
