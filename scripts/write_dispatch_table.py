"""Write k3jax/data/ep_dispatch_table.json: the dispatch latency model's fastest
way to move routed rows under expert parallelism
(k3jax.tools.dispatch_latency.auto_form, uniform routing) for every tabulated
(ep, nodes) at every power-of-two token count up to TOKEN_GRID's last, as
token ranges. k3jax.layout.ep_dispatch_choice reads it.

  python -m scripts.write_dispatch_table            # rewrite the committed table
  python -m scripts.write_dispatch_table --out PATH # write elsewhere

The pick at grid point 2^i holds for 2^i <= tokens < 2^(i + 1) (the last
for every larger count); consecutive equal picks are merged.
"""

from __future__ import annotations

import os
import sys
import time

from k3jax.config import K3, K3Config
from k3jax.tools.dispatch_latency import FORMS, TIE_REL, DispatchEstimate, hardware, sweep
from k3jax.tools.ep_destinations import UNIFORM
from scripts import table_writer

COMMAND = "python -m scripts.write_dispatch_table"
TABLE_PATH = os.path.join(table_writer.K3JAX_DATA, "ep_dispatch_table.json")
TOKEN_GRID = table_writer.TOKEN_GRID
LAYOUTS = ((8, 1), (16, 2), (32, 4), (64, 8))
"""(ep, nodes): one 8-GPU node, and 8 GPUs a node over 2, 4 and 8 nodes."""

Row = tuple[int, str, dict[str, DispatchEstimate]]     # (tokens, pick, {form: estimate})


def picks(cfg: K3Config = K3, layouts=LAYOUTS, grid=TOKEN_GRID,
          log=lambda message: None) -> dict[tuple[int, int], list[Row]]:
    """(ep, nodes) -> (tokens, auto pick, every form's estimate) at every
    grid token count, uniform routing."""
    out = {}
    for ep, nodes in layouts:
        t0 = time.perf_counter()
        rows = []
        for tokens in grid:
            ests, pick = sweep(cfg, ep, nodes, tokens, UNIFORM)
            rows.append((tokens, pick, ests))
        out[(ep, nodes)] = rows
        log(f"ep {ep} over {nodes} node(s): {time.perf_counter() - t0:.1f} s")
    return out


def ranges(rows: list[Row]) -> tuple[tuple[int, str], ...]:
    """(first token count, form) per run of equal picks."""
    out: list[tuple[int, str]] = []
    for tokens, pick, _ in rows:
        if not out or out[-1][1] != pick:
            out.append((tokens, pick))
    return tuple(out)


def render(table: dict[tuple[int, int], list[Row]], cfg: K3Config = K3) -> str:
    """The table file's JSON text: the command that writes it, the header
    (model inputs, hardware figures), the token grid and a row per layout:
    its picks and the model's layer microseconds per form at every grid point."""
    hw = hardware()
    description = [
        "A row per (ep, nodes). picks: [[first token count, form], ...], the dispatch latency",
        "model's fastest way to move the routed rows (k3jax.tools.dispatch_latency, a model's",
        "prediction, uniform routing) among " + ", ".join(FORMS) + " (hierarchical only over",
        f"several nodes); a form later in that list only where it is more than {TIE_REL:.0%}",
        "faster. A pick holds from its first token count up to the next pick's.",
        "layer_us_model: the model's layer microseconds per form at each token_grid count.",
        "k3jax.layout.ep_dispatch_choice reads it.",
        "",
        f"Model: K3 (latent {cfg.routed_expert_hidden_size}, {cfg.num_experts} experts, top "
        f"{cfg.num_experts_per_token}), SP + EP, bf16 rows,",
        "  the replicated shared expert the only work the transfers hide under.",
        f"Hardware ({hw['name']}): NVLink bus {hw['nvlink_bus_bytes_per_s']:.4g} B/s, "
        f"InfiniBand {hw['ib_bus_bytes_per_s']:.4g} B/s a NIC,",
        f"  {hw['nics_per_node']} NICs and {hw['gpus_per_node']} GPUs a node; ring latency "
        f"{hw['ring_base_latency_s']:.3g} s + {hw['nvlink_step_latency_s']:.3g} s an NVLink step,",
        f"  {hw['ib_step_latency_s']:.3g} s an inter-node step ({hw['ib_lone_step_latency_s']:.3g} s "
        f"with one rank a node), >= {hw['net_step_floor_s']:.3g} s a step across nodes.",
    ]
    rows = []
    for (ep, nodes), layout_rows in table.items():
        forms = [f for f in FORMS if f in layout_rows[0][2]]
        rows.append({"ep": ep, "nodes": nodes,
                     "picks": [list(pick) for pick in ranges(layout_rows)],
                     "layer_us_model": {f: [round(ests[f].layer_s * 1e6) for _, _, ests in layout_rows]
                                        for f in forms}})
    return table_writer.render_json({"generated_by": COMMAND, "description": description,
                                     "token_grid": [t for t, _, _ in next(iter(table.values()))],
                                     "table": rows},
                                    one_item_a_line=("description", "table"))


def write(path: str = TABLE_PATH, log=print) -> str:
    """Run the model over every tabulated layout and write the table to ``path``."""
    return table_writer.write_timed(path, lambda: render(picks(log=log)), log)


def main(argv=None) -> int:
    return table_writer.main(write, __doc__.split("\n\n")[0], TABLE_PATH, argv)


if __name__ == "__main__":
    sys.exit(main())
