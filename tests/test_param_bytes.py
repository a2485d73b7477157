"""Per-device bytes of the shared expert's parameters: measured from the placed
arrays' addressable shards (8 simulated devices) and checked against
k3jax.tools.memory.param_shard_bytes; sharded = replicated / tp exactly (SPEC 4, 6).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from k3jax import K3, TINY, AbstractSource, MlpMode, ParallelConfig, abstract_mesh, build_layer, make_layout
from k3jax.tools.memory import addressable_bytes_per_device, param_shard_bytes
from layout_cases import LAYOUTS, MOE_LAYER, module

SHARED = ("gate_DF", "up_DF", "down_FD")


def shared_bytes_per_device(moe) -> dict:
    """{device: bytes of shared.{gate,up,down} shards resident on it}, from the arrays."""
    out: dict = {}
    for name in SHARED:
        for shard in getattr(moe.shared, name)[...].addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def replicated_shared_bytes(cfg, itemsize: int) -> int:
    D, F = cfg.hidden_size, cfg.shared_intermediate_size
    return 3 * D * F * itemsize


@pytest.mark.parametrize("name", ["sp_tp8_repl", "sp_tp8_shard", "sp_dp2_tp4_shard",
                                  "sp_ep_tp8_shard", "tp8"])
def test_shared_expert_bytes_per_device(eight_devices, name):
    layout = make_layout(TINY, LAYOUTS[name])
    moe = module(TINY, name, MOE_LAYER)[0]
    full = replicated_shared_bytes(TINY, 4)                       # 3 x 96 x 128 x 4 B
    split = layout.parallel.tp if layout.shared_mlp.mode is not MlpMode.REPLICATED else 1
    measured = shared_bytes_per_device(moe)
    assert set(measured) == set(eight_devices)
    assert all(b * split == full for b in measured.values()), (split, measured)
    planned = param_shard_bytes(moe)
    assert sum(planned[f"shared.{n}"] for n in SHARED) * split == full
    assert all(b == sum(planned[f"shared.{n}"] for n in SHARED) for b in measured.values())


@pytest.mark.parametrize("name", ["sp_tp8_shard", "sp_ep_dp2_tp4_shard", "tp8", "ep_dp8"])
def test_planned_bytes_are_the_resident_bytes(eight_devices, name):
    """Every parameter, every device: what param_shard_bytes plans is what the
    placed arrays occupy (the layouts split everything evenly)."""
    moe = module(TINY, name, MOE_LAYER)[0]
    per_device = addressable_bytes_per_device(moe)
    assert set(per_device) == set(eight_devices)
    assert set(per_device.values()) == {sum(param_shard_bytes(moe).values())}


def test_sharded_shared_expert_saves_exactly_a_factor_tp(eight_devices):
    repl = shared_bytes_per_device(module(TINY, "sp_tp8_repl", MOE_LAYER)[0])
    shard = shared_bytes_per_device(module(TINY, "sp_tp8_shard", MOE_LAYER)[0])
    assert set(repl) == set(shard)
    assert all(repl[d] == 8 * shard[d] for d in repl)


@pytest.mark.parametrize("tp", [4, 8])
def test_k3_shared_expert_bytes_spec6(tp):
    """K3 in bf16, planned on an abstract mesh (nothing allocated): 264,241,152 B
    per layer replicated, a tp-th of it sharded; 92 layers at tp 4 save 16.98 GiB."""
    GiB = 2**30
    per_layer = {}
    for shard in (False, True):
        par = ParallelConfig(tp=tp, sequence_parallel=True, shard_shared_expert=shard)
        moe = build_layer(make_layout(K3, par, dtype=jnp.bfloat16), 1, abstract_mesh(par),
                          source=AbstractSource())
        per_layer[shard] = sum(param_shard_bytes(moe)[f"shared.{n}"] for n in SHARED)
    assert per_layer[False] == replicated_shared_bytes(K3, 2) == 264_241_152
    assert per_layer[True] * tp == per_layer[False]
    assert per_layer[False] * K3.num_moe_layers / GiB == 22.640625
    if tp == 4:
        assert (per_layer[False] - per_layer[True]) * K3.num_moe_layers / GiB == 16.98046875
