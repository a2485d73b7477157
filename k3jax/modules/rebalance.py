"""Rebalancing a KimiMoE's redundant expert slots without a reload.

    rebalance(moe, new_placement)

The expert weights move between devices in place, as one jitted program of
collective permutes of the slots (k3jax.parallel.replicas.move_slots: every
slot of the new placement takes an old slot of the same logical expert,
from its own device when one holds it there); no checkpoint is read and no
device holds more than its own slots at any time. Then the module's Layout,
a static attribute (part of the nnx graph definition, and the key of its
jitted programs), is replaced: ``moe.layout`` becomes the same Layout with
``expert_placement`` = the new placement (None for the identity), checked
as ``make_layout`` checks one (k3jax.layout.redundant), and the module's
parameter declarations follow it. A graphdef split off before the call
describes the old placement: split again afterwards.

The new placement must have the layer's shape: E logical experts, E + R
slots (``ParallelConfig.redundant_experts``), the layout's ep and nodes.
"""

from __future__ import annotations

import dataclasses

from k3jax.layout.expert_placement import ExpertPlacement
from k3jax.layout.redundant import resolve_placement
from k3jax.modules.moe import KimiMoE, moe_decls
from k3jax.parallel.replicas import move_slots


def rebalance(moe: KimiMoE, placement: ExpertPlacement) -> None:
    """Move ``moe``'s expert slots to ``placement`` in place (module
    docstring). Raises RedundantExpertsError (a LayoutError) for a placement
    of another shape; the module is unchanged then."""
    if not isinstance(moe, KimiMoE):
        raise TypeError(f"rebalance: expected a KimiMoE, got {type(moe).__name__}")
    old = moe.layout
    layout = dataclasses.replace(old, expert_placement=resolve_placement(old.cfg, old.parallel,
                                                                          placement))
    if layout == old:
        return
    variables = {name: getattr(moe, name) for name in old.experts.param_names()}
    moved = move_slots({n: v.get_value() for n, v in variables.items()}, old, placement,
                       moe.mesh)
    for name, variable in variables.items():
        variable.set_value(moved[name])
    moe.layout = layout
    moe._decls = moe_decls(layout)


__all__ = ["rebalance"]
