"""benchmarks/gpu_kernels.py --smoke runs on the CPU (xla vs interpret) and
writes the JSON / markdown the full GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(_REPO, "benchmarks", "gpu_kernels.py")


def test_benchmark_smoke_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, _SCRIPT, "--smoke", "--json", str(out_json),
                           "--markdown", str(out_md)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=_REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert set(result) == {"meta", "ceilings", "grouped", "mlp"}
    assert {"date", "gpu", "jax_version", "command", "kernel_backend", "iters"} <= set(result["meta"])
    assert result["meta"]["kernel_backend"] == "interpret"
    assert result["ceilings"]["matmul_tflops"] > 0 and result["ceilings"]["copy_tbps"] > 0
    assert {r["op"] for r in result["grouped"]} == {"gate_up_situ", "down"}
    for row in result["grouped"] + result["mlp"]:
        assert "skipped" not in row and "error" not in row, row
        assert row["max_rel_err"] <= 2e-2
        for impl in ("kernel", "xla"):
            assert {"us", "tflops", "pct_dense", "weight_tbps", "pct_copy"} <= set(row[impl])
            assert row[impl]["us"] > 0
        assert row["speedup"] > 0
    assert {"rows", "local_experts", "active_experts", "small"} <= set(result["grouped"][0])
    assert result["mlp"] and result["mlp"][0]["op"] == "situ_mlp_up"
    markdown = out_md.read_text()
    assert "Ceilings" in markdown and "| gate_up_situ |" in markdown and "| situ_mlp_up |" in markdown


def test_benchmark_help(capsys):
    sys.path.insert(0, os.path.dirname(_SCRIPT))
    import gpu_kernels

    with pytest.raises(SystemExit) as exit_info:
        gpu_kernels.parse_args(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "--smoke" in usage and "--json" in usage and "--markdown" in usage
