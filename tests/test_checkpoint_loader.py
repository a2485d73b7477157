"""The checkpoint loader's fast path: every loaded parameter is bitwise the
stored tensors (as the safetensors library reads them) transposed (all but
the packed MXFP4 codes, held as stored), stacked and padded; header problems
are named before any data is read; worker failures stop the others and
report the first error; ``load_layers`` with one progress bar; ``k3jax
load-bench``, ``make-checkpoint --num-experts`` and ``run --layers``."""

from __future__ import annotations

import json
import re
import struct
import threading
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from k3jax.checkpoint import (
    CheckpointError,
    CheckpointReader,
    load_layer,
    load_layers,
    make_synthetic_checkpoint,
)
from k3jax.checkpoint import reader as reader_module
from k3jax.checkpoint.host import Workers, first_nonfinite
from k3jax.checkpoint.names import layer_prefix, layer_tensors
from k3jax.cli import main
from k3jax.config import TINY
from k3jax.formats import ExpertStorage
from k3jax.layout import ParallelConfig, make_layout, make_mesh
from k3jax.modules import layer_decls
from k3jax.variables import WEIGHTS
from numerics import jitted, rel_err
from pallas_kernels.mxfp4_fast import FAST_SCALES
from pallas_kernels.mxfp4_words import deinterleave_words, interleave_words

CFG = TINY.replace(num_hidden_layers=3)
MOE = layer_prefix(1, True)


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory):
    """BF16 weights with MXFP4 routed experts, split over two files."""
    d = tmp_path_factory.mktemp("mx") / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=5, dtype="bfloat16", experts="mxfp4", num_files=2)
    return d


@pytest.fixture(scope="module")
def f32_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("f32") / "ckpt"
    make_synthetic_checkpoint(d, CFG, seed=6, dtype="float32")
    return d


def stored(ckpt) -> dict[str, np.ndarray]:
    """Every tensor, read by the safetensors library."""
    out = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def expected_param(decl, ref, prefix, tensors, num_experts):
    """The full parameter a loader must build: stored [out, in] tensors
    transposed (those whose TensorRef says so), packed MXFP4 codes in the
    word layout (interleave_words, TensorRef.interleave), experts stacked, zero rows where
    ``decl.padding`` says."""
    def one(e):
        a = tensors[ref.name(prefix, e)]
        if ref.interleave:
            return interleave_words(a)
        return a.T if ref.transpose else a
    logical = np.stack([one(e) for e in range(num_experts)]) if ref.per_expert else one(None)
    logical = logical.astype(decl.dtype)
    if decl.padding is None:
        return logical
    ax, size = decl.padding.axis, decl.shape[decl.padding.axis]
    src = [decl.padding.source_index(i, size) for i in range(size)]
    full = np.zeros(decl.shape, logical.dtype)
    for i, s in enumerate(src):
        if s is not None:
            index = [slice(None)] * len(decl.shape)
            index[ax] = i
            source = [slice(None)] * len(decl.shape)
            source[ax] = s
            full[tuple(index)] = logical[tuple(source)]
    return full


def check_bitwise(module, layer, tensors, parallel=ParallelConfig(), mesh=None,
                  dtype=jax.numpy.float32, experts=ExpertStorage.DENSE):
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices]) if mesh is None else mesh
    layout = make_layout(CFG, parallel, mesh, backend="xla", experts=experts, dtype=dtype)
    is_moe = CFG.is_moe_layer(layer)
    prefix, refs = layer_prefix(layer, is_moe), layer_tensors(is_moe)
    params = {".".join(map(str, p)): v.get_value()
              for p, v in nnx.to_flat_state(nnx.state(module, WEIGHTS))}
    decls = layer_decls(layout, layer)
    assert sorted(params) == sorted(d.name for d in decls)
    for decl in decls:
        got = np.asarray(params[decl.name])
        want = expected_param(decl, refs[decl.name], prefix, tensors, CFG.num_experts)
        assert got.dtype == want.dtype and got.shape == want.shape, decl.name
        np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                      np.ascontiguousarray(want).view(np.uint8), err_msg=decl.name)
    if is_moe and experts is ExpertStorage.MXFP4:
        # packed codes are held [E, out, in/2]: the stored tensors, stacked, each
        # 4 bytes' bits interleaved, which deinterleave_words undoes exactly
        for w, name in (("w1", "w1_packed_EFL"), ("w3", "w3_packed_EFL"), ("w2", "w2_packed_ELF")):
            want = np.stack([tensors[f"{prefix}experts.{e}.{w}.weight_packed"]
                             for e in range(CFG.num_experts)])
            np.testing.assert_array_equal(deinterleave_words(np.asarray(params[name])), want,
                                          err_msg=name)


