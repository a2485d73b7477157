"""Snapshot the outputs of `k3jax run`, `plan` and `compile` on every layout of
tests/layout_cases.py, so a refactor can be diffed against them.

    python benchmarks/cli_snapshot.py OUTDIR [--skip-compile]

Writes OUTDIR/<layout>.<command>.{json,txt,npy}; diff two OUTDIRs with
`diff -r` (the .npy files with cmp). Timings are removed from the JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

_TIMING_KEYS = {"compile_seconds", "compile_s", "seconds", "wall_s", "time_s", "elapsed_s"}


def _flags(par) -> list[str]:
    flags = ["--dp", str(par.dp), "--tp", str(par.tp)]
    flags += ["--sequence-parallel"] * par.sequence_parallel
    flags += ["--expert-parallel"] * par.expert_parallel
    flags += ["--shard-shared-expert"] * bool(par.shard_shared_expert)
    flags += ["--pad-under-ep"] * par.pad_under_ep
    if par.sequence_parallel and par.shard_shared_expert:
        flags += ["--shared-overlap", par.shared_overlap.value]
    return flags


def _scrub(obj):
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items() if k not in _TIMING_KEYS}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    return obj


def _k3jax(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "k3jax", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)


def main() -> int:
    out = os.path.abspath(sys.argv[1])
    skip_compile = "--skip-compile" in sys.argv
    os.makedirs(out, exist_ok=True)
    from layout_cases import EXTRA_LAYOUTS, LAYOUTS
    for name, par in {**LAYOUTS, **EXTRA_LAYOUTS}.items():
        flags = _flags(par)
        jobs = {"plan": ["plan", "--preset", "k3", *flags, "--json"]}
        if not par.pad_under_ep:
            jobs["run"] = ["run", "--devices", str(par.num_devices), *flags,
                           "--output", os.path.join(out, f"{name}.run.npy")]
        if not skip_compile and not par.pad_under_ep:
            jobs["compile"] = ["compile", "--preset", "k3", *flags, "--tokens", "256", "--json"]
        for cmd, argv in jobs.items():
            p = _k3jax(argv)
            print(f"{name:24s} {cmd:8s} rc={p.returncode}", flush=True)
            if cmd == "run":
                text = p.stdout
            else:
                try:
                    text = json.dumps(_scrub(json.loads(p.stdout)), indent=1, sort_keys=True)
                except json.JSONDecodeError:
                    text = p.stdout
            with open(os.path.join(out, f"{name}.{cmd}.txt"), "w") as f:
                f.write(f"rc={p.returncode}\n{text}\n--- stderr\n{p.stderr[-2000:] if p.returncode else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
