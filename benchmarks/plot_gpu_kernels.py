"""Plot a benchmarks.kernel_sweep result against its targets.

  python -m benchmarks.plot_gpu_kernels gpu.json -o gpu.png

Three panels, each with its target drawn in:
  1. grouped matmuls, % of the measured dense bf16 rate vs tokens, kernel
     (solid) and jax.lax.ragged_dot (dashed), per op and EP; target 70%;
  2. the same runs' weight-read bandwidth, % of the measured copy rate, at the
     small (decode) token counts; target 60%;
  3. fused MLP up-projection speedup over unfused XLA vs tokens, per tp;
     target > 1.
Rows that were skipped or failed are left out of the lines and counted in
the title. Needs matplotlib (present here, maybe not on the GPU machine):
plot after fetching the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.bench_report import write_atomically

PREFILL_TARGET_PCT = 70.0
DECODE_TARGET_PCT = 60.0


def load_result(path: str) -> dict:
    """The JSON benchmarks.kernel_sweep wrote; ValueError naming what is missing."""
    with open(path) as f:
        try:
            result = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e})") from None
    missing = [k for k in ("meta", "ceilings", "grouped", "mlp") if k not in result]
    if missing or result["ceilings"] is None:
        raise ValueError(f"{path} is not a benchmarks.kernel_sweep result "
                         f"(missing: {missing or ['ceilings']})")
    return result


def measured(rows: list[dict]) -> list[dict]:
    """Rows with a kernel timing (not skipped, not failed)."""
    return [r for r in rows if "kernel" in r]


def plot(result: dict, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, ceil = result["meta"], result["ceilings"]
    grouped, mlp = measured(result["grouped"]), measured(result["mlp"])
    left_out = len(result["grouped"]) + len(result["mlp"]) - len(grouped) - len(mlp)
    fig, (ax_rate, ax_bw, ax_mlp) = plt.subplots(1, 3, figsize=(17, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    series = sorted({(r["op"], r["ep"]) for r in grouped})
    for i, (op, ep) in enumerate(series):
        rows = sorted((r for r in grouped if (r["op"], r["ep"]) == (op, ep)),
                      key=lambda r: r["tokens"])
        color = colors[i % len(colors)]
        tokens = [r["tokens"] for r in rows]
        ax_rate.plot(tokens, [r["kernel"]["pct_dense"] for r in rows], "o-", color=color,
                     label=f"{op} EP {ep}")
        with_xla = [r for r in rows if "xla" in r]
        ax_rate.plot([r["tokens"] for r in with_xla], [r["xla"]["pct_dense"] for r in with_xla],
                     "x--", color=color, alpha=0.6)
        small = [r for r in rows if r["small"]]
        ax_bw.plot([r["tokens"] for r in small], [r["kernel"]["pct_copy"] for r in small], "o-",
                   color=color, label=f"{op} EP {ep}")
    ax_rate.axhline(PREFILL_TARGET_PCT, color="k", lw=0.8, ls=":",
                    label=f"target {PREFILL_TARGET_PCT:.0f}% (prefill)")
    ax_rate.set(xscale="log", xlabel="tokens (rows = tokens x top-k)", ylabel="% of dense bf16 matmul",
                title=f"grouped matmul vs dense {ceil['matmul_tflops']:.3g} TFLOP/s\n"
                      "solid: kernel, dashed: ragged_dot")
    ax_bw.axhline(DECODE_TARGET_PCT, color="k", lw=0.8, ls=":",
                  label=f"target {DECODE_TARGET_PCT:.0f}%")
    ax_bw.set(xscale="log", xlabel="tokens", ylabel="% of copy bandwidth (weights read)",
              title=f"decode: weight streaming vs copy {ceil['copy_tbps']:.3g} TB/s")
    for i, tp in enumerate(sorted({r["tp"] for r in mlp})):
        rows = sorted((r for r in mlp if r["tp"] == tp and "speedup" in r), key=lambda r: r["tokens"])
        ax_mlp.plot([r["tokens"] for r in rows], [r["speedup"] for r in rows], "o-",
                    color=colors[i % len(colors)], label=f"tp {tp} (F = {rows[0]['F'] if rows else '?'})")
    ax_mlp.axhline(1.0, color="k", lw=0.8, ls=":", label="XLA (target: above)")
    ax_mlp.set(xscale="log", xlabel="tokens", ylabel="speedup over unfused XLA",
               title="fused MLP up-projection (situ_mlp_up)")
    for ax, rows in ((ax_rate, grouped), (ax_bw, [r for r in grouped if r["small"]]), (ax_mlp, mlp)):
        ticks = sorted({r["tokens"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    suffix = "" if meta.get("complete") else ", incomplete run"
    fig.suptitle(f"{meta['gpu']}, jax {meta['jax_version']}, {meta['date']}{suffix}"
                 + (f" ({left_out} rows skipped or failed)" if left_out else ""))
    fig.tight_layout()
    try:
        write_atomically(out_path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="the JSON written by python -m benchmarks.kernel_sweep --json")
    p.add_argument("-o", "--output", required=True, metavar="PNG", help="the plot to write")
    args = p.parse_args(argv)
    if not os.path.isfile(args.result):
        p.error(f"result {args.result}: no such file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        p.error(f"--output {args.output}: the folder does not exist")
    try:
        result = load_result(args.result)
    except ValueError as e:
        p.error(str(e))
    plot(result, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
