"""Write k3jax/data/shared_overlap_table.json: the whole-layer latency model's
fastest shared-expert form (k3jax.tools.layer_latency.auto_choice) for every
tabulated (layer, tp, dp) at every power-of-two token count up to
TOKEN_GRID's last, as token ranges. k3jax.layout.shared_overlap_choice reads it.

  python -m scripts.write_overlap_table            # rewrite the committed table
  python -m scripts.write_overlap_table --out PATH # write elsewhere

The pick at grid point 2^i holds for 2^i <= tokens < 2^(i + 1) (the last
for every larger count); consecutive equal picks are merged.
"""

from __future__ import annotations

import os
import sys
import time

from k3jax.config import K3, K3Config
from k3jax.tools.layer_latency import CHOICES, LAYERS, TIE_REL, AutoRow, hardware, sweep
from scripts import table_writer

COMMAND = "python -m scripts.write_overlap_table"
TABLE_PATH = os.path.join(table_writer.K3JAX_DATA, "shared_overlap_table.json")
TOKEN_GRID = table_writer.TOKEN_GRID
LAYOUTS = ((2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1))
"""(tp, dp): every SP + EP layout of one 8-GPU node with tp >= 2."""


def picks(cfg: K3Config = K3, layouts=LAYOUTS, grid=TOKEN_GRID, layers=LAYERS,
          log=lambda message: None) -> dict[tuple[str, int, int], list[AutoRow]]:
    """(layer, tp, dp) -> the auto row at every grid token count."""
    out = {}
    for layer in layers:
        for tp, dp in layouts:
            t0 = time.perf_counter()
            out[(layer, tp, dp)] = [sweep(cfg, tp, dp, t, layer=layer)[1] for t in grid]
            log(f"{layer} tp {tp} dp {dp}: {time.perf_counter() - t0:.1f} s")
    return out


def ranges(rows: list[AutoRow]) -> tuple[tuple[int, str, str], ...]:
    """(first token count, form, scatter dtype) per run of equal picks; the
    weights form's scatter dtype reads "float32" (it has no scatter)."""
    out: list[tuple[int, str, str]] = []
    for row in rows:
        entry = (row.tokens, row.form.value, row.scatter_dtype or "float32")
        if not out or out[-1][1:] != entry[1:]:
            out.append(entry)
    return tuple(out)


def render(table: dict[tuple[str, int, int], list[AutoRow]], cfg: K3Config = K3) -> str:
    """The table file's JSON text: the command that writes it, the header
    (model inputs, hardware figures), the token grid and a row per (layer,
    tp, dp): its picks and the model's ratio auto / replicated at every grid
    point."""
    hw = hardware()
    description = [
        "A row per (layer, tp, dp). picks: [[first token count, form, scatter dtype], ...], the",
        "whole-layer latency model's fastest shared-expert form (k3jax.tools.layer_latency, a",
        "model's prediction) among " + ", ".join(f"{f.value}/{s or '-'}" for f, s in CHOICES) + ";",
        f"a bf16 scatter only where it is more than {TIE_REL:.0%} faster. A pick holds from its",
        "first token count up to the next pick's. auto_over_replicated_model: the model's ratio",
        "auto / replicated at each token_grid count. k3jax.layout.shared_overlap_choice reads it.",
        "",
        f"Model: K3 (hidden {cfg.hidden_size}, shared width {cfg.shared_intermediate_size}, "
        f"dense width {cfg.intermediate_size}, {cfg.num_experts} experts, top {cfg.num_experts_per_token}),",
        "  SP + EP over dp x tp GPUs of one node, bf16 weights and activations.",
        f"Hardware ({hw['name']}): dense bf16 {hw['dense_bf16_flops_per_s']:.4g} FLOP/s, HBM copy "
        f"{hw['hbm_copy_bytes_per_s']:.4g} B/s,",
        f"  NVLink bus {hw['nvlink_bus_bytes_per_s']:.4g} B/s, {hw['collective_latency_s']:.3g} s a "
        f"collective, {hw['collective_sms']} of {hw['num_sms']} SMs a collective.",
    ]
    rows = [{"layer": layer, "tp": tp, "dp": dp, "picks": [list(pick) for pick in ranges(layout_rows)],
             "auto_over_replicated_model": [round(r.ratio, 3) for r in layout_rows]}
            for (layer, tp, dp), layout_rows in table.items()]
    return table_writer.render_json({"generated_by": COMMAND, "description": description,
                                     "token_grid": [r.tokens for r in next(iter(table.values()))],
                                     "table": rows},
                                    one_item_a_line=("description", "table"))


def write(path: str = TABLE_PATH, log=print) -> str:
    """Run the model over every tabulated layout and write the table to ``path``."""
    return table_writer.write_timed(path, lambda: render(picks(log=log)), log)


def main(argv=None) -> int:
    return table_writer.main(write, __doc__.split("\n\n")[0], TABLE_PATH, argv)


if __name__ == "__main__":
    sys.exit(main())
