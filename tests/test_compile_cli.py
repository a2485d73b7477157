"""``k3jax compile`` (compile-only H200 devices, no GPU) and the CLI's platform
default. The full-size K3 numbers are checked in test_aot_layouts.py; here the
TINY model keeps each compile to seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import k3jax.tools.aot
from k3jax.cli import main
from k3jax.cli.platforms import default_jax_platforms, default_xla_flags
from k3jax.tools.plan import plan_layer_bytes
from layout_cases import LAYOUTS

pytestmark = pytest.mark.tiers(
    compile=["test_json_has_the_issues_keys_and_the_planners_weights", "test_tables_for_the_dense_layer",
             "test_pallas_kernels_are_compiled_with_the_check_on_first_use_on"],
    integration=["test_the_cli_on_a_cpu_host_prints_no_plugin_traceback"])

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SP_EP_SHARD = ["--tp", "8", "--sequence-parallel", "--expert-parallel", "--shard-shared-expert"]


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_json_has_the_issues_keys_and_the_planners_weights(capsys):
    assert main(["compile", "--preset", "tiny", *SP_EP_SHARD, "--tokens", "64",
                 "--expert-dtype", "bfloat16", "--shared-overlap", "ring", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"per_device_bytes", "planner_weight_bytes", "fits_h200", "collectives",
                        "kernels", "flops", "bytes_accessed", "target"}
    from k3jax.config import TINY
    planner = sum(plan_layer_bytes(TINY, LAYOUTS["sp_ep_tp8_shard"], 1,
                                   expert_dtype="bfloat16").values())
    assert out["per_device_bytes"]["weights"] == out["planner_weight_bytes"] == planner
    assert set(out["per_device_bytes"]) == {"weights", "activations", "outputs", "temporaries"}
    assert out["per_device_bytes"]["activations"] == 64 // 8 * TINY.hidden_size * 2
    assert out["fits_h200"] is True and out["kernels"] == []
    assert out["target"]["device"] == "NVIDIA H200"
    assert out["target"]["compute_capability"] == "sm_90a"
    kinds = [c["kind"] for c in out["collectives"]]
    # routed: all-gathers + one reduce-scatter; the sharded shared expert's ring
    # (--shared-overlap ring): collective-permutes
    assert kinds.count("all-gather") >= 2 and kinds.count("reduce-scatter") == 1
    assert "collective-permute" in kinds
    for c in out["collectives"]:
        assert set(c) >= {"kind", "bytes", "group", "async", "compute_between"}
        assert c["group"] == 8 and c["bytes"] > 0
        assert set(c["compute_between"]) == {"ops", "flops"}


def test_pallas_kernels_are_compiled_with_the_check_on_first_use_on(capsys):
    """The default K3JAX_SELFCHECK (the suite runs with it off): the check
    cannot run a GPU kernel on this host, so compile must not ask it, or every
    launch would trace its XLA fallback and the report would hold no kernel."""
    from pallas_kernels.selfcheck import gate
    gate.reset()
    gate.force_mode("1")
    try:
        assert main(["compile", "--preset", "tiny", "--tokens", "64", "--backend", "pallas",
                     "--expert-dtype", "mxfp4", "--json"]) == 0
        records = gate.records()
    finally:
        gate.force_mode(None)
        gate.reset()
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    kernels = {k["name"].rsplit("_", 1)[0]: k for k in report["kernels"]}
    # the MXFP4 dispatch at TINY's decode, abstract experts taken as FAST (the
    # default): the swap-AB kernels, one a launch, and no exact kernel
    assert report["mxfp4_dequant"] == "fast"
    fast = {name for name in kernels if "_mxfp4_swap_ab_t" in name}
    assert {name.split("_mxfp4")[0] for name in fast} == {"grouped_situ_glu", "grouped_matmul"}
    assert not any("_exact_" in name for name in kernels), sorted(kernels)
    for name in fast:
        assert kernels[name]["dequant_sass_per_weight"] is None   # TINY: one K step, no loop
    assert records == [] and "failed its check" not in captured.err
    # --mxfp4-dequant exact: the row-major exact kernels instead
    assert main(["compile", "--preset", "tiny", "--tokens", "64", "--backend", "pallas",
                 "--expert-dtype", "mxfp4", "--mxfp4-dequant", "exact", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mxfp4_dequant"] == "exact"
    assert {k["name"].rsplit("_", 1)[0] for k in report["kernels"] if "_mxfp4" in k["name"]} == {
        "grouped_situ_glu_mxfp4_exact_m64", "grouped_matmul_mxfp4_exact_m64"}


def test_tables_for_the_dense_layer(capsys):
    assert main(["compile", "--preset", "tiny", "--tp", "8", "--layer", "0", "--tokens", "32",
                 "--expert-dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "Per-device bytes from the compiler" in out and "weights == planner" in out
    assert "all-reduce" in out      # plain TP: the row-parallel down projection's sum


@pytest.mark.parametrize("argv, words", [
    (["--tp", "7"], "--dp 1 --tp 7 does not fit this model"),
    (["--preset", "tiny", "--layer", "9"], "--layer 9: the model has layers 0..2"),
    (["--preset", "tiny", "--expert-dtype", "float32"], "--expert-dtype float32 needs --dtype "
                                                        "float32"),
    (["--preset", "tiny", "--tp", "8", "--sequence-parallel"],
     "(--expert-dtype bfloat16)"),
])
def test_usage_errors_exit_2_naming_the_flags(argv, words, capsys):
    assert main(["compile", *argv]) == 2
    assert words in one_line_error(capsys.readouterr().err)


def test_the_cli_adds_the_gpu_flags_but_keeps_the_users():
    env = {"XLA_FLAGS": "--xla_gpu_all_gather_combine_threshold_bytes=1024 --xla_dump_to=/tmp/d"}
    flags = default_xla_flags(env).split()
    assert flags == ["--xla_gpu_all_gather_combine_threshold_bytes=1024", "--xla_dump_to=/tmp/d",
                     "--xla_gpu_reduce_scatter_combine_threshold_bytes=0",
                     "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"]
    assert default_xla_flags({}).split() == [
        "--xla_gpu_all_gather_combine_threshold_bytes=0",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=0",
        "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"]


def test_the_gpu_options_are_options_this_jaxlib_knows():
    """XLA refuses an option it does not know ("No such compile option")."""
    import jax
    import jax.numpy as jnp

    from k3jax.xla_options import GPU_COMPILER_OPTIONS

    jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile(compiler_options=GPU_COMPILER_OPTIONS)
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile(
            compiler_options={"xla_gpu_no_such_option": True})


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--layer", "-1"], ["--backend", "cuda"]])
def test_bad_flag_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compile", *argv])
    assert e.value.code == 2
    assert argv[0] in one_line_error(capsys.readouterr().err)


def test_a_missing_gpu_compile_extra_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(k3jax.tools.aot, "_nvcc_wheel_bin", lambda: None)
    assert main(["compile", "--preset", "tiny", "--tp", "8", "--layer", "0",
                 "--expert-dtype", "bfloat16"]) == 1
    assert "install the gpu-compile extra" in one_line_error(capsys.readouterr().err)


# -- the CLI's JAX platform ----------------------------------------------------
def test_cpu_by_default_without_an_nvidia_device_node(tmp_path):
    env: dict[str, str] = {}
    assert default_jax_platforms(env, tmp_path / "nvidiactl") == "cpu"
    assert env == {"JAX_PLATFORMS": "cpu"}
    (tmp_path / "nvidiactl").touch()
    env = {}
    assert default_jax_platforms(env, tmp_path / "nvidiactl") is None and env == {}
    env = {"JAX_PLATFORMS": "cuda"}                        # the user's choice stands
    assert default_jax_platforms(env, tmp_path / "missing") == "cuda"
    assert env == {"JAX_PLATFORMS": "cuda"}


def test_the_cli_on_a_cpu_host_prints_no_plugin_traceback():
    """With the CUDA plugin installed and no JAX_PLATFORMS, jax's platform
    search would print "Jax plugin configuration error ... cuInit(0) failed" on a
    host without a GPU (on a GPU host jax finds the GPU: no error either)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "k3jax", "plan", "--preset", "tiny", "--json"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=_REPO)
    assert proc.returncode == 0, proc.stderr
    assert "plugin configuration error" not in proc.stderr.lower(), proc.stderr
    assert "cuInit" not in proc.stderr
    assert json.loads(proc.stdout)["per_device_bytes"]["total"] > 0
