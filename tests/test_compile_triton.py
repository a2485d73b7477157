"""``k3jax compile --backend triton``: the layer's Triton kernels compiled by
Triton and the wheel's ptxas for a compute capability, without a GPU; the
launches are the layer's own (collected while its forward is traced)."""

from __future__ import annotations

import json

import pytest

from k3jax.cli import main

pytestmark = pytest.mark.tiers(compile=["test_every_triton_launch_of_the_layer_compiles"])


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
