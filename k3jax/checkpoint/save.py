"""Saving a layer as an HF checkpoint that ``load_layer`` reads back bit-exact.

    save_layer(module, directory)      # KimiMoE or KimiMLP, any layout

Every weight the module holds (``nnx.state(module, k3jax.variables.WEIGHTS)``:
nnx.Params, the RouterBias, a packed format's PackedWeights) is written
under its docs/spec.md §3 name by ``checkpoint_tensors``: [out, in] as
stored, one tensor per routed expert, the MoE intermediate padding
(docs/spec.md §5) removed, a packed format's codes back in the checkpoint's
byte order (the loader's word interleave undone), each in the dtype the
module holds it in; plus ``config.json`` (the module's K3Config). The write
is k3jax.checkpoint.writer.write_checkpoint's: into a temporary folder next
to ``directory``, renamed into place at the end, so a failure leaves
nothing behind.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.checkpoint.names import layer_prefix, layer_tensors
from k3jax.checkpoint.writer import write_checkpoint
from k3jax.modules import KimiMLP, KimiMoE, module_decls
from k3jax.runtime.agreement import gather
from k3jax.variables import WEIGHTS
from pallas_kernels.mxfp4_words import deinterleave_words


def param_path(path: tuple) -> str:
    """An nnx state path (("shared", "gate_DF")) as a parameter name ("shared.gate_DF")."""
    return ".".join(map(str, path))


def checkpoint_tensors(module: KimiMLP | KimiMoE, layer: int,
                       arrays: dict[str, np.ndarray], *,
                       replicas: str | None = None) -> dict[str, np.ndarray]:
    """{param path: whole array in the parameter's shape} (gradients, or
    weights) -> {checkpoint tensor name (docs/spec.md §3): array}: [out, in] as stored,
    one tensor per routed expert, the MoE intermediate padding (docs/spec.md §5)
    removed, a packed format's codes deinterleaved to the stored byte order.
    Names carry ``model.layers.{layer}.`` and no ``language_model.``.
    A layer with redundant expert slots (ParamDecl.slots) needs ``replicas``:
    "sum" for gradients (each logical expert's is the sum of its slots'),
    "first" for weights (its first slot's: replicas are copies)."""
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
        if decl.slots is not None:
            a = _logical_experts(a, decl.slots, replicas, path)
        if ref.interleave:
            a = deinterleave_words(np.ascontiguousarray(a))
        if ref.per_expert:
            for e in range(a.shape[0]):
                out[ref.name(prefix, e)] = np.ascontiguousarray(a[e].T if ref.transpose else a[e])
        else:
            out[ref.name(prefix)] = np.ascontiguousarray(a.T if ref.transpose else a)
    return out


def _logical_experts(a: np.ndarray, slots: tuple[int, ...], replicas: str | None,
                     path: str) -> np.ndarray:
    """[E + R, ...] slots -> [E, ...] logical experts: the slots of each
    summed (segment sum by ``slots``, "sum") or its first slot ("first")."""
    slot_E = np.asarray(slots)
    E = int(slot_E.max()) + 1
    if replicas == "first":
        return a[np.unique(slot_E, return_index=True)[1]]
    if replicas != "sum" or not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"checkpoint_tensors: {path} holds redundant expert slots: pass "
                         f"replicas='sum' (float gradients) or 'first' (weights), got "
                         f"{replicas!r} for {a.dtype}")
    out = np.zeros((E, *a.shape[1:]), np.float64 if a.dtype == np.float64 else np.float32)
    np.add.at(out, slot_E, a.astype(out.dtype))
    return out.astype(a.dtype)


def _layer_of(module: KimiMLP | KimiMoE, layer: int | None) -> int:
    """``layer``, checked against the module's kind; None: the model's first
    layer of that kind."""
    is_moe, cfg = isinstance(module, KimiMoE), module.cfg
    kind = "an MoE" if is_moe else "a dense"
    if layer is None:
        for i in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(i) == is_moe:
                return i
        raise ValueError(f"save_layer: the model config has no {kind.split()[-1]} layer")
    if (not isinstance(layer, int) or isinstance(layer, bool)
            or not 0 <= layer < cfg.num_hidden_layers):
        raise ValueError(f"save_layer: layer must be an integer in [0, "
                         f"{cfg.num_hidden_layers}), got {layer!r}")
    if cfg.is_moe_layer(layer) != is_moe:
        raise ValueError(f"save_layer: layer {layer} is not {kind} layer of this model, but "
                         f"the module is a {type(module).__name__}")
    return layer


def save_layer(module: KimiMLP | KimiMoE, directory: str | os.PathLike, *,
               layer: int | None = None, num_files: int = 1) -> None:
    """Write ``module``'s weights as the tensors of layer ``layer`` (None:
    the model's first layer of the module's kind: 0 for K3's dense MLP, 1
    for an MoE layer) and its config as ``config.json`` to ``directory``
    (which must not exist or be empty; FileExistsError otherwise), split
    over ``num_files`` safetensors files. ``load_layer(directory, layer,
    ..., dtype=module.dtype)`` gives back the same weights bit for bit, in
    any layout: dense and packed (MXFP4) experts alike (packed ones load
    packed with ``mxfp4="packed"``). Padding entries are not stored (the
    loader pads with zeros, as every module holds them).

    Atomic: everything goes to a temporary folder beside ``directory`` and
    is renamed into place last; a failure removes it and raises. Over
    several processes every process must call it (the weights are
    gathered); process 0 writes."""
    if not isinstance(module, (KimiMLP, KimiMoE)):
        raise TypeError(f"save_layer: expected a KimiMLP or KimiMoE, got {type(module).__name__}")
    layer = _layer_of(module, layer)
    arrays = {}
    for path, var in nnx.to_flat_state(nnx.state(module, WEIGHTS)):
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(f"save_layer: {param_path(path)} is abstract (a module built with "
                             f"AbstractSource or under nnx.eval_shape holds no values)")
        arrays[param_path(path)] = (gather(value) if not value.is_fully_addressable
                                    else np.asarray(value))
    if jax.process_index() != 0:
        return
    tensors = checkpoint_tensors(module, layer, arrays, replicas="first")
    write_checkpoint(directory, module.cfg, tensors.items(), num_files=num_files)


__all__ = ["checkpoint_tensors", "param_path", "save_layer"]
