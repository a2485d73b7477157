"""The MXFP4 Mosaic kernel (mosaic_sm90_mxfp4.py) compiles for the H200
(sm_90a) through ptxas without a GPU, at K3's routed-expert shapes at EP 8
(112 local experts; gate/up: K 3584 -> N 3072, fused; down: K 3072 -> N 3584)
at decode (16 and 256 tokens x top-16 = 256 and 4096 rows) and prefill
(4096 tokens = 65536 rows).

Every configuration compiles to two kernels, the op on the same codes
declared FAST and EXACT in one program (benchmarks/compile_table.mxfp4_both):
the fast one (the swap-AB kernel at decode, the row-major one at prefill)
and the exact row-major one EXACT weights run, each with 0 spill bytes
(the fused tile's SiTU epilogue stages the gate products through SMEM to
get there). The six are
benchmarks/compile_table.py's MXFP4 configurations (the grouped ops' MXFP4
dispatch), compiled once per test run (tests/compile_cache.py) and held to the
golden register file by tests/test_aot_kernels.py.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from compile_cache import kernel_reports

from benchmarks import compile_table
from pallas_kernels import mxfp4_fast
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4_swap_ab as sw
from pallas_kernels.grouped_matmul import mxfp4_dequant

pytestmark = pytest.mark.compile

LOCAL_EXPERTS = 112   # 896 experts / EP 8
TOP_K = 16
SHAPES = {"gate_up_situ": (3584, 3072, 2), "down": (3072, 3584, 1)}
TOKENS = {"decode": 16, "decode_256": 256, "prefill": 4096}


def test_the_configurations_are_k3s_at_ep8():
    """compile_table's MXFP4 rows are these ops and phases at these shapes."""
    configs = {c.name: c for c in compile_table.kernel_configs()}
    for op, (k, n, num_w) in SHAPES.items():
        for tokens in TOKENS.values():
            x, *ws, sizes = configs[f"{op}_mxfp4 ep=8 tokens={tokens}"].arg_specs
            assert x.shape == (tokens * TOP_K, k) and sizes.shape == (LOCAL_EXPERTS,)
            assert [w.shape for w in ws] == [(LOCAL_EXPERTS, n, k // 2),
                                             (LOCAL_EXPERTS, k // 32, n)] * num_w


# The fast kernels' K steps (pallas_kernels.mxfp4_fast's sequence on the word
# layout, one scale a thread's row), counted in SASS by k3jax.tools.kernel_sass:
# swap-AB 2.25 / 1.88 (down / gate-up, 16 tokens), 2.27 / 2.10 (256), 2.22
# (down, 4096) per weight (A from registers); row-major 2.22 (gate/up, 4096:
# with the SMEM round trip of the bf16 tile); the exact kernel's about 14.
# The bound is the 2.5 the MXFP4 kernels are held to: a change that makes a
# fast path dearer than that fails here.
FAST_SASS_PER_WEIGHT_MAX = 2.5
# The weight elements one consumer warpgroup's K step multiplies, by weights
# a launch: the row-major tile's [128, 128] bf16 B per weight, the swap-AB
# warpgroup's [64, 128] A fragment per weight.
FAST_WEIGHTS = {"row_major": {1: 128 * 128, 2: 2 * 128 * 128},
                "swap_ab": {1: 64 * 128, 2: 2 * 64 * 128}}


@pytest.mark.parametrize("phase", list(TOKENS))
@pytest.mark.parametrize("op", list(SHAPES))
def test_mxfp4_kernel_compiles_for_sm90a(op, phase):
    """Two kernels a configuration: the fast one (swap-AB at decode,
    row-major at prefill) and the exact row-major one for EXACT weights
    (a scale byte outside FAST_SCALES)."""
    found = kernel_reports(f"{op}_mxfp4 ep=8 tokens={TOKENS[phase]}")
    base = "grouped_situ_glu" if op == "gate_up_situ" else "grouped_matmul"
    num_w = SHAPES[op][2]
    # the fast kernel the dispatch takes (dispatch.mxfp4_module)
    block_t = sw.block_t_for(TOKENS[phase] * TOP_K, LOCAL_EXPERTS, num_w)
    kind, suffix = ("row_major", "_mxfp4_m64") if block_t is None else \
        ("swap_ab", f"_mxfp4_swap_ab_t{block_t}")
    fast_weights = FAST_WEIGHTS[kind][num_w]
    by_kind = {("exact" if "_mxfp4_exact_" in r.name else "fast"): r for r in found}
    assert len(found) == 2 and set(by_kind) == {"fast", "exact"}, found
    assert re.fullmatch(rf"{base}{suffix}(_\d+)?", by_kind["fast"].name), found
    assert by_kind["exact"].name.startswith(f"{base}_mxfp4_exact_m64"), found
    for r in found:
        assert 0 < r.registers <= 255 and 0 < r.smem_bytes <= 232_448, r
        assert r.grid == (132, 1, 1), r                # persistent: one CTA per SM
        assert r.spill_bytes == 0, r
        # the consumer K step's SASS is counted (k3jax.tools.kernel_sass): every
        # weight element of the step is multiplied once per x plane
        assert r.k_step is not None, r
    assert by_kind["exact"].k_step.mma_weights == FAST_WEIGHTS["row_major"][num_w], found
    fast, exact = by_kind["fast"].k_step, by_kind["exact"].k_step
    assert fast.mma_weights == fast_weights, fast
    assert fast.per_weight() <= FAST_SASS_PER_WEIGHT_MAX < exact.per_weight(), (fast, exact)
    # one bf16x2 multiply per two weights the warpgroup dequantizes
    assert fast.nested_trips == () and dict(fast.by_opcode)["HMUL2"] == fast_weights // 256, fast


@functools.cache
def _mxfp4_ptx(m: int, k: int, n: int, g: int) -> dict[str, str]:
    """PTX of grouped_matmul_mxfp4's fast and exact kernels ({"fast", "exact"}),
    both compiled deviceless for sm_90a in one program (the same codes
    declared FAST and EXACT)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.layout import ParallelConfig
    from k3jax.tools.aot import h200_mesh, ptxas_dump
    from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4
    from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights
    mesh = h200_mesh(ParallelConfig())
    specs = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in
             [((m, k), jnp.bfloat16), ((g, n, k // 2), jnp.uint8), ((g, k // 32, n), jnp.uint8),
              ((g,), jnp.int32)]]

    def fn(x, packed, scale, sizes):
        return tuple(mosaic_sm90_mxfp4.grouped_matmul_mxfp4(x, Mxfp4Weights(packed, scale, d), sizes)
                     for d in (Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT))

    with ptxas_dump():  # the wheel's ptxas; MOSAIC_GPU_DUMP_TO is ours below
        folder = tempfile.mkdtemp(prefix="k3jax-mxfp4-ptx-")
        saved = os.environ.get("MOSAIC_GPU_DUMP_TO")
        os.environ["MOSAIC_GPU_DUMP_TO"] = folder
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                    jax.default_device(mesh.devices.flat[0]):
                jax.jit(fn).lower(*specs).compile()
            ptx = {("exact" if "_exact_" in p.name else "fast"): p.read_text()
                   for p in Path(folder).glob("*.ptx")}
            assert len(list(Path(folder).glob("*.ptx"))) == 2, list(Path(folder).iterdir())
            return ptx
        finally:
            os.environ.pop("MOSAIC_GPU_DUMP_TO")
            if saved is not None:
                os.environ["MOSAIC_GPU_DUMP_TO"] = saved
            shutil.rmtree(folder, ignore_errors=True)


def _sequence_regex(sequence, key: str | None = None, inputs=(), outputs=()) -> re.Pattern:
    """mxfp4_fast's PTX lines for ``sequence`` in order (its INPUTS / OUTPUTS
    under ``key``, or ``inputs`` / ``outputs``), its $N operands as the
    registers LLVM substitutes."""
    if key is not None:
        inputs, outputs = mxfp4_fast.INPUTS[key], mxfp4_fast.OUTPUTS[key]
    lines = mxfp4_fast.ptx_lines(sequence, inputs, outputs)
    parts = [re.sub(r"\\\$\d+", r"%r\\d+", re.escape(line)) for line in lines]
    return re.compile(r"\s*".join(parts))


def test_kernel_ptx_holds_the_fast_sequence():
    """One K step of a 128-column block: 2 chunks of 64 rows, each thread 2
    rows x 4 words, run mxfp4_fast.SEQUENCE (16 times), and 2 x 2 rows
    SCALE_SEQUENCE (one scale block a thread's row); no exact dequant in the
    fast kernel (its float32 flush compare, setp.lt.f32, is absent)."""
    ptx = _mxfp4_ptx(64, 256, 128, 2)["fast"]
    assert len(_sequence_regex(mxfp4_fast.SEQUENCE, "SEQUENCE").findall(ptx)) == 16
    assert len(_sequence_regex(mxfp4_fast.SCALE_SEQUENCE, "SCALE_SEQUENCE").findall(ptx)) == 4
    assert "mul.rn.bf16x2" in ptx and "setp.lt.f32" not in ptx


def test_exact_kernel_ptx_reads_the_word_layout_in_place():
    """The exact kernel (EXACT weights) reads the codes in the word layout:
    each thread runs mxfp4_dequant.CODE_BITS_SEQUENCE (the fast sequence's
    bit permutation, no scale multiply) on each of its 2 rows x 4 words of
    each 64-row chunk: 2 chunks x 2 x 4 = 16 times a K step; then the exact
    float32 decode (its flush compare, setp.lt.f32), no bf16x2 multiply."""
    ptx = _mxfp4_ptx(64, 256, 128, 2)["exact"]
    pattern = _sequence_regex(mxfp4_dequant.CODE_BITS_SEQUENCE, inputs=("q",),
                              outputs=tuple(f"{x}{j}" for j in range(4) for x in "lh"))
    assert len(pattern.findall(ptx)) == 16
    assert "setp.lt.f32" in ptx and "mul.rn.bf16x2" not in ptx
