"""The check of a layer's input, before its forward touches it: an array
(jax or numpy, or a tracer of one) of a floating dtype, shaped [T, hidden]."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def check_layer_input(x: Any, hidden_size: int, who: str = "layer") -> None:
    """TypeError naming the type when ``x`` is not an array (a list, a
    tuple, a scalar) or its dtype is not floating; ValueError naming the
    shape unless it is [T, ``hidden_size``]. ``who`` starts the message
    (the module's class name)."""
    if not all(hasattr(x, a) for a in ("shape", "ndim", "dtype")):
        kind = type(x).__name__
        hint = " (convert it with jnp.asarray)" if isinstance(x, (list, tuple)) else ""
        raise TypeError(f"{who}: x must be a jax or numpy array [T, {hidden_size}], got a "
                        f"{kind}{hint}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}: x must have a floating dtype, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != hidden_size:
        raise ValueError(f"{who}: x must be [T, {hidden_size}], got {list(x.shape)}")
