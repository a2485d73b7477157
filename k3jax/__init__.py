"""k3jax: the Kimi K3 mixture-of-experts block in JAX.

Data flows one way: config -> layout -> modules -> kernels.

    from k3jax import TINY, ParallelConfig, make_layout, make_mesh, build_layer, RandomSource
    parallel = ParallelConfig(dp=1, tp=8, sequence_parallel=True, expert_parallel=True)
    mesh = make_mesh(parallel)
    layout = make_layout(TINY, parallel, mesh)   # placement, backend, expert storage, dtype
    moe = build_layer(layout, 1, mesh, source=RandomSource(0))
    y_TD = moe(x_TD)

JAX's platform: importing k3jax sets JAX_PLATFORMS=cpu when the user has
not chosen a platform (JAX_PLATFORMS unset) and the machine has no NVIDIA
GPU (no device node /dev/nvidiactl or /dev/nvidia0). With the CUDA plugin
installed (the gpu-compile extra) and no GPU, JAX's default platform search
would otherwise try CUDA first and print a "cuInit(0) failed" traceback
before falling back to the CPU. Where jax was imported first, its
``jax_platforms`` option is set instead, unless already set. A chosen
platform is never changed. Importing k3jax does not import jax.
"""

import importlib
import os
import sys

NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")
"""Device nodes the NVIDIA driver creates: where none exists there is no NVIDIA GPU."""


def default_to_cpu(environ=os.environ, device_nodes=NVIDIA_DEVICE_NODES) -> str | None:
    """Choose the CPU as JAX's platform where nothing was chosen and no NVIDIA
    GPU exists (module docstring). Returns JAX_PLATFORMS as it now stands in
    ``environ`` (None: unset, JAX decides)."""
    if "JAX_PLATFORMS" in environ or any(os.path.exists(node) for node in device_nodes):
        return environ.get("JAX_PLATFORMS")
    environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")   # imported before k3jax: it read JAX_PLATFORMS already
    if jax is not None and environ is os.environ and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    return "cpu"


default_to_cpu()

# Public name -> the submodule that defines it. Imported on first use (PEP 562),
# so ``import k3jax.config`` or ``import k3jax.reference`` (torch only) does
# not pay for jax and flax.
_EXPORTS = {
    "k3jax.config": ("K3", "PRESETS", "TINY", "TINY_GROUPED", "K3Config", "from_hf_config",
                     "preset"),
    "k3jax.layout.parallel": ("DATA", "MESH_AXES", "NODE", "TENSOR", "EpDispatch", "ParallelConfig",
                              "SharedOverlap", "abstract_mesh", "make_mesh"),
    "k3jax.layout": ("ExpertShardError", "Layout", "LayoutError", "MlpLayout", "MlpMode", "MoEMode",
                     "Mxfp4ShardError", "make_layout", "mlp_layout", "padded_moe_intermediate"),
    "k3jax.formats": ("ExpertStorage", "WeightFormat", "get_format", "register_format"),
    "k3jax.modules": ("AbstractSource", "KimiMLP", "KimiMoE", "ParamSource", "RandomSource",
                      "RngsSource", "build_layer"),
    "k3jax.variables": ("WEIGHTS", "PackedWeight", "RouterBias", "update_router_bias"),
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

