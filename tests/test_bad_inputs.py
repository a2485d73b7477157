"""Bad inputs a new user tries: each refused with one line naming the culprit
(exit 2 usage: flags, environment; 1 bad data: files, checkpoints, peers) or
handled by a stated rule; sizes checked before any device starts; outputs
atomic, links followed; multi-process start-up naming who it waits for."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import k3jax.cli.run as run_cli
from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.cli import main
from k3jax.cli.machine import MAX_SIMULATED_DEVICES, device_count_problem, max_simulated_devices
from k3jax.config import TINY, read_hf_config
from k3jax.files import atomic_write, check_writable
from k3jax.modules.inputs import check_layer_input
from k3jax.runtime import rendezvous
from k3jax.runtime.startup import ProcessSpec

pytestmark = pytest.mark.tiers(integration=["test_a_lone_process_names_the_missing_peer_end_to_end",
                                            "test_ctrl_c_ends_a_run_within_seconds"])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def error_line(err: str) -> str:   # the one error line (warnings aside), no traceback
    lines = [line for line in err.strip().splitlines() if "warning:" not in line]
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad") / "ck"
    make_synthetic_checkpoint(d, TINY, seed=0, dtype="float32")
    return d


def edited_checkpoint(ckpt, tmp_path, **changes):
    """A copy of ``ckpt`` whose config.json has ``changes`` (None: key deleted)."""
    d = tmp_path / "edited"
    shutil.copytree(ckpt, d)
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture
def no_devices(monkeypatch):
    """Fail the test if the run starts any device."""
    def started(*a, **k):
        raise AssertionError("devices were started")
    monkeypatch.setattr(run_cli, "request_devices", started)


# -- sizes, before anything is allocated ----------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--tp", "1000000"], "--dp 1 --tp 1000000 does not fit this model: moe_intermediate_size 64"),
    (["--tp", "1024"], "--dp 1 --tp 1024 does not fit this model"),
    (["--devices", "100000"], "--devices 100000: 100,000 devices: one process here simulates "
                              "at most"),
    (["--dp", "100000"], "--dp 100000 x --tp 1: 100,000 devices"),
    (["--dp", "2049", "--expert-parallel", "--ep-dispatch", "gather"], "not divisible by the EP"),
    (["--dp", "4096"], "4,096 devices: one process here simulates at most"),
    (["--dp", str(1 << 40)], "a mesh holds at most 1,048,576 devices"),
])
def test_device_counts_and_layouts_are_refused_before_any_device(flags, words, no_devices,
                                                                 tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["run", *flags, "--output", str(tmp_path / "y.npy")]) == 2
    assert words in error_line(capsys.readouterr().err)
    assert time.monotonic() - t0 < 30 and os.listdir(tmp_path) == []


def test_the_simulated_device_limit_follows_memory():
    assert max_simulated_devices(available=64 << 30) == MAX_SIMULATED_DEVICES
    assert max_simulated_devices(available=100 << 20) == 100 and \
        device_count_problem(8, available=64 << 30) is None
    assert "at most 100 CPU devices" in device_count_problem(101, available=100 << 20)


@pytest.mark.parametrize("argv, words", [
    (["plan", "--tp", "1000000"], "does not fit this model"),
    (["plan", "--dp", str(1 << 31)], "a mesh holds at most"),
    (["plan", "--tokens", str(1 << 30)], "expected at most 1,048,576 tokens"),
    (["latency", "--tokens", "1000000000"], "--tokens 1000000000: the token count must be in"),
    (["latency", "--tp", "0"], "--tp 0: expected a positive integer"),
    (["compile", "--tp", "16"], "16 GPUs a node, and an H200 node holds 8"),
    (["compile", "--dp", "1024", "--tp", "8", "--nodes", "1024"], "k3jax compile targets at most"),
])
def test_other_commands_refuse_sizes_in_seconds(argv, words, capsys):
    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert words in error_line(capsys.readouterr().err)
    assert time.monotonic() - t0 < 30


def test_make_checkpoint_refuses_what_memory_cannot_build(tmp_path, capsys, monkeypatch):
    import k3jax.cli.make_checkpoint as mk
    monkeypatch.setattr(mk, "memory_problem", lambda n, what: f"{what} needs {n} bytes")
    assert main(["make-checkpoint", str(tmp_path / "c")]) == 2
    assert "the checkpoint (built in memory before it is written) needs" in \
        error_line(capsys.readouterr().err)
    assert os.listdir(tmp_path) == []


# -- config keys ----------------------------------------------------------------------
def test_a_missing_top_k_whose_default_takes_every_expert_is_an_error(ckpt, tmp_path, capsys):
    d = edited_checkpoint(ckpt, tmp_path, num_experts_per_token=None)
    assert main(["run", "--checkpoint", str(d), "--output", str(tmp_path / "y.npy")]) == 1
    err = error_line(capsys.readouterr().err)
    assert "no 'num_experts_per_token' key, and K3's default 16 would route every token to all " \
           "16 experts" in err
    assert not (tmp_path / "y.npy").exists()


def test_a_missing_shape_key_is_named(ckpt, tmp_path, capsys):
    d = edited_checkpoint(ckpt, tmp_path, moe_intermediate_size=None)
    assert main(["run", "--checkpoint", str(d)]) == 1
    err = error_line(capsys.readouterr().err)
    assert "has no 'moe_intermediate_size' key: K3's default moe_intermediate_size=3072 used" in err


def test_missing_math_keys_are_named_in_one_warning(ckpt, tmp_path, capsys):
    d = edited_checkpoint(ckpt, tmp_path, rms_norm_eps=None, activation_situ_beta=None)
    x = np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out, ref = tmp_path / "y.npy", tmp_path / "ref.npy"
    common = ["--input", str(tmp_path / "x.npy"), "--backend", "xla"]
    assert main(["run", "--checkpoint", str(d), *common, "--output", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"k3jax run: warning: {d}/config.json has no 'rms_norm_eps', "
                   f"'activation_situ_beta' keys: K3's defaults rms_norm_eps=1e-05, "
                   f"activation_situ_beta=4.0 used"]
    assert main(["run", "--checkpoint", str(ckpt), *common, "--output", str(ref)]) == 0
    assert "warning" not in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(out), np.load(ref))   # TINY's values are K3's


def test_defaults_a_config_contradicts_name_the_missing_key():
    raw = {**TINY.to_hf_dict(), "num_expert_group": 4, "num_experts_per_token": 8}
    del raw["topk_group"]
    with pytest.raises(ValueError, match=r"cannot supply num_experts_per_token=8 \(no "
                                         r"'topk_group' key: K3's default topk_group=1 used\)"):
        read_hf_config(raw)
    raw = TINY.to_hf_dict()
    del raw["rms_norm_eps"], raw["activation_situ_linear_beta"]
    assert read_hf_config(raw)[1] == {"rms_norm_eps": 1e-5, "activation_situ_linear_beta": None}


def test_plan_names_the_defaults_of_a_partial_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 7168, "num_experts": 896}))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k3jax plan: warning: --config {path} has no ")
    assert "'moe_intermediate_size'" in err[0] and "num_experts_per_token=16" in err[0]


# -- files ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--input", "--cotangent"])
@pytest.mark.parametrize("case, words", [
    ("npz", "is an .npz archive (np.savez), not a .npy file"),
    ("bfloat16", "must be float32, got raw 2-byte records '|V2' (np.save writes bfloat16 arrays"),
    ("truncated", "is truncated: its header announces float32["),
    ("directory", "cannot read it: it is a directory"),
    ("text", "cannot read it: not a .npy file"),
])
def test_bad_array_files_are_bad_data_naming_flag_and_file(flag, case, words, tmp_path, capsys):
    x = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    bad = tmp_path / "bad.npy"
    if case == "npz":
        bad = tmp_path / "bad.npz"
        np.savez(bad, x=x)
    elif case == "bfloat16":
        np.save(bad, x.astype(ml_dtypes.bfloat16))
    elif case == "truncated":
        header = io.BytesIO()
        rows = 10**9 if flag == "--input" else 4     # the cotangent's shape is checked first
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (rows, 96)})
        bad.write_bytes(header.getvalue() + b"\0" * 64)
    else:
        bad.mkdir() if case == "directory" else bad.write_text("hello")
    flags = (["--input", str(bad)] if flag == "--input" else
             ["--input", str(tmp_path / "x.npy"), "--cotangent", str(bad),
              "--grads", str(tmp_path / "g.safetensors")])
    before = set(os.listdir(tmp_path))
    assert main(["run", *flags, "--backend", "xla", "--output", str(tmp_path / "y.npy")]) == 1
    err = error_line(capsys.readouterr().err)
    assert f"{flag} {bad}" in err and words in err
    assert set(os.listdir(tmp_path)) == before


def test_a_file_where_a_checkpoint_directory_belongs(ckpt, capsys):
    assert main(["run", "--checkpoint", str(ckpt / "config.json")]) == 1
    assert f"checkpoint {ckpt}/config.json is not a directory" in error_line(capsys.readouterr().err)
    assert main(["run", "--checkpoint", str(ckpt / "nope")]) == 1
    assert "checkpoint directory not found" in error_line(capsys.readouterr().err)


def test_a_bad_config_file_is_bad_data(tmp_path, capsys):
    (tmp_path / "c.json").write_text("{not json")
    assert main(["plan", "--config", str(tmp_path / "c.json")]) == 1
    assert "is not valid JSON" in error_line(capsys.readouterr().err)
    assert main(["plan", "--config", str(tmp_path)]) == 1
    assert "a directory without a config.json" in error_line(capsys.readouterr().err)


# -- outputs: atomic, links followed -------------------------------------------------
def test_outputs_follow_links_and_keep_them(tmp_path, capsys):
    target, link = tmp_path / "target.npy", tmp_path / "link.npy"
    np.save(target, np.zeros(3, np.float32))
    link.symlink_to(target)
    assert main(["run", "--backend", "xla", "--output", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert np.load(target).shape == (7, 96)
    dangling, made = tmp_path / "dangling.npy", tmp_path / "made.npy"
    dangling.symlink_to(made)
    assert main(["run", "--backend", "xla", "--output", str(dangling)]) == 0
    assert dangling.is_symlink() and np.load(made).shape == (7, 96)
    capsys.readouterr()
    names = sorted(os.listdir(tmp_path))
    assert names == ["dangling.npy", "link.npy", "made.npy", "target.npy"]   # no temporaries


def test_links_that_cannot_be_written_are_refused_first(tmp_path, capsys, no_devices):
    loop = tmp_path / "loop.npy"
    loop.symlink_to(loop)
    nowhere = tmp_path / "nowhere.npy"
    nowhere.symlink_to(tmp_path / "missing" / "y.npy")
    todir = tmp_path / "todir.npy"
    (tmp_path / "d").mkdir()
    todir.symlink_to(tmp_path / "d")
    for link, words in ((loop, "is a symbolic link loop"),
                        (nowhere, f"directory does not exist: {tmp_path}/missing (the target of "
                                  f"the link {nowhere})"),
                        (todir, f"{tmp_path}/d is a directory (the target of the link {todir})")):
        assert main(["run", "--output", str(link)]) == 2
        assert f"--output {link}: " in (err := error_line(capsys.readouterr().err)) and words in err


def test_a_failed_write_leaves_the_old_file_and_its_link(tmp_path):
    target, link = tmp_path / "t.json", tmp_path / "l.json"
    target.write_text("old")
    link.symlink_to(target)

    def fail(f):
        f.write("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match=f"^cannot write {link}: No space left on device$"):
        atomic_write(str(link), fail, mode="w")
    assert target.read_text() == "old" and link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["l.json", "t.json"]
    atomic_write(str(link), lambda f: f.write("new"), mode="w")
    assert target.read_text() == "new" and link.is_symlink()
    assert check_writable(str(link)) is None


def test_a_failed_run_leaves_the_old_output(tmp_path, capsys):
    out = tmp_path / "y.npy"
    out.write_bytes(b"old")
    (tmp_path / "x.npy").write_text("not an array")
    assert main(["run", "--input", str(tmp_path / "x.npy"), "--output", str(out)]) == 1
    capsys.readouterr()
    assert out.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["x.npy", "y.npy"]


def test_make_checkpoint_follows_a_link_to_an_empty_directory(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert main(["make-checkpoint", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "config.json").exists()
    capsys.readouterr()
    assert main(["make-checkpoint", str(tmp_path / "link")]) == 2
    assert "(the target of the link" in error_line(capsys.readouterr().err)


# -- flags a run would ignore, environment variables, consistency --------------------------
@pytest.mark.parametrize("argv, words", [
    (["run", "--layer", "0", "--dp", "2", "--expert-parallel", "--ep-dispatch", "all-to-all"],
     "--expert-parallel --ep-dispatch all-to-all: layer 0 is the dense MLP, with no routed "
     "experts; these flags apply to MoE layers only (MoE layers: 1..2)"),
    (["run", "--layer", "0", "--mxfp4", "dequantize"], "--mxfp4 dequantize: layer 0 is the dense"),
    (["compile", "--preset", "tiny", "--layer", "0", "--expert-parallel"],
     "--expert-parallel: layer 0 is the dense MLP")])
def test_moe_only_flags_on_the_dense_layer_are_usage_errors(argv, words, no_devices, capsys):
    assert main(argv) == 2
    assert words in error_line(capsys.readouterr().err)


@pytest.mark.parametrize("name, value", [
    ("K3JAX_SELFCHECK", "bogus"), ("K3JAX_SELFCHECK_TIMEOUT", "-1"), ("K3JAX_AUTOTUNE", "yes"),
    ("K3JAX_TUNE_REPEATS", "0"), ("K3JAX_INTERPRET_STALL_S", "nan"), ("JAX_PROCESS_ID", "one"),
    ("K3JAX_SHARD_SP_SHARED_EXPERT", "2"), ("K3JAX_INIT_TIMEOUT", "soon")])
def test_bad_environment_variables_are_usage_errors(name, value, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    assert main(["plan", "--preset", "tiny", "--json"]) == 2
    err = error_line(capsys.readouterr().err)
    assert err.startswith("k3jax plan: error: environment variable ") and name in err


def test_plan_and_latency_agree_on_tp_3(capsys):
    """plan --tp 3 plans plain tensor parallelism, which K3 allows; latency
    models SP + EP with the shared expert sharded, which tp 3 cannot split:
    its error says so, and plan refuses that layout too."""
    assert main(["plan", "--tp", "3", "--json"]) == 0
    capsys.readouterr()
    assert main(["latency", "--tp", "3"]) == 2
    err = error_line(capsys.readouterr().err)
    assert "tp 3 does not divide the hidden size 7168" in err
    assert "k3jax plan --dp 1 --tp 3 --sequence-parallel --expert-parallel --shard-shared-expert" \
        in err and "not plain tensor parallelism" in err
    assert main(["plan", "--tp", "3", "--sequence-parallel", "--expert-parallel",
                 "--shard-shared-expert"]) == 2
    assert "does not fit this model" in error_line(capsys.readouterr().err)


def test_the_layer_input_check_names_the_type():
    check_layer_input(jnp.zeros((3, 96), jnp.bfloat16), 96)
    with pytest.raises(TypeError, match=r"KimiMoE: x must be a jax or numpy array \[\.\.\., 96\], "
                                        r"got a list \(convert it with jnp.asarray\)"):
        check_layer_input([[0.0] * 96], 96, "KimiMoE")
    with pytest.raises(TypeError, match="floating dtype, got int32"):
        check_layer_input(np.zeros((3, 96), np.int32), 96)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 96\] .*, got \[3, 95\]"):
        check_layer_input(np.zeros((3, 95), np.float32), 96)
    check_layer_input(np.zeros((2, 3, 96), np.float32), 96)      # any leading shape
    with pytest.raises(ValueError, match=r"got \[\]"):
        check_layer_input(np.zeros((), np.float32), 96)


# -- multi-process start-up -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_all(address: str, processes, timeout_s: float) -> dict:
    """Join ``processes`` ((id, count) pairs) in threads: {id: "ok" | error,
    (id, "out"): the waiting lines}."""
    results = {}

    def one(pid, count):
        out = io.StringIO()
        try:
            rendezvous.join(ProcessSpec(address, count, pid), timeout_s, report_s=0.3, out=out)
            results[pid] = "ok"
        except rendezvous.JoinError as e:
            results[pid] = str(e)
        results[(pid, "out")] = out.getvalue()
    threads = [threading.Thread(target=one, args=p) for p in processes]
    for t in threads:
        t.start()
        time.sleep(0.4)        # the peers start first: they wait for the coordinator
    for t in threads:
        t.join(timeout=timeout_s + 30)
    return results


def test_processes_join_in_any_order():
    address = f"127.0.0.1:{free_port()}"
    r = join_all(address, [(2, 3), (1, 3), (0, 3)], timeout_s=20)
    assert [r[i] for i in range(3)] == ["ok"] * 3
    assert f"waiting for the coordinator (process 0) at {address}: Connection refused" in r[(2, "out")]
    assert rendezvous.format_ids([3]) == "process 3"
    assert rendezvous.format_ids([1, 4, 5, 6, 9]) == "processes 1, 4-6, 9"
    assert rendezvous.format_ids(range(1, 100000, 2), limit=2) == "processes 1, 3, ... (50000 in all)"


def test_a_lone_coordinator_names_the_missing_processes():
    address = f"127.0.0.1:{free_port()}"
    r = join_all(address, [(1, 4), (0, 4)], timeout_s=1.5)
    assert r[0] == (f"process 0 of 4: processes 2-3 never joined the run at {address} (waited "
                    f"1.5 s; $K3JAX_INIT_TIMEOUT sets it)")
    assert f"[process 0/4] waiting for processes 2-3 of 4 to join at {address}" in r[(0, "out")]
    assert r[1].startswith("process 1 of 4") and "processes 2-3 never joined" in r[1]
    assert f"[process 1/4] joined at {address}; waiting for processes 2-3" in r[(1, "out")]


def test_a_lone_peer_names_the_coordinator_it_cannot_reach():
    address = f"127.0.0.1:{free_port()}"
    r = join_all(address, [(1, 2)], timeout_s=1)
    assert r[1].startswith(f"process 1 of 2 could not reach the coordinator (process 0) at "
                           f"{address} in 1 s: Connection refused")
    r = join_all("no-such-host.invalid:1234", [(1, 2)], timeout_s=1)
    assert r[1].startswith("process 1 of 2 cannot resolve the coordinator's host "
                           "'no-such-host.invalid'")


@pytest.mark.parametrize("processes, words", [
    ([(1, 2), (0, 3)], "process 1 was started with --num-processes 2, process 0 with 3"),
    ([(1, 3), (1, 3), (0, 3)], "two processes were started with --process-id 1")])
def test_inconsistent_processes_are_named(processes, words):
    assert words in join_all(f"127.0.0.1:{free_port()}", processes, timeout_s=10)[0]


def k3jax_process(*argv, env=None) -> subprocess.Popen:
    """``python -m k3jax ARGV`` with SIGINT at its default (a test worker may ignore it)."""
    code = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execv(sys.executable, [sys.executable, '-m', 'k3jax', *sys.argv[1:]])")
    return subprocess.Popen([sys.executable, "-c", code, *argv], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
                            stderr=subprocess.PIPE, text=True)


def test_a_lone_process_names_the_missing_peer_end_to_end():
    address = f"127.0.0.1:{free_port()}"
    p = k3jax_process("run", "--coordinator-address", address, "--num-processes", "2",
                      "--process-id", "0", "--devices", "2", env={"K3JAX_INIT_TIMEOUT": "3"})
    code, err = p.wait(timeout=300), p.communicate()[1]    # a few lines: no pipe fills
    assert code == 1 and error_line(err) == (f"k3jax run: error: process 0 of 2: process 1 never "
                                             f"joined the run at {address} (waited 3 s; "
                                             f"$K3JAX_INIT_TIMEOUT sets it)")


def test_ctrl_c_ends_a_run_within_seconds():
    p = k3jax_process("run", "--dp", "1024", "--backend", "xla")
    time.sleep(12)           # in the middle of the devices' start or the compile
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, err = p.communicate(timeout=120)
    assert time.monotonic() - t0 < 8 and p.returncode in (0, 130), err   # 0: it had finished
    assert "Traceback" not in err, err
