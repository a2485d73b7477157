"""Max / mean tokens per device and per node under expert parallelism,
before and after balancing with redundant experts
(k3jax.layout.expert_placement.place_experts), counted on the CPU: (token,
expert) rows, not times.

    PYTHONPATH=$PWD python -m benchmarks.expert_balance [--skip-notebook]

Layouts: EP 16 and EP 32 (2 and 4 nodes of 8 devices), R = 0 / 16 / 32 / 64
redundant slots (a cell whose E + R does not divide over the devices is
"n/a"). "Before" is the layout without redundancy (device d holds experts
[d E/ep, (d + 1) E/ep)); "after" the placement the balancer computes from a
MEASURED sample of tokens, then evaluated on FRESH tokens of the same
routing: every (row, expert) pair of the fresh tokens goes to the slot
``replica_choice`` picks (global row index mod replica count) and the rows
each device and node receives are counted exactly.

Routing sources:

  zipf s    K3's 896 experts, top 16. Each expert has a selection bias
            -s ln(rank + 1), the ranks a fixed random permutation of the
            experts (seed 0); each token takes the top 16 of bias + Gumbel
            noise, i.e. 16 distinct experts drawn without replacement with
            probability proportional to (rank + 1)^-s (Zipf, exponent s).
            Measured on 16384 tokens (seed 1), evaluated on 16384 (seed 2).
  nb04      the router that notebooks/04_training_and_load_balancing.ipynb
            trains, its loop reproduced here at the notebook's size (TINY: 16
            experts, top 4; MoE layer 1 on 8 simulated CPU devices, SP + EP +
            the sharded shared expert; 200 Adam steps of 64 fresh tokens that
            share one direction, learning rate 3e-3), once without the bias
            update (gamma 0) and once with it (gamma 0.01). The trained router
            and bias route 64 fresh batches (measured) and 64 more (evaluated).
            With 16 experts, EP 32 exists only at R = 16.

Writes benchmarks/results/expert_balance.md (the table) and
benchmarks/results/expert_balance.png (rows per device, before and after).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
TABLE, FIGURE = RESULTS / "expert_balance.md", RESULTS / "expert_balance.png"
LAYOUTS = ((16, 2), (32, 4))           # (ep, nodes): 8 devices a node
REDUNDANT = (0, 16, 32, 64)
ZIPF_S = (1.0, 0.5)
TOKENS = 16384
K3_E, K3_K = 896, 16
TARGET = 1.10                          # EP 16, R 32, zipf s 1.0: max / mean per device


def zipf_ids(s: float, tokens: int, seed: int, num_experts: int = K3_E, k: int = K3_K,
             ranks_seed: int = 0) -> np.ndarray:
    """[tokens, k] distinct expert ids a row (module docstring, "zipf s")."""
    ranks = np.random.default_rng(ranks_seed).permutation(num_experts)
    out = np.empty((tokens, k), np.int64)
    rng = np.random.default_rng(seed)
    for start in range(0, tokens, 4096):          # 4096 x 896 noise at a time
        n = min(4096, tokens - start)
        g = rng.gumbel(size=(n, num_experts)) - s * np.log(ranks + 1.0)
        out[start:start + n] = np.argpartition(-g, k, axis=1)[:, :k]
    return out


def notebook_ids(batches: int = 64) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{run: (measured ids, evaluated ids)}: notebook 04's training loop
    reproduced (its cells 4 and 5), then its trained router and bias routing
    2 x ``batches`` fresh batches of its tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax import TINY, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
    from k3jax.cli.common import pick_devices
    from k3jax.grads import split_trainable
    from k3jax.ops import route

    cfg = TINY
    parallel = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                              shard_shared_expert=True)
    mesh = make_mesh(parallel, pick_devices(8))
    layout = make_layout(cfg, parallel, mesh, backend="xla")
    steps, tokens, lr, offset = 200, 64, 3e-3, 1.5
    E, K, D = cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size
    student = build_layer(layout, 1, mesh, source=RandomSource(1))
    teacher = build_layer(layout, 1, mesh, source=RandomSource(2))
    graphdef, params0, frozen0 = split_trainable(student)
    teacher_graph, teacher_state = nnx.split(teacher)
    mu_D = offset * np.asarray(jax.random.normal(jax.random.key(3), (D,)))

    def batch(key):
        x_TD = jax.random.normal(key, (tokens, D)) + mu_D
        return x_TD, nnx.merge(teacher_graph, teacher_state)(x_TD)

    def ids_of(params, bias_E, x_TD):
        return route(x_TD, params["router_DE"].get_value(), bias_E, cfg)[0]

    @jax.jit
    def train(gamma, keys):
        def step(carry, key):
            params, m, v, bias_E, t = carry
            x_TD, y_TD = batch(key)
            frozen = jax.tree.map(lambda _: bias_E, frozen0)

            def loss_fn(params):
                out_TD = nnx.merge(graphdef, params, frozen)(x_TD)
                return jnp.mean((out_TD - y_TD) ** 2) / jnp.mean(y_TD ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            t = t + 1
            m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
            v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
            params = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - 0.9 ** t))
                                  / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8), params, m, v)
            ids_TK = ids_of(params, bias_E, x_TD)
            load_E = jnp.zeros(E).at[ids_TK.reshape(-1)].add(1.0) * E / (tokens * K)
            bias_E = bias_E + gamma * jnp.sign(1.0 - load_E)
            return (params, m, v, bias_E, t), loss

        zeros = jax.tree.map(jnp.zeros_like, params0)
        bias0 = jax.tree.leaves(frozen0)[0]
        (params, _, _, bias_E, _), loss = jax.lax.scan(step, (params0, zeros, zeros, bias0, 0),
                                                       keys)
        return params, bias_E, loss

    @jax.jit
    def route_batches(params, bias_E, keys):
        return jax.vmap(lambda key: ids_of(params, bias_E, batch(key)[0]))(keys)

    keys = jax.random.split(jax.random.key(0), steps)      # the notebook's batches
    fresh = jax.random.split(jax.random.key(100), 2 * batches)
    out = {}
    for name, gamma in (("nb04, no balancing", 0.0), ("nb04, bias balancing", 0.01)):
        params, bias_E, loss = train(gamma, keys)
        ids = np.asarray(route_batches(params, bias_E, fresh)).reshape(2, -1, K)
        print(f"  {name}: loss {float(loss[0]):.3f} -> {float(loss[-20:].mean()):.3f}",
              file=sys.stderr)
        out[name] = (ids[0], ids[1])
    return out


def count(placement, ids_TK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows per device [ep], rows per node [nodes]) of ``ids_TK`` routed by
    replica_choice over ``placement`` (global row index = row in ids_TK)."""
    import jax.numpy as jnp

    from k3jax.layout.expert_placement import replica_choice

    table, cnt = placement.replica_arrays()
    slots = np.asarray(replica_choice(jnp.asarray(ids_TK), jnp.arange(ids_TK.shape[0]),
                                      jnp.asarray(table), jnp.asarray(cnt)))
    dev = np.bincount(slots.ravel() // placement.slots_per_device, minlength=placement.ep)
    return dev, dev.reshape(placement.nodes, -1).sum(1)


def ratio(x: np.ndarray) -> float:
    return float(x.max() / x.mean())


def cells(source: str, measured: np.ndarray, evaluated: np.ndarray, E: int) -> list[dict]:
    """One row per (layout, R): before / after max / mean per device and node."""
    from k3jax.layout import expert_placement as xp

    load = np.bincount(measured.ravel(), minlength=E)
    rows = []
    for ep, nodes in LAYOUTS:
        before = (count(xp.uniform_placement(E, 0, ep, nodes), evaluated)
                  if E % ep == 0 else None)
        for R in REDUNDANT:
            row = {"source": source, "ep": ep, "nodes": nodes, "R": R, "E": E,
                   "before": before, "after": None}
            if (E + R) % ep == 0:
                placement = xp.place_experts(load, R, nodes, ep)
                row["after"] = count(placement, evaluated)
            rows.append(row)
    return rows


def fmt(pair, i: int) -> str:
    return "n/a" if pair is None else f"{ratio(pair[i]):.3f}"


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Expert balance: max / mean (token, expert) rows per device and node",
        "",
        f"Counts of rows on the CPU, not times. Generated by `{meta['command']}` on "
        f"{meta['date']} ({meta['seconds']:.0f} s). Before: the layout without redundancy. "
        "After: `place_experts` on a measured sample, evaluated on fresh tokens routed by "
        "`replica_choice`. n/a: E + R does not divide over the devices (or, before, E does "
        "not). Sources: benchmarks/expert_balance.py's docstring.",
        "",
        "| routing | EP (nodes x 8) | R | per device before | per device after | "
        "per node before | per node after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['source']} | {r['ep']} ({r['nodes']} x 8) | {r['R']} | "
                     f"{fmt(r['before'], 0)} | {fmt(r['after'], 0)} | {fmt(r['before'], 1)} | "
                     f"{fmt(r['after'], 1)} |")
    lines += ["", meta["target"], ""]
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    """Rows per device over the mean, before and after, for the cells that
    show the effect best: zipf s 1.0 at EP 16 and EP 32 with R = 32, and
    notebook 04's router without balancing at EP 16 (R = 16) and EP 32 (R = 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = [("zipf s=1.0", 16, 32), ("zipf s=1.0", 32, 32),
              ("nb04, no balancing", 16, 16), ("nb04, no balancing", 32, 16)]
    picked = [next((r for r in rows if (r["source"], r["ep"], r["R"]) == w), None) for w in wanted]
    picked = [r for r in picked if r is not None and r["after"] is not None]
    cols = 2
    rows_ = -(-len(picked) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(11, 3.6 * rows_), squeeze=False)
    for ax in axes.flat[len(picked):]:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, picked):
        ep = r["ep"]
        x = np.arange(ep)
        after = r["after"][0] / r["after"][0].mean()
        if r["before"] is not None:
            before = r["before"][0] / r["before"][0].mean()
            ax.bar(x - 0.2, before, 0.4, label=f"before (R 0) {before.max():.2f}", color="C3")
        ax.bar(x + 0.2, after, 0.4, label=f"after (R {r['R']}) {after.max():.2f}", color="C0")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        for n in range(1, r["nodes"]):
            ax.axvline(n * 8 - 0.5, color="grey", lw=0.8)
        ax.set_title(f"{r['source']}, EP {ep} ({r['nodes']} x 8)", fontsize=9)
        ax.set_xlabel("device (node boundaries: grey)")
        ax.legend(fontsize=7, title="max / mean", title_fontsize=7)
    for row in axes:
        row[0].set_ylabel("rows per device / mean")
    fig.suptitle("(token, expert) rows per device on fresh tokens, before and after balancing "
                 "(counts, CPU)", fontsize=9)
    fig.tight_layout()
    from k3jax.files import atomic_write

    atomic_write(str(path), lambda f: fig.savefig(f, format="png", dpi=110))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-notebook", action="store_true", help="only the synthetic skew")
    p.add_argument("--out", type=Path, default=TABLE, help="the table (the figure beside it)")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)     # before any backend starts (notebook 04's mesh)
    t0 = time.perf_counter()
    rows = []
    for s in ZIPF_S:
        measured, evaluated = zipf_ids(s, TOKENS, 1), zipf_ids(s, TOKENS, 2)
        rows += cells(f"zipf s={s}", measured, evaluated, K3_E)
    if not args.skip_notebook:
        for name, (measured, evaluated) in notebook_ids().items():
            rows += cells(name, measured, evaluated, 16)
    target = next(r for r in rows if (r["source"], r["ep"], r["R"]) == ("zipf s=1.0", 16, 32))
    got = ratio(target["after"][0])
    meta = {"command": "PYTHONPATH=$PWD python -m benchmarks.expert_balance",
            "date": datetime.date.today().isoformat(), "seconds": time.perf_counter() - t0,
            "target": f"Target: <= {TARGET} per device at EP 16, R 32, zipf s 1.0: "
                      f"{got:.3f} ({'met' if got <= TARGET else 'missed'})."}
    from k3jax.files import atomic_write

    text = render(rows, meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(str(args.out), lambda f: f.write(text), mode="w")
    figure(rows, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)
    return 0 if got <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
