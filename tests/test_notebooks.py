"""The research notebooks (notebooks/*.ipynb): stored without outputs, shaped
as a short paper, and executed top to bottom on the CPU without error.

Each notebook asserts its own claims (SPEC 6's figures, layouts agreeing,
errors within tolerance) and prints a JSON summary in its last code cell;
the tests below read that summary back and check the key figures again, so a
notebook that stopped computing them fails here too.

Run as a script to execute the notebooks and keep the executed copies (with
outputs and figures) for reading:

    .venv/bin/python tests/test_notebooks.py --output-dir /tmp/notebooks [NAME ...]
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import tempfile
import time

import nbformat
import pytest
from nbclient import NotebookClient

from k3jax.layout import ep_dispatch_choice

pytestmark = pytest.mark.tiers(
    integration=[
        "test_01_shared_expert_sequence_parallel",
        "test_02_moe_padding_and_ep",
        "test_03_torch_crosscheck",
        "test_04_training_and_load_balancing",
    ])

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = {
    "01_shared_expert_sequence_parallel.ipynb",
    "02_moe_padding_and_ep.ipynb",
    "03_torch_crosscheck.ipynb",
    "04_training_and_load_balancing.ipynb",
}
CELL_TIMEOUT_S = 300
# Relative-error bar (max |err| / max |ref|) for the notebooks' float64-referenced rows.
BAR = {"float32": 1e-5, "bfloat16": 1e-2, "mxfp4": 1e-5}
GiB = 2**30


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def execute(name: str, workdir: str | os.PathLike) -> nbformat.NotebookNode:
    """Run notebook ``name`` top to bottom in a fresh python3 kernel (this
    interpreter's ipykernel) with ``workdir`` as its working directory.
    Raises nbclient's CellExecutionError on the first failing cell."""
    nb = read(name)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def summary(nb: nbformat.NotebookNode) -> dict:
    """The JSON object the last code cell printed."""
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("text", "") for o in last.outputs
                   if o.output_type == "stream" and o.name == "stdout")
    return json.loads(text)


# -- stored form ---------------------------------------------------------------
def test_the_notebooks_exist():
    assert {p.name for p in NOTEBOOK_DIR.glob("*.ipynb")} == NOTEBOOKS


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_stored_without_outputs(name):
    """Committed notebooks carry no outputs and no execution counts."""
    nb = read(name)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: cell {i} has stored outputs"
            assert cell.execution_count is None, f"{name}: cell {i} has an execution count"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_reads_as_a_short_paper(name):
    """Question first, then Method and an Answer; the first code cell sets up
    the simulated CPU devices before anything imports k3jax (which starts no
    backend itself, but its users do), and devices come from pick_devices."""
    nb = read(name)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert "**Question.**" in nb.cells[0].source
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "**Method.**" in markdown and "## Answer" in markdown
    assert markdown.index("**Question.**") < markdown.index("**Method.**") < markdown.index("## Answer")
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in code[0] and "k3jax" not in code[0]
    assert "JAX_PLATFORMS" not in "\n".join(code)  # would hide the GPUs; the notebooks run there unchanged
    assert "pick_devices(8)" in code[1]


# -- execution -----------------------------------------------------------------
@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """{name: executed notebook}, each run once per session, on demand."""
    cache: dict[str, nbformat.NotebookNode] = {}

    def get(name: str) -> nbformat.NotebookNode:
        if name not in cache:
            cache[name] = execute(name, tmp_path_factory.mktemp(name.removesuffix(".ipynb")))
        return cache[name]
    return get


