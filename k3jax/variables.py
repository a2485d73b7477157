"""The nnx.Variable types of the K3 block's weights: what trains and what does not.

    nnx.Param     every weight that trains by gradient: float arrays in the
                  Layout's dtype (router, latent projections and norm, the
                  shared expert, the dense MLP, dense routed experts)
    RouterBias    the router's correction bias ``router_bias_E`` [E] float32
                  (checkpoint ``gate.e_score_correction_bias``): it selects
                  experts only (top-k is piecewise constant, so its gradient
                  is zero) and moves by the aux-loss-free rule
                  (``update_router_bias``), never by an optimizer
    PackedWeight  a packed expert format's integer arrays (MXFP4's uint8
                  codes and scales, k3jax.formats): gradients flow through
                  their dequantized values to the input and the other
                  weights, never to them

So Flax's defaults do the right thing: ``nnx.grad`` differentiates the
nnx.Params, ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` (weight decay
included) touches neither the bias nor packed experts, and
``nnx.state(model, nnx.Param)`` is the trainable state. ``WEIGHTS`` is the
filter of every weight a layer holds (what a checkpoint stores, what the
planner prices): ``nnx.state(module, WEIGHTS)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """The router's expert-selection bias [E] float32: added to the sigmoid
    scores for top-k selection only. Frozen to gradients; moved by
    ``update_router_bias``."""


class PackedWeight(nnx.Variable):
    """An integer array of a packed routed-expert format (MXFP4 codes [E,
    out, in/2] and scales [E, in/32, out], uint8). Frozen: not differentiable."""


WEIGHTS = nnx.Any(nnx.Param, RouterBias, PackedWeight)
"""The nnx filter of every weight a K3 module holds (and nothing else it may
hold, such as statistics): ``nnx.state(module, WEIGHTS)``."""


def update_router_bias(target, tokens_per_expert, rate: float):
    """The aux-loss-free load-balancing step (DeepSeek-V3, K3): every expert's
    bias moves by ``rate`` towards balance,

        bias_e += rate * sign(mean(load) - load_e)

    (an overloaded expert's bias falls, an underloaded one's rises, an expert
    at the mean keeps its own). ``tokens_per_expert`` [E]: the (token, expert)
    assignments each expert received over the step (any numeric dtype), or
    the layer's router statistics (an ExpertLoad: its ``tokens_per_expert``
    is taken). ``target``: a KimiMoE
    (its ``router_bias_E``), a RouterBias variable (both updated in place, so
    it works inside ``nnx.jit``), or a bias array [E]. Returns the new bias
    [E] in the bias's dtype (float32). ValueError when the shapes differ."""
    var = getattr(target, "router_bias_E", target)
    bias_E = var.get_value() if isinstance(var, nnx.Variable) else jnp.asarray(var)
    load_E = jnp.asarray(getattr(tokens_per_expert, "tokens_per_expert", tokens_per_expert))
    if bias_E.ndim != 1 or tuple(load_E.shape) != tuple(bias_E.shape):
        raise ValueError(f"update_router_bias: tokens_per_expert must be [{bias_E.shape[0]}] "
                         f"(one count per expert), got {list(load_E.shape)}")
    load_E = load_E.astype(jnp.float32)
    step_E = jnp.asarray(rate, jnp.float32) * jnp.sign(jnp.mean(load_E) - load_E)
    new_E = (bias_E.astype(jnp.float32) + step_E).astype(bias_E.dtype)
    if isinstance(var, nnx.Variable):
        var.set_value(new_E)
    return new_E


__all__ = ["PackedWeight", "RouterBias", "WEIGHTS", "update_router_bias"]