@pytest.mark.parametrize("ckpt, parallel, dtype", [
    ("mxfp4_ckpt", ParallelConfig(), "bfloat16"),
    ("f32_ckpt", ParallelConfig(tp=8), "bfloat16"),                       # padded blocks, cast
    ("mxfp4_ckpt", ParallelConfig(dp=2, tp=4, sequence_parallel=True, expert_parallel=True),
     "float32"),
], ids=["mxfp4-single-bf16", "f32-tp8-padded-to-bf16", "mxfp4-ep8-to-f32"])
def test_loaded_parameters_are_the_stored_tensors_bitwise(request, eight_devices, ckpt, parallel,
                                                          dtype):
    ckpt = request.getfixturevalue(ckpt)
    tensors = stored(ckpt)
    experts = ExpertStorage.MXFP4 if any(n.endswith("_packed") for n in tensors) else \
        ExpertStorage.DENSE
    mesh = make_mesh(parallel, eight_devices[:parallel.num_devices])
    for layer in (0, 1):
        module = load_layer(ckpt, layer, parallel, mesh, dtype=jax.numpy.dtype(dtype),
                            backend="xla", workers=2)
        check_bitwise(module, layer, tensors, parallel, mesh, jax.numpy.dtype(dtype), experts)


def test_dense_experts_dequantize_and_one_worker(f32_ckpt, mxfp4_ckpt):
    tensors = stored(f32_ckpt)
    a = load_layer(f32_ckpt, 1, backend="xla", workers=1)
    check_bitwise(a, 1, tensors)
    b = load_layer(f32_ckpt, 1, backend="xla", workers=3)
    for (_, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()))
    deq = load_layer(mxfp4_ckpt, 1, backend="xla", mxfp4="dequantize")   # decoded on the host
    x = np.random.default_rng(0).standard_normal((5, CFG.hidden_size)).astype(np.float32)
    packed = load_layer(mxfp4_ckpt, 1, backend="xla")
    assert rel_err(jitted(deq)(x), jitted(packed)(x)) < 1e-5


# -- the reader ------------------------------------------------------------------
def test_reader_regions_match_safetensors(mxfp4_ckpt):
    reader = CheckpointReader(mxfp4_ckpt)
    tensors = stored(mxfp4_ckpt)
    rng = np.random.default_rng(1)
    workers = Workers(2)
    for name in (MOE + "shared_experts.down_proj.weight", MOE + "experts.3.w2.weight_packed",
                 MOE + "gate.e_score_correction_bias", MOE + "routed_expert_norm.weight"):
        want = tensors[name]
        assert reader.read(name).dtype == want.dtype
        for _ in range(4):
            index = []
            for n in want.shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            np.testing.assert_array_equal(reader.read(name, index), want[tuple(index)])
            np.testing.assert_array_equal(reader.read(name, index, workers=workers),
                                          want[tuple(index)])
        if want.ndim == 2:   # into a strided destination (a column window of a wider array)
            wide = np.zeros((want.shape[0], want.shape[1] + 9), want.dtype)
            reader.read(name, [slice(None), slice(2, want.shape[1])],
                        out=wide[:, 4:4 + want.shape[1] - 2])
            np.testing.assert_array_equal(wide[:, 4:4 + want.shape[1] - 2], want[:, 2:])
            assert not wide[:, :4].any() and not wide[:, 4 + want.shape[1] - 2:].any()
    workers.close()


