"""k3jax.layout: the shared-expert gate (SPEC 4), ParallelConfig validation,
make_mesh errors, the padding rule (SPEC 5), the Layout's properties and its
build decisions (backend from the mesh's devices, expert storage, dtype).

Everything here is planning (no weights), so K3's full sizes are used.
"""

from __future__ import annotations

import re
import types
import typing

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax import (
    DATA,
    K3,
    TENSOR,
    TINY,
    Layout,
    MlpMode,
    MoEMode,
    ParallelConfig,
    make_layout,
    make_mesh,
    mlp_layout,
    padded_moe_intermediate,
)
from k3jax.formats import ExpertStorage, Mxfp4Format
from k3jax.formats.mxfp4 import PARAM_NAMES as MXFP4_PARAMS
from k3jax.layout import (
    SHARD_SHARED_EXPERT_ENV,
    Dispatch,
    ExpertShardError,
    LayoutError,
    MlpLayout,
    SharedOverlap,
    abstract_mesh,
)
from k3jax.modules import AbstractSource, KimiMLP, build_layer
from k3jax.modules.params import Padding
from pallas_kernels.backend import INTERPRET, XLA, BackendName, resolve_backend

H, SHARED_I, DENSE_I = 7168, 6144, 33792       # K3 hidden, shared expert (2 x 3072), dense MLP
ENV = SHARD_SHARED_EXPERT_ENV


def sp(tp, shard, dp=1, **kw):
    return ParallelConfig(dp=dp, tp=tp, sequence_parallel=True, shard_shared_expert=shard, **kw)


@pytest.fixture(autouse=True)
def _no_env_opt_in(monkeypatch):
    """The gate's default must not depend on the caller's environment."""
    monkeypatch.delenv(ENV, raising=False)


# -- the gate: SPEC 4's five cases --------------------------------------------
def test_gate_on_sp_tp8_shards_over_the_tensor_axis():
    assert mlp_layout(sp(8, True), H, SHARED_I).overlap is SharedOverlap.AUTO   # the default
    gate = mlp_layout(sp(8, True, shared_overlap=SharedOverlap.RING), H, SHARED_I)
    assert gate.mode is MlpMode.SP_SHARDED
    assert gate.weight_axes == (TENSOR,)
    assert gate.param_specs == {"gate_DF": P(None, (TENSOR,)), "up_DF": P(None, (TENSOR,)),
                                "down_FD": P((TENSOR,), None)}
    assert gate.collectives == ("collective-permute",) * 14
    unoverlapped = mlp_layout(sp(8, True, shared_overlap=SharedOverlap.NONE), H, SHARED_I)
    assert unoverlapped.collectives == ("all-gather", "reduce-scatter")
    assert unoverlapped.param_specs == gate.param_specs
    assert (gate.hidden, gate.intermediate) == (H, SHARED_I)


def test_overlap_applies_to_sp_sharded_mlps_only():
    """Decided once: only an SP-sharded MLP carries RING; the other modes NONE."""
    for par in (sp(8, False), ParallelConfig(tp=8), ParallelConfig(dp=8)):
        assert par.shared_overlap is SharedOverlap.AUTO
        assert mlp_layout(par, H, SHARED_I).overlap is SharedOverlap.NONE
    with pytest.raises(ValueError, match="overlap ring needs an SP-sharded MLP"):
        MlpLayout(MlpMode.TP, ParallelConfig(tp=8), H, SHARED_I, (TENSOR,), "x", SharedOverlap.RING)
    # strings and enums alike: the value (the CLI's flag) is the member
    assert ParallelConfig(tp=8, shared_overlap="ring").shared_overlap is SharedOverlap.RING
    with pytest.raises(ValueError, match="shared_overlap must be one of 'none', 'ring', "
                                         "'weights', 'auto' .*got 'rings'"):
        ParallelConfig(tp=8, shared_overlap="rings")


