"""The formats by name, and the user-facing choice among the built-in ones.

    register_format(fmt)   add a format (its ``name`` must be new, its
                           parameters' checkpoint names must not clash)
    get_format(choice)     a name ("dense"), an ExpertStorage member or a
                           WeightFormat -> the WeightFormat
    registered_formats()   {name: format}, built-ins first
    codecs()               the formats that keep float weights in tensors of
                           their own (the loader decodes them)
    dequantized_form(fmt)  the dense storage that loads ``fmt``'s tensors
                           dequantized ("mxfp4" -> "mxfp4-dequant")

Built in: "dense", "mxfp4" and "mxfp4-dequant" (MXFP4 in the checkpoint,
dense in device memory), the values of ``ExpertStorage``.
"""

from __future__ import annotations

import enum

from k3jax.formats.base import StoredTensor, WeightFormat
from k3jax.formats.dense import DenseFormat
from k3jax.formats.mxfp4 import Mxfp4Format

_FORMATS: dict[str, WeightFormat] = {}


class ExpertStorage(enum.Enum):
    """The built-in formats, as the CLI and callers name them (get_format
    takes a member, its value, or any registered format).

    DENSE          float experts in the Layout's dtype
    MXFP4          packed codes + scales (k3jax.formats.mxfp4)
    MXFP4_DEQUANT  MXFP4 in the checkpoint, dequantized to the Layout's dtype
                   as it is loaded: in device memory exactly as DENSE
    """

    DENSE = "dense"
    MXFP4 = "mxfp4"
    MXFP4_DEQUANT = "mxfp4-dequant"

    @property
    def format(self) -> WeightFormat:
        return get_format(self.value)

    @property
    def packed(self) -> bool:
        """Are the experts held packed (not float arrays in the Layout's dtype)?"""
        return self.format.packed


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` under ``fmt.name``; ValueError when the name is taken or
    one of its parameters has another StoredTensor in a registered format."""
    if not isinstance(fmt, WeightFormat) or not fmt.name:
        raise ValueError(f"register_format: expected a named WeightFormat, got {fmt!r}")
    if fmt.name in _FORMATS:
        raise ValueError(f"register_format: a format named {fmt.name!r} is registered already")
    known = expert_tensors()
    for param, stored in fmt.checkpoint_tensors().items():
        if param in known and known[param] != stored:
            raise ValueError(f"register_format: {fmt.name!r} declares parameter {param!r} as "
                             f"{stored}, a registered format as {known[param]}")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format added by register_format (the built-ins stay)."""
    if name in {s.value for s in ExpertStorage}:
        raise ValueError(f"unregister_format: {name!r} is built in")
    _FORMATS.pop(name, None)


def get_format(choice: str | ExpertStorage | WeightFormat) -> WeightFormat:
    """The format ``choice`` names (a WeightFormat is itself)."""
    if isinstance(choice, WeightFormat):
        return choice
    name = choice.value if isinstance(choice, ExpertStorage) else choice
    if not isinstance(name, str) or name not in _FORMATS:
        raise ValueError(f"unknown expert format {choice!r}; registered: {', '.join(_FORMATS)}")
    return _FORMATS[name]


def registered_formats() -> dict[str, WeightFormat]:
    return dict(_FORMATS)


def codecs() -> list[WeightFormat]:
    return [f for f in _FORMATS.values() if f.codec]


def dequantized_form(fmt: WeightFormat) -> WeightFormat:
    """The registered dense storage whose ``decodes`` is ``fmt``'s name."""
    for f in _FORMATS.values():
        if isinstance(f, DenseFormat) and f.decodes == fmt.name:
            return f
    raise ValueError(f"no registered format loads {fmt.name!r} experts dequantized")


def expert_tensors() -> dict[str, StoredTensor]:
    """{parameter: StoredTensor} over every registered format."""
    return {param: stored for f in _FORMATS.values()
            for param, stored in f.checkpoint_tensors().items()}


for _builtin in (DenseFormat(), Mxfp4Format(), DenseFormat("mxfp4-dequant", decodes="mxfp4")):
    register_format(_builtin)


__all__ = ["ExpertStorage", "codecs", "dequantized_form", "expert_tensors", "get_format",
           "register_format", "registered_formats", "unregister_format"]
