"""Gradients of one layer (dense KimiMLP or KimiMoE) in its own layout.

    layer_grads(module, x_TD, dy_TD) -> LayerGrads(dx_TD, {param path: grad}, frozen)

One jitted program per layout runs the forward and its VJP for a cotangent
dy_TD [T, D]: dx_TD [T, D] (x's dtype) and the gradient of every trainable
weight, with that weight's shape, dtype and sharding (a sharded weight's
gradient stays sharded: nothing is gathered). The backward's collectives
mirror the forward's (all-gather <-> reduce-scatter over the same axes), and
the gradients of weights replicated over the token axes are all-reduced over
those axes (each device saw only its own rows).

Trainable: the ``nnx.Param``s (k3jax.variables). The router's
``router_bias_E`` (checkpoint ``gate.e_score_correction_bias``) is a
``RouterBias``: it only selects experts, top-k selection is piecewise
constant, so its gradient is zero; K3 moves it by load balancing instead
(``k3jax.variables.update_router_bias``, notebook 04). Gradients reach the
router weights through the selected sigmoid scores, not through the
selection. Routed experts in a packed format (k3jax.formats; e.g. MXFP4's
uint8 codes and scales) are ``PackedWeight``s: their integer arrays have no
gradient; the gradient flows through their dequantized values to the input
and the other weights only. So plain ``nnx.grad`` and ``nnx.Optimizer(...,
wrt=nnx.Param)`` train exactly these weights; ``LayerGrads.frozen`` names
every weight left out, and :func:`trainable` (``nnx.Param``) is the filter.

``checkpoint_tensors`` (k3jax.checkpoint.save) turns gradients (or weights)
into the checkpoint's tensors (docs/spec.md §3 names, [out, in], one per
expert, MoE padding removed). With redundant expert slots the gradients
here are per slot; ``checkpoint_tensors(..., replicas="sum")`` sums each
logical expert's slots, giving the gradient of the layer without them.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from k3jax.checkpoint.save import checkpoint_tensors, param_path
from k3jax.modules.layer import module_decls
from k3jax.modules.mlp import KimiMLP
from k3jax.modules.moe import KimiMoE

SELECTION_ONLY = ("router_bias_E",)   # the RouterBias: used for expert selection only

trainable = nnx.Param
"""The nnx filter of the weights that get gradients: the nnx.Params (the
RouterBias and PackedWeights are other Variable types)."""


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


__all__ = ["LayerGrads", "SELECTION_ONLY", "checkpoint_tensors", "grad_program", "layer_grads",
           "module_decls", "param_path", "split_trainable", "trainable"]