def test_gate_off_sp_tp8_replicates():
    gate = mlp_layout(sp(8, False), H, SHARED_I)
    assert gate.mode is MlpMode.REPLICATED and gate.weight_axes == ()
    assert gate.param_specs == {"gate_DF": P(None, None), "up_DF": P(None, None),
                                "down_FD": P(None, None)}
    assert gate.collectives == ()
    assert "opt-in" in gate.reason


def test_gate_on_without_sp_is_plain_tp_not_the_sp_layout():
    gate = mlp_layout(ParallelConfig(tp=8, shard_shared_expert=True), H, SHARED_I)
    assert gate.mode is not MlpMode.SP_SHARDED
    assert gate.mode is MlpMode.TP and gate.collectives == ("all-reduce",)


def test_gate_on_sp_tp1_is_rejected_and_tp1_never_shards():
    with pytest.raises(ValueError, match=r"sequence_parallel needs tp > 1"):
        sp(1, True)
    gate = mlp_layout(ParallelConfig(tp=1, shard_shared_expert=True), H, SHARED_I)
    assert gate.mode is MlpMode.REPLICATED and gate.weight_axes == ()
    assert "sequence parallel" in gate.reason
    dp8 = mlp_layout(ParallelConfig(dp=8, shard_shared_expert=True), H, SHARED_I)
    assert dp8.mode is MlpMode.REPLICATED and dp8.weight_axes == ()


def test_gate_on_sp_tp5_does_not_shard_and_says_why():
    gate = mlp_layout(sp(5, True), H, SHARED_I)          # 7168 % 5 = 3, 6144 % 5 = 4
    assert gate.mode is MlpMode.REPLICATED and gate.weight_axes == ()
    assert "tp=5" in gate.reason and "not divisible" in gate.reason


@pytest.mark.parametrize("tp, hidden, inter, shards", [
    (16, H, SHARED_I, True),        # both divide
    (32, H, SHARED_I, True),
    (3, H, SHARED_I, False),        # 6144 % 3 == 0 but 7168 % 3 == 1: hidden fails
    (7, H, SHARED_I, False),        # 7168 % 7 == 0 but 6144 % 7 == 5: intermediate fails
    (8, H, SHARED_I + 4, False),    # intermediate % 8 == 4
    (8, H + 4, SHARED_I, False),    # hidden % 8 == 4
])
def test_gate_divisibility(tp, hidden, inter, shards):
    gate = mlp_layout(sp(tp, True), hidden, inter)
    assert (gate.mode is MlpMode.SP_SHARDED) is shards
    assert gate.weight_axes == ((TENSOR,) if shards else ())


# -- the opt-in: explicit bool, else the environment variable ------------------
@pytest.mark.parametrize("env, explicit, shards", [
    (None, None, False),           # default off
    ("1", None, True),
    ("0", None, False),
    ("", None, False),
    ("1", False, False),           # the explicit bool wins
    ("0", True, True),
    ("yes", True, True),           # a bad value is never read when the bool is given
])
def test_env_fallback(monkeypatch, env, explicit, shards):
    if env is not None:
        monkeypatch.setenv(ENV, env)
    par = sp(8, explicit)
    assert par.shard_shared_expert is shards
    assert (mlp_layout(par, H, SHARED_I).mode is MlpMode.SP_SHARDED) is shards
    assert (make_layout(K3, par).shared_mlp.mode is MlpMode.SP_SHARDED) is shards


@pytest.mark.parametrize("bad", ["yes", "true", "2", "on"])
def test_env_bad_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(ValueError, match=rf"{ENV} must be 0 or 1, got '{bad}'"):
        mlp_layout(sp(8, None), H, SHARED_I)


