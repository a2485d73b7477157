"""benchmarks.kernel_sweep --smoke runs on the CPU (xla vs interpret) and
writes the JSON / markdown the full GPU run writes; benchmarks.lower_check and
benchmarks.model_rows run their slices of the sweep without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from benchmarks import kernel_sweep, measure

pytestmark = pytest.mark.tiers(
    compile=["test_lower_only_lowers_the_chosen_configs_for_sm90"],
    slow=[
        "test_wrong_kernel_aborts_and_keeps_the_rows_measured_before",
        "test_keep_going_records_the_wrong_kernel_as_an_error_row",
    ],
    integration=[
        "test_benchmark_smoke_writes_json_and_markdown",
        "test_model_only_writes_every_row_of_the_sweep_without_a_gpu",
        "test_device_run_script_records_the_environment_and_refuses_a_cpu",
    ])

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SWEEP = [sys.executable, "-m", "benchmarks.kernel_sweep"]
_LOWER = [sys.executable, "-m", "benchmarks.lower_check"]
_MODEL = [sys.executable, "-m", "benchmarks.model_rows"]
_PLOT = [sys.executable, "-m", "benchmarks.plot_gpu_kernels"]


def test_benchmark_smoke_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([*_SWEEP, "--smoke", "--json", str(out_json),
                           "--markdown", str(out_md)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=_REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert set(result) == {"meta", "ceilings", "grouped", "mlp", "mxfp4"}
    assert {"date", "gpu", "jax_version", "command", "kernel_backend", "iters"} <= set(result["meta"])
    assert result["meta"]["kernel_backend"] == "interpret" and result["meta"]["complete"] is True
    assert result["ceilings"]["matmul_tflops"] > 0 and result["ceilings"]["copy_tbps"] > 0
    assert {r["op"] for r in result["grouped"]} == {"gate_up_situ", "down"}
    for row in result["grouped"] + result["mlp"]:
        assert "skipped" not in row and "error" not in row, row
        assert row["max_rel_err"] <= 1e-2
        for impl in ("kernel", "xla"):
            assert {"us", "tflops", "pct_dense", "weight_tbps", "pct_copy"} <= set(row[impl])
            assert row[impl]["us"] > 0
        assert row["speedup"] > 0
    assert {"rows", "local_experts", "active_experts", "small"} <= set(result["grouped"][0])
    assert result["mlp"] and result["mlp"][0]["op"] == "situ_mlp_up"
    assert {r["op"] for r in result["mxfp4"]} == {"gate_up_situ", "down"}
    for row in result["mxfp4"]:   # packed vs bf16 weights vs dequantize + ragged_dot
        assert "error" not in row and row["max_rel_err"] <= 1e-2, row
        assert {"mxfp4", "bf16", "dequant_ragged_dot"} <= set(row) and row["mxfp4"]["us"] > 0
    markdown = out_md.read_text()
    assert "Ceilings" in markdown and "| gate_up_situ |" in markdown and "| situ_mlp_up |" in markdown
    assert "MXFP4 experts" in markdown

    png = tmp_path / "bench.png"
    plot = subprocess.run([*_PLOT, str(out_json), "-o", str(png)], cwd=_REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("make_input,culprit", [
    (lambda d: d / "missing.json", "no such file"),
    (lambda d: (d / "x.json").write_text("{not json") and d / "x.json", "is not JSON"),
    (lambda d: (d / "y.json").write_text('{"meta": {}}') and d / "y.json", "missing"),
])
def test_plot_rejects_bad_input_with_exit_2(tmp_path, make_input, culprit):
    proc = subprocess.run([*_PLOT, str(make_input(tmp_path)), "-o",
                           str(tmp_path / "p.png")], capture_output=True, text=True,
                          timeout=120, cwd=_REPO, check=False)
    assert proc.returncode == 2 and culprit in proc.stderr, proc.stderr
    assert not (tmp_path / "p.png").exists()


def test_lower_only_lowers_the_chosen_configs_for_sm90():
    """The pre-flight CLI on the CPU, on a slice of the sweep: both grouped ops
    at EP 16 / 16 tokens, the jax Mosaic ragged_dot peer of the "down" row and
    the MLP at tp 8 / T 8 lower for sm_90. Every one of the full sweep's 69
    configs is compiled through ptxas (a superset of lowering) by
    tests/test_aot_kernels.py, whose list test_the_configuration_list_is_the_benchmarks
    ties to this sweep."""
    proc = subprocess.run([*_LOWER, "--ep", "16", "--tokens", "16",
                           "--tp", "8", "--mlp-tokens", "8"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=_REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("lowered  ") == 4 and "FAILED" not in proc.stdout
    assert "# 4 of 4 configs lower for sm_90" in proc.stdout
    assert proc.stdout.count("(peer: jax Mosaic)") == 1
    assert "gate_up_situ ep=16 tokens=16" in proc.stdout
    assert "situ_mlp_up tp=8 tokens=8" in proc.stdout


@pytest.mark.parametrize("argv,culprit", [
    (["--ep", "5"], "--ep 5"), (["--tp", "7"], "--tp 7"), (["--iters", "0"], "--iters"),
    (["--tokens", "-16"], "--tokens"), (["--smoke", "--lower-only"], "--lower-only"),
    (["--json", "/no/such/folder/out.json"], "--json"),
])
def test_usage_errors_exit_2_naming_the_flag(argv, culprit, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_sweep.parse_args(argv)
    assert exit_info.value.code == 2
    assert culprit in capsys.readouterr().err


def _wrong_down_kernel(monkeypatch):
    """Make the check reject the "down" rows, as a wrong kernel would."""
    real_check = measure.check_against_reference

    def check(name, out, ref, valid_rows):
        if name.startswith("down"):
            raise measure.KernelMismatch(f"{name}: relative error 0.5 > 0.01 (injected)")
        return real_check(name, out, ref, valid_rows)

    monkeypatch.setattr(measure, "check_against_reference", check)


def test_wrong_kernel_aborts_and_keeps_the_rows_measured_before(tmp_path, monkeypatch, capsys):
    _wrong_down_kernel(monkeypatch)
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    code = kernel_sweep.main(["--smoke", "--json", str(out_json), "--markdown", str(out_md)])
    assert code == 3 and "ABORT" in capsys.readouterr().err
    partial = json.loads(out_json.read_text())
    assert partial["meta"]["complete"] is False
    assert [r["op"] for r in partial["mlp"]] == ["situ_mlp_up"]          # runs first
    assert [r["op"] for r in partial["grouped"]] == ["gate_up_situ"]      # then "down" aborts
    assert "incomplete" in out_md.read_text()
    assert sorted(os.listdir(tmp_path)) == ["b.json", "b.md"]  # no temporary files left


def test_keep_going_records_the_wrong_kernel_as_an_error_row(tmp_path, monkeypatch):
    _wrong_down_kernel(monkeypatch)
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    code = kernel_sweep.main(["--smoke", "--keep-going", "--json", str(out_json),
                             "--markdown", str(out_md)])
    assert code == 1
    result = json.loads(out_json.read_text())
    assert result["meta"]["complete"] is True
    rows = {r["op"]: r for r in result["grouped"] + result["mlp"]}
    assert "injected" in rows["down"]["error"]
    assert "error" not in rows["gate_up_situ"] and "error" not in rows["situ_mlp_up"]
    assert "| down | 4 | 4 | 24 | 48 | ERROR down ep=4 tokens=24" in out_md.read_text()


def test_model_only_writes_every_row_of_the_sweep_without_a_gpu(tmp_path):
    """benchmarks.model_rows: the cost model's fields for each row (a K3-shape subset)."""
    out = tmp_path / "model.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([*_MODEL, "--ep", "32", "--tokens", "16",
                           "--tp", "8", "--mlp-tokens", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=_REPO,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    model = json.loads(out.read_text())
    rows = model["grouped"] + model["mlp"]
    assert [(r["op"], r["ep"], r["tp"], r["tokens"]) for r in rows] == [
        ("gate_up_situ", 32, None, 16), ("gate_up_situ_mxfp4", 32, None, 16),
        ("down", 32, None, 16), ("down_mxfp4", 32, None, 16), ("situ_mlp_up", None, 8, 8)]
    fields = {"op", "ep", "tp", "tokens", "tiles", "sm_fill", "weight_reads_per_active_expert",
              "x_bytes_over_weight_bytes", "rows_computed_per_useful_row", "predicted_us"}
    for r in rows:
        assert fields <= set(r) and r["predicted_us"] > 0 and 0 < r["sm_fill"] <= 1, r
    assert all(r["weight_reads_per_active_expert"] <= 1.05 for r in model["grouped"])
    # MXFP4 rows (at decode, mosaic_sm90_mxfp4_swap_ab's kernel): 17/32 of the
    # bf16 rows' weight bytes
    by_op = {r["op"]: r for r in model["grouped"]}
    for op in ("gate_up_situ", "down"):
        mx, bf = by_op[op + "_mxfp4"], by_op[op]
        assert mx["config"]["kernel"] == "mosaic_sm90_mxfp4_swap_ab" and mx["config"]["mxfp4"]
        assert bf["config"]["kernel"] in ("mosaic_sm90", "mosaic_sm90_swap_ab")
        assert mx["config"]["num_compute_wgs"] == 2
        per_read = [r["hbm_bytes"]["weights"] / r["weight_reads_per_active_expert"]
                    for r in (mx, bf)]
        assert per_read[0] == pytest.approx(per_read[1] * 17 / 64)
    assert model["mlp"][0]["config"]["split_k"] > 1 and model["mlp"][0]["sm_fill"] >= 0.9


def test_benchmark_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_sweep.parse_args(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "--smoke" in usage and "--json" in usage and "--markdown" in usage
    assert "benchmarks.lower_check" in usage and "--keep-going" in usage


def test_device_run_script_records_the_environment_and_refuses_a_cpu(tmp_path):
    """benchmarks/h200_device_run.sh: env.txt, then the correctness pass, then
    the sweep, whose exit status it returns (2 here: both need a GPU)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(_REPO, "benchmarks", "h200_device_run.sh")],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    env_txt = (tmp_path / "env.txt").read_text()
    assert f"jax {jax.__version__}" in env_txt and "devices [Cpu" in env_txt
    assert "the full benchmark needs a GPU" in (tmp_path / "headline.log").read_text()
    assert "needs a GPU" in (tmp_path / "checks.log").read_text()       # step 2: checks
    assert "the full benchmark needs a GPU" in (tmp_path / "gpu.log").read_text()  # step 3
