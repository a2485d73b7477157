"""Where a token's k experts live under expert parallelism: the expected
number of distinct nodes and devices its routed row must reach, exactly for
two routing models, and a Monte Carlo estimate of the same to check them.

Placement (k3jax.layout): E experts over ep devices, E_d = E / ep a device,
device d holding [d E_d, (d + 1) E_d); N nodes of G = ep / N devices, node n
holding devices [n G, (n + 1) G). A token lives on one device (its owner,
(n_o, g_o)) and picks K distinct experts.

Routing models (``Routing``; each an assumption, not a measurement):

  uniform        the K experts are drawn uniformly without replacement from
                 all E: the balanced routing K3's auxiliary-loss-free bias
                 steers towards, and what the committed table assumes;
  skewed(f)      with probability f the K experts are drawn uniformly without
                 replacement from the E / N experts of one node, that node
                 drawn uniformly and independently of the owner (the
                 experts a token picks cluster on one node); otherwise
                 uniform. SKEWED = skewed(0.5) is the stated skewed scenario.

How unevenly the pairs fall on the devices (``Balance``, max / mean a
device and a node; BALANCED for the uniform routing) is a separate input of
the dispatch model: the busiest device sets the layer's time.

Expected per token (``Destinations``):

  nodes          distinct nodes holding >= 1 of its experts
  remote_nodes   of those, the nodes other than the owner's: the rows the
                 all-to-all's stage A sends over InfiniBand
  devices        distinct devices holding >= 1 of its experts
  stage_b_rows   the rows stage B sends over NVLink: for every node the
                 token reaches, the devices there holding one of its experts
                 other than the counterpart (position g_o) that received it

Exact forms. With p(h, E', K) = 1 - prod_{i<K} (E' - h - i) / (E' - i), the
chance that h given experts of E' hold at least one of K drawn without
replacement from the E':

  uniform:       nodes = N p(E/N, E, K), remote_nodes = (N - 1) p(E/N, E, K),
                 devices = ep p(E_d, E, K)
  one node:      nodes = 1, remote_nodes = (N - 1) / N,
                 devices = G p(E_d, E/N, K)
  skewed(f):     f x one node + (1 - f) x uniform, each figure
  stage_b_rows = devices (G - 1) / G in every model: each device of a node is
                 equally likely to hold one of the experts, so the N
                 counterparts at position g_o hold devices / G of them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a token's K experts are drawn (module docstring):
    ``node_fraction`` f of tokens take all K from one node's experts."""

    node_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.node_fraction, (int, float)) and 0.0 <= self.node_fraction <= 1.0):
            raise ValueError(f"Routing.node_fraction must be in [0, 1], got {self.node_fraction!r}")

    @property
    def name(self) -> str:
        f = self.node_fraction
        return "uniform" if f == 0 else f"skewed ({f:.0%} of tokens on one node)"


UNIFORM = Routing(0.0)
SKEWED = Routing(0.5)


