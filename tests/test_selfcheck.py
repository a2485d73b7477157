"""The kernel check on first use (pallas_kernels.selfcheck) and ``k3jax
selfcheck``, end to end in interpret mode on 2 simulated CPU devices: every
launch of the tiny layer checked and cached, a second run reading the cache,
the perturbation hook making exactly one configuration fall back while the
layer still matches its XLA reference, corrupt cache files rechecked, an
unwritable cache directory reported once, and the verdict rules."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.cli import main
from numerics import rel_err
from pallas_kernels.backend import INTERPRET, XLA
from pallas_kernels.selfcheck import check, gate, launch
from pallas_kernels.selfcheck.cache import CheckResult
from pallas_kernels.selfcheck.config import KernelConfig

pytestmark = pytest.mark.tiers(slow=["test_the_layer_with_a_fallback_still_matches_its_xla_reference",
                                     "test_tune_end_to_end_caches_and_exports_the_picks",
                                     "test_a_corrupt_cache_file_is_rechecked_and_rewritten"])

ARGV = ["selfcheck", "--preset", "tiny", "--backend", "interpret", "--tp", "2", "--devices", "2",
        "--sequence-parallel", "--expert-parallel", "--tokens", "16", "--json"]


def run_selfcheck(capsys, argv=ARGV) -> tuple[int, dict | None, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else None), captured.err


@pytest.fixture(autouse=True)
def _fresh_gate(monkeypatch):
    monkeypatch.delenv(gate.PERTURB_ENV, raising=False)
    gate.reset()
    yield
    gate.reset()
    gate.force_mode(None)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The done-when command once, into a fresh cache: (its JSON, the cache dir)."""
    cache = tmp_path_factory.mktemp("selfcheck-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3JAX_CACHE_DIR", str(cache))
        gate.reset()
        import contextlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(ARGV) == 0
    return json.loads(out.getvalue()), cache


def test_every_launch_is_checked_ok_and_cached(first_run):
    out, cache = first_run
    assert out["cache_dir"] == str(cache)
    ops = sorted(c["config"].split(":")[0] for c in out["checks"])
    assert ops == ["grouped_matmul", "grouped_situ_glu", "situ_mlp_up"]   # the layer's launches
    for c in out["checks"]:
        assert c["verdict"] == "ok" and c["backend"] == "interpret" and not c["cached"], c
        assert 0 < c["max_rel_err"] <= check.TOL_BF16
        assert c["seconds"] > 0
    assert len(list(cache.glob("selfcheck-*.json"))) == len(out["checks"])


def test_a_second_run_reads_the_cache_and_launches_no_check(first_run, tmp_path, monkeypatch,
                                                            capsys):
    _, cache = first_run
    shutil.copytree(cache, tmp_path / "c")
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))

    def no_check(config):
        raise AssertionError(f"checked {config.name} again")
    monkeypatch.setattr(gate, "check", no_check)
    code, out, err = run_selfcheck(capsys)
    assert code == 0, err
    assert [c["cached"] for c in out["checks"]] == [True] * 3
    assert [c["verdict"] for c in out["checks"]] == ["ok"] * 3


def test_perturbed_configuration_falls_back_with_one_warning(first_run, tmp_path, monkeypatch,
                                                             capsys):
    base, cache = first_run
    victim = next(c["config"] for c in base["checks"] if c["config"].startswith("grouped_matmul"))
    shutil.copytree(cache, tmp_path / "c")
    for path in (tmp_path / "c").glob("selfcheck-*.json"):   # victim's result: checked again
        if json.loads(path.read_text())["key"]["config"]["op"] == "grouped_matmul":
            path.unlink()
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv(gate.PERTURB_ENV, victim)
    code, out, err = run_selfcheck(capsys)
    assert code == 0, err
    by_name = {c["config"]: c for c in out["checks"]}
    assert victim in by_name, (victim, out, err)
    assert by_name[victim]["verdict"] == "mismatch" and by_name[victim]["backend"] == "xla"
    assert by_name[victim]["max_rel_err"] > 0.1
    others = [c for name, c in by_name.items() if name != victim]
    assert [(c["verdict"], c["backend"]) for c in others] == [("ok", "interpret")] * 2
    warnings = [line for line in err.splitlines() if "failed its check" in line]
    assert len(warnings) == 1 and victim in warnings[0] and "mismatch" in warnings[0], err


