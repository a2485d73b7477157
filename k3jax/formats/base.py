"""What a routed-expert weight format is: ``WeightFormat``, the two facts it
reads (``ExpertLayout``, what the Layout decided for the experts;
``StoredTensor``, where a parameter lies in a checkpoint), and nothing else.

A format owns everything that depends on how the experts' weights are held:

    name, describe()       the registry key ("dense") and the Layout's line
    split_refusal(el)      why the layout's split cannot hold it (None: it can)
    bind(el)               itself with the facts the layout decides (e.g. a K order)
    param_decls(el)        the module's parameters for w1 / w3 / w2, names fixed
    checkpoint_tensors()   {parameter: StoredTensor}: the loader's names table
    kernel_weights(p, dt)  (w1, w3, w2) as the grouped matmuls take them
    codec, stored_names,   a float weight [out, in] kept in tensors of the
    check_stored, decode,  format's own in a checkpoint: their names, header
    encode                 check, host-side decode (loader) and encode (writer)
    fact_params, fact_of,  a static fact read off the stored bytes (e.g. which
    combine_facts,         dequant the scale bytes allow), agreed by every
    agree_facts, with_fact process and bound into the format

Formats depend on the config and pallas_kernels only; the Layout holds the
bound format and the modules, the loader and the tools call its methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from k3jax.formats.decl import Padding, ParamDecl
from pallas_kernels.backend import KernelBackend

ExpertWeights = tuple[Any, Any, Any]
"""(w1 [E, L, F], w3 [E, L, F], w2 [E, F, L]) in logical shapes: arrays, or
the pytrees a format hands the grouped matmuls (pallas_kernels takes them)."""


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """What the Layout decided for one layer's routed experts, in the dense
    weights' global shapes w1, w3 [E, L, F] and w2 [E, F, L].

    num_experts   E (all of them; EP splits axis 0 per ``specs``), or the
                  E + R slots with redundant experts (the module then marks
                  each declaration's ``slots``: the logical expert of each)
    latent        L
    intermediate  I, the real intermediate
    padded        F >= I (docs/spec.md §5); each of ``shards`` blocks of F
                  holds I / shards real entries first, then zeros
    shards        devices splitting each expert's F (1 under EP)
    specs         PartitionSpecs of the dense (w1, w3, w2)
    dtype         the Layout's: activations and float weights
    backend       the kernels' backend, resolved (pallas_kernels.backend)
    """

    num_experts: int
    latent: int
    intermediate: int
    padded: int
    shards: int
    specs: tuple[P, P, P]
    dtype: Any
    backend: KernelBackend

    def padding(self, axis: int, real: int | None = None) -> Padding | None:
        """The padding of an axis that runs along F (``real`` real entries in
        all, I by default, in ``shards`` blocks); None when F is unpadded."""
        if self.padded == self.intermediate:
            return None
        return Padding(axis, self.shards, self.intermediate if real is None else real)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one routed-expert parameter [E, ...] lies in a checkpoint: one
    tensor per expert, ``experts.{e}.<suffix>``, stacked along E on load.

    transpose   stored as the per-expert parameter's transpose ([out, in])
    raw         the format's own tensor, read as stored, its dtype one of
                ``dtypes`` (safetensors names); False: a float weight, read
                as floats or decoded from any registered codec's tensors
    interleave  the loader's op after reading: the word interleave of packed
                4-bit codes (pallas_kernels' word layout)
    check       raw only: raises ValueError for a block the format rejects
                (the loader names the tensor)
    """

    suffix: str
    transpose: bool
    raw: bool = False
    dtypes: tuple[str, ...] = ()
    interleave: bool = False
    check: Callable[[np.ndarray], None] | None = None


Read = Callable[..., np.ndarray]
"""The loader's reader for ``decode``: read(name, [rows, cols] slices,
check=None) -> the stored region, ``check``ed (ValueError -> the loader's
error naming the tensor)."""

HeaderCheck = Callable[[str, tuple, set], None]
"""The loader's header check for ``check_stored``: (name, shape, dtypes)."""


class WeightFormat:
    """A routed-expert weight format (module docstring). A subclass is a
    frozen dataclass (hashable: the Layout holding it keys jitted programs)
    registered under ``name`` (k3jax.formats.registry.register_format)."""

    name = ""
    packed = False   # not float arrays in the Layout's dtype: frozen (PackedWeight decls)
    codec = False    # stores a float weight in tensors of its own (stored_names ... encode)
    fact_params: tuple[str, ...] = ()   # parameters whose stored bytes decide a fact

    # -- the layout -----------------------------------------------------------
    def describe(self) -> str | None:
        """A line for Layout.describe(), or None."""
        return None

    def split_refusal(self, el: ExpertLayout) -> str | None:
        """Why the experts cannot be held split as ``el`` says, or None."""
        return None

    def bind(self, el: ExpertLayout) -> WeightFormat:
        """This format with the facts ``el`` decides; make_layout keeps it."""
        return self

    # -- the module -----------------------------------------------------------
    def param_decls(self, el: ExpertLayout) -> list[ParamDecl]:
        """The parameters holding w1, w3, w2 (global shapes, specs, padding)."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> dict[str, StoredTensor]:
        """{parameter name: StoredTensor} of every parameter of param_decls."""
        raise NotImplementedError

    def param_names(self) -> tuple[str, ...]:
        return tuple(self.checkpoint_tensors())

    def kernel_weights(self, p: Mapping[str, jax.Array], dtype) -> ExpertWeights:
        """(w1, w3, w2) from this device's shards ``p`` of the parameters, as
        the grouped matmuls take them; ``dtype`` the activations'."""
        raise NotImplementedError

    # -- a codec: a float weight [out, in] in tensors of the format's own -----
    def stored_names(self, weight_name: str) -> tuple[str, ...]:
        """``...w1.weight`` -> the names of the tensors that hold it."""
        raise NotImplementedError(f"format {self.name!r} stores no float weight")

    def check_stored(self, check: HeaderCheck, weight_name: str, out: int, n_in: int) -> None:
        """Check the headers of the tensors holding ``weight_name`` [out, n_in]
        with ``check``; ValueError for a shape the format cannot hold."""
        raise NotImplementedError(f"format {self.name!r} stores no float weight")

    def decode(self, read: Read, weight_name: str, rows: slice, cols: slice) -> np.ndarray:
        """Rows ``rows`` and inputs ``cols`` of the float weight, as float32."""
        raise NotImplementedError(f"format {self.name!r} stores no float weight")

    def encode(self, w_out_in: np.ndarray) -> tuple[np.ndarray, ...]:
        """A float weight [out, in] -> its tensors, in stored_names' order."""
        raise NotImplementedError(f"format {self.name!r} stores no float weight")

    # -- a fact read off the stored bytes of ``fact_params`` ------------------
    def fact_of(self, block: np.ndarray) -> Any:
        raise NotImplementedError

    def combine_facts(self, facts: Sequence[Any]) -> Any:
        """The fact of a whole layer from its stored blocks' (this process's)."""
        raise NotImplementedError

    def agree_facts(self, local: Sequence[Any]) -> list[Any]:
        """This process's fact per layer -> the facts every process agrees on
        (collective over the processes)."""
        raise NotImplementedError

    def with_fact(self, fact: Any) -> WeightFormat:
        raise NotImplementedError


def swap_last(spec: P, ndim: int) -> P:
    """The PartitionSpec of an ``ndim``-D array's transpose in its last two
    axes (P() stays P(): replicated either way)."""
    if not len(spec):
        return spec
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[-2:] = entries[-2:][::-1]
    return P(*entries)


__all__ = ["ExpertLayout", "ExpertWeights", "HeaderCheck", "Read", "StoredTensor", "WeightFormat",
           "swap_last"]
