"""The MXFP4 Mosaic kernel (mosaic_sm90_mxfp4.py) compiles for the H200
(sm_90a) through ptxas without a GPU, at K3's routed-expert shapes at EP 8
(112 local experts; gate/up: K 3584 -> N 3072, fused; down: K 3072 -> N 3584)
at decode (16 tokens x top-16 = 256 rows) and prefill (4096 tokens = 65536 rows).

Every configuration compiles with 0 spill bytes (the fused tile's SiTU
epilogue stages the gate products through SMEM to get there). The four are
benchmarks/compile_table.py's MXFP4 configurations (the grouped ops' MXFP4
dispatch), compiled once per test run (tests/compile_cache.py) and held to the
golden register file by tests/test_aot_kernels.py.
"""

from __future__ import annotations

import pytest
from compile_cache import kernel_reports

from benchmarks import compile_table

pytestmark = pytest.mark.compile

LOCAL_EXPERTS = 112   # 896 experts / EP 8
TOP_K = 16
SHAPES = {"gate_up_situ": (3584, 3072, 2), "down": (3072, 3584, 1)}
TOKENS = {"decode": 16, "prefill": 4096}


def test_the_configurations_are_k3s_at_ep8():
    """compile_table's MXFP4 rows are these ops and phases at these shapes."""
    configs = {c.name: c for c in compile_table.kernel_configs()}
    for op, (k, n, num_w) in SHAPES.items():
        for tokens in TOKENS.values():
            x, *ws, sizes = configs[f"{op}_mxfp4 ep=8 tokens={tokens}"].arg_specs
            assert x.shape == (tokens * TOP_K, k) and sizes.shape == (LOCAL_EXPERTS,)
            assert [w.shape for w in ws] == [(LOCAL_EXPERTS, k // 2, n),
                                             (LOCAL_EXPERTS, k // 32, n)] * num_w


@pytest.mark.parametrize("phase", list(TOKENS))
@pytest.mark.parametrize("op", list(SHAPES))
def test_mxfp4_kernel_compiles_for_sm90a(op, phase):
    found = kernel_reports(f"{op}_mxfp4 ep=8 tokens={TOKENS[phase]}")
    assert len(found) == 1, found
    r = found[0]
    assert r.name.startswith(("grouped_situ_glu_mxfp4_m64", "grouped_matmul_mxfp4_m64")), r
    assert 0 < r.registers <= 255 and 0 < r.smem_bytes <= 232_448, r
    assert r.grid == (132, 1, 1), r                # persistent: one CTA per SM
    assert r.spill_bytes == 0, r
    # the consumer K step's SASS is counted (k3jax.kernel_sass): every
    # weight element of the step is multiplied once per x plane
    assert r.k_step is not None and r.k_step.mma_kn == 128 * 128, r
    assert r.k_step.instructions > 0 and r.k_step.per_weight() > 0, r