def test_the_layer_with_a_fallback_still_matches_its_xla_reference(first_run, tmp_path,
                                                                   monkeypatch, capsys):
    """The perturbed routed down-projection runs XLA, the other launches their
    interpret-mode kernels, and the layer's output matches the xla backend's."""
    shutil.copytree(first_run[1], tmp_path / "c")
    for path in (tmp_path / "c").glob("selfcheck-*.json"):
        if json.loads(path.read_text())["key"]["config"]["op"] == "grouped_matmul":
            path.unlink()
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv(gate.PERTURB_ENV, "grouped_matmul:*")
    from k3jax.config import TINY
    from k3jax.formats import ExpertStorage
    from k3jax.layout import ParallelConfig, make_layout, make_mesh
    from k3jax.modules.layer import build_layer
    from k3jax.modules.params import RandomSource

    parallel = ParallelConfig(dp=1, tp=2, sequence_parallel=True, expert_parallel=True)
    mesh = make_mesh(parallel, jax.devices()[:2])
    x = jax.random.normal(jax.random.key(3), (16, TINY.hidden_size), jnp.bfloat16)

    def forward(backend):
        layout = make_layout(TINY, parallel, mesh, backend=backend,
                             experts=ExpertStorage.MXFP4, dtype=jnp.bfloat16)
        module = build_layer(layout, 1, mesh, source=RandomSource(seed=5))
        return np.asarray(nnx.jit(lambda m, x: m(x))(module, x), np.float32)

    gate.force_mode("1")
    got = forward("interpret")
    assert sorted((r.config.op, r.backend) for r in gate.records()) == [
        ("grouped_matmul", "xla"), ("grouped_situ_glu", "interpret"), ("situ_mlp_up", "interpret")]
    assert len([ln for ln in capsys.readouterr().err.splitlines() if "failed its check" in ln]) == 1
    assert rel_err(got, forward("xla")) <= check.TOL_BF16


def test_a_corrupt_cache_file_is_rechecked_and_rewritten(first_run, tmp_path, monkeypatch, capsys):
    _, cache = first_run
    shutil.copytree(cache, tmp_path / "c")
    files = sorted((tmp_path / "c").glob("selfcheck-*.json"))
    files[0].write_text(files[0].read_text()[:40])            # truncated
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))
    code, out, err = run_selfcheck(capsys)
    assert code == 0, err
    assert sorted(c["cached"] for c in out["checks"]) == [False, True, True]
    assert f"ignoring {files[0]} is corrupt" in err
    assert json.loads(files[0].read_text())["result"]["verdict"] == "ok"   # rewritten


def test_an_unwritable_cache_directory_is_one_line_not_an_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "file" / "cache"))
    argv = [a for a in ARGV[:-3] if a != "--expert-parallel"] + [    # the dense layer: one
        "--layer", "0", "--tokens", "8", "--json"]                     # launch, no experts
    code, out, err = run_selfcheck(capsys, argv)
    assert code == 0, err
    assert [c["verdict"] for c in out["checks"]] == ["ok"]
    lines = [line for line in err.splitlines() if "checks run again on every start" in line]
    assert len(lines) == 1 and "cannot write" in lines[0], err


def test_selfcheck_without_the_backend_exits_2_naming_it(capsys):
    for backend in ("pallas", "triton"):
        code, _, err = run_selfcheck(capsys, ["selfcheck", "--preset", "tiny", "--backend", backend])
        assert code == 2 and f"--backend {backend}" in err and len(err.strip().splitlines()) == 1


CONFIG = KernelConfig(op="grouped_matmul", m=16, k=32, n=32, groups=4, x_dtype="float32",
                      w_dtype="float32", tiles="row_major", backend="interpret")


def test_compare_never_passes_nan_and_flags_a_mismatch():
    ref = np.random.default_rng(0).standard_normal((8, 4))
    assert check.compare(ref + 1e-7, ref, check.TOL_F32)[0] == "ok"
    bad = ref.copy()
    bad[3, 1] = np.nan
    assert check.compare(bad, ref, check.TOL_F32)[0] == "mismatch"
    assert check.compare(ref * 1.01, ref, check.TOL_F32)[0] == "mismatch"
    assert check.tolerance(CONFIG) == check.TOL_F32
    assert check.tolerance(KernelConfig(**{**CONFIG.to_json(), "x_dtype": "bfloat16"})) \
        == check.TOL_BF16


