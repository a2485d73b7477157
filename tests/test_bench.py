"""k3jax bench: a tiny smoke run (JSON structure, PNG file), the crossover
rule, the scaling, atomic output and flag errors. No timing thresholds."""

from __future__ import annotations

import json
import math
import os

import pytest

from k3jax import K3, TINY
from k3jax.cli import main as cli_main
from k3jax.files import atomic_write
from k3jax.tools.token_sweep import crossover_tokens, default_experts, scale_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_smoke_json_and_plot(eight_devices, tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = cli_main(["bench", "--preset", "tiny", "--tokens", "8,32", "--repeats", "1", "--warmup", "0",
                     "--json", str(out_json), "--plot", str(out_png), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "crossover (shared expert)" in out and "ratio" in out

    doc = json.loads(out_json.read_text())
    assert doc["tokens"] == [8, 32] and doc["devices"] == 8 and doc["platform"] == "cpu"
    assert doc["simulated_devices"] is True and doc["repeats"] == 1
    assert doc["config"]["hidden_size"] == TINY.hidden_size            # tiny: CPU scale 1
    assert set(doc["benchmarks"]) == {"shared_expert", "moe_layer"}
    for bench in doc["benchmarks"].values():
        assert {"what", "replicated", "sharded", "ratio", "crossover_tokens", "max_rel_diff"} <= set(bench)
        for layout in ("replicated", "sharded"):
            series = bench[layout]
            assert series["layout"] == layout
            assert len(series["median_ms"]) == 2 and len(series["samples_ms"]) == 2
            assert all(len(s) == 1 for s in series["samples_ms"])
            assert all(math.isfinite(v) and v > 0 for v in series["median_ms"])
        assert "sp-sharded" in bench["sharded"]["description"]
        assert "replicated" in bench["replicated"]["description"]
        expected = [s / r for s, r in zip(bench["sharded"]["median_ms"], bench["replicated"]["median_ms"],
                                          strict=True)]
        assert bench["ratio"] == pytest.approx(expected)
        assert bench["crossover_tokens"] in (None, 8, 32)
        assert bench["crossover_tokens"] == crossover_tokens([8, 32], bench["ratio"])
        # the two layouts agree in float32 (measured <= 4.5e-7)
        assert len(bench["max_rel_diff"]) == 2 and all(0 <= d < 1e-5 for d in bench["max_rel_diff"])

    data = out_png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "bench.png"]   # no temporary left


def test_json_to_stdout(eight_devices, capsys):
    code = cli_main(["bench", "--preset", "tiny", "--tokens", "16", "--repeats", "1", "--warmup", "0",
                     "--skip-moe-layer", "--json", "-", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)                       # stdout holds only the JSON; the table is on stderr
    assert set(doc["benchmarks"]) == {"shared_expert"} and doc["tokens"] == [16]
    assert "Median latency" in err


def test_crossover_rule():
    t = [8, 32, 128, 256, 512]
    assert crossover_tokens(t, [0.8, 0.9, 1.1, 1.3, 1.7]) == 128
    assert crossover_tokens(t, [0.8, 1.2, 0.9, 1.3, 1.7]) == 256      # a noisy point is not it
    assert crossover_tokens(t, [0.8, 0.9, 0.9, 1.3, 0.95]) is None
    assert crossover_tokens(t, [1.1, 1.2, 1.3, 1.4, 1.5]) == 8


def test_scale_config_keeps_divisibility():
    cfg = scale_config(K3, 16, 8, num_experts=32, top_k=2)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size) == (448, 192, 224)
    assert cfg.num_experts == 32 and cfg.num_experts_per_token == 2
    odd = scale_config(K3, 7, 6)
    for width in (odd.hidden_size, odd.moe_intermediate_size, odd.intermediate_size,
                  odd.routed_expert_hidden_size):
        assert width % 6 == 0 and width > 0
    assert default_experts(K3, 8, "cpu") == (32, 2)
    assert default_experts(K3, 8, "gpu") == (896, 16)
    assert default_experts(TINY, 8, "cpu") == (16, 2)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.json"

    def fail(f):
        f.write("{half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(str(target), fail, mode="w")
    assert os.listdir(tmp_path) == []
    atomic_write(str(target), lambda f: f.write("{}"), mode="w")
    assert target.read_text() == "{}"


@pytest.mark.parametrize("argv, message", [
    (["--devices", "1"], "--devices must be >= 2"),
    (["--json", "/nonexistent-dir/x.json"], "directory does not exist"),
    (["--plot", "out.txt"], "expected a .png"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    code = cli_main(["bench", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_missing_config_file_is_bad_data_exit_1(capsys):
    code = cli_main(["bench", "--config", "/nonexistent/config.json"])
    _, err = capsys.readouterr()
    assert code == 1 and "not found" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("tokens", ["8,x", "0,8", "32,8", ""])
def test_bad_tokens_exit_2(capsys, tokens):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--tokens", tokens])
    assert e.value.code == 2 and "--tokens" in capsys.readouterr().err


def test_atomic_write_gives_usual_permissions(tmp_path):
    """mkstemp's 0600 must not leak into outputs: 0666 less the umask."""
    umask = os.umask(0o022)
    try:
        target = tmp_path / "y.bin"
        atomic_write(str(target), lambda f: f.write(b"x"))
    finally:
        os.umask(umask)
    assert (target.stat().st_mode & 0o777) == 0o644
