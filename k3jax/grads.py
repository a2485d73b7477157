"""Gradients of one layer (dense KimiMLP or KimiMoE) in its own layout.

    layer_grads(module, x_TD, dy_TD) -> LayerGrads(dx_TD, {param path: grad}, frozen)

One jitted program per layout runs the forward and its VJP for a cotangent
dy_TD [T, D]: dx_TD [T, D] (x's dtype) and the gradient of every trainable
weight, with that weight's shape, dtype and sharding (a sharded weight's
gradient stays sharded: nothing is gathered). The backward's collectives
mirror the forward's (all-gather <-> reduce-scatter over the same axes), and
the gradients of weights replicated over the token axes are all-reduced over
those axes (each device saw only its own rows).

Trainable: the floating-point ``nnx.Param``s, except the router's
``router_bias_E`` (checkpoint ``gate.e_score_correction_bias``), which only
selects experts: top-k selection is piecewise constant, so its gradient is
zero; K3 adjusts it by load balancing instead (notebook 04). Gradients reach
the router weights through the selected sigmoid scores, not through the
selection.

Frozen: routed experts in a packed format (k3jax.formats; e.g. MXFP4's uint8
codes and scales): their integer arrays have no gradient; the gradient flows
through their dequantized values to the input and the other weights only.
``LayerGrads.frozen`` names every parameter left out, and :func:`trainable`
is the nnx filter that decides.

``checkpoint_tensors`` turns gradients (or weights) into the checkpoint's
tensors (docs/spec.md §3 names, [out, in], one per expert, MoE padding removed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.checkpoint.names import layer_prefix, layer_tensors
from k3jax.modules.mlp import KimiMLP, mlp_decls
from k3jax.modules.moe import SHARED_PREFIX, KimiMoE, moe_decls
from k3jax.modules.params import ParamDecl

SELECTION_ONLY = ("router_bias_E",)   # used for expert selection only: zero gradient


def param_path(path: tuple) -> str:
    """An nnx state path (("shared", "gate_DF")) as a parameter name ("shared.gate_DF")."""
    return ".".join(map(str, path))


def trainable(path: tuple, variable) -> bool:
    """The nnx filter of the weights that get gradients: floating-point
    ``nnx.Param``s other than the selection-only router bias."""
    return (isinstance(variable, nnx.Param)
            and jnp.issubdtype(variable.get_value().dtype, jnp.floating)
            and path[-1] not in SELECTION_ONLY)


@dataclasses.dataclass(frozen=True)
class LayerGrads:
    """y_TD [T, D]: the forward's output (module dtype); dx_TD [T, D] in x's
    dtype; weights: {param path: gradient} with each parameter's shape, dtype
    and sharding; frozen: the parameters without a gradient (the
    selection-only bias, a packed format's integer arrays)."""

    y_TD: jax.Array
    dx_TD: jax.Array
    weights: dict[str, jax.Array]
    frozen: tuple[str, ...]


def split_trainable(module: KimiMLP | KimiMoE):
    """(graphdef, trainable state, frozen state) of ``module``."""
    return nnx.split(module, trainable, ...)


def layer_grads(module: KimiMLP | KimiMoE, x_TD: jax.Array, dy_TD: jax.Array) -> LayerGrads:
    """Forward of ``module`` on x_TD [T, D] and its VJP for dy_TD [T, D]
    (cast to the module's dtype). Raises ValueError naming the argument
    whose shape is wrong."""
    if not isinstance(module, (KimiMLP, KimiMoE)):
        raise TypeError(f"layer_grads: expected a KimiMLP or KimiMoE, got {type(module).__name__}")
    D = _hidden(module)
    if x_TD.ndim != 2 or x_TD.shape[1] != D:
        raise ValueError(f"layer_grads: x_TD must be [T, {D}], got {list(x_TD.shape)}")
    if tuple(dy_TD.shape) != tuple(x_TD.shape):
        raise ValueError(f"layer_grads: dy_TD must have x_TD's shape {list(x_TD.shape)}, "
                         f"got {list(dy_TD.shape)}")
    _, params, frozen = split_trainable(module)
    y_TD, dx_TD, grads = grad_program(module)(params, frozen, x_TD, dy_TD)
    flat = {param_path(path): v.get_value() for path, v in nnx.to_flat_state(grads)}
    return LayerGrads(y_TD, dx_TD, flat, tuple(param_path(p) for p, _ in nnx.to_flat_state(frozen)))


_PROGRAMS: dict = {}


def grad_program(module: KimiMLP | KimiMoE):
    """The jitted f(params, frozen, x_TD, dy_TD) -> (y_TD, dx_TD, gradient state)
    that ``layer_grads`` runs (params, frozen: ``split_trainable``'s states);
    one per layout, dtype and backend, shared by every module of that kind
    (so tests and training loops compile it once). Lower it to read the HLO."""
    if isinstance(module, KimiMoE):
        key = (KimiMoE, module.layout, module.mesh)   # the Layout holds dtype, backend, storage
    else:
        key = (KimiMLP, module.layout, module.act, module.mesh, module.dtype, module.backend)
    if key not in _PROGRAMS:
        graphdef = nnx.graphdef(module)

        @jax.jit
        def program(params, frozen, x_TD, dy_TD):
            def forward(x_TD, params):
                return nnx.merge(graphdef, params, frozen)(x_TD)

            y_TD, pullback = jax.vjp(forward, x_TD, params)
            return y_TD, *pullback(dy_TD.astype(y_TD.dtype))

        _PROGRAMS[key] = program
    return _PROGRAMS[key]


def _hidden(module: KimiMLP | KimiMoE) -> int:
    return module.cfg.hidden_size if isinstance(module, KimiMoE) else module.layout.hidden


def module_decls(module: KimiMLP | KimiMoE) -> dict[str, ParamDecl]:
    """{param path: declaration} of every parameter of ``module``."""
    if isinstance(module, KimiMoE):
        decls = moe_decls(module.layout) + mlp_decls(module.shared.layout, module.dtype,
                                                     SHARED_PREFIX)
    else:
        decls = mlp_decls(module.layout, module.dtype)
    return {d.name: d for d in decls}


def checkpoint_tensors(module: KimiMLP | KimiMoE, layer: int,
                       arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{param path: whole array in the parameter's shape} (gradients, or
    weights) -> {checkpoint tensor name (docs/spec.md §3): array}: [out, in] as stored,
    one tensor per routed expert, the MoE intermediate padding (docs/spec.md §5)
    removed. Names carry ``model.layers.{layer}.`` and no ``language_model.``."""
    is_moe = isinstance(module, KimiMoE)
    prefix, refs = layer_prefix(layer, is_moe), layer_tensors(is_moe)
    decls = module_decls(module)
    out: dict[str, np.ndarray] = {}
    for path, a in arrays.items():
        decl, ref = decls[path], refs[path]
        a = np.asarray(a)
        if a.shape != decl.shape:
            raise ValueError(f"checkpoint_tensors: {path} must be {list(decl.shape)}, "
                             f"got {list(a.shape)}")
        if decl.padding is not None:
            size = decl.shape[decl.padding.axis]
            real = [i for i in range(size) if decl.padding.source_index(i, size) is not None]
            a = np.take(a, real, axis=decl.padding.axis)
        if ref.per_expert:
            for e in range(a.shape[0]):
                out[ref.name(prefix, e)] = np.ascontiguousarray(a[e].T if ref.transpose else a[e])
        else:
            out[ref.name(prefix)] = np.ascontiguousarray(a.T if ref.transpose else a)
    return out


__all__ = ["LayerGrads", "SELECTION_ONLY", "checkpoint_tensors", "grad_program", "layer_grads",
           "module_decls", "param_path", "split_trainable", "trainable"]