def test_a_slow_kernel_times_out_and_a_raising_one_is_an_error():
    def slow(x, ws, gs):
        time.sleep(1.0)
        return x
    result = check.run_check(CONFIG, timeout_s=0.2, launch=slow)
    assert result.verdict == "timeout" and "0.2 s" in result.error

    def broken(x, ws, gs):
        raise ValueError("no such tiling")
    result = check.run_check(CONFIG, timeout_s=60, launch=broken)
    assert result.verdict == "error" and "no such tiling" in result.error


def test_modes_off_and_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gate, "check", lambda config: CheckResult("mismatch", 0.5, 0.1, "forced"))
    monkeypatch.setenv(gate.MODE_ENV, "0")
    assert gate.trusted_backend(CONFIG) == INTERPRET and gate.records() == []
    monkeypatch.setenv(gate.MODE_ENV, "1")
    assert gate.trusted_backend(CONFIG) == XLA
    gate.reset()
    monkeypatch.setenv(gate.MODE_ENV, "strict")
    with pytest.raises(gate.SelfCheckError, match="grouped_matmul:m16.*mismatch: forced"):
        gate.trusted_backend(CONFIG)
    monkeypatch.setenv(gate.MODE_ENV, "yes")
    with pytest.raises(ValueError, match="K3JAX_SELFCHECK='yes'"):
        gate.mode()


def test_agreed_backends_override_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(gate.MODE_ENV, "1")
    monkeypatch.setattr(gate, "check", lambda config: CheckResult("ok", 1e-6, 0.1))
    assert gate.trusted_backend(CONFIG) == INTERPRET
    gate.agree({CONFIG.name: "xla"})
    assert gate.trusted_backend(CONFIG) == XLA


def test_processes_combine_to_xla_where_any_check_failed():
    from k3jax.runtime.agreement import combine_backends
    views = {0: {"a": "pallas", "b": "pallas", "c": "pallas"},
             1: {"a": "pallas", "b": "xla"},           # b failed here; c not checked (off)
             2: {"a": "pallas", "b": "pallas", "c": "pallas"}}
    assert combine_backends(views) == {"a": "pallas", "b": "xla", "c": "pallas"}
    assert combine_backends({0: {}, 1: {}}) == {}


GROUPED = KernelConfig(op="grouped_situ_glu", m=64, k=64, n=64, groups=8, x_dtype="bfloat16",
                       w_dtype="bfloat16", tiles="swap_ab", backend="interpret", beta=4.0,
                       linear_beta=25.0)


def test_tuning_candidates_come_from_the_committed_table():
    from pallas_kernels.grouped_matmul import tile_choice
    from pallas_kernels.selfcheck import tune

    entries = tune.candidates(GROUPED)
    assert 2 <= len(entries) <= tune.MAX_CANDIDATES
    assert len({json.dumps(e, sort_keys=True) for e in entries}) == len(entries)
    own = tile_choice.grouped_config(64, 64, 64, 8, 2, "bfloat16", tuned=False)
    assert entries[0] == tile_choice.entry_of(own, "grouped")
    assert tune.candidates(KernelConfig(**{**GROUPED.to_json(), "w_dtype": "mxfp4"})) == []


def test_tuning_keeps_the_fastest_passing_candidate_and_later_launches_use_it(monkeypatch):
    from pallas_kernels.grouped_matmul import tile_choice
    from pallas_kernels.selfcheck import tune

    entries = tune.candidates(GROUPED)
    times = iter([30.0, 10.0, 20.0][:len(entries)])
    verdicts = iter(["ok", "ok", "mismatch"][:len(entries)])

    def fake_check(config, *, timeout_s, perturb, launch, repeats):
        verdict, us = next(verdicts), next(times)
        return CheckResult(verdict, 1e-3, 0.1, None if verdict == "ok" else "forced",
                           timings_us={"median_us": us} if verdict == "ok" else None)
    monkeypatch.setattr(tune, "run_check", fake_check)
    result = tune.tune(GROUPED, timeout_s=10, perturb=False)
    assert result.ok and result.tuned_entry == entries[1]
    assert result.tuned == tune.label(entries[1], "grouped")
    assert sorted(result.timings_us.values()) == [10.0, 30.0]    # the failing one is not timed
    try:
        tune.install(GROUPED, result)
        assert tile_choice.entry_of(tile_choice.grouped_config(64, 64, 64, 8, 2, "bfloat16"),
                                    "grouped") == entries[1]
    finally:
        tile_choice.clear_tuned()
    assert tile_choice.grouped_config(64, 64, 64, 8, 2, "bfloat16") == \
        tile_choice.row_config(entries[0])


