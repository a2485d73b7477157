"""Every Mosaic GPU kernel configuration of benchmarks/compile_table.py compiles
for the H200 (sm_90a) through ptxas without a GPU, and holds to the golden
file k3jax/data/sm90a_kernels.json: no kernel uses more registers or
spills more bytes than the file says, every configuration is in the file and
the file names no configuration that no longer exists. The configurations:
the ones benchmarks.kernel_sweep times (grouped sweep, jax's Mosaic
ragged_dot peers, MLP sweep), tokamax.ragged_dot at the headline shapes, the
MXFP4 and weight-gradient kernels, and every distinct kernel of
benchmarks/gpu_kernel_checks.py. The ptxas is the nvidia-cuda-nvcc wheel's
(k3jax.tools.aot.pin_wheel_ptxas).

A configuration with fewer registers or spill bytes than the file passes
with a warning: regenerate the file
(``python -m benchmarks.compile_table --kernels --write-golden``).

Only configurations named in KNOWN_SPILLS may spill, whatever the file
says, with the reason; the test fails on an entry that no longer spills, so
the table cannot go stale. Each configuration compiles once per test run
(tests/compile_cache.py), whichever tests read it.
"""

from __future__ import annotations

import functools
import json
import os
import warnings

import pytest
from compile_cache import kernel_reports

from benchmarks import compile_table
from k3jax.tools.aot import pin_wheel_ptxas

pytestmark = pytest.mark.compile

# Every k3jax kernel is spill-free; the only spills are jax's own kernel's.
_PEER = ("jax's ragged_dot_mgpu peer (not k3jax's kernel), block_m 128 at EP 8: 255 "
         "registers, 84 B + 84 B of spill")
KNOWN_SPILLS: dict[str, str] = {
    **{f"down ep=8 tokens={t} (peer: jax Mosaic)": _PEER for t in (1024, 4096, 16384)},
}

CONFIGS = [c.name for c in compile_table.kernel_configs()]
REGENERATE = f"regenerate it: {compile_table.GOLDEN_COMMAND}"


@functools.cache
def golden() -> dict:
    return compile_table.read_golden()["configurations"]


def test_the_configuration_list_is_the_benchmarks():
    """110 configurations: 36 grouped, 18 jax Mosaic peers, 15 MLP, 5 tokamax
    peers, 6 MXFP4, 2 weight-gradient (tgmm), 28 check kernels (4 forcing the
    weights-on-M kernel, 6 that kernel in CTA clusters: 2 overhanging N, 1 with
    192 accumulator registers a thread)."""
    assert len(CONFIGS) == len(set(CONFIGS)) == 110
    assert sum(n.startswith(("gate_up_situ ", "down ")) and "peer" not in n for n in CONFIGS) == 36
    assert sum("(peer: jax Mosaic)" in n for n in CONFIGS) == 18
    assert sum("(peer: tokamax)" in n for n in CONFIGS) == 5
    assert sum(n.startswith("situ_mlp_up") and "peer" not in n for n in CONFIGS) == 15
    assert sum("_mxfp4 " in n for n in CONFIGS) == 6
    assert sum(n.startswith("tgmm ") for n in CONFIGS) == 2
    assert sum(n.startswith("check ") for n in CONFIGS) == 28
    assert set(KNOWN_SPILLS) <= set(CONFIGS), set(KNOWN_SPILLS) - set(CONFIGS)


def test_the_golden_file_names_exactly_the_configurations():
    doc = compile_table.read_golden()
    assert doc["command"] == compile_table.GOLDEN_COMMAND
    assert list(doc["configurations"]) == CONFIGS, (
        f"not in the golden file: {sorted(set(CONFIGS) - set(doc['configurations']))}; "
        f"in it but no longer configurations: {sorted(set(doc['configurations']) - set(CONFIGS))}"
        f"; {REGENERATE}")


def test_ptxas_is_the_wheels():
    assert "nvidia" in str(pin_wheel_ptxas())
    assert os.environ["PATH"].split(os.pathsep)[0] == str(pin_wheel_ptxas().parent)


