"""``k3jax compile --backend triton``: the layer's Triton kernels compiled by
Triton and the wheel's ptxas for a compute capability, without a GPU; the
launches are the layer's own (collected while its forward is traced)."""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx

from k3jax.cli import main
from k3jax.config import K3
from k3jax.tools.aot import GPU_COMPILER_OPTIONS, h200_mesh
from k3jax.tools.compile import compiled_bytes, layer_on_mesh, shard_bytes
from layout_cases import (
    LAYOUTS,
    MXFP4_DECODE_TEMP_MAX,
    MXFP4_DECODE_TOKENS,
    MXFP4_LAYOUT,
    MXFP4_PREFILL_OVER_BF16,
    MXFP4_PREFILL_TOKENS,
)
from pallas_kernels.backend import TRITON
from pallas_kernels.selfcheck import gate
from pallas_kernels.triton_target import triton_target

pytestmark = pytest.mark.tiers(compile=["test_every_triton_launch_of_the_layer_compiles",
                                        "test_mxfp4_layer_temporaries_through_triton"])


@pytest.mark.parametrize("capability", [80, 90])
def test_every_triton_launch_of_the_layer_compiles(capability, capsys):
    assert main(["compile", "--backend", "triton", "--compute-capability", str(capability),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compute_capability"] == capability and out["layout"] == "dp=1, tp=1"
    kernels = {k["config"].split(":")[0]: k for k in out["kernels"]}
    assert sorted(kernels) == ["grouped_matmul", "grouped_situ_glu", "situ_mlp_up"]
    assert kernels["grouped_matmul"]["kernel"] == "grouped_matmul_mxfp4_kernel"   # MXFP4 experts
    for k in out["kernels"]:
        assert k["capability"] == capability and 0 < k["registers"] <= 255
        assert 0 < k["shared_bytes"] <= k["smem_limit"]
        if capability == 90:
            assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, k


@pytest.mark.parametrize("argv, words", [
    (["compile", "--compute-capability", "90"], "--compute-capability needs --backend triton"),
    (["compile", "--backend", "triton", "--grads"], "--grads compiles through XLA"),
])
def test_triton_usage_errors_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def _temporaries(tokens: int, expert_dtype: str) -> int:
    """MoE layer 1 of K3 on the MXFP4 layout (SP + EP + shard, tp 8), its
    Triton kernels lowered for sm_90 inside XLA's deviceless compile for 8
    H200s (k3jax.tools.compile.compile_layer's program; that function compiles the
    xla and pallas backends): per-device temporaries in bytes."""
    parallel = LAYOUTS[MXFP4_LAYOUT]
    with triton_target(90):
        built = layer_on_mesh(K3, parallel, 1, h200_mesh(parallel), tokens=tokens,
                              backend="triton", dtype="bfloat16", expert_dtype=expert_dtype)
        graph, state = nnx.split(built.module)
        fn = jax.jit(lambda state, x_TD: nnx.merge(graph, state)(x_TD),
                     compiler_options=GPU_COMPILER_OPTIONS)
        with gate.collecting(), jax.sharding.use_abstract_mesh(built.mesh.abstract_mesh):
            compiled = fn.trace(state, built.x_TD).lower().compile()
    assert built.layout.backend == TRITON
    return compiled_bytes(compiled, shard_bytes(built.x_TD))["temporaries"]


def test_mxfp4_layer_temporaries_through_triton():
    """The Triton kernels read the packed codes in place: MXFP4 experts'
    temporaries within the targets test_aot_layouts holds for XLA and
    Pallas (decode at most MXFP4_DECODE_TEMP_MAX, prefill at most
    MXFP4_PREFILL_OVER_BF16 x the bf16 experts')."""
    decode = _temporaries(MXFP4_DECODE_TOKENS, "mxfp4")
    assert 0 < decode <= MXFP4_DECODE_TEMP_MAX, decode
    mxfp4 = _temporaries(MXFP4_PREFILL_TOKENS, "mxfp4")
    bf16 = _temporaries(MXFP4_PREFILL_TOKENS, "bfloat16")
    print(f"triton: {decode / 2 ** 30:.4f} GiB at {MXFP4_DECODE_TOKENS} tokens; "
          f"{mxfp4 / 2 ** 30:.3f} / {bf16 / 2 ** 30:.3f} GiB at {MXFP4_PREFILL_TOKENS}")
    assert 0 < mxfp4 <= MXFP4_PREFILL_OVER_BF16 * bf16, (mxfp4, bf16)
