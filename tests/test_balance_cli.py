"""``k3jax balance``: a placement from a load file in the format ``k3jax run
--expert-load`` writes, its before / after figures, its exit codes (2 for
flags, 1 for bad files) with one line naming the culprit, and its output
written whole or not at all (a failed run leaves the directory as it was)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from k3jax.cli import main
from k3jax.layout import expert_placement as xp

E, K = 896, 16


def load_entry(counts: np.ndarray, devices: int = 16, nodes: int = 2) -> dict:
    """One layer of a load file (the format k3jax run --expert-load writes)."""
    dev = counts.reshape(devices, -1).sum(1)
    node = dev.reshape(nodes, -1).sum(1)
    return {"tokens_per_expert": counts.tolist(), "tokens_per_device": dev.tolist(),
            "tokens_per_node": node.tolist(), "mean_score_per_expert": [0.5] * len(counts),
            "imbalance": {"device": float(dev.max() / dev.mean()),
                          "node": float(node.max() / node.mean())}}


def skewed_counts(seed: int, s: float = 1.0, tokens: int = 2048) -> np.ndarray:
    ranks = np.random.default_rng(0).permutation(E)
    g = np.random.default_rng(seed).gumbel(size=(tokens, E)) - s * np.log(ranks + 1.0)
    return np.bincount(np.argpartition(-g, K, axis=1)[:, :K].ravel(), minlength=E)


@pytest.fixture
def load_file(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"1": load_entry(skewed_counts(1)),
                                "2": load_entry(skewed_counts(2, s=0.5))}))
    return path


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "k3jax balance: error:" in lines[0], err
    return lines[0]


def test_balance_writes_a_placement_and_prints_before_and_after(load_file, tmp_path, capsys):
    out = tmp_path / "placement.json"
    argv = ["balance", "--load", str(load_file), "--redundant-experts", "32", "--nodes", "2",
            "--devices", "16", "--output", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "EP 16 over 2 node(s), 32 redundant slot(s)" in text and f"wrote {out}" in text
    placements = xp.read_placements(str(out))
    assert set(placements) == {1, 2}
    counts = skewed_counts(1)
    assert placements[1] == xp.place_experts(counts, 32, 2, 16)
    assert xp.imbalance(xp.device_loads(placements[1], counts)) < 1.01
    # --json, one layer, the same figures
    assert main(argv[:-2] + ["--layer", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["layers"]
    assert row["layer"] == 1 and doc["redundant_experts"] == 32
    before = xp.device_loads(xp.uniform_placement(E, 0, 16, 2), counts)
    assert row["before"]["device"] == pytest.approx(before.max() / before.mean())
    assert row["before"]["device"] > 1.5 > row["after"]["device"]
    assert row["after"]["device_mean"] == pytest.approx(counts.sum() / 16)


def test_balance_evaluates_a_placement_file(load_file, tmp_path, capsys):
    out = tmp_path / "p.json"
    xp.write_placements(str(out), {1: xp.uniform_placement(E, 32, 16, 2),
                                   2: xp.uniform_placement(E, 0, 16, 2)})
    assert main(["balance", "--load", str(load_file), "--placement", str(out), "--nodes", "2",
                 "--devices", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layers"]
    assert rows[1]["after"] == rows[1]["before"]          # layer 2's placement is the identity


@pytest.mark.parametrize("flags, names", [
    (["--redundant-experts", "16", "--nodes", "4", "--devices", "32"],
     "--redundant-experts 16: 896 experts + 16 = 912 slots do not divide over --devices 32"),
    (["--redundant-experts", "32", "--nodes", "3", "--devices", "16"],
     "--nodes 3 does not divide --devices 16"),
    (["--redundant-experts", "32", "--nodes", "2", "--devices", "16", "--layer", "7"],
     "--layer 7: "),
    (["--redundant-experts", "32", "--nodes", "2", "--devices", "16", "--output", "/nonexistent/p.json"],
     "--output /nonexistent/p.json"),
    (["--placement", "p.json", "--redundant-experts", "32", "--nodes", "2", "--devices", "16"],
     "--redundant-experts: not with --placement"),
])
def test_flag_errors_exit_2_naming_the_flag(flags, names, load_file, capsys):
    assert main(["balance", "--load", str(load_file), *flags]) == 2
    assert names in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("argv, names", [
    (["--redundant-experts", "-1"], "argument --redundant-experts: expected an integer >= 0"),
    (["--devices", "0"], "argument --devices: expected a positive integer"),
])
def test_bad_flag_values_exit_2(argv, names, load_file, capsys):
    with pytest.raises(SystemExit) as e:
        main(["balance", "--load", str(load_file), "--devices", "16", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err, err


def bad_files(tmp_path):
    """(what, the load file, the placement file or None, words of the error)."""
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"1": load_entry(np.ones(E - 16, int), devices=8)}))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"1": load_entry(skewed_counts(3))}))
    drop = tmp_path / "drop.json"
    doc = xp.placements_to_json({1: xp.uniform_placement(E, 32, 16, 2)})
    doc["layers"]["1"]["slot_expert"] = [1 if e == 0 else e for e in doc["layers"]["1"]["slot_expert"]]
    drop.write_text(json.dumps(doc))
    other = tmp_path / "other.json"
    xp.write_placements(str(other), {1: xp.uniform_placement(E, 32, 32, 4)})
    return [("wrong length", short, None, "layer '1': tokens_per_expert: 880 entries, but the "
                                          "model has 896 experts"),
            ("drops an expert", good, drop, "layer 1: no slot holds logical expert(s) [0]"),
            ("other devices", good, other, "layer 1's placement is for 896 experts over 32 "
                                           "devices on 4 node(s), not 896 over --devices 16")]


@pytest.mark.parametrize("case", range(3), ids=["wrong-length", "drops-an-expert", "other-devices"])
def test_bad_files_exit_1_naming_the_culprit_and_change_nothing(case, tmp_path, capsys):
    what, load, placement, names = bad_files(tmp_path)[case]
    out = tmp_path / "out.json"
    out.write_text("old")
    before = sorted(os.listdir(tmp_path))
    argv = ["balance", "--load", str(load), "--nodes", "2", "--devices", "16"]
    argv += ["--placement", str(placement)] if placement else ["--redundant-experts", "32",
                                                               "--output", str(out)]
    assert main(argv) == 1, what
    line = one_line_error(capsys.readouterr().err)
    assert names in line and str(placement or load) in line, line
    assert sorted(os.listdir(tmp_path)) == before and out.read_text() == "old"


def test_output_is_replaced_whole(load_file, tmp_path, monkeypatch, capsys):
    """A failure while writing leaves the old file and no temporary file."""
    out = tmp_path / "out.json"
    out.write_text("old")
    real = xp.placements_to_json

    def broken(placements):
        raise OSError("disk full")
    monkeypatch.setattr(xp, "placements_to_json", broken)
    argv = ["balance", "--load", str(load_file), "--redundant-experts", "32", "--nodes", "2",
            "--devices", "16", "--output", str(out)]
    assert main(argv) == 1
    assert "disk full" in one_line_error(capsys.readouterr().err)
    assert out.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["load.json", "out.json"]
    monkeypatch.setattr(xp, "placements_to_json", real)
    assert main(argv) == 0
    assert set(xp.read_placements(str(out))) == {1, 2}


def test_tiny_preset_without_a_before_layout(tmp_path, capsys):
    """16 experts over 32 devices exist only with redundancy: no 'before'."""
    path = tmp_path / "load.json"
    counts = np.arange(16) + 1
    path.write_text(json.dumps({"1": {"tokens_per_expert": counts.tolist()}}))
    assert main(["balance", "--preset", "tiny", "--load", str(path), "--redundant-experts", "16",
                 "--nodes", "4", "--devices", "32", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["layers"]
    assert row["before"] is None and row["after"]["device"] >= 1.0


def test_the_latency_hook_gives_the_busiest_layers_balance(load_file, tmp_path):
    """balance_for_latency: the max / mean of the worst layer, without
    redundancy or with a placement file; the model slows with it."""
    from k3jax.cli.balance import balance_for_latency
    from k3jax.config import K3
    from k3jax.tools import dispatch_latency as dl

    worst = balance_for_latency(str(load_file), None, None, E, 16, 2)
    layer1 = balance_for_latency(str(load_file), None, 1, E, 16, 2)
    dev = xp.device_loads(xp.uniform_placement(E, 0, 16, 2), skewed_counts(1))
    assert worst == layer1 and layer1.device == pytest.approx(dev.max() / dev.mean())
    out = tmp_path / "p.json"
    xp.write_placements(str(out), {n: xp.place_experts(skewed_counts(n, 1.0 if n == 1 else 0.5),
                                                       32, 2, 16) for n in (1, 2)})
    placed = balance_for_latency(str(load_file), str(out), None, E, 16, 2)
    assert placed.device < 1.05 < layer1.device and placed.slots_per_device == 58
    assert dl.estimate(K3, 8192, 16, 2, "gather", balance=layer1).layer_s > \
        dl.estimate(K3, 8192, 16, 2, "gather", balance=placed).layer_s
    with pytest.raises(ValueError, match="not 32 on 4"):
        balance_for_latency(str(load_file), str(out), None, E, 32, 4)


def _layer_s(out: str, tokens: int) -> dict[str, float]:
    rows = json.loads(out)["rows"]
    return {r["form"]: r["layer_s"] for r in rows if r["tokens"] == tokens}


def test_latency_charges_the_busiest_device_of_a_load_and_its_placement(load_file, tmp_path,
                                                                         capsys):
    """k3jax latency --load: the skewed load's busiest device makes every form
    slower than balanced at a size where the experts' matmuls count; the
    placement k3jax balance wrote for it brings the time back down."""
    base = ["latency", "--nodes", "2", "--tokens", "8192", "--json"]
    assert main(base) == 0
    balanced = _layer_s(capsys.readouterr().out, 8192)
    assert main(base + ["--load", str(load_file), "--load-layer", "1"]) == 0
    skewed = _layer_s(capsys.readouterr().out, 8192)
    placement = tmp_path / "placement.json"
    assert main(["balance", "--load", str(load_file), "--redundant-experts", "32", "--nodes",
                 "2", "--devices", "16", "--output", str(placement)]) == 0
    capsys.readouterr()
    assert main(base + ["--load", str(load_file), "--load-layer", "1",
                        "--placement", str(placement)]) == 0
    placed = _layer_s(capsys.readouterr().out, 8192)
    assert set(balanced) == set(skewed) == set(placed)
    for form in balanced:
        assert skewed[form] > balanced[form]
        assert placed[form] < skewed[form]


@pytest.mark.parametrize("flags, culprit", [
    (["--load", "L.json"], "--load L.json: needs --nodes"),
    (["--nodes", "2", "--placement", "P.json"], "--placement P.json: needs --load"),
    (["--nodes", "2", "--load-layer", "3"], "--load-layer 3: needs --load"),
])
def test_latency_load_flags_need_their_partners(flags, culprit, capsys):
    assert main(["latency", "--tokens", "256", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0], err
