"""K3's MoE layer compiled for 2 x 8 and 4 x 8 H200s without a GPU, in every
EP dispatch form: per-device memory from the compiler and the collectives'
bytes by where they run (across nodes, or inside a node), written as the
table benchmarks/results/compiled_nodes_h200.md.

    PYTHONPATH=$PWD python -m benchmarks.compiled_nodes [--tokens 256 8192] [--nodes 2 4]

Each cell is one ``k3jax.tools.compile.compile_layer`` (what ``k3jax compile
--nodes N --dp N --tp 8 --sequence-parallel --expert-parallel --ep-dispatch
FORM --expert-dtype mxfp4 --backend xla`` runs). Compiler output, not times:
the bytes a form puts on the inter-node link are the sum, over the
collectives whose replica groups span the node axis, of each one's full
buffer (for ragged all-to-all, the worst-case buffer it is compiled with;
what it sends depends on the routing).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from k3jax.config import K3
from k3jax.files import atomic_write
from k3jax.layout import NODE, EpDispatch, ParallelConfig
from k3jax.tools.compile import compile_layer

RESULT = Path(__file__).resolve().parent / "results" / "compiled_nodes_h200.md"
FORMS = (EpDispatch.GATHER, EpDispatch.HIERARCHICAL, EpDispatch.ALL_TO_ALL)
GB = 1e9


def row(nodes: int, form: EpDispatch, tokens: int) -> dict:
    """One cell: the compiled report's figures for K3 layer 1, MXFP4 experts."""
    parallel = ParallelConfig(dp=nodes, tp=8, nodes=nodes, sequence_parallel=True,
                              expert_parallel=True, ep_dispatch=form)
    r = compile_layer(K3, parallel, 1, tokens=tokens, backend="xla", dtype="bfloat16",
                      expert_dtype="mxfp4")
    across = [c for c, axes in zip(r.collectives, r.axes_of_collectives()) if NODE in axes]
    return {"nodes": nodes, "ep": parallel.ep, "form": form.value, "tokens": tokens,
            "weights": r.per_device_bytes["weights"],
            "temporaries": r.per_device_bytes["temporaries"],
            "needed": r.needed_bytes, "fits": r.needed_bytes <= r.device_memory_bytes,
            "collectives": len(r.collectives), "across": len(across),
            "across_bytes": sum(c.bytes for c in across),
            "inside_bytes": sum(c.bytes for c in r.collectives) - sum(c.bytes for c in across),
            "kinds_across": sorted({c.kind for c in across}),
            "seconds": r.compile_seconds}


def table(rows: list[dict]) -> str:
    lines = [
        "# K3 MoE layer 1 compiled for several H200 nodes (no GPU)",
        "",
        f"Written by `python -m benchmarks.compiled_nodes` on {datetime.date.today()}, jax 0.11.2,",
        "deviceless compile (XLA's GPU pipeline for the compile-only topologies 1x2x8 / 1x4x8,",
        "one host a node), XLA backend, bf16 activations, MXFP4 routed experts, SP + EP over",
        "dp = nodes, tp 8. Compiler output, not times. Bytes per device; 'across' is every",
        "collective whose replica groups span the node axis, at its full buffer (ragged",
        "all-to-all: the worst-case buffer; the routing decides what is sent).",
        "",
        "| nodes | EP | tokens | form | weights GB | temporaries GB | needed GB (all layers) | fits | "
        "collectives | across nodes | bytes across nodes | bytes inside a node | kinds across |",
        "|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['ep']} | {r['tokens']} | {r['form']} | {r['weights'] / GB:.3f} | "
            f"{r['temporaries'] / GB:.3f} | {r['needed'] / GB:.2f} | {r['fits']} | "
            f"{r['collectives']} | {r['across']} | {r['across_bytes']:,} | {r['inside_bytes']:,} | "
            f"{', '.join(r['kinds_across'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_nodes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    p.add_argument("--output", type=Path, default=RESULT)
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error("--tokens: every token count must be >= 1")
    rows = []
    cells = [(n, f, t) for n in args.nodes for t in args.tokens for f in FORMS]
    for i, (nodes, form, tokens) in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {nodes} nodes, {form.value}, {tokens} tokens", file=sys.stderr,
              flush=True)
        rows.append(row(nodes, form, tokens))
    text = table(rows)
    atomic_write(str(args.output), lambda f: f.write(text), mode="w")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
