"""The ``k3jax`` command line: ``run`` and ``make-checkpoint``.

Most checks call ``k3jax.cli.main`` in-process (this process has 8 simulated
CPU devices, so --devices is 8 or 1); a few run ``python -m k3jax`` end to end.
Outputs are checked against the float64 numpy reference."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from k3jax.checkpoint import CheckpointReader, write_checkpoint
from k3jax.checkpoint.names import layer_prefix
from k3jax.cli import main
from k3jax.config import TINY
from numerics import rel_err
from pallas_kernels.mxfp4 import dequant_numpy
from reference_np import np_mlp, np_moe

pytestmark = pytest.mark.tiers(
    integration=["test_subprocess_default_run", "test_subprocess_sharded_run_and_usage_error"])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = layer_prefix(1, True)


def layer_tensors(ckpt, layer):
    """{suffix: float64} of one layer, read back from the files (MXFP4 decoded)."""
    reader = CheckpointReader(ckpt)
    prefix = layer_prefix(layer, reader.config.is_moe_layer(layer))
    out = {}
    for full in reader._file_of:
        name = full[len(reader.prefix):]
        if not name.startswith(prefix) or name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            weight = name[:-len("_packed")]
            out[weight[len(prefix):]] = dequant_numpy(reader.read(name),
                                                           reader.read(weight + "_scale"))
        else:
            out[name[len(prefix):]] = np.asarray(reader.read(name), np.float64)
    return out


def reference(ckpt, layer, x):
    cfg = CheckpointReader(ckpt).config
    t = layer_tensors(ckpt, layer)
    if cfg.is_moe_layer(layer):
        return np_moe(x, t, cfg)
    return np_mlp(x, t["gate_proj.weight"], t["up_proj.weight"], t["down_proj.weight"], cfg)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def _no_env_opt_in(monkeypatch):
    monkeypatch.delenv("K3JAX_SHARD_SP_SHARED_EXPERT", raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``k3jax make-checkpoint`` output: TINY, seed 3, BF16 weights, 2 files."""
    d = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-checkpoint", str(d), "--preset", "tiny", "--seed", "3",
                 "--num-files", "2"]) == 0
    return d


@pytest.fixture(scope="module")
def x_path(tmp_path_factory):
    """float32 [9, 96] input, bf16-representable so that --dtype bfloat16 routes alike."""
    x = np.random.default_rng(42).standard_normal((9, 96)).astype(np.float32)
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    path = tmp_path_factory.mktemp("x") / "x.npy"
    np.save(path, x)
    return path


def run_layer(ckpt, layer, x_path, out, *flags):
    rc = main(["run", "--checkpoint", str(ckpt), "--layer", str(layer), "--input", str(x_path),
               "--output", str(out), "--backend", "xla", *flags])
    assert rc == 0, flags
    y = np.load(out)
    assert y.dtype == np.float32 and y.shape == (9, 96)
    return y


# -- make-checkpoint ---------------------------------------------------------------
def test_make_checkpoint_is_loadable_and_deterministic(ckpt, tmp_path, capsys):
    reader = CheckpointReader(ckpt)
    assert reader.config == TINY
    assert reader.info(MOE + "experts.0.w1.weight")[0] == "BF16"
    assert os.path.isfile(ckpt / "model.safetensors.index.json")
    assert main(["make-checkpoint", str(tmp_path / "same"), "--seed", "3", "--num-files", "2"]) == 0
    assert main(["make-checkpoint", str(tmp_path / "other"), "--seed", "4", "--num-files", "2"]) == 0
    assert "wrote tiny checkpoint" in capsys.readouterr().out
    for file in sorted(os.listdir(ckpt)):
        same = (ckpt / file).read_bytes() == (tmp_path / "same" / file).read_bytes()
        assert same, file
    f = "model-00001-of-00002.safetensors"
    assert (ckpt / f).read_bytes() != (tmp_path / "other" / f).read_bytes()


