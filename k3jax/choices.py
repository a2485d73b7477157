"""One style of argument for every choice of the public constructors
(ParallelConfig, make_layout, load_layer, build_layer): an enum member or
its value, the string the CLI flag takes ("all-to-all", "ring", "packed").
An error lists the choices. Dtypes likewise: a dtype or its name."""

from __future__ import annotations

import enum
from typing import TypeVar

import numpy as np

E = TypeVar("E", bound=enum.Enum)


def as_choice(cls: type[E], value, what: str) -> E:
    """``value`` as a member of the enum ``cls``: a member is itself, a
    string its member by value (or by name, any case: "ALL_TO_ALL");
    ValueError naming ``what`` and the choices otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value)
        except ValueError:
            pass
        by_name = {m.name.lower(): m for m in cls}
        if value.lower() in by_name:
            return by_name[value.lower()]
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{what} must be one of {choices} (or a {cls.__name__}), got {value!r}")


LAYOUT_DTYPES = ("float32", "bfloat16", "float16")
"""The activations' and float weights' dtypes the kernels take (XLA, Mosaic
and Triton alike); make_layout refuses any other."""


def layout_dtype(dtype, who: str) -> np.dtype:
    """``dtype`` (a dtype, a scalar type such as jnp.bfloat16, or its name)
    as a dtype of LAYOUT_DTYPES; ValueError naming it and ``who`` otherwise."""
    try:
        resolved = None if dtype is None else np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in LAYOUT_DTYPES:
        shown = resolved.name if resolved is not None else repr(dtype)
        raise ValueError(f"{who}: dtype {shown} is not one the kernels take; choose one of "
                         f"{', '.join(LAYOUT_DTYPES)}")
    return resolved


__all__ = ["LAYOUT_DTYPES", "as_choice", "layout_dtype"]
