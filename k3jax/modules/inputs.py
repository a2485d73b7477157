"""The check of a layer's input, before its forward touches it (and before
any tracing): an array (jax or numpy, or a tracer of one) of a floating
dtype, shaped [..., hidden] (any leading shape: [T, hidden], [B, S, hidden],
a single row [hidden]).

The dtype rule the modules follow: a floating input (float16, bfloat16,
float32, float64) is cast to the Layout's dtype, and the output is in the
Layout's dtype; any other dtype (integer, bool, complex) is a TypeError
naming it. The layout's token split (Layout.token_axes) applies to the
flattened rows: [..., D] is computed as [prod(...), D] and reshaped back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_layer_input(x: Any, hidden_size: int, who: str = "layer") -> None:
    """TypeError naming the type when ``x`` is not an array (a list, a
    tuple, a scalar) or its dtype is not floating; ValueError naming the
    shape unless it is [..., ``hidden_size``]. ``who`` starts the message
    (the module's class name)."""
    if not all(hasattr(x, a) for a in ("shape", "ndim", "dtype")):
        kind = type(x).__name__
        hint = " (convert it with jnp.asarray)" if isinstance(x, (list, tuple)) else ""
        raise TypeError(f"{who}: x must be a jax or numpy array [..., {hidden_size}], got a "
                        f"{kind}{hint}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must have a floating dtype, got {x.dtype} (a floating x "
                        f"is cast to the layout's dtype)")
    if x.ndim < 1 or x.shape[-1] != hidden_size:
        raise ValueError(f"{who}: x must be [..., {hidden_size}] (e.g. [T, {hidden_size}] or "
                         f"[B, S, {hidden_size}]), got {list(x.shape)}")


def as_rows(x: Any, hidden_size: int, who: str) -> tuple[jax.Array, tuple[int, ...]]:
    """``check_layer_input``, then (x as rows [T, hidden], the leading shape):
    T is the product of the leading dimensions (1 for a single row [hidden])."""
    check_layer_input(x, hidden_size, who)
    lead = tuple(x.shape[:-1])
    return (x if x.ndim == 2 else jnp.reshape(x, (-1, hidden_size))), lead


def from_rows(y_TD: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """The rows [T, D] a module computed, back in the input's leading shape [..., D]."""
    return y_TD if len(lead) == 1 else jnp.reshape(y_TD, (*lead, y_TD.shape[-1]))


__all__ = ["as_rows", "check_layer_input", "from_rows"]