def test_make_checkpoint_mxfp4_runs(tmp_path, x_path):
    d = tmp_path / "mx"
    assert main(["make-checkpoint", str(d), "--experts", "mxfp4", "--dtype", "float32"]) == 0
    assert CheckpointReader(d).has(MOE + "experts.3.w2.weight_scale")
    y = run_layer(d, 1, x_path, tmp_path / "y.npy", "--devices", "1")
    assert rel_err(y, reference(d, 1, np.load(x_path))) < 1e-5


def test_make_checkpoint_errors(ckpt, tmp_path, capsys):
    assert main(["make-checkpoint", str(ckpt)]) == 2                 # not empty
    assert "is not an empty directory" in one_line_error(capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        main(["make-checkpoint", str(tmp_path / "huge"), "--preset", "huge"])
    assert e.value.code == 2
    assert "invalid choice: 'huge'" in one_line_error(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "huge")
    # k3 (~1 TB of weights) only with --num-experts
    assert main(["make-checkpoint", str(tmp_path / "k3"), "--preset", "k3"]) == 2
    assert "--preset k3 is ~1 TB of weights: give --num-experts N" in one_line_error(
        capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "k3")


# -- run ------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [1, 0, 2])
def test_run_matches_numpy(ckpt, x_path, tmp_path, layer, capsys):
    y = run_layer(ckpt, layer, x_path, tmp_path / "y.npy", "--devices", "1")
    assert rel_err(y, reference(ckpt, layer, np.load(x_path))) < 1e-5
    out = capsys.readouterr().out
    assert f"layer {layer} ({'MoE' if layer else 'dense MLP'}), T=9" in out
    assert f"wrote {tmp_path / 'y.npy'}" in out


def test_run_bfloat16_and_repeat(ckpt, x_path, tmp_path, capsys):
    y = run_layer(ckpt, 1, x_path, tmp_path / "y.npy", "--devices", "1", "--dtype", "bfloat16",
                  "--repeat", "3")
    err = rel_err(y, reference(ckpt, 1, np.load(x_path)))
    assert 1e-5 < err < 2e-2
    out = capsys.readouterr().out
    assert "dtype=bfloat16" in out
    assert "forward: median" in out and "over 3 timed runs after the first, compiling one" in out


def test_run_default_in_process(capsys):
    assert main(["run", "--devices", "1", "--backend", "xla"]) == 0
    out = capsys.readouterr().out
    assert "no --checkpoint: using the tiny synthetic" in out
    assert "layer 1 (MoE), T=7, hidden=96" in out and "output: [7, 96] float32" in out
    assert "median" not in out


LAYOUT_FLAGS = {
    "tp8": ["--tp", "8"],
    "tp8-sp": ["--tp", "8", "--sequence-parallel"],
    "tp8-sp-ep": ["--tp", "8", "--sequence-parallel", "--expert-parallel"],
    "dp2-tp4-sp-shared": ["--dp", "2", "--tp", "4", "--sequence-parallel", "--shard-shared-expert"],
    "dp4-tp2-sp-ep-shared": ["--dp", "4", "--tp", "2", "--sequence-parallel", "--expert-parallel",
                             "--shard-shared-expert"],
    "dp8-ep": ["--dp", "8", "--expert-parallel"],
    "dp8": ["--tp", "1"],
}


@pytest.fixture(scope="module")
def single_device_output(ckpt, x_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "y.npy"
    return {layer: run_layer(ckpt, layer, x_path, out, "--devices", "1") for layer in (0, 1)}


@pytest.mark.parametrize("name", sorted(LAYOUT_FLAGS))
def test_every_layout_writes_the_same_output(ckpt, x_path, tmp_path, single_device_output, name,
                                             eight_devices, capsys):
    flags = ["--devices", "8", *LAYOUT_FLAGS[name]]
    y = run_layer(ckpt, 1, x_path, tmp_path / "y.npy", *flags)
    assert rel_err(y, single_device_output[1]) < 1e-5
    out = capsys.readouterr().out
    assert "on 8 cpu device(s)" in out
    if "--shard-shared-expert" in flags:
        assert "shared expert: sp-sharded" in out, out
    if name in ("tp8-sp", "dp2-tp4-sp-shared"):        # the dense layer 0 too
        y0 = run_layer(ckpt, 0, x_path, tmp_path / "y0.npy", *flags)
        assert rel_err(y0, single_device_output[0]) < 1e-5


# -- errors ---------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["run", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["run", "--shared-overlap", "windowed"], "invalid choice: 'windowed'"),
    (["plan", "--shared-overlap", "RING"], "invalid choice: 'RING'"),
    (["run", "--tp", "0"], "expected a positive integer"),
    (["run", "--repeat", "two"], "expected a positive integer"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_argparse_usage_errors_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("argv, words", [
    (["--tp", "3", "--devices", "8"], "--devices 8 is not divisible by --tp 3"),
    (["--sequence-parallel"], "sequence_parallel needs tp > 1"),
    (["--dp", "3", "--tp", "2", "--expert-parallel", "--devices", "6"], "not divisible by the EP size"),
    (["--dp", "2", "--tp", "2", "--devices", "8"], "does not match --devices 8"),
])
def test_layout_usage_errors_exit_2(argv, words, tmp_path, capsys):
    out = tmp_path / "y.npy"
    assert main(["run", *argv, "--output", str(out)]) == 2
    assert words in one_line_error(capsys.readouterr().err)
    assert not out.exists()


def test_failed_runs_write_no_output(ckpt, tmp_path, capsys):
    out = tmp_path / "y.npy"
    wide = tmp_path / "wide.npy"
    np.save(wide, np.random.default_rng(0).standard_normal((4, 97)).astype(np.float32))
    base = ["run", "--checkpoint", str(ckpt), "--devices", "1", "--backend", "xla",
            "--output", str(out)]
    assert main([*base, "--input", str(wide)]) == 1
    assert "must be [T, 96]" in one_line_error(capsys.readouterr().err)
    assert main([*base, "--layer", "3"]) == 2
    assert f"--layer 3 is out of range: {ckpt} has 3 layers" in one_line_error(capsys.readouterr().err)
    # A checkpoint missing one tensor.
    reader = CheckpointReader(ckpt)
    victim = MOE + "routed_expert_up_proj.weight"
    items = [(n, reader.read(n)) for n in reader._file_of if n != victim]
    broken = tmp_path / "broken"
    write_checkpoint(broken, TINY, items)
    assert main([*base[:2], str(broken), *base[3:]]) == 1
    assert f"missing tensor {victim}" in one_line_error(capsys.readouterr().err)
    assert not out.exists()
    assert [f for f in os.listdir(tmp_path) if f.endswith(".npy")] == ["wide.npy"]  # no temp files


# -- end to end, in fresh processes ---------------------------------------------------
def k3jax(*argv, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("K3JAX_SHARD_SP_SHARED_EXPERT", None)
    return subprocess.run([sys.executable, "-m", "k3jax", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_subprocess_default_run():
    p = k3jax("run")
    assert p.returncode == 0, p.stderr
    assert "no --checkpoint: using the tiny synthetic" in p.stdout
    assert "mesh: {'data': 1, 'tensor': 1} on 1" in p.stdout
    assert "output: [7, 96] float32" in p.stdout


def test_subprocess_sharded_run_and_usage_error(ckpt, x_path, tmp_path, single_device_output):
    out = tmp_path / "y.npy"
    p = k3jax("run", "--checkpoint", str(ckpt), "--input", str(x_path), "--output", str(out),
              "--devices", "8", "--tp", "8", "--sequence-parallel", "--expert-parallel",
              "--backend", "xla")
    assert p.returncode == 0, p.stderr
    assert "on 8 cpu device(s)" in p.stdout
    assert rel_err(np.load(out), single_device_output[1]) < 1e-5
    p = k3jax("run", "--tp", "3", "--devices", "8")
    assert p.returncode == 2
    assert "--devices 8 is not divisible by --tp 3" in one_line_error(p.stderr)
