"""Every 8-device layout of tests/layout_cases.py at full K3 size (BF16, MXFP4
experts) compiled for 8 H200s without a GPU (k3jax.tools.compile.compile_layer), at
256 and 8192 tokens: the MoE layer 1 with XLA, the dense layer 0 with XLA
(once per distinct dense placement), and the MoE layer 1 with the Pallas
backend in the layout of the issue's "done when" command (sp_ep_tp8_shard).
Pallas in every layout, and the single-device layout, are compiled by
``python benchmarks/compile_table.py --layouts`` (benchmarks/results/compiled_layouts_h200.md):
2-3 minutes each on a loaded 2-core machine, too slow for the suite.
Checked here:

- the compiler's argument bytes of the weights equal the planner's, exactly;
  the input and output shards are the layout's;
- packed MXFP4 experts (sp_ep_tp8_shard, XLA and Pallas): no compiled
  program holds a copy of their codes (no instruction but the parameters
  has a packed array's shape), and the temporaries meet the targets: at
  most MXFP4_DECODE_TEMP_MAX at 16 tokens, at most MXFP4_PREFILL_OVER_BF16
  times the bf16 experts' at 8192 (two extra compiles each: 16 tokens, and
  the bf16 peer at 8192);
- the overlap contract (Layout.shared_overlaps_routed) against the compiled
  H200 schedule: where it is true and the shared expert issues collectives,
  each of them stays asynchronous, uncombined with the routed path's, with
  routed-expert GEMMs scheduled between start and done. Where it is false:
  under plain TP the shared expert has no collective of its own; an
  SP-sharded one with dp > 1 is not claimed (XLA overlaps its all-gather at
  some token counts only: the compiled schedule has no routed GEMM under it
  at 256 tokens, nor with EP at 8192).

Fit (``fits_h200``) is recorded, not asserted per layout: on 8 GPUs K3's MXFP4
experts alone exceed an H200 (k3jax plan). Each layer compiles once per
process (module-level cache).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from k3jax import K3, TINY, MlpMode, ParallelConfig, SharedOverlap, make_layout
from k3jax.formats import ExpertStorage
from k3jax.modules.moe import ROUTED_SCOPE, SHARED_SCOPE, moe_decls
from k3jax.tools.aot import GPU_COMPILER_OPTIONS, h200_mesh
from k3jax.tools.compile import CompileReport, compile_layer
from k3jax.tools.hlo_schedule import in_scope
from k3jax.tools.kernel_ptxas import TOKAMAX_PEER
from layout_cases import (
    LAYOUTS,
    MULTI_DEVICE,
    MXFP4_DECODE_TEMP_MAX,
    MXFP4_DECODE_TOKENS,
    MXFP4_LAYOUT,
    MXFP4_PREFILL_OVER_BF16,
    MXFP4_PREFILL_TOKENS,
    UNOVERLAPPED,
)
from pallas_kernels.mxfp4_words import deinterleave_words

pytestmark = pytest.mark.compile

TOKENS = (256, 8192)
MOE, DENSE = 1, 0


@functools.cache
def report(cfg, parallel: ParallelConfig, layer: int, tokens: int, backend: str,
           options: tuple = (), expert_dtype: str = "mxfp4") -> CompileReport:
    return compile_layer(cfg, parallel, layer, tokens=tokens, backend=backend,
                         compiler_options=dict(options) if options else None,
                         expert_dtype=expert_dtype)


def _dense_placements() -> list[str]:
    """One layout per distinct dense-layer placement (the dense compile depends
    on nothing else)."""
    seen, names = set(), []
    for name in MULTI_DEVICE:
        par = LAYOUTS[name]
        lay = make_layout(K3, par)
        key = (lay.dense_mlp, lay.token_axes, par.dp, par.tp)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


PALLAS_LAYOUTS = ["sp_ep_tp8_shard"]
PASSES = ([(name, MOE, "xla") for name in MULTI_DEVICE]
          + [(name, MOE, "pallas") for name in PALLAS_LAYOUTS]
          + [(name, DENSE, "xla") for name in _dense_placements()])
CONTRACT = [(name, "xla") for name in MULTI_DEVICE] + [(name, "pallas") for name in PALLAS_LAYOUTS]


def _on_one_worker(*args):
    """pytest.param(*args) in the xdist group of its compile (name, layer,
    backend, tokens): bin/test runs ``--dist loadgroup``, so the tests that
    read one compiled layer share report()'s cache instead of compiling it
    again on another worker (the Pallas layer takes 80-96 s)."""
    name, layer, backend, tokens = args if len(args) == 4 else (args[0], MOE, *args[1:])
    return pytest.param(*args, marks=pytest.mark.xdist_group(f"{name}-{layer}-{backend}-{tokens}"))


@pytest.mark.parametrize("name,layer,backend,tokens",
                         [_on_one_worker(*p, t) for p in PASSES for t in TOKENS])
def test_compiled_bytes_are_the_planners(name, layer, backend, tokens):
    par = LAYOUTS[name]
    r = report(K3, par, layer, tokens, backend)
    b = r.per_device_bytes
    assert b["weights"] == r.planner_weight_bytes > 0
    rows = tokens // make_layout(K3, par).row_shards
    assert b["activations"] == b["outputs"] == rows * K3.hidden_size * 2   # bf16 shards
    assert b["temporaries"] > 0
    assert r.model_weight_bytes > r.device_memory_bytes    # K3 on 8 H200s: weights alone
    assert r.fits_h200 is False
    assert r.flops > 0 and r.bytes_accessed > 0
    assert (len(r.kernels) > 0) is (backend == "pallas")
    for k in r.kernels:   # every kernel of the layer compiles without spills
        assert k.registers <= 255 and 0 < k.smem_bytes <= 232_448 and k.spill_bytes == 0, k
    # tokamax.ragged_dot, the peer, compiled for each of our grouped launches' shapes
    assert (len(r.peer_kernels) > 0) is (backend == "pallas")
    ours = {k.name.rsplit("_", 1)[0] for k in r.kernels}
    for p in r.peer_kernels:
        assert p.peer == TOKAMAX_PEER and p.launch.kernel in ours, (p, ours)
        assert p.report is not None and 0 < p.report.registers <= 255, p


def _shared(c) -> bool:
    return in_scope(c.op_name, SHARED_SCOPE)


@pytest.mark.parametrize("name,backend,tokens",
                         [_on_one_worker(*c, t) for c in CONTRACT for t in TOKENS])
def test_overlap_contract_holds_in_the_h200_schedule(name, backend, tokens):
    layout = make_layout(K3, LAYOUTS[name])
    sched = report(K3, LAYOUTS[name], MOE, tokens, backend).collectives
    shared = [c for c in sched if _shared(c)]
    overlapping = [c for c in shared
                   if c.is_async and c.parts == 1 and not in_scope(c.op_name, ROUTED_SCOPE)
                   and c.matmuls_between_in(ROUTED_SCOPE) > 0]
    if not layout.shared_overlaps_routed:
        if layout.shared_mlp.mode is MlpMode.TP:
            # The shared partial rides in the routed all-reduce (outside both scopes).
            assert shared == []
        else:   # SP-sharded with dp > 1: not claimed, since not kept at every token count
            assert layout.parallel.dp > 1
        return
    if layout.shared_mlp.overlap is SharedOverlap.RING:
        # the ring: 2 (tp - 1) block transfers over the tensor axis, each
        # asynchronous with work under it. In the full-size MoE layer XLA puts routed-expert
        # weight transposes rather than a matmul under a few of them (3 of 12 in
        # sp_ep_tp8_shard at 256 tokens); tests/test_overlap.py checks a matmul under every
        # one in the dense layer and a 16-expert MoE layer.
        assert {c.kind for c in shared} == {"collective-permute"}, sched
        assert sum(c.parts for c in shared) == 2 * (layout.parallel.tp - 1)
        assert all(c.is_async and c.compute_between > 0 for c in shared), sched
        # a GEMM under most of them (ComputeOp.is_matmul: dot FLOPs, or a Mosaic
        # kernel, whose FLOPs HLO cannot see, on the Pallas backend)
        assert sum(any(op.is_matmul for op in c.compute_ops) for c in shared) * 2 > len(shared), sched
    elif layout.shared_mlp.mode is MlpMode.SP_SHARDED:
        assert sorted(c.kind for c in shared) == ["all-gather", "reduce-scatter"], sched
        assert overlapping == shared, [(c.kind, c.is_async, c.parts, c.compute_between)
                                       for c in shared]
    else:   # replicated: no collective of its own, nothing to keep asynchronous
        assert shared == []


@functools.cache
def tiny_shared_collectives(combine: bool):
    """TINY sp_ep_tp8_shard (unoverlapped) at 64 tokens, with XLA's default
    combiners or with GPU_COMPILER_OPTIONS."""
    options = (("xla_gpu_all_gather_combine_threshold_bytes", 1 << 30),
               ("xla_gpu_reduce_scatter_combine_threshold_bytes", 1 << 30)) if combine else ()
    r = report(TINY, UNOVERLAPPED["sp_ep_tp8_shard_none"], MOE, 64, "xla", options)
    return [c for c in r.collectives if _shared(c)]


def test_combiners_merge_the_shared_experts_collectives_unless_told_not_to():
    """Why GPU_COMPILER_OPTIONS: in the unoverlapped form (--shared-overlap
    none) XLA's combiners fold the shared expert's
    all-gather and reduce-scatter into the routed path's (one collective
    carrying both scopes, which then cannot overlap the other branch)."""
    assert GPU_COMPILER_OPTIONS["xla_gpu_all_gather_combine_threshold_bytes"] == 0
    assert GPU_COMPILER_OPTIONS["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 0
    merged = tiny_shared_collectives(combine=True)
    assert merged and all(c.parts > 1 and in_scope(c.op_name, ROUTED_SCOPE) for c in merged)
    separate = tiny_shared_collectives(combine=False)
    assert sorted(c.kind for c in separate) == ["all-gather", "reduce-scatter"]
    assert all(c.parts == 1 and c.is_async for c in separate)


def test_a_tiny_model_fits():
    r = report(TINY, LAYOUTS["sp_ep_tp8_shard"], MOE, 64, "xla", ())
    assert r.fits_h200 is True and r.needed_bytes < r.device_memory_bytes
    assert r.per_device_bytes["weights"] == r.planner_weight_bytes


# -- packed MXFP4 experts: no copy of the codes, temporaries within the targets --------
# Pallas at 8192: the gate/up kernel writes h in the K order the down
# kernel takes (Mxfp4Format.k_order), so no transposed copy of h sits
# beside it (with one, 2.62 GiB against bf16's 1.95, 1.34x).
_PACKED_KEEP = ("parameter", "bitcast", "get-tuple-element", "tuple")


def packed_copies(hlo_text: str, shapes) -> list[str]:
    """The instructions of a compiled module's text whose result has one of
    ``shapes`` (uint8 shard shapes of packed codes) and that are not a
    parameter, a bitcast or a tuple's element: copies of the codes."""
    wanted = {"u8[" + ",".join(map(str, s)) + "]" for s in shapes}
    found = []
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?\S+ = (u8\[[\d,]*\])(?:\{[^}]*\})? ([\w-]+)\(", line)
        if m and m.group(1) in wanted and m.group(2) not in _PACKED_KEEP:
            found.append(line.strip()[:160])
    return found


def _packed_shard_shapes(parallel: ParallelConfig) -> list[tuple[int, ...]]:
    """Per-device shapes of the packed codes (w1, w3, w2) on the H200 mesh."""
    layout = make_layout(K3, parallel, experts=ExpertStorage.MXFP4)
    mesh = h200_mesh(parallel)
    return [NamedSharding(mesh, d.spec).shard_shape(d.shape) for d in moe_decls(layout)
            if "_packed_" in d.name]


def test_packed_copies_finds_a_copy_of_the_codes():
    """packed_copies on CPU-compiled modules: a deinterleaved (or plainly
    rewritten) whole array is one; one expert's deinterleave and a
    reduction over the array are not."""
    codes = jax.ShapeDtypeStruct((4, 32, 64), jnp.uint8)

    def text(fn):
        return jax.jit(fn).lower(codes).compile().as_text()
    assert packed_copies(text(deinterleave_words), [(4, 32, 64)])
    assert packed_copies(text(lambda c: c + 1), [(4, 32, 64)])
    assert not packed_copies(text(lambda c: deinterleave_words(c[1])), [(4, 32, 64)])
    assert not packed_copies(text(lambda c: c.sum(axis=0)), [(4, 32, 64)])


def _mxfp4_case(backend: str, tokens: int, *marks):
    """pytest.param(backend, tokens) in the xdist group of the MXFP4 layout's
    compile at (backend, tokens) (_on_one_worker's): the 8192-token reports
    are test_compiled_bytes_are_the_planners', compiled once."""
    group = pytest.mark.xdist_group(f"{MXFP4_LAYOUT}-{MOE}-{backend}-{tokens}")
    return pytest.param(backend, tokens, marks=(group, *marks))


@pytest.mark.parametrize("backend,tokens", [_mxfp4_case(b, t) for b in ("xla", "pallas")
                                            for t in (MXFP4_DECODE_TOKENS, MXFP4_PREFILL_TOKENS)])
def test_mxfp4_programs_hold_no_copy_of_the_packed_experts(backend, tokens):
    par = LAYOUTS[MXFP4_LAYOUT]
    r = report(K3, par, MOE, tokens, backend)
    shapes = _packed_shard_shapes(par)
    assert len(shapes) == 3
    for s in shapes:   # the parameters are there, in the text's notation
        assert f"u8[{','.join(map(str, s))}]" in r.hlo_text, s
    assert packed_copies(r.hlo_text, shapes) == []


@pytest.mark.parametrize("backend,tokens", [_mxfp4_case(b, MXFP4_DECODE_TOKENS)
                                            for b in ("xla", "pallas")])
def test_mxfp4_temporaries_at_decode_are_within_the_target(backend, tokens):
    r = report(K3, LAYOUTS[MXFP4_LAYOUT], MOE, tokens, backend)
    temporaries = r.per_device_bytes["temporaries"]
    print(f"{backend} MXFP4 {tokens} tokens: {temporaries / 2 ** 30:.4f} GiB")
    assert 0 < temporaries <= MXFP4_DECODE_TEMP_MAX, temporaries


@pytest.mark.parametrize("backend,tokens", [
    _mxfp4_case("xla", MXFP4_PREFILL_TOKENS),
    _mxfp4_case("pallas", MXFP4_PREFILL_TOKENS)])
def test_mxfp4_temporaries_at_prefill_are_within_the_bf16_target(backend, tokens):
    par = LAYOUTS[MXFP4_LAYOUT]
    mxfp4 = report(K3, par, MOE, tokens, backend).per_device_bytes["temporaries"]
    bf16 = report(K3, par, MOE, tokens, backend,
                  expert_dtype="bfloat16").per_device_bytes["temporaries"]
    print(f"{backend} {tokens} tokens: MXFP4 {mxfp4 / 2 ** 30:.3f} GiB, "
          f"bf16 {bf16 / 2 ** 30:.3f} GiB ({mxfp4 / bf16:.3f}x)")
    assert 0 < mxfp4 <= MXFP4_PREFILL_OVER_BF16 * bf16, (mxfp4, bf16)
