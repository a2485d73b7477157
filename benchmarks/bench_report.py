"""The GPU benchmark's outputs: the result JSON (rewritten after every row),
the console lines and the BENCHMARKS.md markdown snippet. Standard library
only, so the plot script can use it without jax."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

TIMING_WORDS = {"cupti": "CUPTI kernel time per call (no dispatch)",
                "wallclock": "wall clock per call over ~1 ms of back-to-back calls"}

class Results:
    """The run's results; rewrites --json / --markdown after every row."""

    def __init__(self, meta: dict, json_path: str | None, markdown_path: str | None):
        self.data = {"meta": {**meta, "complete": False}, "ceilings": None, "grouped": [],
                     "mlp": [], "mxfp4": []}
        self.json_path, self.markdown_path = json_path, markdown_path

    def set_ceilings(self, ceilings: dict) -> None:
        self.data["ceilings"] = ceilings
        self.save()

    def add(self, section: str, row: dict) -> None:
        self.data[section].append(row)
        self.save()

    def finish(self, elapsed_s: float) -> None:
        self.data["meta"].update(complete=True, elapsed_s=elapsed_s)
        self.save()

    @property
    def rows(self) -> list[dict]:
        return self.data["grouped"] + self.data["mlp"] + self.data["mxfp4"]

    def save(self) -> None:
        if self.json_path:
            _write_text(self.json_path, json.dumps(self.data, indent=1))
        if self.markdown_path and self.data["ceilings"] is not None:
            _write_text(self.markdown_path, to_markdown(self.data))


