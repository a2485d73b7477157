"""Usage errors of the ``k3jax`` sub-commands: exit 2, one line naming the
flag, before any work and without writing an output; write failures name the
user's path, never a temporary file."""

from __future__ import annotations

import os

import jax
import pytest

from k3jax.cli import main
from k3jax.cli.common import UsageError, require_devices
from k3jax.files import atomic_write


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def mx_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mx") / "ckpt"
    assert main(["make-checkpoint", str(d), "--experts", "mxfp4"]) == 0
    return d


@pytest.mark.parametrize("argv", [
    ["run", "--layer", "-1"], ["run", "--layer", "one"], ["run", "--repeat", "0"],
    ["make-checkpoint", "x", "--seed", "-1"], ["bench", "--seed", "-1"],
    ["bench", "--min-sample-ms", "inf"], ["bench", "--min-sample-ms", "nan"],
    ["bench", "--min-sample-ms", "-1"], ["bench", "--min-sample-ms", "fast"],
])
def test_bad_flag_values_exit_2_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {argv[-2]}:" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("flags, words", [
    (["--layer", "5"], "--layer 5 is out of range: the tiny synthetic checkpoint has 3 layers (0..2)"),
    (["--backend", "pallas"], "--backend pallas needs a Hopper GPU"),
    (["--backend", "triton"], "--backend triton needs a CUDA GPU (sm_80 or newer), and the "
                              "devices here are cpu"),
    (["--tp", "3"], "--dp 1 --tp 3 does not fit this model: moe_intermediate_size 64 is not "
                    "divisible by the 3 devices"),
])
def test_run_usage_errors_exit_2(flags, words, tmp_path, capsys):
    out = tmp_path / "y.npy"
    assert main(["run", *flags, "--output", str(out)]) == 2
    assert words in one_line_error(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend, words", [
    ("pallas", "--backend pallas needs a Hopper GPU, and the devices here are cpu"),
    ("triton", "--backend triton needs a CUDA GPU (sm_80 or newer), and the devices here are cpu"),
])
def test_bench_refuses_gpu_backends_on_cpu_devices(backend, words, tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["bench", "--backend", backend, "--preset", "tiny", "--json", str(out)]) == 2
    assert words in one_line_error(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []


def test_packed_mxfp4_that_does_not_fit_names_the_flag(mx_ckpt, capsys):
    argv = ["run", "--checkpoint", str(mx_ckpt), "--tp", "4", "--backend", "xla"]
    assert main(argv) == 2
    err = one_line_error(capsys.readouterr().err)
    assert ("MXFP4 packed experts need the per-shard intermediate (16) to be a multiple of 32; "
            "store the experts dequantized instead (--mxfp4 dequantize)") in err
    assert main([*argv, "--mxfp4", "dequantize"]) == 0


@pytest.mark.parametrize("flags, words", [
    (["--tp", "7"], "--dp 1 --tp 7 does not fit this model: moe_intermediate_size 3072 is not "
                    "divisible by the 7 devices"),
    (["--preset", "tiny", "--tp", "8", "--sequence-parallel"],
     "MXFP4 packed experts need the per-shard intermediate (8) to be a multiple of 32; store the "
     "experts dequantized instead (--expert-dtype bfloat16)"),
])
def test_plan_layout_errors_name_the_flags(flags, words, capsys):
    assert main(["plan", *flags]) == 2
    assert words in one_line_error(capsys.readouterr().err)
    assert main(["plan", "--preset", "tiny", "--tp", "8", "--sequence-parallel",
                 "--expert-dtype", "bfloat16"]) == 0


def test_accelerator_hosts_do_not_fall_back_to_cpu_devices(monkeypatch):
    require_devices(8)                                     # the CPU: simulated devices are fine
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    require_devices(2)
    with pytest.raises(UsageError, match="--devices 4: only 2 gpu device"):
        require_devices(4)


def unwritable(case: str, tmp_path, suffix: str) -> tuple[str, str]:
    """(an output path of ``case`` ending in ``suffix``, words of its error)."""
    if case == "proc":
        return f"/proc/k3jax-out{suffix}", "cannot create files in /proc"
    if case == "directory":
        (tmp_path / f"dir{suffix}").mkdir()
        return str(tmp_path / f"dir{suffix}"), "is a directory"
    return str(tmp_path / "nope" / f"y{suffix}"), "does not exist"


@pytest.mark.parametrize("case", ["proc", "directory", "missing parent"])
def test_unwritable_outputs_are_refused_before_any_work(case, tmp_path, capsys, monkeypatch):
    import k3jax.cli.bench as bench
    import k3jax.cli.run as run

    def no_work(*a, **k):
        raise AssertionError("the work started")
    monkeypatch.setattr(run, "request_devices", no_work)
    monkeypatch.setattr(bench, "request_devices", no_work)
    for argv, flag, suffix in ((["run"], "--output", ".npy"), (["bench"], "--json", ".json"),
                               (["bench"], "--plot", ".png")):
        path, words = unwritable(case, tmp_path, suffix)
        assert main([*argv, flag, path]) == 2
        err = one_line_error(capsys.readouterr().err)
        assert f"{flag} {path}: " in err and words in err and ".k3jax-" not in err


def test_atomic_write_names_the_users_path(tmp_path):
    with pytest.raises(OSError, match="^cannot write /proc/x.npy: No such file or directory$"):
        atomic_write("/proc/x.npy", lambda f: f.write(b"x"))

    def fail(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    target = tmp_path / "y.npy"
    with pytest.raises(OSError, match=f"^cannot write {target}: No space left on device$"):
        atomic_write(str(target), fail)
    assert os.listdir(tmp_path) == []


def test_make_checkpoint_usage_errors(tmp_path, capsys):
    assert main(["make-checkpoint", str(tmp_path / "c"), "--num-files", "1000"]) == 2
    assert "--num-files 1000: the tiny checkpoint has only 115 tensors" in \
        one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "c").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["make-checkpoint", str(tmp_path / "full")]) == 2
    assert "is not an empty directory" in one_line_error(capsys.readouterr().err)
    assert main(["make-checkpoint", "/proc/k3jax/ckpt"]) == 2
    assert "/proc/k3jax/ckpt: cannot create files in /proc" in one_line_error(capsys.readouterr().err)
