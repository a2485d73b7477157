"""Write pallas_kernels/data/tile_table.json: the tile search's pick
(k3jax.tools.tile_search) for every shape of TABLE_INPUTS.

  python -m scripts.write_tile_table            # rewrite the committed table
  python -m scripts.write_tile_table --out PATH # write elsewhere

Inputs: the K3 shapes the benchmarks run (benchmarks.cases' grouped
and MLP sweeps, at every power-of-two token count up to 16384 so that M
buckets are dense, and the shared / dense MLP widths at tp 1, 4, 8), the tiny
preset's on up to 8 devices, and the launcher-dispatched shapes of
benchmarks/gpu_kernel_checks.py, with the search's targets
(tile_search.TARGETS) and the hardware numbers (pallas_kernels.hardware.H200),
all named in the table's header.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax.numpy as jnp

from k3jax.config import K3, TINY, K3Config
from k3jax.tools import kernel_cost
from k3jax.tools.tile_search import TARGETS, SearchTargets, best_grouped_config, best_mlp_config
from pallas_kernels.grouped_matmul import tile_choice
from scripts import table_writer

COMMAND = "python -m scripts.write_tile_table"
TABLE_PATH = os.path.join(table_writer.PALLAS_KERNELS_DATA, "tile_table.json")
KEY_FIELDS = ("op", "m_bucket", "k", "n", "groups", "num_weights", "dtype")
"""The fields of a row's key, in order."""


