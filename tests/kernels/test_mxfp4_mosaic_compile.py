"""The MXFP4 Mosaic kernel (mosaic_sm90_mxfp4.py) compiles for the H200
(sm_90a) through ptxas without a GPU, at K3's routed-expert shapes at EP 8
(112 local experts; gate/up: K 3584 -> N 3072, fused; down: K 3072 -> N 3584)
at decode (16 tokens x top-16 = 256 rows) and prefill (4096 tokens = 65536 rows).

Every configuration compiles with 0 spill bytes (the fused tile's SiTU
epilogue stages the gate products through SMEM to get there).
Measured on the shared 2-core machine: 30-80 s per compile (four compiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from k3jax.aot import pin_wheel_ptxas
from k3jax.kernel_ptxas import ptxas_reports
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4 as mk
from pallas_kernels.mxfp4 import Mxfp4Weights

pytestmark = pytest.mark.compile

LOCAL_EXPERTS = 112   # 896 experts / EP 8
TOP_K = 16
SHAPES = {"gate_up_situ": (3584, 3072, 2), "down": (3072, 3584, 1)}
TOKENS = {"decode": 16, "prefill": 4096}


def _reports(op: str, tokens: int):
    k, n, num_w = SHAPES[op]
    rows = tokens * TOP_K
    S = jax.ShapeDtypeStruct
    weight = [S((LOCAL_EXPERTS, k // 2, n), jnp.uint8), S((LOCAL_EXPERTS, k // 32, n), jnp.uint8)]
    specs = (S((rows, k), jnp.bfloat16), *weight * num_w, S((LOCAL_EXPERTS,), jnp.int32))

    def fn(x, *rest):
        ws = [Mxfp4Weights(rest[i], rest[i + 1]) for i in range(0, 2 * num_w, 2)]
        if num_w == 2:
            return mk.grouped_situ_glu_mxfp4(x, *ws, rest[-1], beta=4.0, linear_beta=25.0)
        return mk.grouped_matmul_mxfp4(x, ws[0], rest[-1])

    pin_wheel_ptxas()
    return ptxas_reports(fn, *specs)


@pytest.mark.parametrize("phase", list(TOKENS))
@pytest.mark.parametrize("op", list(SHAPES))
def test_mxfp4_kernel_compiles_for_sm90a(op, phase):
    found = _reports(op, TOKENS[phase])
    assert len(found) == 1, found
    r = found[0]
    assert r.name.startswith(("grouped_situ_glu_mxfp4_m64", "grouped_matmul_mxfp4_m64")), r
    assert 0 < r.registers <= 255 and 0 < r.smem_bytes <= 232_448, r
    assert r.grid == (132, 1, 1), r                # persistent: one CTA per SM
    assert r.spill_bytes == 0, r                   # issue 13: no spills
