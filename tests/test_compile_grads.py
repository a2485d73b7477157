"""``k3jax compile --grads``: one layer's forward + VJP (what layer_grads runs)
compiled for H200s without a GPU. TINY-sized models keep each compile to
seconds; the full-size K3 figures are benchmarks/results/training_memory.md."""

from __future__ import annotations

import json

import pytest

from k3jax.cli import main
from k3jax.config import K3, TINY
from k3jax.layout import ParallelConfig
from k3jax.tools.compile_grads import compile_layer_grads
from k3jax.tools.plan import plan_layer_bytes
from layout_cases import LAYOUTS

pytestmark = pytest.mark.compile
SP_EP_SHARD = ["--tp", "8", "--sequence-parallel", "--expert-parallel", "--shard-shared-expert"]


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_json_reports_the_training_step(capsys):
    tokens = 64
    assert main(["compile", "--grads", "--preset", "tiny", *SP_EP_SHARD, "--tokens", str(tokens),
                 "--expert-dtype", "bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    b = out["per_device_bytes"]
    planner = sum(plan_layer_bytes(TINY, LAYOUTS["sp_ep_tp8_shard"], 1,
                                   expert_dtype="bfloat16").values())
    assert b["weights"] == out["planner_weight_bytes"] == planner
    x_shard = tokens // 8 * TINY.hidden_size * 2
    assert b["activations"] == 2 * x_shard                  # x and dy
    grads = out["grads"]
    assert grads["frozen"] == ["router_bias_E"] and grads["x_gradient"] is None
    # every weight but the (float32, selection-only) router bias has a gradient
    # of its own shard's size; the outputs are y, dx and those gradients
    assert 0 < grads["gradient_bytes"] < b["weights"]
    # (plus the output tuple's table of buffer pointers, 8 bytes per output)
    assert 0 <= b["outputs"] - (grads["gradient_bytes"] + 2 * x_shard) <= 8 * 32
    assert out["fit"]["needed_bytes"] == sum(b.values())
    assert out["fits_h200"] is True and out["kernels"] == []
    kinds = [c["kind"] for c in out["collectives"]]
    # the forward's all-gathers / reduce-scatters mirrored in the backward
    assert kinds.count("all-gather") >= 2 and kinds.count("reduce-scatter") >= 2
    for c in out["collectives"]:
        assert set(c) >= {"kind", "bytes", "group", "async", "compute_between"}


def test_packed_mxfp4_experts_are_frozen_and_named(capsys):
    assert main(["compile", "--grads", "--preset", "tiny", "--tp", "2", "--tokens", "32"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "frozen: " in text and "experts" in text.split("frozen: ")[1]
    assert "x-gradient of the frozen MXFP4 experts: blocked scan of dy @ W[g]^T" in text
    assert main(["compile", "--grads", "--preset", "tiny", "--tp", "2", "--tokens", "32",
                 "--json"]) == 0
    grads = json.loads(capsys.readouterr().out)["grads"]
    packed = [name for name in grads["frozen"] if name != "router_bias_E"]
    assert packed and all("experts" in name or "_E" in name for name in packed), grads
    assert "mxfp4_vjp" in grads["x_gradient"]


def test_the_training_step_compiles_the_dequant_the_experts_allow(capsys):
    """--mxfp4-dequant with --grads: the Pallas training step's forward
    launches the fast MXFP4 kernels, or with exact the exact ones (x's
    gradient is the blocked scan either way)."""
    def kernels(dequant):
        assert main(["compile", "--grads", "--preset", "tiny", "--tp", "2", "--tokens", "64",
                     "--backend", "pallas", "--mxfp4-dequant", dequant, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["mxfp4_dequant"] == dequant and "mxfp4_vjp" in out["grads"]["x_gradient"]
        return {k["name"].rsplit("_", 1)[0] for k in out["kernels"] if "_mxfp4" in k["name"]}
    fast, exact = kernels("fast"), kernels("exact")
    assert fast and not any("_exact" in name for name in fast), fast
    assert exact == {"grouped_situ_glu_mxfp4_exact_m64", "grouped_matmul_mxfp4_exact_m64"}, exact


@pytest.mark.parametrize("argv, words", [
    (["--tp", "7"], "--dp 1 --tp 7 cannot train this model"),
    (["--preset", "tiny", "--tp", "8", "--sequence-parallel"], "(--expert-dtype bfloat16)"),
    (["--preset", "tiny", "--layer", "9"], "--layer 9: the model has layers 0..2"),
])
def test_a_layout_that_cannot_train_exits_2_naming_the_flags(argv, words, capsys):
    assert main(["compile", "--grads", *argv]) == 2
    assert words in one_line_error(capsys.readouterr().err)


def test_the_xla_backward_has_no_dense_expansion():
    """Many local experts (64 per device): ragged_dot's VJP, expanded densely,
    would hold [T*K rows, G*L] per device; the blocked backward stays
    near the activations."""
    cfg = TINY.replace(num_experts=512, num_experts_per_token=8, routed_expert_hidden_size=256,
                       moe_intermediate_size=256)
    parallel = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True)
    tokens = 2048
    report = compile_layer_grads(cfg, parallel, 1, tokens=tokens, backend="xla",
                                 expert_dtype="bfloat16")
    local_experts = cfg.num_experts // 8
    # SP + EP: every device sorts all T * K gathered pairs (its experts' first)
    rows = tokens * cfg.num_experts_per_token
    dense = rows * local_experts * cfg.routed_expert_hidden_size * 2
    assert report.per_device_bytes["temporaries"] < dense / 4, (report.per_device_bytes, dense)


def test_the_xla_training_step_grows_linearly_in_tokens():
    """K3 layer 1 on tp 8 (SP + EP, sharded shared expert in the form the
    default picks), bf16 experts, XLA's buffer assignment for the H200 target:
    the temporaries at 4x the tokens stay within 4.5x, and at 32768 tokens
    (every device sorts all P = T * K = 524288 pairs) below two [P, L] and
    two [P, F] bf16 row buffers: at most the re-gathered rows x_PL, their
    gradient and dh_PF are held at once, never also a [P, L] cotangent of
    the down projection's rows (grouped_matmul_combine's backward gathers
    it per row block). Two compiles, about 10-25 s each here."""
    parallel = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True)
    reports = {t: compile_layer_grads(K3, parallel, 1, tokens=t, backend="xla",
                                      expert_dtype="bfloat16") for t in (8192, 32768)}
    temps = {t: r.per_device_bytes["temporaries"] for t, r in reports.items()}
    forms = {t: r.to_dict()["layout"]["overlap_forms"]["shared_expert"]
             for t, r in reports.items()}
    pairs = 32768 * K3.num_experts_per_token
    rows_PL = pairs * K3.routed_expert_hidden_size * 2
    rows_PF = pairs * reports[32768].layout.padded_moe_intermediate * 2
    assert temps[32768] <= 4.5 * temps[8192], (temps, forms)
    assert temps[32768] < 2 * rows_PL + 2 * rows_PF, (temps, forms)
