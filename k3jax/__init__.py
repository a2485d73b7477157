"""k3jax: the Kimi K3 mixture-of-experts block in JAX.

Data flows one way: config -> layout -> modules -> kernels.

    from k3jax import TINY, ParallelConfig, make_layout, make_mesh, build_layer, RandomSource
    parallel = ParallelConfig(dp=1, tp=8, sequence_parallel=True, expert_parallel=True)
    layout = make_layout(TINY, parallel)
    moe = build_layer(layout, 1, make_mesh(parallel), source=RandomSource(0))
    y_TD = moe(x_TD)
"""

from k3jax.config import K3, PRESETS, TINY, TINY_GROUPED, K3Config, from_hf_config, preset
from k3jax.layout import (
                          DATA,
                          MESH_AXES,
                          TENSOR,
                          Layout,
                          MlpLayout,
                          MlpMode,
                          MoEMode,
                          ParallelConfig,
                          abstract_mesh,
                          make_layout,
                          make_mesh,
                          mlp_layout,
                          padded_moe_intermediate,
)
from k3jax.modules import AbstractSource, KimiMLP, KimiMoE, ParamSource, RandomSource, build_layer
from k3jax.ops import SiTU, rms_norm, route, routed_experts, situ_mlp

__all__ = [
    "K3", "PRESETS", "TINY", "TINY_GROUPED", "K3Config", "from_hf_config", "preset",
    "DATA", "MESH_AXES", "TENSOR", "Layout", "MlpLayout", "MlpMode", "MoEMode", "ParallelConfig",
    "abstract_mesh", "make_layout", "make_mesh", "mlp_layout", "padded_moe_intermediate",
    "AbstractSource", "KimiMLP", "KimiMoE", "ParamSource", "RandomSource", "build_layer",
    "SiTU", "rms_norm", "route", "routed_experts", "situ_mlp",
]
