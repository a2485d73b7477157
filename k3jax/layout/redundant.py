"""Redundant expert slots in the Layout: which placement (if any) a layer
holds, decided once by ``make_layout`` (k3jax.layout.expert_placement holds
the placement itself, its file and the balancer).

``ParallelConfig.redundant_experts`` (R, ``--redundant-experts``) and an
optional ``ExpertPlacement`` (``--expert-placement FILE``'s entry for the
layer) give ``Layout.expert_placement``:

    R = 0, no placement          None: today's layout exactly (slot e holds
                                 expert e, no op added to any program)
    R > 0, no placement          placed for uniform load (uniform_placement;
                                 when ep does not divide E, the balancer on a
                                 uniform load, place_experts)
    a placement                  that placement, checked against the model and
                                 the devices: E logical experts, ep and nodes
                                 of the layout, R slots beyond E; the identity
                                 (R = 0, slot e holding e) is None

Every refusal is a LayoutError (``RedundantExpertsError``) of one line naming
the flag: R > 0 outside expert parallelism, E + R not divisible by the EP
size, a placement for other devices or another model.
"""

from __future__ import annotations

from k3jax.config import K3Config
from k3jax.layout.expert_placement import (
    ExpertPlacement,
    PlacementError,
    place_experts,
    uniform_placement,
)
from k3jax.layout.parallel import ParallelConfig
from k3jax.layout.placement import LayoutError


class ExpertSlots:
    """The Layout's facts about its expert slots (Layout derives from it;
    it reads ``cfg``, ``parallel`` and ``expert_placement``)."""

    @property
    def num_slots(self) -> int:
        """Slots along the routed experts' axis 0: E + R, or E without a placement."""
        p = self.expert_placement
        return self.cfg.num_experts if p is None else p.num_slots

    @property
    def local_experts(self) -> int:
        """Expert slots a device holds: num_slots / ep (ep 1 outside EP)."""
        return self.num_slots // self.parallel.ep

    @property
    def redundant_note(self) -> str:
        """Layout.describe's note on the slots: " (R redundant slots)", or ""."""
        p = self.expert_placement
        return f" ({p.redundant} redundant slots)" if p is not None and p.redundant else ""


class RedundantExpertsError(LayoutError):
    """--redundant-experts or --expert-placement that this layout cannot hold."""


def resolve_placement(cfg: K3Config, parallel: ParallelConfig,
                      placement: ExpertPlacement | None) -> ExpertPlacement | None:
    """The placement a layer of ``cfg`` holds on ``parallel`` (module
    docstring); None is the layout without redundancy."""
    R, E, ep = parallel.redundant_experts, cfg.num_experts, parallel.ep
    if placement is None and R == 0:
        return None
    if not parallel.expert_parallel:
        what = f"--redundant-experts {R}" if R else "--expert-placement"
        raise RedundantExpertsError(f"{what} needs --expert-parallel (redundant slots hold "
                                    f"whole experts over the EP devices)")
    if (E + R) % ep:
        raise RedundantExpertsError(f"--redundant-experts {R}: {E} experts + {R} = {E + R} "
                                    f"slots do not divide over the EP size {ep} (dp x tp)")
    if placement is None:
        try:
            if E % ep:   # no home block per device: balance a uniform load instead
                return place_experts([1.0] * E, R, parallel.nodes, ep)
            return uniform_placement(E, R, ep, parallel.nodes)
        except PlacementError as e:
            raise RedundantExpertsError(f"--redundant-experts {R}: {e}") from None
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"expert_placement must be an ExpertPlacement, got "
                        f"{type(placement).__name__}")
    checks = (("logical experts", placement.num_logical, E), ("EP devices", placement.ep, ep),
              ("nodes", placement.nodes, parallel.nodes),
              ("redundant slots (--redundant-experts)", placement.redundant, R))
    for what, theirs, ours in checks:
        if theirs != ours:
            raise RedundantExpertsError(f"--expert-placement is for {theirs} {what}, the layout "
                                        f"has {ours}")
    return None if placement.is_identity else placement


__all__ = ["ExpertSlots", "RedundantExpertsError", "resolve_placement"]