def test_compare_entries_orders_worse_and_better():
    row = {"kernel": "k", "registers": 168, "spill_store_bytes": 0, "spill_load_bytes": 0,
           "smem_bytes": 1024, "grid": [132, 1, 1]}
    assert compile_table.compare_entries([row], [row]) == ([], [])
    worse, other = compile_table.compare_entries([row], [{**row, "registers": 170,
                                                          "spill_load_bytes": 4}])
    assert worse == ["k: registers 168 -> 170", "k: spill_load_bytes 0 -> 4"] and other == []
    assert compile_table.compare_entries([row], [{**row, "registers": 128, "grid": [66, 1, 1]}]) \
        == ([], ["k: registers 168 -> 128", "k: grid [132, 1, 1] -> [66, 1, 1]"])
    assert compile_table.compare_entries([row], [row, {**row, "kernel": "j"}])[0]
    assert compile_table.compare_entries([row], [{**row, "kernel": "j"}])[0]


def test_golden_json_reads_back():
    row = {"kernel": "k", "registers": 168, "spill_store_bytes": 0, "spill_load_bytes": 0,
           "smem_bytes": 1024, "grid": [132, 1, 1]}
    doc = {"command": "c", "commit": "abc", "configurations": {"a b": [row, row], "c": [row]}}
    text = compile_table.golden_json(doc)
    assert json.loads(text) == doc and len(text.splitlines()) == 13


def test_write_golden_refuses_a_worse_configuration(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_table, "GOLDEN_JSON", tmp_path / "g.json")
    monkeypatch.setattr(compile_table, "GOLDEN_MD", tmp_path / "g.md")
    monkeypatch.setattr(compile_table, "ptxas_version", lambda: "ptxas 1")
    row = {"kernel": "k", "registers": 168, "spill_store_bytes": 0, "spill_load_bytes": 0,
           "smem_bytes": 1024, "grid": [132, 1, 1]}
    log = []
    assert compile_table.write_golden(compile_table.golden_document({"a": [row]}, "abc"),
                                      log=log.append) == 0
    worse = compile_table.golden_document({"a": [{**row, "registers": 200}]}, "def")
    assert compile_table.write_golden(worse, log=log.append) == 1
    assert compile_table.read_golden(tmp_path / "g.json")["commit"] == "abc"
    assert "a: k: registers 168 -> 200" in " ".join(log)
    assert compile_table.write_golden(worse, accept_worse=True, log=log.append) == 0
    assert compile_table.read_golden(tmp_path / "g.json")["configurations"]["a"][0]["registers"] \
        == 200
    md = (tmp_path / "g.md").read_text()
    assert compile_table.GOLDEN_COMMAND in md and "def" in md and "ptxas 1" in md


@pytest.mark.parametrize("argv", [["--write-golden"], ["--kernels", "--accept-worse"],
                                  ["--kernels", "--layouts", "--write-golden"]])
def test_golden_flag_misuse_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        compile_table.main(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err


@pytest.mark.parametrize("name", CONFIGS)
def test_compiles_for_sm90a_within_the_golden_file(name):
    found = kernel_reports(name)
    assert found, f"{name}: no Mosaic GPU kernel was compiled"
    for r in found:
        assert 0 < r.registers <= 255, r
        assert 0 < r.smem_bytes <= 232_448, r          # the H200's opt-in SMEM per block
        assert r.grid and all(g >= 1 for g in r.grid), r
    spilled = [r for r in found if r.spill_bytes]
    if name in KNOWN_SPILLS:
        assert spilled, (f"{name} no longer spills: remove it from KNOWN_SPILLS "
                         f"({KNOWN_SPILLS[name]!r}); {REGENERATE}")
    else:
        assert not spilled, [(r.name, r.registers, r.spill_store_bytes, r.spill_load_bytes,
                              r.warnings) for r in spilled]
    assert name in golden(), f"{name} is not in {compile_table.GOLDEN_JSON}: {REGENERATE}"
    worse, other = compile_table.compare_entries(golden()[name],
                                                 compile_table.kernel_entries(list(found)))
    assert not worse, f"{name} is worse than {compile_table.GOLDEN_JSON.name}: {worse}"
    if other:
        warnings.warn(f"{name} differs from {compile_table.GOLDEN_JSON.name} ({other}): if it "
                      f"improved, {REGENERATE}", stacklevel=1)