def test_01_shared_expert_sequence_parallel(executed):
    s = summary(executed("01_shared_expert_sequence_parallel.ipynb"))
    assert s["shared_replicated_gib"] == 22.640625
    assert s["shared_sharded_tp4_gib"] == 22.640625 / 4
    assert s["shared_saved_tp4_gib"] == 16.98046875
    for row in s["memory"]:
        assert row["shared_sharded"] * row["tp"] == row["shared_replicated"]
        assert row["total_ep_sharded"] < row["total_ep_replicated"]
    assert s["hlo_collectives"] == {"replicated": {}, "sharded": {"all-gather": 1, "reduce-scatter": 1},
                                    "ring": {"collective-permute": 14}}
    # the latency model: FLOPs as compiled; ring beats the unoverlapped form at 8192 tokens
    assert all(1.0 <= r < 1.001 for r in s["model_flops_ratio"].values())
    assert s["model_tokens"][-1] == 8192
    for tp in ("tp4", "tp8"):
        pct = s["model_pct_vs_replicated"][tp]
        assert pct["sharded+ring"][-1] < pct["sharded"][-1]
    assert s["added_bytes_per_token"] > 0
    # the whole-layer model: auto within 5 % of replicated at every token count on 4 and 8 GPUs,
    # and the module model within the error it states against vLLM
    assert s["layer_tokens"] == [8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    for tp in ("tp4", "tp8"):
        assert len(s["layer_auto_ratio"][tp]) == 10 and max(s["layer_auto_ratio"][tp]) <= 1.05
    assert 0 <= s["vllm_error_pp"] <= 55
    assert s["tokens"] == [8, 32, 128, 256, 512, 1024, 2048]
    assert len(s["measured_ratio"]) == 7 and all(math.isfinite(r) and r > 0 for r in s["measured_ratio"])
    assert s["measured_crossover"] is None or s["measured_crossover"] in s["tokens"]
    assert s["model_crossover"] is not None and 8 < s["model_crossover"] < 2048
    assert 0 <= s["max_rel_diff"] < 1e-5    # float32 layouts agree (measured 9.8e-7)


def test_02_moe_padding_and_ep(executed):
    s = summary(executed("02_moe_padding_and_ep.ipynb"))
    gb = s["routed_gb"]
    assert gb["tp"]["8"] == "180.81" and gb["tp"]["16"] == gb["tp"]["32"] == "120.54"
    assert gb["ep"]["16"] == "90.40" and gb["ep"]["32"] == "45.20"
    assert gb["ep_pad_under_ep"]["16"] == gb["ep_pad_under_ep"]["32"] == "120.54"
    assert s["floor_bytes"] == 896 * 3 * 256 * 3584 * 92 * 0.53125
    assert s["cli_routed_bytes"] == s["floor_bytes"]
    checks = s["numerics"]
    assert {c["layout"] for c in checks} >= {"ep_dp8", "ep_dp8_pad_under_ep", "tp8"}
    padded = [c for c in checks if c["padded_intermediate"] > c["intermediate"]]
    assert padded, "no layout exercised the padding"
    for c in checks:
        assert c["zero_padding"] and c["err_vs_unpadded"] < 1e-5 and c["err_vs_torch_f64"] < 1e-5, c
    # the dispatch latency model across nodes (a prediction): auto is the committed table's pick, and
    # the hierarchical form moves fewer InfiniBand bytes than the flat gather at every token count
    d = s["dispatch"]
    assert d["tokens"] == [2 ** i for i in range(3, 14)]
    assert d["destinations"]["ep16_uniform"]["remote_nodes"] == pytest.approx(1.0, abs=1e-3)
    assert d["destinations"]["ep32_skewed"]["nodes"] < d["destinations"]["ep32_uniform"]["nodes"]
    for key, (ep, nodes) in (("ep16_nodes2", (16, 2)), ("ep32_nodes4", (32, 4))):
        series = d[key]
        assert series["pick"] == [ep_dispatch_choice.pick(ep, nodes, t) for t in d["tokens"]]
        for j in range(len(d["tokens"])):
            assert series["hierarchical"]["ib_bytes"][j] < series["gather"]["ib_bytes"][j]
            assert all(0 < series[f]["dispatch_s"][j] < series[f]["layer_s"][j]
                       for f in ("gather", "hierarchical", "all-to-all"))


def test_03_torch_crosscheck(executed):
    s = summary(executed("03_torch_crosscheck.ipynb"))
    rows = s["rows"]
    layouts = {r["layout"] for r in rows}
    assert len(layouts) >= 11
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "mxfp4"}
    tolerance = s["tolerance"]
    assert set(tolerance) == set(BAR) and tolerance["float32"] <= 1e-5
    # Checked against the project's bar here, whatever the notebook declares
    # (its own bfloat16 tolerance is 2e-2). Measured max: float32 6.3e-7,
    # bfloat16 6.4e-3, mxfp4 5.2e-7.
    for r in rows:
        assert math.isfinite(r["rel_err"]) and r["rel_err"] < BAR[r["dtype"]], r
        if r["dtype"] == "bfloat16":
            assert r["rel_err"] > 1e-5, r           # the bf16 run really rounds to bf16
    for layout in layouts:      # every layout, in every dtype, for the MoE layer
        assert {r["dtype"] for r in rows if r["layout"] == layout and r["layer"] == 1} == set(tolerance)


def test_04_training_and_load_balancing(executed):
    s = summary(executed("04_training_and_load_balancing.ipynb"))
    assert s["steps"] >= 200 and "sequence-parallel" in s["layout"] and "expert-parallel" in s["layout"]
    off, on = s["runs"]["without balancing"], s["runs"]["with balancing"]
    for run in (off, on):
        assert all(math.isfinite(v) for v in run.values()), run
        assert run["loss_first"] / run["loss_final"] > 5          # measured 8.8x / 8.2x
        assert run["imbalance_first"] > 3                         # measured 3.9
    assert on["imbalance_final"] < 2 < 3 < off["imbalance_final"]   # measured 1.6 vs 4.0
    assert off["idle_experts_final"] >= 8 and on["idle_experts_final"] == 0   # measured 10 vs 0
    assert on["bias_spread"] > off["bias_spread"]                 # only balancing moves the bias
    assert on["loss_final"] < 1.25 * off["loss_final"]
    # redundant experts (R = 8) placed for the load left at the end: never a busier device,
    # and a calmer one where the bias update did not even the load out
    for run in (off, on):
        assert run["device_imbalance_placed_r8"] <= run["device_imbalance_placed_r0"]
    assert off["device_imbalance_placed_r8"] < off["device_imbalance_placed_r0"]


# -- as a script: execute and keep the outputs -----------------------------------
def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Execute the notebooks on this machine and save executed copies.")
    p.add_argument("names", nargs="*", help="notebook file names (default: all)")
    p.add_argument("--output-dir", required=True, help="where the executed notebooks are written")
    args = p.parse_args(argv)
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names or sorted(NOTEBOOKS):
        name = pathlib.Path(name).name
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            nb = execute(name, workdir)
        nbformat.write(nb, out / name)
        print(f"{name}: {time.perf_counter() - t0:.0f} s -> {out / name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