def _powers_of_two(count: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(count))


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """One model's launches. Grouped: the routed experts' gate/up (K = latent,
    N = intermediate / expert_tp, two weights) and down (K and N swapped, one
    weight), tokens x top_k rows over num_experts / ep groups. MLP: x [tokens,
    hidden] @ [hidden, F / tp] for F in mlp_widths (shared experts, dense layer)."""

    name: str
    latent: int
    inter: int
    num_experts: int
    top_k: int
    hidden: int
    mlp_widths: tuple[int, ...]
    eps: tuple[int, ...]
    expert_tps: tuple[int, ...]
    tokens: tuple[int, ...]
    mlp_tps: tuple[int, ...]
    mlp_tokens: tuple[int, ...]

    @classmethod
    def of(cls, name: str, cfg: K3Config, **shards) -> ModelShapes:
        return cls(name=name, latent=cfg.routed_expert_hidden_size, inter=cfg.moe_intermediate_size,
                   num_experts=cfg.num_experts, top_k=cfg.num_experts_per_token,
                   hidden=cfg.hidden_size,
                   mlp_widths=(cfg.shared_intermediate_size, cfg.intermediate_size), **shards)

    def grouped_keys(self, dtype: str) -> list[tuple]:
        keys = []
        for ep in self.eps:
            for tp in self.expert_tps:
                inter = self.inter // tp
                for k, n, w in ((self.latent, inter, 2), (inter, self.latent, 1)):
                    keys += [("grouped", t * self.top_k, k, n, self.num_experts // ep, w, dtype)
                             for t in self.tokens]
        return keys

    def mlp_keys(self, dtype: str) -> list[tuple]:
        return [("mlp", t, self.hidden, width // tp, 1, 2, dtype)
                for width in self.mlp_widths for tp in self.mlp_tps for t in self.mlp_tokens]

    def describe(self) -> list[str]:
        return [f"  {self.name}: latent {self.latent}, intermediate {self.inter} / expert tp "
                f"{list(self.expert_tps)}, {self.num_experts} experts / EP {list(self.eps)}, "
                f"top_k {self.top_k}; tokens {list(self.tokens)} (M = tokens x top_k);",
                f"    MLP hidden {self.hidden}, widths {list(self.mlp_widths)} / tp "
                f"{list(self.mlp_tps)}, tokens {list(self.mlp_tokens)}"]


# The benchmarks' K3 shapes (the device sweep runs EP 8 / 16 / 32 and tp 1 / 4 / 8).
K3_SHAPES = ModelShapes.of("K3", K3, eps=(8, 16, 32), expert_tps=(1,), tokens=_powers_of_two(15),
                           mlp_tps=(1, 4, 8), mlp_tokens=_powers_of_two(15))
# The tiny preset the CLI and the layout tests run, on up to 8 devices.
TINY_SHAPES = ModelShapes.of("TINY", TINY, eps=(1, 2, 4, 8), expert_tps=(1, 2, 4, 8),
                             tokens=_powers_of_two(9), mlp_tps=(1, 2, 4, 8),
                             mlp_tokens=_powers_of_two(9))


@dataclasses.dataclass(frozen=True)
class TableInputs:
    """The shapes the table holds: each model's (ModelShapes) in every dtype,
    and the kernel check cases' rows (extra_grouped: (M, K, N, groups,
    num_weights, dtype); extra_mlp: (tokens, D, F, dtype))."""

    models: tuple[ModelShapes, ...] = (K3_SHAPES, TINY_SHAPES)
    dtypes: tuple[str, ...] = ("bfloat16",)
    extra_grouped: tuple[tuple[int, int, int, int, int, str], ...] = (
        *((300, 256, 256, 8, w, d) for w in (1, 2) for d in ("bfloat16", "float32")),
        (40, 256, 256, 4, 1, "bfloat16"),
        *((120, 96, 80, 4, 2, d) for d in ("bfloat16", "float32")),
        *((1024, 512, 512, 4, w, d) for w in (1, 2) for d in ("bfloat16", "float32")),
        (4096, 1024, 8192, 8, 1, "bfloat16"),
        (2048, 1024, 4096, 64, 2, "bfloat16"),
    )
    extra_mlp: tuple[tuple[int, int, int, str], ...] = (
        (40, 256, 192, "bfloat16"), (40, 256, 192, "float32"), (512, 512, 256, "bfloat16"),
        (8, 7168, 768, "bfloat16"),
    )

    def grouped_keys(self) -> list[tuple]:
        """Table keys ("grouped", M, K, N, groups, num_weights, dtype)."""
        keys = [key for d in self.dtypes for model in self.models for key in model.grouped_keys(d)]
        keys += [("grouped", *row) for row in self.extra_grouped]
        return list(dict.fromkeys(keys))

    def mlp_keys(self) -> list[tuple]:
        """Table keys ("mlp", tokens, D, F, 1, 2, dtype)."""
        keys = [key for d in self.dtypes for model in self.models for key in model.mlp_keys(d)]
        keys += [("mlp", t, dd, f, 1, 2, d) for t, dd, f, d in self.extra_mlp]
        return list(dict.fromkeys(keys))


INPUTS = TableInputs()


def search(key: tuple, targets: SearchTargets = TARGETS) -> dict:
    """The search's pick for one table key, as the table's entry."""
    op, m, k, n, groups, num_weights, dtype = key
    if op == "mlp":
        cfg = best_mlp_config(m, k, n, dtype=jnp.dtype(dtype), targets=targets)
        return {"kernel": tile_choice.MLP, **dataclasses.asdict(cfg)}
    cfg = best_grouped_config(m, k, n, groups, num_weights, dtype, targets)
    if cfg is None:
        return {"kernel": tile_choice.ROW_MAJOR}
    return {"kernel": tile_choice.SWAP_AB, **dataclasses.asdict(cfg)}


def header(inputs: TableInputs, targets: SearchTargets) -> list[str]:
    """The table file's description lines: what a row holds, the inputs,
    targets and hardware numbers."""
    hw = kernel_cost.H200
    return [
        "Shape key -> launch config for the grouped and MLP launchers",
        "(pallas_kernels/grouped_matmul/tile_choice.py reads it). A row: {'key': [op, M bucket,",
        "K, N, groups, num_weights, dtype], 'entry': {'kernel': 'row_major' | 'swap_ab' | 'mlp',",
        "**the config's fields}}.",
        "",
        "Inputs:",
        *[line for model in inputs.models for line in model.describe()],
        f"  dtypes {list(inputs.dtypes)}",
        f"  kernel check shapes: grouped {[list(r) for r in inputs.extra_grouped]}",
        f"    mlp {[list(r) for r in inputs.extra_mlp]}",
        f"  proxy routings: numpy default_rng seeds {list(targets.proxy_seeds)} (uniform",
        "    multinomial draws of the M rows over the groups)",
        f"Targets: {dataclasses.asdict(targets)}",
        f"Hardware ({hw.name}): {hw.num_sms} SMs, dense bf16 {hw.dense_bf16_flops_per_s:.4g} FLOP/s,",
        f"  HBM copy {hw.hbm_copy_bytes_per_s:.4g} B/s, {hw.sm_lane_ops_per_s:.4g} lane ops/s a SM,",
        f"  tile overhead {kernel_cost.TILE_OVERHEAD_S:.3g} s",
    ]


def render(entries: dict[tuple, dict], inputs: TableInputs, targets: SearchTargets) -> str:
    """The table file's JSON text: the command that writes it, the header,
    the key's fields and a row per key, in ``entries``' order."""
    return table_writer.render_json({
        "generated_by": COMMAND, "description": header(inputs, targets),
        "key_fields": list(KEY_FIELDS),
        "tiles": [{"key": list(key), "entry": entry} for key, entry in entries.items()]},
        one_item_a_line=("description", "tiles"))


def write(path: str = TABLE_PATH, inputs: TableInputs = INPUTS, targets: SearchTargets = TARGETS,
          log=print) -> dict[tuple, dict]:
    """Run the search over every key of ``inputs`` and write the table to ``path``."""
    entries = {}
    t0 = time.perf_counter()
    for key in inputs.grouped_keys() + inputs.mlp_keys():
        t1 = time.perf_counter()
        entries[key] = search(key, targets)
        log(f"{key}: {entries[key]['kernel']} ({time.perf_counter() - t1:.1f} s)")
    table_writer.write_source(path, render(entries, inputs, targets))
    log(f"wrote {len(entries)} rows to {path} in {time.perf_counter() - t0:.0f} s")
    return entries


def main(argv=None) -> int:
    return table_writer.main(write, __doc__.split("\n\n")[0], TABLE_PATH, argv)


if __name__ == "__main__":
    sys.exit(main())