def test_env_is_read_once_at_construction(monkeypatch):
    """The opt-in is decided when the ParallelConfig is built: a later change
    of the variable moves neither the layout nor its description."""
    monkeypatch.setenv(ENV, "1")
    par = sp(8, None)
    monkeypatch.setenv(ENV, "0")
    layout = make_layout(K3, par)
    assert par.shard_shared_expert is True and layout.shared_mlp.mode is MlpMode.SP_SHARDED
    assert "shard-shared-expert requested" in par.describe()
    monkeypatch.setenv(ENV, "bad")
    assert make_layout(K3, par).shared_mlp.mode is MlpMode.SP_SHARDED   # not re-read


@pytest.mark.parametrize("par", [dict(), dict(tp=8), dict(dp=8, expert_parallel=True)],
                         ids=["single", "tp8", "ep_dp8"])
def test_env_is_not_read_without_sp(monkeypatch, par):
    """Without sequence parallelism the opt-in cannot matter: even a malformed
    value is not read, and None resolves to False."""
    monkeypatch.setenv(ENV, "yes")
    parallel = ParallelConfig(**par)
    assert parallel.shard_shared_expert is False
    assert "shard-shared-expert" not in make_layout(TINY, parallel).describe()


@pytest.mark.parametrize("bad", [1, "1", 0.0])
def test_shard_shared_expert_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=rf"ParallelConfig.shard_shared_expert must be a bool "
                                         rf"or None, got {bad!r}"):
        sp(8, bad)


# -- one gate for the dense MLP and the shared expert --------------------------
@pytest.mark.parametrize("par", [sp(8, True), sp(8, False), sp(4, True, dp=2), sp(16, True),
                                 ParallelConfig(tp=8), ParallelConfig(dp=8)],
                         ids=["sp8-on", "sp8-off", "sp-dp2-tp4-on", "sp16-on", "tp8", "dp8"])
def test_same_gate_serves_dense_mlp_and_shared_expert(par):
    layout = make_layout(K3, par)
    assert layout.dense_mlp == mlp_layout(par, H, DENSE_I, layer_kind="dense")
    assert layout.shared_mlp == mlp_layout(par, H, SHARED_I)
    assert K3.intermediate_size == DENSE_I and K3.shared_intermediate_size == SHARED_I


def test_dense_and_shared_can_differ_by_divisibility():
    """Same gate, different widths: 33796 % 8 == 4 keeps the dense MLP
    replicated while the shared expert (6144) shards."""
    cfg = K3.replace(intermediate_size=DENSE_I + 4)
    layout = make_layout(cfg, sp(8, True))
    assert layout.shared_mlp.mode is MlpMode.SP_SHARDED
    assert layout.dense_mlp.mode is MlpMode.REPLICATED and "33796" in layout.dense_mlp.reason
    assert make_layout(K3, sp(8, True)).dense_mlp.mode is MlpMode.SP_SHARDED


# -- validation errors name the culprit ----------------------------------------
def test_make_mesh_rejects_a_device_count_mismatch(eight_devices):
    with pytest.raises(ValueError, match=r"dp \* tp = 4 \* 8 = 32 but 16 devices"):
        make_mesh(ParallelConfig(dp=4, tp=8))
    with pytest.raises(ValueError, match=r"dp \* tp = 1 \* 4 = 4 but 8 devices"):
        make_mesh(ParallelConfig(tp=4), devices=eight_devices)
    mesh = make_mesh(ParallelConfig(dp=2, tp=4), devices=eight_devices)
    assert dict(mesh.shape) == {DATA: 2, TENSOR: 4}


def test_experts_must_divide_the_ep_size():
    with pytest.raises(ValueError, match=r"num_experts 896 is not divisible by the EP size "
                                         r"dp\*tp = 256"):
        make_layout(K3, sp(8, False, dp=32, expert_parallel=True))
    with pytest.raises(ValueError, match=r"num_experts 16 .* EP size dp\*tp = 3"):
        make_layout(TINY, ParallelConfig(dp=3, expert_parallel=True))
    assert make_layout(K3, sp(8, False, dp=16, expert_parallel=True)).local_experts == 7


