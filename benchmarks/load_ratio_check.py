"""The checkpoint loader's rate against a raw read of the same bytes, as a
check: ``k3jax load-bench --min-ratio`` on CPU devices, on a small
checkpoint with the mix of a K3 MoE layer, made here.

The checkpoint is K3 with every width halved and 56 routed MXFP4 experts
(one device's share of 896 under EP 16; hidden 3584, latent 1792, I 1536,
shared I 3072): its MoE layer (layer 1) is 0.35 GB in about the proportions
of the full-width layer's 1.35 GB (``layer_mix``): 68% packed codes
(interleaved into the word layout on load), 27% BF16 weights and 4% scales
(transposed on load). Its values are random bits (``synthetic_tensors(...,
fast=True)``: written in a second or two).

An attempt runs ``python -m k3jax load-bench --checkpoint DIR --layer 1
--repeat R --json --min-ratio M`` in a child process with
``JAX_PLATFORMS=cpu``: loader runs and raw-read runs alternate (R timed runs
of each after one warm-up of each, page cache warm) and their medians are
compared, so a neighbour that slows the machine for part of the run slows
both peers' runs. The check passes at the first of ``--attempts`` attempts
that holds M, and fails when none does: a loader that slipped fails every
attempt, a burst of load on a shared machine only some.

    python -m benchmarks.load_ratio_check                 # a temporary checkpoint
    python -m benchmarks.load_ratio_check --dir /tmp/k3half --repeat 9

Exit status: 0 the ratio held (each attempt's JSON line on stdout); 1 no
attempt held it (load-bench's line naming the figures on stderr for each,
then one line with every attempt's ratio); 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

LOADER_RATIO_TARGET = 0.30
"""The least loader / raw read the loader must hold (median against median)."""

REPEAT = 7
"""Timed loader runs and raw-read runs (alternating) whose medians are compared."""

ATTEMPTS = 3
"""Attempts before the check fails."""


def config():
    """K3 at half width with 56 routed experts, two layers (a small dense layer 0)."""
    from k3jax.config import K3

    return K3.replace(hidden_size=K3.hidden_size // 2,
                      routed_expert_hidden_size=K3.routed_expert_hidden_size // 2,
                      moe_intermediate_size=K3.moe_intermediate_size // 2,
                      intermediate_size=512, num_experts=56, num_hidden_layers=2)


def layer_mix(cfg) -> dict[str, float]:
    """Byte shares of one MoE layer of ``cfg`` stored with MXFP4 experts and
    BF16 weights: packed codes, scales, BF16 (router, latent projections,
    norm, shared experts) and the float32 router bias."""
    from pallas_kernels.mxfp4 import BLOCK_SIZE

    D, L, E, I = (cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts,
                  cfg.moe_intermediate_size)
    parts = {"codes": E * 3 * I * L // 2, "scales": E * 3 * I * L // BLOCK_SIZE,
             "bf16": 2 * (E * D + 2 * L * D + int(cfg.latent_moe_use_norm) * L
                          + 3 * cfg.shared_intermediate_size * D),
             "bias": 4 * E}
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()}


def make(directory: str) -> None:
    """Write the check's checkpoint into ``directory`` (absent or empty)."""
    from k3jax.checkpoint.writer import make_synthetic_checkpoint

    make_synthetic_checkpoint(directory, config(), seed=0, dtype="bfloat16", experts="mxfp4",
                              fast=True)


def attempt(directory: str, repeat: int, min_ratio: float) -> tuple[int, float | None]:
    """One load-bench run on ``directory``'s layer 1 on CPU devices (its
    output passed on): (exit status, the ratio it printed, None if none)."""
    cmd = [sys.executable, "-m", "k3jax", "load-bench", "--checkpoint", directory, "--layer", "1",
           "--repeat", str(repeat), "--json", "--min-ratio", str(min_ratio)]
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    lines = proc.stdout.strip().splitlines()
    try:
        ratio = json.loads(lines[-1])["ratio"] if lines else None
    except (ValueError, KeyError, TypeError):
        ratio = None
    return proc.returncode, ratio


def check(directory: str, repeat: int, min_ratio: float, attempts: int) -> int:
    """0 at the first attempt that holds ``min_ratio``; else the last
    attempt's status, with one line naming every attempt's ratio."""
    ratios: list[float | None] = []
    status = 1
    for _ in range(attempts):
        status, ratio = attempt(directory, repeat, min_ratio)
        ratios.append(ratio)
        if status == 0 or ratio is None:
            return status
    shown = ", ".join("?" if r is None else f"{r:.3f}" for r in ratios)
    print(f"load_ratio_check: the loader held less than {min_ratio:g} of the raw read in each "
          f"of {attempts} attempts (ratios {shown}; medians of {repeat} runs each)",
          file=sys.stderr)
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_ratio_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", metavar="DIR",
                   help="write the checkpoint here and keep it (reused when it holds one)")
    p.add_argument("--repeat", type=int, default=REPEAT, metavar="R",
                   help=f"timed runs of each peer an attempt (default {REPEAT})")
    p.add_argument("--min-ratio", type=float, default=LOADER_RATIO_TARGET, metavar="M",
                   help=f"the least loader / raw read (default {LOADER_RATIO_TARGET})")
    p.add_argument("--attempts", type=int, default=ATTEMPTS, metavar="N",
                   help=f"attempts before failing (default {ATTEMPTS})")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.attempts < 1 or not 0 <= args.min_ratio:
        p.error("--repeat and --attempts must be >= 1, --min-ratio >= 0")
    if args.dir is not None:
        if not (os.path.isdir(args.dir) and os.listdir(args.dir)):
            make(args.dir)
        return check(args.dir, args.repeat, args.min_ratio, args.attempts)
    with tempfile.TemporaryDirectory(prefix="k3jax-load-ratio-") as tmp:
        directory = os.path.join(tmp, "ckpt")
        make(directory)
        return check(directory, args.repeat, args.min_ratio, args.attempts)


if __name__ == "__main__":
    sys.exit(main())
