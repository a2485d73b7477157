"""How a K3 layer's routed experts are split: the padding rule of
docs/spec.md §5 (``padded_moe_intermediate``) and the refusal make_layout
raises when the experts' format cannot be split this way
(``ExpertShardError``). The formats themselves are k3jax.formats."""

from __future__ import annotations

from k3jax.layout.placement import LayoutError


class ExpertShardError(LayoutError):
    """The layout's expert format cannot be held split this way (its
    WeightFormat.split_refusal says why, e.g. a shard would cut a packed
    format's scale block); dense storage of the same experts can."""


def padded_moe_intermediate(intermediate: int, shards: int, min_per_partition: int) -> int:
    """docs/spec.md §5: the routed-expert intermediate after padding, for ``shards``
    devices splitting each expert's intermediate (1 under EP). Each shard takes
    ``intermediate // shards`` real columns, so ``shards`` must divide it."""
    if intermediate % shards:
        raise LayoutError(f"moe_intermediate_size {intermediate} is not divisible by the "
                         f"{shards} devices splitting each expert's intermediate")
    if shards > 1 and intermediate // shards < min_per_partition:
        return min_per_partition * shards
    return intermediate


__all__ = ["ExpertShardError", "padded_moe_intermediate"]
