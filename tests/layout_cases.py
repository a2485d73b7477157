"""The parallel layouts under test and cached, jitted modules for them.

Shared by test_layouts_numerics, test_collectives, test_param_bytes and
test_sequence_parallel (one pytest process, so a layout's module is built
once however many tests use it). Import as ``from layout_cases import ...``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import (
    TINY,
    AbstractSource,
    ParallelConfig,
    RandomSource,
    SharedOverlap,
    build_layer,
    make_layout,
    make_mesh,
)
from numerics import rel_err

SEED = 0
DENSE_LAYER, MOE_LAYER = 0, 1

# name -> ParallelConfig; every layout the issue lists (8 devices except "single").
LAYOUTS: dict[str, ParallelConfig] = {
    "single": ParallelConfig(),
    "dp8": ParallelConfig(dp=8),
    "tp8": ParallelConfig(tp=8),
    "dp2_tp4": ParallelConfig(dp=2, tp=4),
    "sp_tp8_repl": ParallelConfig(tp=8, sequence_parallel=True, shard_shared_expert=False),
    "sp_tp8_shard": ParallelConfig(tp=8, sequence_parallel=True, shard_shared_expert=True,
                                   shared_overlap=SharedOverlap.RING),
    "sp_dp2_tp4_shard": ParallelConfig(dp=2, tp=4, sequence_parallel=True, shard_shared_expert=True,
                                       shared_overlap=SharedOverlap.RING),
    "sp_ep_tp8_repl": ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                                     shard_shared_expert=False),
    "sp_ep_tp8_shard": ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                                      shard_shared_expert=True, shared_overlap=SharedOverlap.RING),
    "sp_ep_dp2_tp4_shard": ParallelConfig(dp=2, tp=4, sequence_parallel=True, expert_parallel=True,
                                          shard_shared_expert=True,
                                          shared_overlap=SharedOverlap.RING),
    "ep_dp8": ParallelConfig(dp=8, expert_parallel=True),
    # EP over plain TP: rows replicated over TENSOR, experts over every device.
    "ep_tp8": ParallelConfig(tp=8, expert_parallel=True),
    "ep_dp2_tp4": ParallelConfig(dp=2, tp=4, expert_parallel=True),
}
MULTI_DEVICE = [name for name in LAYOUTS if name != "single"]

# Packed MXFP4 experts' compiled temporaries (tests/test_aot_layouts.py for the
# XLA and Pallas backends, tests/test_compile_triton.py for Triton): K3's MoE
# layer on this layout at most MXFP4_DECODE_TEMP_MAX bytes a device at
# MXFP4_DECODE_TOKENS, and at most MXFP4_PREFILL_OVER_BF16 x the bf16
# experts' at MXFP4_PREFILL_TOKENS.
MXFP4_LAYOUT = "sp_ep_tp8_shard"
MXFP4_DECODE_TOKENS, MXFP4_PREFILL_TOKENS = 16, 8192
MXFP4_DECODE_TEMP_MAX = 0.1 * 2 ** 30
MXFP4_PREFILL_OVER_BF16 = 1.1
# Not one of the layouts: vLLM's pre-fix padding under EP, for the padding tests.
EXTRA_LAYOUTS: dict[str, ParallelConfig] = {
    "ep_dp8_pad_under_ep": ParallelConfig(dp=8, expert_parallel=True, pad_under_ep=True),
}
# The SP-sharded layouts above name SharedOverlap.RING (the default, AUTO,
# picks per token count: the "_auto" layouts below); these are the same
# layouts with the unoverlapped all-gather + reduce-scatter.
UNOVERLAPPED = {f"{name}_none": dataclasses.replace(LAYOUTS[name], shared_overlap=SharedOverlap.NONE)
                for name in ("sp_tp8_shard", "sp_dp2_tp4_shard", "sp_ep_tp8_shard",
                             "sp_ep_dp2_tp4_shard")}
EXTRA_LAYOUTS.update(UNOVERLAPPED)
# The same SP-sharded layouts with the weights gathered instead of the rows
# (SharedOverlap.WEIGHTS), each beside the replicated layout its output must
# equal bit for bit: the same mesh with the shared expert / dense MLP replicated.
WEIGHTS_FORM = {f"{name}_weights": dataclasses.replace(LAYOUTS[name], shared_overlap=SharedOverlap.WEIGHTS)
                for name in ("sp_tp8_shard", "sp_dp2_tp4_shard", "sp_ep_tp8_shard",
                             "sp_ep_dp2_tp4_shard")}
REPLICATED_PEER = {f"{name}_weights": name.removesuffix("_shard") + "_repl"
                   for name in ("sp_tp8_shard", "sp_dp2_tp4_shard", "sp_ep_tp8_shard",
                                "sp_ep_dp2_tp4_shard")}
EXTRA_LAYOUTS.update(WEIGHTS_FORM)
EXTRA_LAYOUTS.update({peer: dataclasses.replace(WEIGHTS_FORM[name], shard_shared_expert=False,
                                                shared_overlap=SharedOverlap.RING)
                      for name, peer in REPLICATED_PEER.items() if peer not in LAYOUTS})
# RING and NONE with their partial sums reduce-scattered in bf16.
EXTRA_LAYOUTS.update({f"{name}_bf16scatter": dataclasses.replace(par, shared_scatter_dtype="bfloat16")
                      for name, par in (("sp_tp8_shard", LAYOUTS["sp_tp8_shard"]),
                                        ("sp_tp8_shard_none", UNOVERLAPPED["sp_tp8_shard_none"]))})
# The default form, AUTO: per token count the committed table's pick (at the
# tests' token counts, NONE or its bf16 scatter, RING or WEIGHTS by (tp, dp)).
AUTO_FORM = {f"{name}_auto": dataclasses.replace(LAYOUTS[name], shared_overlap=SharedOverlap.AUTO)
             for name in ("sp_tp8_shard", "sp_dp2_tp4_shard", "sp_ep_tp8_shard",
                          "sp_ep_dp2_tp4_shard")}
EXTRA_LAYOUTS.update(AUTO_FORM)
_ALL = {**LAYOUTS, **EXTRA_LAYOUTS}


def add_layout(name: str, parallel: ParallelConfig) -> str:
    """Make ``parallel`` available to module() / output() as ``name`` (a test's
    own layout, e.g. one derived from a table's pick); the same name must keep
    the same ParallelConfig."""
    if _ALL.setdefault(name, parallel) != parallel:
        raise ValueError(f"layout_cases.add_layout: {name!r} is already another layout")
    return name


def _module_key(cfg, name: str, layer: int):
    """Layouts that give the dense MLP the same placement share one module."""
    layout = make_layout(cfg, _ALL[name])
    if cfg.is_moe_layer(layer):
        return name
    par = layout.parallel
    return (layout.dense_mlp, layout.token_axes, par.dp, par.tp)


_MODULES: dict = {}


def _build(cfg, name: str, layer: int, dtype_name: str):
    par = _ALL[name]
    mesh = make_mesh(par)
    layout = make_layout(cfg, par, mesh, backend="xla", dtype=jnp.dtype(dtype_name))
    module = build_layer(layout, layer, mesh, source=RandomSource(SEED))
    graph, state = nnx.split(module)
    fn = jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD))
    return module, state, fn


def module(cfg, name: str, layer: int, dtype=jnp.float32):
    """(module, nnx state, jitted f(state, x_TD) -> y_TD) for a layout, built with RandomSource(SEED)."""
    dtype_name = jnp.dtype(dtype).name
    key = (cfg, _module_key(cfg, name, layer), layer, dtype_name)
    if key not in _MODULES:
        _MODULES[key] = _build(cfg, name, layer, dtype_name)
    return _MODULES[key]


@functools.cache
def _output(cfg, name: str, layer: int, dtype_name: str, T: int) -> np.ndarray:
    _, state, fn = module(cfg, name, layer, dtype_name)
    y_TD = fn(state, inputs(cfg, T, dtype_name))
    assert y_TD.shape == (T, cfg.hidden_size) and y_TD.dtype == jnp.dtype(dtype_name)
    return np.asarray(y_TD.astype(jnp.float32))


def output(cfg, name: str, layer: int, T: int, dtype=jnp.float32) -> np.ndarray:
    """Layer output [T, D] (as float32 numpy) of ``layout`` on the standard input."""
    return _output(cfg, name, layer, jnp.dtype(dtype).name, T)


def inputs(cfg, T: int, dtype=jnp.float32) -> jax.Array:
    """Fresh normal x_TD [T, D] (a fixed key per T, so every layout sees the same)."""
    x_TD = jax.random.normal(jax.random.key(1000 + T), (T, cfg.hidden_size), jnp.float32)
    return x_TD.astype(dtype)


# -- compiled HLO ------------------------------------------------------------
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# "%name = <shape> opcode(" -- the opcode is the first lower-case word followed by "(".
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def count_collectives(hlo_text: str) -> Counter:
    """{collective: number of instructions} in compiled HLO text.

    Reads each instruction's opcode (not its name, so fusions or values named
    after a collective are not counted); an async pair "X-start"/"X-done"
    counts once, as X."""
    counts: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group(1)
        if op.endswith("-done"):
            continue
        op = op.removesuffix("-start")
        if op in COLLECTIVES:
            counts[op] += 1
    return counts


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def permute_axes(hlo_line: str, parallel: ParallelConfig) -> str:
    """The mesh axis a collective-permute's source_target_pairs run along, in
    the replica_groups notation ("{'tensor'}"): every pair r -> r + 1 (mod tp)
    inside one data group is the tensor-axis ring. Fails on any other pattern."""
    m = _PAIRS.search(hlo_line)
    assert m, f"no source_target_pairs in {hlo_line[:200]}"
    pairs = sorted((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))
    tp = parallel.tp
    ring = sorted((r, r - r % tp + (r % tp + 1) % tp) for r in range(parallel.num_devices))
    assert pairs == ring, f"not the tensor-axis ring: {pairs}"
    return "{'tensor'}"


def compiled_hlo(cfg, name: str, layer: int, T: int, dtype=jnp.float32) -> str:
    """Compiled HLO of the layer's forward, with abstract weights (nothing allocated)
    and x_TD [T, D] placed as the layout places token rows (replicated when T
    does not split evenly)."""
    par = _ALL[name]
    mesh = make_mesh(par)
    layout = make_layout(cfg, par, mesh, backend="xla", dtype=dtype)
    module = build_layer(layout, layer, mesh, source=AbstractSource())
    graph, state = nnx.split(module)
    spec = layout.x_TD if T % layout.row_shards == 0 else jax.sharding.PartitionSpec()
    x_TD = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.dtype(dtype),
                                sharding=jax.sharding.NamedSharding(mesh, spec))
    fn = jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD))
    return fn.lower(state, x_TD).compile().as_text()


__all__ = [
    "COLLECTIVES",
    "DENSE_LAYER",
    "EXTRA_LAYOUTS",
    "LAYOUTS",
    "UNOVERLAPPED",
    "WEIGHTS_FORM",
    "REPLICATED_PEER",
    "MOE_LAYER",
    "MULTI_DEVICE",
    "SEED",
    "TINY",
    "compiled_hlo",
    "count_collectives",
    "inputs",
    "module",
    "output",
    "permute_axes",
    "rel_err",
]