def rewrite_header(path, edit):
    """Rewrite the JSON header of a safetensors file with ``edit(header)``."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    text = json.dumps(edit(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


@pytest.fixture
def count_reads(monkeypatch):
    calls = []
    real = reader_module._pread_into
    monkeypatch.setattr(reader_module, "_pread_into",
                        lambda *a: (calls.append(a[3]), real(*a))[1])
    return calls


def test_truncated_file_names_the_tensor_before_reading(tmp_path, count_reads):
    d = tmp_path / "c"
    make_synthetic_checkpoint(d, CFG, seed=1, dtype="float32", num_files=2)
    victim = sorted(d.glob("*.safetensors"))[1]
    last = max(((n, e["data_offsets"][1]) for n, e in _header(victim).items()
                if n != "__metadata__"), key=lambda t: t[1])[0]
    victim.write_bytes(victim.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=rf"{victim.name}: tensor {re.escape(last)}: its "
                                              r"data ends at byte \d+, beyond the file's"):
        load_layer(d, 1, backend="xla")
    assert count_reads == []


def _header(path):
    data = path.read_bytes()
    return json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])


@pytest.mark.parametrize("what", ["offsets", "dtype", "shape", "json"])
def test_malformed_header_is_named_before_reading(tmp_path, count_reads, what):
    d = tmp_path / "c"
    make_synthetic_checkpoint(d, CFG, seed=1, dtype="float32", num_files=2)
    file = sorted(d.glob("*.safetensors"))[0]
    name = next(n for n in _header(file) if n != "__metadata__")

    def edit(h):
        if what == "offsets":
            a, b = h[name]["data_offsets"]
            h[name]["data_offsets"] = [a, b - 4]
        elif what == "dtype":
            h[name]["dtype"] = "Q9"
        else:
            h[name]["shape"] = [-1, 2]
        return h
    if what == "json":
        data = file.read_bytes()
        file.write_bytes(data[:8] + b"{not json" + data[17:])
        match = "header is not JSON"
    else:
        rewrite_header(file, edit)
        match = {"offsets": rf"tensor {re.escape(name)}: data_offsets .* hold \d+ bytes",
                 "dtype": rf"tensor {re.escape(name)}: unknown dtype 'Q9'",
                 "shape": rf"tensor {re.escape(name)}: bad shape"}[what]
    with pytest.raises(CheckpointError, match=rf"cannot read safetensors file .*{file.name}: {match}"):
        load_layers(d, [0, 1, 2], backend="xla")
    assert count_reads == []


def test_missing_tensor_of_a_later_layer_fails_before_any_data(tmp_path, count_reads):
    d = tmp_path / "c"
    make_synthetic_checkpoint(d, CFG, seed=1, dtype="float32")
    missing = layer_prefix(2, True) + "experts.15.w3.weight"
    tensors = stored(d)
    del tensors[missing]
    from k3jax.checkpoint import write_checkpoint
    write_checkpoint(tmp_path / "e", CFG, sorted(tensors.items()))
    with pytest.raises(CheckpointError, match=f"missing tensor {re.escape(missing)}"):
        load_layers(tmp_path / "e", [0, 1, 2], backend="xla")
    assert count_reads == []


# -- workers ---------------------------------------------------------------------
def test_a_failing_job_stops_the_others_and_the_first_error_is_raised():
    workers = Workers(2)
    ran = []

    def fail(message, delay):
        def job():
            time.sleep(delay)
            raise RuntimeError(message)
        return job

    def slow(i):
        def job():
            time.sleep(0.05)
            ran.append(i)
        return job
    jobs = [fail("first", 0.0), fail("second", 0.2)] + [slow(i) for i in range(40)]
    with pytest.raises(RuntimeError, match="^first$"):
        workers.run(jobs)
    assert len(ran) < 5, ran          # the rest never started
    workers.run([slow(100)])          # the pool still works
    assert ran[-1] == 100
    workers.close()


def test_nan_in_an_expert_read_by_a_worker_is_named(tmp_path):
    d = tmp_path / "c"
    make_synthetic_checkpoint(d, CFG, seed=2, dtype="bfloat16")
    tensors = stored(d)
    name = MOE + "experts.11.w2.weight"
    bad = tensors[name].copy()
    bad[5, 7] = np.inf
    tensors[name] = bad
    from k3jax.checkpoint import write_checkpoint
    write_checkpoint(tmp_path / "e", CFG, sorted(tensors.items()))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} holds NaN or inf "
                                                        f"(the first at index [5, 7])")):
        load_layer(tmp_path / "e", 1, backend="xla", workers=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_first_nonfinite_on_the_bits(dtype):
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((300, 50)) * 1e3).astype(dtype)
    a[0, 0] = np.finfo(dtype).max          # the largest finite value is finite
    a[1, 1] = -np.finfo(dtype).max
    assert first_nonfinite(a) is None
    for value in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[123, 45] = value
        b[200, 3] = value
        assert first_nonfinite(b) == (123, 45)
        assert first_nonfinite(b, Workers(2)) == (123, 45)
        assert first_nonfinite(b[100:, 40:]) == (23, 5)


# -- load_layers -----------------------------------------------------------------
def test_load_layers_one_bar_in_bytes(f32_ckpt, monkeypatch):
    import tqdm

    bars = []

    class Recording:
        def __init__(self, total, unit, **kwargs):
            self.total, self.unit, self.seen, self.lock = total, unit, 0, threading.Lock()
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            with self.lock:
                self.seen += n

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    modules = load_layers(f32_ckpt, [0, 1, 2], backend="xla", progress=True)
    (bar,) = bars
    total = sum(v.get_value().nbytes for m in modules
                for _, v in nnx.to_flat_state(nnx.state(m, WEIGHTS)))
    assert bar.unit == "B" and bar.seen == bar.total == total
    tensors = stored(f32_ckpt)
    for layer, m in zip([0, 1, 2], modules):
        check_bitwise(m, layer, tensors)


# -- the CLI -----------------------------------------------------------------------
def test_load_bench_json(f32_ckpt, capsys):
    assert main(["load-bench", "--checkpoint", str(f32_ckpt), "--layer", "1", "--repeat", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"bytes", "loader_GBps", "raw_GBps", "ratio"}
    reader = CheckpointReader(f32_ckpt)
    prefix = layer_prefix(1, True)
    want = sum(int(np.prod(reader.info(n[len(reader.prefix):])[1])) * 4
               for n in reader._file_of if n.startswith(prefix) and not n.endswith("bias")) \
        + CFG.num_experts * 4
    assert out["bytes"] == want
    assert all(out[k] > 0 for k in ("loader_GBps", "raw_GBps", "ratio"))
    assert out["ratio"] == pytest.approx(out["loader_GBps"] / out["raw_GBps"])


def test_load_bench_text_has_its_peers(f32_ckpt, capsys):
    """On CPU devices: the host side alone (with the ops, which run there),
    the reads and checks alone (blocks as stored) and no device ops."""
    assert main(["load-bench", "--checkpoint", str(f32_ckpt), "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for peer in (r"the loader's host side alone \(reads, checks, the ops on the host; nothing "
                 r"placed\)", r"the reads and checks alone \(blocks as stored, staging, no op"):
        found = re.search(rf"peer: {peer}.*?, ([0-9.]+) GB/s, ([0-9.]+) of the raw read", out)
        assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0, (peer, out)
    assert "peer: the on-device ops alone: none (on CPU devices the transposes" in out, out


def test_load_bench_min_ratio_fails_below_it_naming_the_figures(f32_ckpt, capsys):
    args = ["load-bench", "--checkpoint", str(f32_ckpt), "--repeat", "1", "--json"]
    assert main([*args, "--min-ratio", "0"]) == 0
    assert main([*args, "--min-ratio", "1e6"]) == 1      # no loader reads 1e6 x a raw read
    out, err = capsys.readouterr()
    ratio = json.loads(out.splitlines()[-1])["ratio"]
    (line,) = err.strip().splitlines()
    assert re.fullmatch(rf"k3jax load-bench: loader / raw read {ratio:.3f} is below --min-ratio "
                        rf"1e\+06: loader [0-9.]+ GB/s, raw read [0-9.]+ GB/s \(medians of 1 "
                        rf"interleaved runs each, layer 1 of {re.escape(str(f32_ckpt))}, "
                        rf"[0-9]+ bytes\)", line), line
    with pytest.raises(SystemExit) as exit_info:     # argparse's own usage error
        main([*args, "--min-ratio", "-1"])
    assert exit_info.value.code == 2
    assert "--min-ratio: expected a finite number >= 0, got '-1'" in capsys.readouterr().err


def test_load_bench_usage(f32_ckpt, tmp_path, capsys):
    assert main(["load-bench", "--checkpoint", str(f32_ckpt), "--layer", "3"]) == 2
    assert "--layer 3 is out of range" in capsys.readouterr().err
    assert main(["load-bench", "--checkpoint", str(tmp_path / "none")]) == 1
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_make_checkpoint_num_experts_and_layers(tmp_path, capsys):
    d = tmp_path / "c"
    assert main(["make-checkpoint", str(d), "--preset", "tiny", "--num-experts", "8",
                 "--num-layers", "2", "--experts", "mxfp4"]) == 0
    reader = CheckpointReader(d)
    assert reader.config == TINY.replace(num_experts=8, num_hidden_layers=2)
    from k3jax.checkpoint.writer import checkpoint_bytes
    assert checkpoint_bytes(reader.config, "bfloat16", "mxfp4") == sum(
        a.nbytes for a in stored(d).values())
    assert "8 routed experts" in capsys.readouterr().out
    load_layer(d, 1, backend="xla")
    for argv, message in [
        (["--preset", "k3"], "--preset k3 is ~1 TB of weights: give --num-experts N"),
        (["--preset", "k3", "--num-experts", "896"], "the checkpoint needs"),
        (["--preset", "tiny", "--num-experts", "2"], "--num-experts 2: K3Config: num_experts_per_token"),
        (["--preset", "tiny", "--num-layers", "4"], "--num-layers 4: the tiny preset has 3 layers"),
    ]:
        assert main(["make-checkpoint", str(tmp_path / "x"), *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "x").exists()


def test_run_layers_in_sequence(f32_ckpt, tmp_path, capsys):
    x = np.random.default_rng(4).standard_normal((5, CFG.hidden_size)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", "--checkpoint", str(f32_ckpt), "--layers", "0:3", "--input",
                 str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"),
                 "--backend", "xla"]) == 0
    assert "layers 0..2 in sequence (dense MLP, MoE, MoE)" in capsys.readouterr().out
    want = x
    for layer in range(3):
        want = np.asarray(jitted(load_layer(f32_ckpt, layer, backend="xla"))(want))
    assert rel_err(np.load(tmp_path / "y.npy"), want) < 1e-5
    for argv, message in [(["--layers", "1:4"], "--layers 1:4 is out of range"),
                          (["--layers", "0:2", "--layer", "1"], "exclude each other")]:
        assert main(["run", "--checkpoint", str(f32_ckpt), *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as exit_info:     # argparse's own usage error
        main(["run", "--layers", "2:2"])
    assert exit_info.value.code == 2
    assert "expected 0 <= A < B" in capsys.readouterr().err


def test_run_with_a_bad_layer_writes_no_output(tmp_path, capsys):
    d = tmp_path / "c"
    make_synthetic_checkpoint(d, CFG, seed=2, dtype="float32")
    tensors = stored(d)
    name = layer_prefix(2, True) + "experts.4.w1.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][0, 1] = np.nan
    from k3jax.checkpoint import write_checkpoint
    write_checkpoint(tmp_path / "e", CFG, sorted(tensors.items()))
    out = tmp_path / "y.npy"
    assert main(["run", "--checkpoint", str(tmp_path / "e"), "--layers", "1:3",
                 "--output", str(out)]) == 1
    assert f"tensor {name} holds NaN or inf" in capsys.readouterr().err
    assert not out.exists()


# -- the MXFP4 experts' dequant, read off the stored scale bytes ------------------------
def _mxfp4_ckpt_with_byte(directory, expert: int, byte: int) -> None:
    """The mxfp4_ckpt fixture's tensors (same seed) with scale byte ``byte`` at
    [0, 0] of layer 1's expert ``expert``'s w2 (outside FAST_SCALES: 0, 1,
    129..254)."""
    from k3jax.checkpoint.writer import synthetic_tensors, write_checkpoint
    tensors = dict(synthetic_tensors(CFG, 5, dtype="bfloat16", experts="mxfp4"))
    scale = tensors[f"{MOE}experts.{expert}.w2.weight_scale"]
    assert FAST_SCALES.start <= scale.min() and scale.max() < FAST_SCALES.stop  # the fixture's
    scale[0, 0] = byte
    write_checkpoint(directory, CFG, tensors.items())


def test_mxfp4_dequant_is_read_off_the_stored_scale_bytes(eight_devices, mxfp4_ckpt, tmp_path):
    """A checkpoint whose scale bytes are all in FAST_SCALES loads FAST; one
    byte outside (in the last expert, on the last device under EP) makes the
    layer EXACT; zero padding (dp 8 EP with pad_under_ep: scale byte 0 in the
    padded blocks) is not stored, so it does not count."""
    from pallas_kernels.mxfp4 import Mxfp4Dequant
    ep = ParallelConfig(dp=8, expert_parallel=True)
    fast = load_layer(mxfp4_ckpt, 1, ep, backend="xla")
    assert fast.layout.experts.dequant is Mxfp4Dequant.FAST
    assert "MXFP4 experts' dequant: fast" in fast.layout.describe()
    for byte in (1, 129):
        ckpt = tmp_path / f"byte{byte}"
        _mxfp4_ckpt_with_byte(ckpt, CFG.num_experts - 1, byte)
        exact = load_layer(ckpt, 1, ep, backend="xla")
        assert exact.layout.experts.dequant is Mxfp4Dequant.EXACT, byte
    padded_ep = ParallelConfig(dp=8, expert_parallel=True, pad_under_ep=True)
    padded = load_layer(mxfp4_ckpt, 1, padded_ep, backend="xla")
    assert padded.layout.padded_moe_intermediate > CFG.moe_intermediate_size
    assert np.asarray(padded.w2_scale_EFL[...]).min() == 0          # the padding's bytes
    assert padded.layout.experts.dequant is Mxfp4Dequant.FAST
    dense = load_layer(mxfp4_ckpt, 1, backend="xla", mxfp4="dequantize")
    assert dense.layout.experts.name == "mxfp4-dequant" and not hasattr(dense.layout.experts,
                                                                         "dequant")


def test_agreed_mxfp4_dequant_is_exact_where_any_process_saw_a_byte_outside():
    """The per-process verdicts (each process reads only its blocks) combine
    per layer: EXACT where any process's is; every process gets the same
    list; one process's verdicts are its own; a process with another number
    of verdicts is named."""
    from k3jax.runtime.agreement import agree_mxfp4_dequant, combine_mxfp4_dequant
    from pallas_kernels.mxfp4 import Mxfp4Dequant
    F, X = Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT
    assert combine_mxfp4_dequant([[F, F, X], [F, X, X]]) == [F, X, X]
    assert combine_mxfp4_dequant([[F, F], [F, F], [F, F]]) == [F, F]
    assert combine_mxfp4_dequant([[X], [F]]) == [X]
    assert combine_mxfp4_dequant([[]]) == []
    assert agree_mxfp4_dequant([F, X]) == [F, X]      # one process: its own
    with pytest.raises(ValueError, match=r"the processes hold \[1, 2\] verdicts"):
        combine_mxfp4_dequant([[F], [F, X]])