def test_tune_end_to_end_caches_and_exports_the_picks(tmp_path, monkeypatch, capsys):
    """k3jax tune in interpret mode (its times mean nothing): each launch's pick
    is its fastest candidate, a later selfcheck reads and installs it, and the
    export is a table tile_choice can read."""
    from pallas_kernels.grouped_matmul import tile_choice
    from pallas_kernels.selfcheck import tune

    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv(tune.REPEATS_ENV, "1")
    argv = ARGV[1:-1] + ["--expert-dtype", "bfloat16", "--json"]
    code, out, err = run_selfcheck(capsys, ["tune", *argv, "--export", str(tmp_path / "t.json")])
    assert code == 0, err
    for c in out["checks"]:
        assert c["verdict"] == "ok" and c["tuned"] == min(c["timings_us"], key=c["timings_us"].get)
    assert max(len(c["timings_us"]) for c in out["checks"]) >= 2
    doc = json.loads((tmp_path / "t.json").read_text())
    table = {tuple(row["key"]): row["entry"] for row in doc["tiles"]}
    assert doc["generated_by"] == "k3jax tune --export" and len(table) == 3
    for key, entry in table.items():
        tile_choice.row_config(entry)

    code, again, err = run_selfcheck(capsys, ["selfcheck", *argv])
    assert code == 0, err
    assert [(c["cached"], c["tuned"]) for c in again["checks"]] == \
        [(True, c["tuned"]) for c in out["checks"]]
    for key, entry in table.items():
        assert tile_choice.entry_of(tile_choice.lookup(*key)[1], key[0]) == entry


def test_a_launch_too_large_is_checked_on_fewer_groups_with_its_own_tiling(monkeypatch):
    from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab, tile_choice

    own = tile_choice.grouped_config(64, 64, 64, 8, 2, "bfloat16", tuned=False)
    assert own is not None   # the committed table holds a swap-AB tiling for this launch
    monkeypatch.setattr(check, "CHECK_WEIGHT_BYTES", 2 * 64 * 64 * 2)   # two bf16 groups
    assert check.check_groups(GROUPED) == 2
    seen = []
    real = mosaic_sm90_swap_ab.grouped_situ_glu

    def spy(x, w_gate, w_up, gs, **kwargs):
        seen.append((w_gate.shape, kwargs["config"]))
        return real(x, w_gate, w_up, gs, **kwargs)
    monkeypatch.setattr(mosaic_sm90_swap_ab, "grouped_situ_glu", spy)
    result = check.run_check(GROUPED, timeout_s=120)
    assert result.verdict == "ok" and result.checked_groups == 2, result
    assert seen == [((2, 64, 64), own)]


def test_cache_files_of_another_format_or_key_are_ignored_naming_them(tmp_path):
    from pallas_kernels.selfcheck import cache

    key = cache.key_of(CONFIG.to_json(), {"jax": "1"})
    path = cache.path_of(tmp_path, key)
    assert cache.load(path, key) == (None, None)
    good = CheckResult("ok", 1e-6, 0.5)
    assert cache.store(path, key, good) is None
    assert cache.load(path, key) == (good, None)
    assert cache.load(path, cache.key_of(CONFIG.to_json(), {"jax": "2"}))[1] == \
        f"{path} holds another key"
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "format": cache.FORMAT + 1}))
    assert cache.load(path, key) == (None, f"{path} has another format")
    path.write_text(json.dumps({**entry, "result": {"verdict": "fine"}}))
    assert "is corrupt" in cache.load(path, key)[1]