def write_atomically(path: str, write_to: Callable[[str], None]) -> None:
    """write_to(tmp) a temporary file beside ``path``, then rename it over
    ``path``: readers never see half a file. (Self-contained: the GPU machine
    has jax and numpy, not k3jax's dependencies.)"""
    fd, tmp = tempfile.mkstemp(prefix=".bench-", suffix=os.path.splitext(path)[1],
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        write_to(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_text(path: str, text: str) -> None:
    def write_to(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    write_atomically(path, write_to)


def _fmt(row: dict, impl: str, key: str, spec: str) -> str:
    return format(row[impl][key], spec) if impl in row else "-"


def _status(row: dict) -> str | None:
    """'skipped (why)' or 'ERROR ...' for a row that was not measured, else None."""
    if "skipped" in row:
        return f"skipped ({row['skipped']})"
    if "error" in row:
        return f"ERROR {row['error'][:200]}"
    return None


def describe_tiles(config: dict) -> str:
    """A launch's tiles in words, from a cost-model config dict: "decode 2x64,
    t64, S1, 4 st., cluster 4, chained" (consumer warpgroups x weight columns,
    token tile, split-K, stages) or "row-major 1x64 x 128, chained" (warpgroups
    x rows x N)."""
    if config["kernel"] == "mosaic_sm90_swap_ab":
        words = [f"decode {config['num_compute_wgs']}x{config['wg_block_w']}",
                 f"t{config['block_t']}", f"S{config['split_k']}",
                 f"{config['max_concurrent_steps']} st."]
        if config["cluster"] > 1:
            words.append(f"cluster {config['cluster']}")
    else:
        words = [f"{config['kernel'].removeprefix('mosaic_sm90').strip('_') or 'row-major'} "
                 f"{config['num_compute_wgs']}x{config['wg_block_m']} x {config['block_n']}"]
        if config["split_k"] > 1:
            words.append(f"S{config['split_k']}")
    if config.get("no_drain"):
        words.append("chained")
    return ", ".join(words)


def format_grouped_row(r: dict) -> str:
    head = f"{r['op']:<13} ep={r['ep']:<3} E={r['local_experts']:<4} tokens={r['tokens']:<6}"
    if (status := _status(r)) is not None:
        return f"{head} {status}"
    bw = f"{_fmt(r, 'kernel', 'weight_tbps', '.2f')} TB/s ({_fmt(r, 'kernel', 'pct_copy', '.0f')}% copy)"
    return (f"{head} rows={r['rows']:<7} kernel {_fmt(r, 'kernel', 'us', '10.1f')} us "
            f"{_fmt(r, 'kernel', 'tflops', '6.1f')} TF/s ({_fmt(r, 'kernel', 'pct_dense', '4.1f')}% dense)"
            f" | xla {_fmt(r, 'xla', 'us', '10.1f')} us ({_fmt(r, 'xla', 'pct_dense', '4.1f')}%)"
            f" | x{r.get('speedup', float('nan')):.2f}" + (f" | weights {bw}" if r["small"] else "")
            + (f" | jax mosaic {_fmt(r, 'jax_mosaic', 'us', '.1f')} us" if "jax_mosaic" in r else "")
            + (f" | triton {_fmt(r, 'triton', 'us', '.1f')} us" if "triton" in r else "")
            + (f" | x-lean {_fmt(r, 'x_lean', 'us', '.1f')} us" if "x_lean" in r else ""))


def format_mlp_row(r: dict) -> str:
    head = f"situ_mlp_up   tp={r['tp']:<2} F={r['F']:<5} tokens={r['tokens']:<5}"
    if (status := _status(r)) is not None:
        return f"{head} {status}"
    return (f"{head} kernel {_fmt(r, 'kernel', 'us', '9.1f')} us "
            f"({_fmt(r, 'kernel', 'pct_dense', '4.1f')}% dense, "
            f"weights {_fmt(r, 'kernel', 'pct_copy', '.0f')}% copy) | xla "
            f"{_fmt(r, 'xla', 'us', '9.1f')} us | x{r.get('speedup', float('nan')):.2f}"
            + (f" | triton {_fmt(r, 'triton', 'us', '.1f')} us" if "triton" in r else ""))


def _table(headers: list[str], lead: list[list], cells: list[list[str] | str]) -> list[str]:
    """Markdown table rows: each row's lead columns, then its cells (or its
    status string in the first cell and the remaining cells empty)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for lead_row, row_cells in zip(lead, cells, strict=True):
        if isinstance(row_cells, str):
            row_cells = [row_cells] + [""] * (len(headers) - len(lead_row) - 1)
        lines.append("| " + " | ".join(str(c) for c in [*lead_row, *row_cells]) + " |")
    return lines


def to_markdown(result: dict) -> str:
    """A snippet for BENCHMARKS.md: provenance, ceilings, one table per sweep."""
    meta, ceil = result["meta"], result["ceilings"]
    lines = [
        f"### Pallas Mosaic GPU kernels: {meta['date']}"
        + ("" if meta["complete"] else " (incomplete: the run was cut short)"),
        "",
        (f"- GPU: {meta['gpu']} ({meta['platform']}), jax {meta['jax_version']}, "
         f"jaxlib {meta['jaxlib_version']}, kernel backend `{meta['kernel_backend']}`"),
        f"- Command: `{meta['command']}`",
        (f"- Ceilings: bf16 matmul {ceil['matmul_shape'][0]}^3 = {ceil['matmul_tflops']:.1f} TFLOP/s; "
         f"elementwise copy = {ceil['copy_tbps']:.2f} TB/s (read + write)"),
        (f"- Timing: {TIMING_WORDS[meta['timing']]}, median of {meta['iters']} after warm-up; "
         f"kernel outputs checked against XLA (max rel err <= {meta['check_tol']})."),
    ]
    grouped = result["grouped"]
    calls = sorted({", ".join(r["xla_custom_calls"]) or "none" for r in grouped
                    if "xla_custom_calls" in r})
    if calls:
        lines.append(f"- Custom calls in XLA's compiled ragged_dot baseline: {'; '.join(calls)}.")
    lines.append("")
    lines += _table(
        ["op", "EP", "local experts", "tokens", "rows", "kernel us", "XLA us", "speedup",
         "kernel % dense", "XLA % dense", "kernel weight TB/s (% copy)", "jax Mosaic ragged_dot us",
         "Triton us", "x-lean decode us"],
        [[r["op"], r["ep"], r["local_experts"], r["tokens"], r["rows"]] for r in grouped],
        [_status(r) or [
            _fmt(r, "kernel", "us", ".1f"), _fmt(r, "xla", "us", ".1f"),
            f"{r.get('speedup', float('nan')):.2f}", _fmt(r, "kernel", "pct_dense", ".1f"),
            _fmt(r, "xla", "pct_dense", ".1f"),
            (f"{r['kernel']['weight_tbps']:.2f} ({r['kernel']['pct_copy']:.0f}%)"
             if r["small"] else ""),
            _fmt(r, "jax_mosaic", "us", ".1f") if r["op"] == "down" else "",
            _fmt(r, "triton", "us", ".1f") if "triton" in r else "",
            _fmt(r, "x_lean", "us", ".1f") if "x_lean" in r else ""] for r in grouped])
    lines.append("")
    mlp = result["mlp"]
    lines += _table(
        ["op", "tp", "D", "F", "tokens", "kernel us", "XLA us", "speedup", "kernel % dense",
         "Triton us"],
        [["situ_mlp_up", r["tp"], r["D"], r["F"], r["tokens"]] for r in mlp],
        [_status(r) or [
            _fmt(r, "kernel", "us", ".1f"), _fmt(r, "xla", "us", ".1f"),
            f"{r.get('speedup', float('nan')):.2f}", _fmt(r, "kernel", "pct_dense", ".1f"),
            _fmt(r, "triton", "us", ".1f") if "triton" in r else ""]
         for r in mlp])
    lines += _mxfp4_table(result.get("mxfp4", []))
    return "\n".join(lines) + "\n"


def _mxfp4_cell(r: dict, impl: str) -> str:
    if impl in r:
        return f"{r[impl]['us']:.1f} ({r[impl]['weight_tbps']:.2f} TB/s, {r[impl]['pct_copy']:.0f}%)"
    return r.get(f"{impl}_error", "-")[:80]


def _mxfp4_table(rows: list[dict]) -> list[str]:
    """MXFP4 experts (bench_mxfp4.py): us (weight TB/s, % of copy) per implementation."""
    if not rows:
        return []
    return ["", "MXFP4 experts: us (weight bytes moved per second, % of copy); "
            "mxfp4 counts 0.53125 B per active parameter, the others 2 B.", ""] + _table(
        ["op", "EP", "tokens", "rows", "mxfp4 (packed)", "bf16 weights", "dequantize + ragged_dot",
         "mxfp4 temp GiB"],
        [[r["op"], r["ep"], r["tokens"], r["rows"]] for r in rows],
        [_status(r) or [_mxfp4_cell(r, "mxfp4"), _mxfp4_cell(r, "bf16"),
                        _mxfp4_cell(r, "dequant_ragged_dot"),
                        f"{r.get('mxfp4_temp_bytes', float('nan')) / 2**30:.2f}"] for r in rows])
