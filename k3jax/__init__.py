"""k3jax: the Kimi K3 mixture-of-experts block in JAX.

Data flows one way: config -> layout -> modules -> kernels.

    from k3jax import TINY, ParallelConfig, make_layout, make_mesh, build_layer, RandomSource
    parallel = ParallelConfig(dp=1, tp=8, sequence_parallel=True, expert_parallel=True)
    mesh = make_mesh(parallel)
    layout = make_layout(TINY, parallel, mesh)   # placement, backend, expert storage, dtype
    moe = build_layer(layout, 1, mesh, source=RandomSource(0))
    y_TD = moe(x_TD)
"""

import importlib

# Public name -> the submodule that defines it. Imported on first use (PEP 562),
# so ``import k3jax.config`` or ``import k3jax.reference`` (torch only) does
# not pay for jax and flax.
_EXPORTS = {
    "k3jax.config": ("K3", "PRESETS", "TINY", "TINY_GROUPED", "K3Config", "from_hf_config",
                     "preset"),
    "k3jax.layout.parallel": ("DATA", "MESH_AXES", "NODE", "TENSOR", "EpDispatch", "ParallelConfig",
                              "SharedOverlap", "abstract_mesh", "make_mesh"),
    "k3jax.layout": ("ExpertStorage", "Layout", "LayoutError", "MlpLayout", "MlpMode", "MoEMode",
                     "Mxfp4ShardError", "make_layout", "mlp_layout", "padded_moe_intermediate"),
    "k3jax.modules": ("AbstractSource", "KimiMLP", "KimiMoE", "ParamSource", "RandomSource",
                      "build_layer"),
    "k3jax.ops": ("SiTU", "rms_norm", "route", "routed_experts", "situ_mlp"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'k3jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