@pytest.mark.parametrize("kwargs, culprit", [
    ({"tp": 1, "sequence_parallel": True}, r"sequence_parallel needs tp > 1"),
    ({"dp": 8, "sequence_parallel": True}, r"sequence_parallel needs tp > 1"),
    ({"tp": 8, "pad_under_ep": True}, r"pad_under_ep only means something with expert_parallel"),
    ({"dp": 0}, r"ParallelConfig.dp must be a positive integer, got 0"),
    ({"tp": 2.0}, r"ParallelConfig.tp must be a positive integer, got 2.0"),
    ({"tp": True}, r"ParallelConfig.tp must be a positive integer, got True"),
])
def test_parallel_config_validation(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        ParallelConfig(**kwargs)


def test_plain_tp_rejects_sizes_it_cannot_split():
    with pytest.raises(ValueError, match=r"intermediate size 6144 is not divisible by tp=5"):
        mlp_layout(ParallelConfig(tp=5), H, SHARED_I)
    with pytest.raises(ValueError, match=r"moe_intermediate_size 3072 is not divisible by the 5 "
                                         r"devices splitting each expert's intermediate"):
        make_layout(K3, ParallelConfig(tp=5))
    with pytest.raises(ValueError, match=r"intermediate size 33796 is not divisible by tp=8"):
        make_layout(K3.replace(intermediate_size=DENSE_I + 4), ParallelConfig(tp=8))


# -- padding (SPEC 5) ------------------------------------------------------------
@pytest.mark.parametrize("shards, padded", [(1, 3072), (8, 3072), (16, 4096), (32, 8192)])
def test_padded_moe_intermediate_spec_cases(shards, padded):
    assert padded_moe_intermediate(3072, shards, 256) == padded


def test_padding_needs_the_shards_to_divide_the_intermediate():
    """3000 / 16 = 187.5: a per-shard width would silently drop columns."""
    with pytest.raises(ValueError, match=r"moe_intermediate_size 3000 is not divisible by the 16 "):
        padded_moe_intermediate(3000, 16, 256)
    with pytest.raises(ValueError, match=r"moe_intermediate_size 3000 .* by the 16 devices"):
        make_layout(K3.replace(moe_intermediate_size=3000),
                    sp(8, False, dp=2, expert_parallel=True, pad_under_ep=True))
    with pytest.raises(ValueError, match=r"Padding: 3000 real entries do not split into 16 equal "
                                         r"blocks \(axis 2\)"):
        Padding(2, 16, 3000)
    assert padded_moe_intermediate(3008, 16, 256) == 4096 and Padding(2, 16, 3008).real == 3008


@pytest.mark.parametrize("tp, padded", [(8, 3072), (16, 4096), (32, 8192)])
def test_plain_tp_layout_pads(tp, padded):
    layout = make_layout(K3, ParallelConfig(tp=tp))
    assert (layout.moe_mode, layout.expert_shards, layout.padded_moe_intermediate) == (
        MoEMode.TP, tp, padded)


@pytest.mark.parametrize("dp, tp, old", [(1, 8, 3072), (2, 8, 4096), (4, 8, 8192)])
def test_ep_never_pads_unless_asked_for_the_old_behaviour(dp, tp, old):
    layout = make_layout(K3, sp(tp, None, dp=dp, expert_parallel=True))
    ep = dp * tp
    assert layout.parallel.ep == ep
    assert (layout.moe_mode, layout.expert_shards, layout.padded_moe_intermediate) == (
        MoEMode.EP, 1, 3072)
    assert layout.local_experts == 896 // ep
    old_layout = make_layout(K3, sp(tp, None, dp=dp, expert_parallel=True, pad_under_ep=True))
    assert old_layout.padded_moe_intermediate == old
    assert old_layout.expert_shards == 1


def test_tiny_pads_at_tp8_only():
    """TINY's min 16 per partition: 64 / 8 = 8 < 16 pads to 128; 64 / 4 = 16 does not."""
    assert make_layout(TINY, ParallelConfig(tp=8)).padded_moe_intermediate == 128
    assert make_layout(TINY, sp(8, True)).padded_moe_intermediate == 128
    assert make_layout(TINY, ParallelConfig(tp=4)).padded_moe_intermediate == 64
    assert make_layout(TINY, sp(8, True, expert_parallel=True)).padded_moe_intermediate == 64


# -- Layout properties -------------------------------------------------------------
# name: (parallel, moe_mode, shared mode, token_axes, row_shards, expert_axes,
#        dispatch_axes, shared_overlaps_routed)
REPL, SPS, TP = MlpMode.REPLICATED, MlpMode.SP_SHARDED, MlpMode.TP
LAYOUT_TABLE = {
    "single": (ParallelConfig(), MoEMode.LOCAL, REPL, (DATA,), 1, (), (), True),
    "dp8": (ParallelConfig(dp=8), MoEMode.LOCAL, REPL, (DATA,), 8, (), (), True),
    "tp8": (ParallelConfig(tp=8), MoEMode.TP, TP, (DATA,), 1, (), (), False),
    "dp2_tp4": (ParallelConfig(dp=2, tp=4), MoEMode.TP, TP, (DATA,), 2, (), (), False),
    "sp_tp8_repl": (sp(8, False), MoEMode.TP, REPL, (DATA, TENSOR), 8, (), (TENSOR,), True),
    "sp_tp8_shard": (sp(8, True), MoEMode.TP, SPS, (DATA, TENSOR), 8, (), (TENSOR,), True),
    "sp_dp2_tp4_shard": (sp(4, True, dp=2), MoEMode.TP, SPS, (DATA, TENSOR), 8, (), (TENSOR,),
                         True),
    "sp_ep_tp8_repl": (sp(8, False, expert_parallel=True), MoEMode.EP, REPL, (DATA, TENSOR), 8,
                       (DATA, TENSOR), (DATA, TENSOR), True),
    "sp_ep_tp8_shard": (sp(8, True, expert_parallel=True), MoEMode.EP, SPS, (DATA, TENSOR), 8,
                        (DATA, TENSOR), (DATA, TENSOR), True),
    "sp_ep_dp2_tp4_shard": (sp(4, True, dp=2, expert_parallel=True), MoEMode.EP, SPS,
                            (DATA, TENSOR), 8, (DATA, TENSOR), (DATA, TENSOR), True),
    "ep_dp8": (ParallelConfig(dp=8, expert_parallel=True), MoEMode.EP, REPL, (DATA,), 8, (DATA,),
               (DATA,), True),
    "ep_tp8": (ParallelConfig(tp=8, expert_parallel=True), MoEMode.EP, TP, (DATA,), 1,
               (DATA, TENSOR), (), False),
    "ep_dp2_tp4": (ParallelConfig(dp=2, tp=4, expert_parallel=True), MoEMode.EP, TP, (DATA,), 2,
                   (DATA, TENSOR), (DATA,), False),
}


@pytest.mark.parametrize("name", list(LAYOUT_TABLE))
def test_layout_properties(name):
    (par, moe_mode, shared_mode, token_axes, row_shards, expert_axes, dispatch_axes,
     overlaps) = LAYOUT_TABLE[name]
    layout = make_layout(TINY, par)
    assert layout.moe_mode is moe_mode
    assert layout.shared_mlp.mode is shared_mode
    assert layout.token_axes == token_axes
    assert layout.row_shards == row_shards
    assert layout.x_TD == P(token_axes, None)
    assert layout.expert_axes == expert_axes
    assert layout.dispatch_axes == dispatch_axes
    plain_tp = par.tp > 1 and not par.sequence_parallel      # TP, or EP over plain TP
    assert layout.dispatch is (Dispatch.ALL_REDUCE if plain_tp else Dispatch.OWN_ROWS)
    assert (layout.dispatch is Dispatch.ALL_REDUCE) is (shared_mode is MlpMode.TP)
    assert layout.local_experts == (16 // par.num_devices if moe_mode is MoEMode.EP else 16)
    assert layout.shared_overlaps_routed is overlaps

    specs = layout.moe_param_specs()
    assert set(specs) == {"router_DE", "router_bias_E", "lat_down_DL", "lat_norm_L", "lat_up_LD",
                          "w1_ELF", "w3_ELF", "w2_EFL", "shared.gate_DF", "shared.up_DF",
                          "shared.down_FD"}
    for replicated in ("router_DE", "router_bias_E", "lat_down_DL", "lat_norm_L", "lat_up_LD"):
        assert specs[replicated] == P()
    w13, w2 = {MoEMode.LOCAL: (P(), P()),
               MoEMode.TP: (P(None, None, TENSOR), P(None, TENSOR, None)),
               MoEMode.EP: (P(expert_axes, None, None), P(expert_axes, None, None))}[moe_mode]
    assert (specs["w1_ELF"], specs["w3_ELF"], specs["w2_EFL"]) == (w13, w13, w2)
    assert specs["shared.gate_DF"] == layout.shared_mlp.gate_DF

    text = layout.describe()
    assert f"routed experts: {moe_mode.value}" in text
    assert f"shared expert: {shared_mode.value}" in text
    assert f"shared expert may overlap routed work: {overlaps}" in text


@pytest.mark.parametrize("dp, overlaps", [(1, True), (2, False)])
def test_the_unoverlapped_sharded_shared_expert_claims_overlap_only_at_dp1(dp, overlaps):
    """The ring is claimed in every SP layout, and so is the default, auto; the all-gather /
    reduce-scatter form only where the tensor axis spans the mesh (what the
    compiled H200 schedule keeps: tests/test_aot_layouts.py)."""
    for ep in (False, True):
        par = sp(8 // dp, True, dp=dp, expert_parallel=ep, shared_overlap=SharedOverlap.NONE)
        assert make_layout(K3, par).shared_overlaps_routed is overlaps
        ring = sp(8 // dp, True, dp=dp, expert_parallel=ep, shared_overlap=SharedOverlap.RING)
        assert make_layout(K3, ring).shared_overlaps_routed is True
        assert make_layout(K3, sp(8 // dp, True, dp=dp, expert_parallel=ep)
                           ).shared_overlaps_routed is True


def test_shared_overlaps_routed_is_a_typed_property():
    """The overlap contract is declared on Layout (SPEC 4), not probed from an attribute."""
    prop = Layout.__dict__["shared_overlaps_routed"]
    assert isinstance(prop, property)
    assert typing.get_type_hints(prop.fget)["return"] is bool
    assert prop.__doc__ and "collective" in prop.__doc__
    layout = make_layout(TINY, sp(8, True))
    with pytest.raises(AttributeError):
        layout.shared_overlaps_routed = False       # frozen, read-only: a contract, not a knob


def test_layout_is_decided_once_and_frozen():
    layout = make_layout(K3, sp(8, True))
    with pytest.raises(AttributeError):
        layout.moe_mode = MoEMode.LOCAL
    assert make_layout(K3, sp(8, True)) == layout


# -- the build decisions: expert storage, backend, dtype ---------------------------
@pytest.mark.parametrize("cfg, par, words", [
    (TINY, ParallelConfig(tp=8), "per-shard intermediate (8) to be a multiple of 32"),
    (TINY, ParallelConfig(tp=4), "per-shard intermediate (16) to be a multiple of 32"),
    (TINY.replace(routed_expert_hidden_size=48), ParallelConfig(), "latent width (48)"),
    (TINY.replace(min_moe_intermediate_per_partition=48), ParallelConfig(tp=2),
     "padded per-shard intermediate (48)"),
], ids=["tp8", "tp4", "latent", "padded"])
def test_make_layout_raises_the_mxfp4_shard_error(cfg, par, words):
    """Packed MXFP4 shardability is a layout fact: make_layout refuses it
    (the format's split_refusal), naming the dimension and the way out;
    dense storage (or MXFP4 dequantized on load) of the same layout is fine.
    The earlier name of the error still imports from k3jax.layout."""
    with pytest.raises(ExpertShardError, match=re.escape(words) + ".*store the experts dequantized"):
        make_layout(cfg, par, experts=ExpertStorage.MXFP4)
    for storage in (ExpertStorage.DENSE, ExpertStorage.MXFP4_DEQUANT):
        assert make_layout(cfg, par, experts=storage).experts.name == storage.value
    assert issubclass(ExpertShardError, LayoutError)
    from k3jax.layout import Mxfp4ShardError
    assert Mxfp4ShardError is ExpertShardError


def test_packed_mxfp4_that_splits_is_accepted():
    """The format is named by its ExpertStorage member, its name or itself;
    an unknown name is refused, naming the registered ones."""
    layout = make_layout(TINY, ParallelConfig(tp=2), experts=ExpertStorage.MXFP4)
    assert layout.experts.packed and not ExpertStorage.MXFP4_DEQUANT.packed
    assert isinstance(layout.experts, Mxfp4Format)
    assert make_layout(TINY, ParallelConfig(tp=2), experts="mxfp4") == layout
    assert make_layout(TINY, ParallelConfig(tp=2), experts=Mxfp4Format()) == layout
    with pytest.raises(ValueError, match="unknown expert format 'mxfp5'; registered: dense, mxfp4"):
        make_layout(TINY, ParallelConfig(tp=2), experts="mxfp5")


@pytest.mark.parametrize("par", [ParallelConfig(), ParallelConfig(tp=4),
                                 ParallelConfig(dp=2, tp=2, expert_parallel=True)],
                         ids=["local", "tp4-padded", "ep4"])
def test_packed_mxfp4_codes_keep_the_stored_orientation(par):
    """Packed codes are [E, out, in/2] as the checkpoint stores them, split
    like their weight (spec's last two entries swapped, F's padding moving
    with F); the scales are [E, in/32, out], split and padded as the weight."""
    from k3jax.modules.moe import moe_decls

    cfg = TINY.replace(moe_intermediate_size=128, min_moe_intermediate_per_partition=64)
    layout = make_layout(cfg, par, experts=ExpertStorage.MXFP4)
    E, L, I, F = 16, cfg.routed_expert_hidden_size, 128, layout.padded_moe_intermediate
    shards = layout.expert_shards
    assert (F, shards) == ((256, 4) if par.tp == 4 and not par.expert_parallel else (128, 1))
    names = [name for pair in MXFP4_PARAMS.values() for name in pair]
    decls = {d.name: d for d in moe_decls(layout) if d.name in names}
    assert sorted(decls) == sorted(names) == sorted(layout.experts.param_names())
    specs = layout.moe_param_specs()
    swap = lambda s: s if s == P() else P(*list(s)[:-2], s[2], s[1])  # noqa: E731
    pad = lambda axis, real: Padding(axis, shards, real) if F != I else None  # noqa: E731
    want = {"w1_packed_EFL": ((E, F, L // 2), swap(specs["w1_ELF"]), pad(1, I)),
            "w3_packed_EFL": ((E, F, L // 2), swap(specs["w3_ELF"]), pad(1, I)),
            "w2_packed_ELF": ((E, L, F // 2), swap(specs["w2_EFL"]), pad(2, I // 2)),
            "w1_scale_ELF": ((E, L // 32, F), specs["w1_ELF"], pad(2, I)),
            "w3_scale_ELF": ((E, L // 32, F), specs["w3_ELF"], pad(2, I)),
            "w2_scale_EFL": ((E, F // 32, L), specs["w2_EFL"], pad(1, I // 32))}
    for name, (shape, spec, padding) in want.items():
        d = decls[name]
        assert (d.shape, d.spec, d.padding, d.dtype) == (shape, spec, padding, jnp.uint8), name


def test_backend_is_resolved_once_from_the_mesh_devices(eight_devices, monkeypatch):
    """"auto" is resolved from the mesh's devices when the Layout is made: a
    CPU mesh says xla even if jax.devices() claimed Hopper GPUs, and an
    explicit backend is kept as given."""
    par = ParallelConfig(tp=8)
    mesh = make_mesh(par, eight_devices)
    hopper = [types.SimpleNamespace(platform="gpu", compute_capability="9.0")] * 8
    monkeypatch.setattr(jax, "devices", lambda *a: hopper)
    layout = make_layout(TINY, par, mesh)
    assert layout.backend == XLA
    assert resolve_backend("auto", hopper) == "pallas"
    assert resolve_backend("auto", mesh.devices.flat) == "xla"
    assert make_layout(TINY, par, mesh, backend="interpret").backend == INTERPRET
    assert make_layout(TINY, par, mesh, backend=BackendName.INTERPRET).backend == INTERPRET
    assert make_layout(TINY, par, mesh, backend=INTERPRET).backend == INTERPRET
    assert make_layout(TINY, par).backend == XLA            # no devices: planning only
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        make_layout(TINY, par, mesh, backend="cuda")


def test_one_backend_for_one_kind_of_device():
    mixed = [types.SimpleNamespace(platform="gpu", compute_capability="9.0"),
             types.SimpleNamespace(platform="gpu", compute_capability="8.0")]
    with pytest.raises(ValueError, match="mix platforms / compute capabilities"):
        resolve_backend("auto", mixed)
    cuda = [types.SimpleNamespace(platform="cuda", compute_capability="9.0")]
    assert resolve_backend("auto", cuda) == "pallas"


def test_make_layout_refuses_a_mesh_that_is_not_the_parallel_configs(eight_devices):
    with pytest.raises(ValueError, match=r"make_layout: mesh \{.*\} does not match the layout"):
        make_layout(TINY, ParallelConfig(tp=8), make_mesh(ParallelConfig(dp=8), eight_devices))


def test_the_modules_read_the_layouts_decisions(eight_devices, monkeypatch):
    """dtype, backend and expert storage come from the Layout alone: the MoE's
    parameters and the backend its routed experts are called with."""
    from k3jax.modules import moe as moe_module

    par = ParallelConfig(tp=2)
    mesh = make_mesh(par, eight_devices[:2])
    layout = make_layout(TINY, par, mesh, backend="interpret", experts=ExpertStorage.MXFP4,
                         dtype=jnp.bfloat16)
    module = build_layer(layout, 1, mesh, source=AbstractSource())
    assert (module.backend, module.experts.name, module.dtype) == (INTERPRET, "mxfp4",
                                                                   jnp.bfloat16)
    assert module.w1_packed_EFL.dtype == jnp.uint8 and module.lat_down_DL.dtype == jnp.bfloat16
    assert module.shared.backend == INTERPRET and module.shared.dtype == jnp.bfloat16
    seen = []

    def spy(*args, backend, **kw):
        seen.append(backend)
        return jnp.zeros((args[0].shape[0], args[0].shape[1]), jnp.float32)

    monkeypatch.setattr(moe_module, "routed_experts", spy)
    moe_module.moe_forward.cache_clear()
    try:
        graph, state = nnx.split(module)
        jax.eval_shape(lambda s, x: nnx.merge(graph, s)(x), state,
                       jax.ShapeDtypeStruct((4, TINY.hidden_size), jnp.bfloat16))
    finally:
        moe_module.moe_forward.cache_clear()
    assert seen == [INTERPRET]


def test_an_mlp_takes_its_placement_from_its_layout():
    layout = make_layout(TINY, ParallelConfig(tp=2))
    other = make_layout(TINY.replace(intermediate_size=320), ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="KimiMLP: mlp must be the Layout's dense_mlp or shared_mlp"):
        KimiMLP(layout, other.dense_mlp, abstract_mesh(ParallelConfig(tp=2)), source=AbstractSource())
