"""``--redundant-experts R`` and ``--expert-placement PLACEMENT.json``, the
layout flags (k3jax.cli.common.add_parallel_flags) that put redundant expert
slots into the layer, read back for run, compile, plan and load-bench.

R is ``ParallelConfig.redundant_experts``: the flag, else the placement
file's (every layer of it must have the same), else 0. The file holds a
placement per MoE layer (k3jax.layout.expert_placement's format, what
``k3jax balance`` writes); each layer a command builds takes its own, which
must fit the model and the devices. Usage errors (R < 0: argparse; R > 0
without --expert-parallel: ParallelConfig; E + R not divisible by the EP
size: make_layout) exit 2 naming the flag; a file that cannot be read, is
malformed or does not fit is bad data (ValueError naming the file: exit 1).
"""

from __future__ import annotations

import argparse
from typing import Iterable

from k3jax.config import K3Config
from k3jax.layout import ParallelConfig
from k3jax.layout.expert_placement import ExpertPlacement, read_placements


def redundant_from_args(args: argparse.Namespace) -> int:
    """R: --redundant-experts, else the --expert-placement file's, else 0."""
    if getattr(args, "redundant_experts", None) is not None:
        return args.redundant_experts
    path = getattr(args, "expert_placement", None)
    if path is None:
        return 0
    counts = {p.redundant for p in read_placements(path).values()}
    if len(counts) != 1:
        raise ValueError(f"--expert-placement {path}: its layers hold different numbers of "
                         f"redundant slots {sorted(counts)}; give --redundant-experts")
    return counts.pop()


def placements_from_args(args: argparse.Namespace, cfg: K3Config, parallel: ParallelConfig,
                         layers: Iterable[int] | None) -> dict[int, ExpertPlacement] | None:
    """{MoE layer: placement} of --expert-placement for the MoE layers among
    ``layers`` (None: every layer of the file; None without the flag);
    ValueError naming the file and the
    layer for one it lacks or one that does not fit ``cfg`` and ``parallel``
    (without --expert-parallel, make_layout refuses the flag instead)."""
    path = getattr(args, "expert_placement", None)
    if path is None:
        return None
    placements = read_placements(path)
    out = {}
    for layer in placements if layers is None else layers:
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"--expert-placement {path}: layer {layer} is out of range: the "
                             f"model has layers 0..{cfg.num_hidden_layers - 1}")
        if not cfg.is_moe_layer(layer):
            continue
        if layer not in placements:
            have = ", ".join(map(str, sorted(placements)))
            raise ValueError(f"--expert-placement {path}: no placement for MoE layer {layer} "
                             f"(it has layers {have})")
        p = out[layer] = placements[layer]
        if not parallel.expert_parallel:
            continue
        for what, theirs, ours in (("logical experts", p.num_logical, cfg.num_experts),
                                   ("EP devices", p.ep, parallel.ep),
                                   ("nodes", p.nodes, parallel.nodes),
                                   ("redundant slots", p.redundant, parallel.redundant_experts)):
            if theirs != ours:
                raise ValueError(f"--expert-placement {path}: layer {layer} is placed for "
                                 f"{theirs} {what}, and the layout has {ours}")
    return out


def help_lines() -> dict[str, str]:
    """The flags' help (add_parallel_flags)."""
    return {"--redundant-experts": "under --expert-parallel, R redundant expert slots holding "
                                   "replicas of experts, (E + R) / (dp x tp) a device (E + R "
                                   "must divide over them) (default 0, or the --expert-placement "
                                   "file's)",
            "--expert-placement": "a placement file (k3jax balance writes one): which expert "
                                  "each slot of each MoE layer holds (default: the slots placed "
                                  "for uniform load)"}


__all__ = ["help_lines", "placements_from_args", "redundant_from_args"]