@dataclasses.dataclass(frozen=True)
class Balance:
    """How unevenly the routed (token, expert) pairs fall on the devices and
    nodes: ``device`` = max / mean pairs a device, ``node`` = max / mean
    pairs a node (each >= 1; the busiest one sets the layer's time), and the
    expert slots a device holds (None: E / ep, no redundant experts).
    BALANCED is what the committed table assumes. From measured statistics
    (``from_loads``: a load file's tokens_per_device / tokens_per_node) or
    from a placement and a load (``from_placement``)."""

    device: float = 1.0
    node: float = 1.0
    slots_per_device: int | None = None
    source: str = "balanced"

    def __post_init__(self) -> None:
        for name in ("device", "node"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1.0:
                raise ValueError(f"Balance.{name} (max / mean load) must be a finite number "
                                 f">= 1, got {value!r}")
        if self.slots_per_device is not None and (not isinstance(self.slots_per_device, int)
                                                  or self.slots_per_device < 1):
            raise ValueError(f"Balance.slots_per_device must be an integer >= 1 or None, "
                             f"got {self.slots_per_device!r}")

    @property
    def name(self) -> str:
        return (f"{self.source} (max / mean per device {self.device:.3f}, per node "
                f"{self.node:.3f})")

    @classmethod
    def from_loads(cls, tokens_per_device, tokens_per_node, slots_per_device: int | None = None,
                   source: str = "measured") -> Balance:
        """max / mean of measured per-device and per-node counts."""
        ratios = []
        for what, loads in (("tokens_per_device", tokens_per_device),
                            ("tokens_per_node", tokens_per_node)):
            loads = np.asarray(loads, np.float64)
            if loads.ndim != 1 or not loads.size or np.any(loads < 0) or \
                    not np.all(np.isfinite(loads)):
                raise ValueError(f"Balance.from_loads: {what} must be a non-empty list of "
                                 f"counts >= 0")
            ratios.append(float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0)
        return cls(max(ratios[0], 1.0), max(ratios[1], 1.0), slots_per_device, source)

    @classmethod
    def from_placement(cls, placement, tokens_per_expert, source: str = "placement") -> Balance:
        """The balance ``placement`` (k3jax.layout.expert_placement) gives
        ``tokens_per_expert`` [E], each replica an equal share of its expert."""
        from k3jax.layout import expert_placement as xp

        return cls.from_loads(xp.device_loads(placement, tokens_per_expert),
                              xp.node_loads(placement, tokens_per_expert),
                              placement.slots_per_device, source)


BALANCED = Balance()


@dataclasses.dataclass(frozen=True)
class Destinations:
    """Expected destinations of one token's routed row (module docstring)."""

    nodes: float
    remote_nodes: float
    devices: float
    stage_b_rows: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def check_placement(num_experts: int, k: int, ep: int, nodes: int) -> None:
    """ValueError naming the culprit unless E experts split evenly over ep
    devices in ``nodes`` equal nodes and K <= E / nodes (a node can hold a
    token's K distinct experts)."""
    for name, value in (("num_experts", num_experts), ("k", k), ("ep", ep), ("nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if ep % nodes:
        raise ValueError(f"nodes {nodes} does not divide ep {ep}")
    if num_experts % ep:
        raise ValueError(f"ep {ep} does not divide the {num_experts} experts")
    if k > num_experts // nodes:
        raise ValueError(f"k {k} exceeds the {num_experts // nodes} experts of one node")


def hit_probability(held: int, pool: int, k: int) -> float:
    """p(h, E', K): the chance that ``held`` given experts of ``pool`` hold at
    least one of ``k`` drawn uniformly without replacement from the pool."""
    if not 0 <= held <= pool or not 0 <= k <= pool:
        raise ValueError(f"hit_probability: need 0 <= held, k <= pool, got {held}, {k}, {pool}")
    miss = math.prod((pool - held - i) / (pool - i) for i in range(k))
    return 1.0 - miss


def expected(num_experts: int, k: int, ep: int, nodes: int,
             routing: Routing = UNIFORM) -> Destinations:
    """The exact expected Destinations (module docstring)."""
    check_placement(num_experts, k, ep, nodes)
    E, N, G = num_experts, nodes, ep // nodes
    per_device, per_node = E // ep, E // N
    p_node = hit_probability(per_node, E, k)
    uniform = (N * p_node, (N - 1) * p_node, ep * hit_probability(per_device, E, k))
    one_node = (1.0, (N - 1) / N, G * hit_probability(per_device, per_node, k))
    f = routing.node_fraction
    nodes_, remote, devices = (f * a + (1 - f) * b for a, b in zip(one_node, uniform))
    return Destinations(nodes=nodes_, remote_nodes=remote, devices=devices,
                        stage_b_rows=devices * (G - 1) / G)


def sample_experts(rng: np.random.Generator, tokens: int, num_experts: int, k: int, nodes: int,
                   routing: Routing = UNIFORM) -> np.ndarray:
    """[tokens, k] int: each row K distinct expert ids drawn by ``routing``."""
    per_node = num_experts // nodes
    local = rng.random((tokens, num_experts), dtype=np.float32).argpartition(k, axis=1)[:, :k]
    one_node = rng.random((tokens, per_node), dtype=np.float32).argpartition(k, axis=1)[:, :k]
    one_node = one_node + per_node * rng.integers(0, nodes, size=(tokens, 1))
    concentrated = rng.random(tokens) < routing.node_fraction
    return np.where(concentrated[:, None], one_node, local)


def monte_carlo(num_experts: int, k: int, ep: int, nodes: int, routing: Routing = UNIFORM, *,
                tokens: int = 20_000, seed: int = 0) -> tuple[Destinations, Destinations]:
    """(means, standard errors) of the Destinations over ``tokens`` sampled
    tokens, each owned by a uniformly drawn device, counted directly from
    the expert ids (no formula)."""
    check_placement(num_experts, k, ep, nodes)
    rng = np.random.default_rng(seed)
    G = ep // nodes
    ids = sample_experts(rng, tokens, num_experts, k, nodes, routing)
    owner = rng.integers(0, ep, size=tokens)
    rows = np.arange(tokens)[:, None]
    hit_dev = np.zeros((tokens, ep), bool)
    hit_dev[rows, ids // (num_experts // ep)] = True
    hit_node = hit_dev.reshape(tokens, nodes, G).any(axis=2)
    counterparts = hit_dev[rows, (owner % G)[:, None] + G * np.arange(nodes)]
    samples = {"nodes": hit_node.sum(1),
               "remote_nodes": hit_node.sum(1) - hit_node[np.arange(tokens), owner // G],
               "devices": hit_dev.sum(1),
               "stage_b_rows": hit_dev.sum(1) - counterparts.sum(1)}
    means = Destinations(**{name: float(v.mean()) for name, v in samples.items()})
    errors = Destinations(**{name: float(v.std(ddof=1) / math.sqrt(tokens))
                             for name, v in samples.items()})
    return means, errors


__all__ = ["BALANCED", "SKEWED", "UNIFORM", "Balance", "Destinations", "Routing",
           "check_placement", "expected", "hit_probability", "monte_carlo", "sample_experts"]
