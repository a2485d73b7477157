"""Where each routed expert lives under expert parallelism, with redundant
replicas of the hot experts (an expert-parallel load balancer, EPLB): the
physical placement, its JSON file, a balancer from measured load, the load a
placement puts on each device, and the per-row replica choice the modules
route with.

Terms. E logical experts (the router's ids), R >= 0 redundant slots, ep
devices over N nodes of G = ep / N devices each (node n holds devices
[n G, (n + 1) G)), S = (E + R) / ep physical slots a device. Slots are
numbered device-major: device d holds slots [d S, (d + 1) S). A placement
(``ExpertPlacement``) says which logical expert's weights each slot holds,
``slot_expert`` [E + R]; every logical expert has at least one slot (its
replicas; a device may hold one expert in several slots).

  * ``uniform_placement(E, R, ep, N)``: what to use before any load is
    measured. R = 0 is the identity, k3jax's layout without redundancy:
    device d holds experts [d E/ep, (d + 1) E/ep). With R > 0 every device
    keeps those home experts and fills its R / ep extra slots with replicas
    of its node neighbour's home experts, so each device carries E / ep
    experts' worth of a uniform load.
  * ``place_experts(load_E, R, N, ep)``: the balancer, hierarchical as
    vLLM's EPLB (``rebalance_experts_hierarchical`` in vLLM's
    vllm/distributed/eplb/rebalance_algo.py, adapted there from
    deepseek-ai/EPLB; written here afresh in numpy):
      1. the experts, in groups (default: one expert a group), are packed onto
         the N nodes, E / N experts a node, so that the nodes' loads balance
         (heaviest first, each to the lightest node with room);
      2. inside each node the node's R / N redundant slots go one at a time to
         the expert whose load per replica is the largest;
      3. the node's slots (each carrying its expert's load / replicas) are
         packed onto the node's G devices, S a device, the same way as 1.
    A replica never leaves its expert's node, so a token row crosses the
    inter-node link at most once per node, as without redundancy. Where the
    groups do not divide over the nodes the nodes are treated as one (vLLM's
    global policy). K3 has one expert group (``num_expert_group`` = 1): vLLM
    then balances globally; here every expert is its own group, so the
    hierarchical policy applies to K3 too.
  * ``device_loads(placement, tokens_per_expert)`` [ep]: a replica takes an
    equal share of its expert's (token, expert) pairs, which is what
    ``replica_choice`` gives in expectation; ``node_loads`` sums a node's.
  * ``replica_choice(ids_TK, row_T, replicas_EM, count_E)``: the physical
    slot of each (token, logical expert) pair, replicas_of(e)[row mod
    count(e)] with ``row`` the pair's GLOBAL row index (the same on every
    device, so every device agrees where a pair goes). A pure jnp function
    over the placement's padded table (``ExpertPlacement.replica_arrays``).

Files: a load file is what ``k3jax run --expert-load`` writes (one JSON object
keyed by MoE layer index as a string; each value holds ``tokens_per_expert``
[E] ints, ``tokens_per_device``, ``tokens_per_node``, ``mean_score_per_expert``
[E] and ``imbalance`` {"device", "node"}); ``read_expert_load`` reads its
``tokens_per_expert``. A placement file holds one placement per MoE layer
(``write_placements`` / ``read_placements``, written whole or not at all).
Every check raises ``PlacementError`` (a ValueError) naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax.numpy as jnp
import numpy as np

from k3jax.files import atomic_write

FORMAT = "k3jax-expert-placement"
FILE_FORMAT = "k3jax-expert-placements"
VERSION = 1


class PlacementError(ValueError):
    """A placement, a load or their files that cannot be used; the message
    names the culprit."""


def _positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise PlacementError(f"{name} must be an integer >= 1, got {value!r}")


def check_sizes(num_experts: int, redundant: int, ep: int, nodes: int) -> None:
    """PlacementError naming the culprit unless E + R slots split evenly over
    ep devices on ``nodes`` equal nodes (R >= 0)."""
    for name, value in (("num_experts", num_experts), ("ep", ep), ("nodes", nodes)):
        _positive(name, value)
    if not isinstance(redundant, (int, np.integer)) or isinstance(redundant, bool) or redundant < 0:
        raise PlacementError(f"redundant experts must be an integer >= 0, got {redundant!r}")
    if ep % nodes:
        raise PlacementError(f"nodes {nodes} does not divide the {ep} EP devices")
    if (num_experts + redundant) % ep:
        raise PlacementError(f"{num_experts} experts + {redundant} redundant slots = "
                             f"{num_experts + redundant} slots do not divide over {ep} EP devices")


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot holds (module docstring).

    ``slot_expert[s]`` (length E + R) is the logical expert of slot s; device
    d holds slots [d S, (d + 1) S), S = (E + R) / ep. Invariants (checked on
    construction): every entry in [0, E), every logical expert present, E + R
    divisible by ep, ep by nodes."""

    num_logical: int
    ep: int
    nodes: int
    slot_expert: tuple[int, ...]

    def __post_init__(self) -> None:
        _positive("num_logical", self.num_logical)
        slots = tuple(self.slot_expert)
        bad = [(s, e) for s, e in enumerate(slots)
               if not isinstance(e, (int, np.integer)) or isinstance(e, bool)
               or not 0 <= e < self.num_logical]
        if bad:
            s, e = bad[0]
            raise PlacementError(f"slot {s} holds expert {e!r}, not a logical expert in "
                                 f"[0, {self.num_logical})")
        object.__setattr__(self, "slot_expert", tuple(int(e) for e in slots))
        if len(self.slot_expert) < self.num_logical:
            raise PlacementError(f"{len(self.slot_expert)} slots cannot hold {self.num_logical} "
                                 f"logical experts")
        check_sizes(self.num_logical, len(self.slot_expert) - self.num_logical, self.ep,
                    self.nodes)
        missing = sorted(set(range(self.num_logical)) - set(self.slot_expert))
        if missing:
            raise PlacementError(f"no slot holds logical expert(s) {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''}: a placement must not "
                                 f"drop an expert")

    @property
    def num_slots(self) -> int:
        """E + R."""
        return len(self.slot_expert)

    @property
    def redundant(self) -> int:
        """R, the slots beyond one per logical expert."""
        return self.num_slots - self.num_logical

    @property
    def slots_per_device(self) -> int:
        """S = (E + R) / ep."""
        return self.num_slots // self.ep

    @property
    def devices_per_node(self) -> int:
        """G = ep / nodes."""
        return self.ep // self.nodes

    @functools.cached_property
    def slot_expert_array(self) -> np.ndarray:
        """``slot_expert`` as int32 [E + R]."""
        return np.asarray(self.slot_expert, np.int32)

    @functools.cached_property
    def replica_count(self) -> np.ndarray:
        """int32 [E]: how many slots hold each logical expert (>= 1)."""
        return np.bincount(self.slot_expert_array, minlength=self.num_logical).astype(np.int32)

    def replicas_of(self, expert: int) -> tuple[int, ...]:
        """The slots holding logical ``expert``, ascending."""
        if not 0 <= expert < self.num_logical:
            raise PlacementError(f"expert {expert} is not in [0, {self.num_logical})")
        return tuple(int(s) for s in np.flatnonzero(self.slot_expert_array == expert))

    def replica_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(replicas_EM int32 [E, M], count_E int32 [E]), M the largest
        replica count: row e lists replicas_of(e), padded with -1. What
        ``replica_choice`` indexes."""
        M = int(self.replica_count.max())
        table = np.full((self.num_logical, M), -1, np.int32)
        order = np.argsort(self.slot_expert_array, kind="stable")       # slots grouped by expert
        starts = np.concatenate([[0], np.cumsum(self.replica_count)[:-1]])
        rank = np.arange(self.num_slots) - np.repeat(starts, self.replica_count)
        table[self.slot_expert_array[order], rank] = order
        return table, self.replica_count.copy()

    def device_experts(self, device: int) -> tuple[int, ...]:
        """The logical experts in device ``device``'s S slots, in slot order."""
        S = self.slots_per_device
        return self.slot_expert[device * S:(device + 1) * S]

    @property
    def is_identity(self) -> bool:
        """R = 0 and slot s holds expert s: the layout without redundancy."""
        return self.redundant == 0 and all(s == e for s, e in enumerate(self.slot_expert))

    def to_json(self) -> dict:
        """The JSON object of one placement (``from_json`` reads it back)."""
        return {"format": FORMAT, "version": VERSION, "num_logical_experts": self.num_logical,
                "redundant_experts": self.redundant, "ep": self.ep, "nodes": self.nodes,
                "slots_per_device": self.slots_per_device, "slot_expert": list(self.slot_expert)}

    @classmethod
    def from_json(cls, doc, where: str = "placement") -> ExpertPlacement:
        """The placement of a ``to_json`` object; PlacementError naming
        ``where`` and the field that is missing, malformed or inconsistent."""
        if not isinstance(doc, dict):
            raise PlacementError(f"{where}: expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise PlacementError(f"{where}: not a {FORMAT} version {VERSION} object (format "
                                 f"{doc.get('format')!r}, version {doc.get('version')!r})")
        fields = {}
        for key in ("num_logical_experts", "redundant_experts", "ep", "nodes", "slots_per_device"):
            value = doc.get(key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise PlacementError(f"{where}: {key} must be an integer, got {value!r}")
            fields[key] = value
        slots = doc.get("slot_expert")
        if not isinstance(slots, list) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                  for e in slots):
            raise PlacementError(f"{where}: slot_expert must be a list of integers")
        E, R = fields["num_logical_experts"], fields["redundant_experts"]
        if len(slots) != E + R:
            raise PlacementError(f"{where}: slot_expert has {len(slots)} entries; "
                                 f"num_logical_experts {E} + redundant_experts {R} = {E + R}")
        try:
            placement = cls(E, fields["ep"], fields["nodes"], tuple(slots))
        except PlacementError as e:
            raise PlacementError(f"{where}: {e}") from None
        if placement.slots_per_device != fields["slots_per_device"]:
            raise PlacementError(f"{where}: slots_per_device {fields['slots_per_device']} is not "
                                 f"(E + R) / ep = {placement.slots_per_device}")
        return placement


def uniform_placement(num_experts: int, redundant: int, ep: int, nodes: int) -> ExpertPlacement:
    """The placement for uniform load (module docstring): the identity at
    R = 0; with R > 0 device d keeps its home experts [d E/ep, (d + 1) E/ep)
    in its first E/ep slots and replicates its node neighbour's home experts
    (device n G + (g + 1) mod G) round-robin in the rest. R > 0 needs ep | E."""
    check_sizes(num_experts, redundant, ep, nodes)
    if redundant and num_experts % ep:
        raise PlacementError(f"uniform_placement with redundant slots keeps each device's home "
                             f"experts: ep {ep} must divide the {num_experts} experts (use "
                             f"place_experts(np.ones(E), ...) instead)")
    if not redundant:
        return ExpertPlacement(num_experts, ep, nodes, tuple(range(num_experts)))
    home, extra, G = num_experts // ep, redundant // ep, ep // nodes
    slots = []
    for d in range(ep):
        neighbour = (d // G) * G + (d % G + 1) % G
        slots += list(range(d * home, (d + 1) * home))
        slots += [neighbour * home + j % home for j in range(extra)]
    return ExpertPlacement(num_experts, ep, nodes, tuple(slots))


def balanced_packing(weight: np.ndarray, packs: int) -> np.ndarray:
    """int [n]: the pack of each of n items, exactly n / packs a pack: the
    items heaviest first (ties by index), each to the lightest pack that has
    room (ties: the lowest pack)."""
    n = len(weight)
    if n % packs:
        raise PlacementError(f"balanced_packing: {n} items do not split into {packs} equal packs")
    per = n // packs
    pack_of = np.empty(n, np.int64)
    loads, counts = np.zeros(packs), np.zeros(packs, np.int64)
    for item in np.argsort(-np.asarray(weight, np.float64), kind="stable"):
        p = int(np.argmin(np.where(counts < per, loads, np.inf)))
        pack_of[item] = p
        loads[p] += weight[item]
        counts[p] += 1
    return pack_of


def replicate(load: np.ndarray, slots: int) -> np.ndarray:
    """int [len(load)]: replicas per expert over ``slots`` >= len(load)
    slots: each extra slot to the expert of the largest load per replica
    (ties: the lowest index)."""
    count = np.ones(len(load), np.int64)
    load = np.asarray(load, np.float64)
    for _ in range(slots - len(load)):
        count[int(np.argmax(load / count))] += 1
    return count


def check_load(load_E, num_experts: int | None = None, where: str = "load") -> np.ndarray:
    """The load as float64 [E]; PlacementError unless it is a finite,
    non-negative 1-D list (of length ``num_experts`` when given)."""
    try:
        load = np.asarray(load_E, np.float64)
    except (TypeError, ValueError):
        raise PlacementError(f"{where}: not a list of numbers") from None
    if load.ndim != 1 or not load.size:
        raise PlacementError(f"{where}: expected a non-empty list, got shape {list(load.shape)}")
    if num_experts is not None and load.size != num_experts:
        raise PlacementError(f"{where}: {load.size} entries, but the model has {num_experts} "
                             f"experts")
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise PlacementError(f"{where}: every entry must be a finite number >= 0")
    return load


def place_experts(load_E, redundant: int, nodes: int, ep: int,
                  groups: int | None = None) -> ExpertPlacement:
    """The balancer (module docstring): a placement of E = len(load_E)
    experts in E + ``redundant`` slots over ep devices on ``nodes`` nodes
    that balances ``load_E`` (tokens per expert, any non-negative measure)
    first over the nodes, then over each node's devices. ``groups``: how
    many contiguous expert groups must stay whole on one node (default E:
    every expert its own group)."""
    load = check_load(load_E)
    E = load.size
    check_sizes(E, redundant, ep, nodes)
    groups = E if groups is None else groups
    _positive("groups", groups)
    if E % groups:
        raise PlacementError(f"groups {groups} does not divide the {E} experts")
    if groups % nodes or redundant % nodes:
        nodes_used = 1                      # vLLM's global policy: one packing over all devices
    else:
        nodes_used = nodes
    G = ep // nodes_used
    per_group = E // groups
    node_of_group = balanced_packing(load.reshape(groups, per_group).sum(1), nodes_used)
    slot_expert = []
    for n in range(nodes_used):
        experts = np.concatenate([np.arange(g * per_group, (g + 1) * per_group)
                                  for g in np.flatnonzero(node_of_group == n)])
        count = replicate(load[experts], (E + redundant) // nodes_used)
        slot_of = np.repeat(experts, count)                     # the node's slots, by expert
        device_of = balanced_packing(np.repeat(load[experts] / count, count), G)
        for g in range(G):
            slot_expert += sorted(int(e) for e in slot_of[device_of == g])
    return ExpertPlacement(E, ep, nodes, tuple(slot_expert))


def device_loads(placement: ExpertPlacement, tokens_per_expert) -> np.ndarray:
    """float64 [ep]: the (token, expert) pairs each device computes when
    every replica takes an equal share of its expert's pairs."""
    load = check_load(tokens_per_expert, placement.num_logical, "tokens_per_expert")
    per_slot = (load / placement.replica_count)[placement.slot_expert_array]
    return per_slot.reshape(placement.ep, placement.slots_per_device).sum(1)


def node_loads(placement: ExpertPlacement, tokens_per_expert) -> np.ndarray:
    """float64 [nodes]: the sum of each node's device_loads."""
    return device_loads(placement, tokens_per_expert).reshape(placement.nodes, -1).sum(1)


def imbalance(loads) -> float:
    """max / mean of per-device (or per-node) loads; 1.0 for an all-zero load."""
    loads = np.asarray(loads, np.float64)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def replica_choice(ids_TK: jnp.ndarray, row_T: jnp.ndarray, replicas_EM: jnp.ndarray,
                   count_E: jnp.ndarray) -> jnp.ndarray:
    """int32 [T, K]: the physical slot of each (row, logical expert) pair,
    replicas_EM[e, row mod count_E[e]] (``ExpertPlacement.replica_arrays``).
    ``row_T`` [T] are the rows' GLOBAL indices, so that every device picks the
    same replica for a pair. Ids outside [0, E) (the padding rows' "no
    expert", E) map to the slot count E + R, a slot no device holds."""
    E = replicas_EM.shape[0]
    num_slots = jnp.sum(count_E)
    valid = (ids_TK >= 0) & (ids_TK < E)
    safe = jnp.where(valid, ids_TK, 0)
    j = row_T[:, None].astype(jnp.int32) % count_E[safe]
    return jnp.where(valid, replicas_EM[safe, j], num_slots).astype(jnp.int32)


def _read_json(path: str):
    """The JSON document at ``path``; PlacementError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise PlacementError(f"{path}: cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlacementError(f"{path}: not JSON ({e})") from None


def read_expert_load(path: str, num_experts: int) -> dict[int, np.ndarray]:
    """{MoE layer index: tokens_per_expert float64 [E]} of a load file
    (module docstring). PlacementError naming the file, the layer and the
    field for anything else: not JSON, not an object of layers, a
    tokens_per_expert (or mean_score_per_expert) of another length than
    ``num_experts``, negative or non-integer counts."""
    doc = _read_json(path)
    if not isinstance(doc, dict) or not doc:
        raise PlacementError(f"{path}: expected a JSON object keyed by MoE layer index")
    out = {}
    for key, entry in doc.items():
        where = f"{path}: layer {key!r}"
        if not key.isdigit():
            raise PlacementError(f"{where}: a layer key must be a layer index")
        if not isinstance(entry, dict) or "tokens_per_expert" not in entry:
            raise PlacementError(f"{where}: no tokens_per_expert")
        counts = entry["tokens_per_expert"]
        if not isinstance(counts, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in counts):
            raise PlacementError(f"{where}: tokens_per_expert must be a list of integers")
        load = check_load(counts, num_experts, f"{where}: tokens_per_expert")
        scores = entry.get("mean_score_per_expert")
        if scores is not None and (not isinstance(scores, list) or len(scores) != num_experts):
            raise PlacementError(f"{where}: mean_score_per_expert must be a list of "
                                 f"{num_experts} numbers")
        out[int(key)] = load
    return dict(sorted(out.items()))


def placements_to_json(placements: dict[int, ExpertPlacement]) -> dict:
    """The placement file's object: one placement per MoE layer index."""
    return {"format": FILE_FORMAT, "version": VERSION,
            "layers": {str(layer): p.to_json() for layer, p in sorted(placements.items())}}


def placements_from_json(doc, where: str = "placements") -> dict[int, ExpertPlacement]:
    """{layer: placement} of a ``placements_to_json`` object (PlacementError
    naming ``where``, the layer and the field otherwise)."""
    if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT or \
            doc.get("version") != VERSION or not isinstance(doc.get("layers"), dict):
        raise PlacementError(f"{where}: not a {FILE_FORMAT} version {VERSION} file")
    out = {}
    for key, entry in doc["layers"].items():
        if not key.isdigit():
            raise PlacementError(f"{where}: layer key {key!r} is not a layer index")
        out[int(key)] = ExpertPlacement.from_json(entry, f"{where}: layer {key}")
    return out


def write_placements(path: str, placements: dict[int, ExpertPlacement]) -> None:
    """Write the placement file at ``path`` whole or not at all."""
    def write(f) -> None:
        f.write(json.dumps(placements_to_json(placements), indent=1) + "\n")
    atomic_write(path, write, mode="w")


def read_placements(path: str) -> dict[int, ExpertPlacement]:
    """{layer: placement} of a placement file (PlacementError naming the file)."""
    doc = _read_json(path)
    return placements_from_json(doc, path)


__all__ = ["FILE_FORMAT", "FORMAT", "VERSION", "ExpertPlacement", "PlacementError",
           "balanced_packing", "check_load", "check_sizes", "device_loads", "imbalance",
           "node_loads", "place_experts", "placements_from_json", "placements_to_json",
           "read_expert_load", "read_placements", "replica_choice", "replicate",
           "uniform_placement", "write_placements"]