def test_concurrent_writers_never_leave_a_partial_file(tmp_path):
    import threading

    from pallas_kernels.selfcheck import cache

    key = cache.key_of(CONFIG.to_json(), {"jax": "1"})
    path = cache.path_of(tmp_path, key)
    results = [CheckResult("ok", i * 1e-7, float(i), timings_us={str(j): float(j) for j in range(50)})
               for i in range(8)]
    seen, problems = [], []

    def writer(result):
        for _ in range(25):
            if (why := cache.store(path, key, result)) is not None:
                problems.append(why)
            got, why = cache.load(path, key)
            if why is not None or got is None:
                problems.append(why)
            seen.append(got)
    threads = [threading.Thread(target=writer, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == [] and all(s in results for s in seen)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]   # no temporary file left


def test_strict_selfcheck_exits_1_naming_the_failed_configuration(first_run, tmp_path,
                                                                   monkeypatch, capsys):
    shutil.copytree(first_run[1], tmp_path / "c")
    for path in (tmp_path / "c").glob("selfcheck-*.json"):
        if json.loads(path.read_text())["key"]["config"]["op"] == "situ_mlp_up":
            path.unlink()
    monkeypatch.setenv("K3JAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv(gate.PERTURB_ENV, "situ_mlp_up:*")
    monkeypatch.setenv(gate.MODE_ENV, "strict")
    code, _, err = run_selfcheck(capsys)
    assert code == 1
    assert re.search(r"error: k3jax selfcheck: situ_mlp_up:\S+ failed its check \(mismatch", err), err


def test_check_inputs_cover_the_tail_rows_and_an_empty_group():
    for seed in range(5):
        sizes = np.asarray(check.random_inputs(GROUPED, np.random.default_rng(seed))["group_sizes"])
        assert sizes.shape == (8,) and sizes.sum() == 64 - 8 and (sizes == 0).any()


@pytest.mark.parametrize("op, axis", [("grouped_matmul", 1), ("grouped_situ_glu", 2)])
def test_k_ordered_mxfp4_weights_are_checked_in_their_own_order(op, axis, monkeypatch):
    """A launch on packed MXFP4 weights in the Mosaic kernels' K order
    (Mxfp4Weights.k_order_axis) is its own configuration (its name and cache
    key say the order) and its check runs weights in that order: the kernel
    (interpret mode) passes against the XLA path on the same weights and
    fails when perturbed. The Triton launcher of a fixed tiling permutes x /
    y as the dispatch does (a stand-in for Triton's kernels, which read the
    codes as stored: the blocked XLA path on the stored weights)."""
    from pallas_kernels.grouped_matmul import blocked, dispatch
    from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights
    from pallas_kernels.selfcheck.config import grouped_config

    g, m, k, n = 2, 24, 128, 128
    w = Mxfp4Weights(jnp.zeros((g, n, k // 2), jnp.uint8), jnp.zeros((g, k // 32, n), jnp.uint8),
                     Mxfp4Dequant.FAST, axis)
    x = jnp.zeros((m, k), jnp.bfloat16)
    betas = (None, None) if op == "grouped_matmul" else (4.0, 25.0)
    ordered = grouped_config(op, x, w, "interpret", *betas)
    plain = grouped_config(op, x, dataclasses.replace(w, k_order_axis=None), "interpret", *betas)
    assert ordered.k_order_axis == axis and plain.k_order_axis is None
    assert f"bfloat16/mxfp4-k{axis}:" in ordered.name and ordered.name != plain.name
    assert ordered.to_json() != plain.to_json()                      # another cache key
    inputs = check.random_inputs(ordered, np.random.default_rng(0))
    assert all(v.k_order_axis == axis for v in inputs["weights"])
    assert check.run_check(ordered, timeout_s=300).verdict == "ok"
    assert check.run_check(ordered, timeout_s=300, perturb=True).verdict == "mismatch"

    class StandIn:
        @staticmethod
        def grouped_matmul_mxfp4(x, packed, scale, sizes, config):
            return blocked.grouped_matmul(x, Mxfp4Weights(packed, scale, Mxfp4Dequant.EXACT),
                                          sizes)

        @staticmethod
        def grouped_situ_glu_mxfp4(x, pg, sg, pu, su, sizes, *, config, beta, linear_beta):
            return blocked.grouped_situ_glu(x, Mxfp4Weights(pg, sg, Mxfp4Dequant.EXACT),
                                            Mxfp4Weights(pu, su, Mxfp4Dequant.EXACT), sizes,
                                            beta=beta, linear_beta=linear_beta)
    monkeypatch.setattr(dispatch, "triton_kernels", lambda: StandIn)
    on_triton = dataclasses.replace(ordered, backend="triton")
    xs, ws, sizes = inputs["x"].astype(jnp.float32), inputs["weights"], inputs["group_sizes"]
    got = launch.fixed_tiling_launcher(on_triton)(xs, ws, sizes)
    want = launch.launcher(ordered, "xla")(xs, ws, sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_k_order_needs_packed_weights():
    with pytest.raises(ValueError, match="k_order_axis 1 needs packed MXFP4 weights, not float32"):
        KernelConfig(**{**CONFIG.to_json(), "k_order_axis": 1})
    with pytest.raises(ValueError, match="k_order_axis must be None, 1 or 2, got 3"):
        KernelConfig(**{**CONFIG.to_json(), "w_dtype": "mxfp4", "k_order_axis": 3})
