"""k3jax plan: SPEC 6's figures exactly, agreement with really placed arrays
(tiny preset, 8 devices, every layout), the collectives against the compiled
HLO of the real module, and the CLI's errors."""

from __future__ import annotations

import collections
import json
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import (
    K3,
    TINY,
    ParallelConfig,
    SharedOverlap,
    build_layer,
    make_layout,
    make_mesh,
)
from k3jax.cli import main as cli_main
from k3jax.layout import shared_overlap_choice
from k3jax.tools.memory import addressable_bytes_per_device, param_shard_bytes
from k3jax.tools.plan import (
    COMPONENTS,
    format_gb,
    format_gib,
    layer_param_bytes,
    make_plan,
    moe_collectives,
    plan_layer_bytes,
)
from layout_cases import EXTRA_LAYOUTS, LAYOUTS, count_collectives, permute_axes

MOE_LAYERS = 92
SHARED_PER_LAYER = 7168 * (2 * 6144 + 6144) * 2          # SPEC 6: 264,241,152 B
GIB = 2**30


def routed_bytes(local_experts: int, i_local: int) -> int:
    """SPEC 6: local_experts x 3 x I_local x 3584 x 92 x 0.53125 B, exactly."""
    value = Fraction(local_experts * 3 * i_local * 3584 * MOE_LAYERS) * Fraction("0.53125")
    assert value.denominator == 1
    return int(value)


def ep(n: int, **kw) -> ParallelConfig:
    """EP over n devices as dp (n / 8) x tp 8 with sequence parallelism."""
    return ParallelConfig(dp=n // 8, tp=8, sequence_parallel=True, expert_parallel=True, **kw)


# ---------------------------------------------------------------------------
# SPEC 6, through the library
# ---------------------------------------------------------------------------
def test_shared_expert_figures():
    assert SHARED_PER_LAYER == 264_241_152
    rep = make_plan(K3, ParallelConfig(tp=4, sequence_parallel=True, shard_shared_expert=False))
    assert rep.per_layer_bytes["moe"]["shared_experts"] == SHARED_PER_LAYER
    assert rep.per_device_bytes["shared_experts"] == SHARED_PER_LAYER * MOE_LAYERS
    assert format_gib(rep.per_device_bytes["shared_experts"]) == "22.640625"
    assert rep.per_device_bytes["shared_experts"] == Fraction("22.640625") * GIB

    for sharded in (ParallelConfig(tp=4, sequence_parallel=True, shard_shared_expert=True),
                    ParallelConfig(tp=4)):                      # SP-sharded and plain TP
        plan = make_plan(K3, sharded)
        assert plan.per_device_bytes["shared_experts"] * 4 == SHARED_PER_LAYER * MOE_LAYERS
        saved = rep.per_device_bytes["shared_experts"] - plan.per_device_bytes["shared_experts"]
        assert saved == Fraction("16.98046875") * GIB == 18_232_639_488
        assert format_gib(saved) == "16.98046875"
    plan = make_plan(K3, ParallelConfig(tp=4, sequence_parallel=True, shard_shared_expert=True))
    assert plan.comparisons["shared_experts_saved"] == 18_232_639_488


@pytest.mark.parametrize("parallel, local_experts, i_local, padded, gb", [
    (ParallelConfig(tp=8), 896, 3072 // 8, 3072, "180.81"),
    (ParallelConfig(tp=16), 896, 4096 // 16, 4096, "120.54"),
    (ParallelConfig(tp=32), 896, 8192 // 32, 8192, "120.54"),
    (ep(16), 56, 3072, 3072, "90.40"),
    (ep(32), 28, 3072, 3072, "45.20"),
    (ParallelConfig(dp=16, expert_parallel=True), 56, 3072, 3072, "90.40"),
    (ep(16, pad_under_ep=True), 56, 4096, 4096, "120.54"),
    (ep(32, pad_under_ep=True), 28, 8192, 8192, "120.54"),
    (ParallelConfig(dp=32, expert_parallel=True, pad_under_ep=True), 28, 8192, 8192, "120.54"),
    # EP over plain TP (vLLM's --tp 16 --expert-parallel), with and without the old padding
    (ParallelConfig(tp=16, expert_parallel=True), 56, 3072, 3072, "90.40"),
    (ParallelConfig(tp=16, expert_parallel=True, pad_under_ep=True), 56, 4096, 4096, "120.54"),
    (ParallelConfig(dp=2, tp=8, expert_parallel=True), 56, 3072, 3072, "90.40"),
])
def test_routed_expert_figures(parallel, local_experts, i_local, padded, gb):
    plan = make_plan(K3, parallel)
    assert plan.padded_moe_intermediate_size == padded
    assert plan.per_device_bytes["routed_experts"] == routed_bytes(local_experts, i_local)
    assert format_gb(plan.per_device_bytes["routed_experts"]) == gb
    assert plan.per_device_bytes["total"] == sum(plan.per_device_bytes[c] for c in COMPONENTS)


def test_pad_under_ep_side_by_side():
    fixed, old = make_plan(K3, ep(16)), make_plan(K3, ep(16, pad_under_ep=True))
    assert fixed.comparisons["routed_experts_if_padded_under_ep"] == old.per_device_bytes["routed_experts"]
    assert old.comparisons["routed_experts_with_fix"] == fixed.per_device_bytes["routed_experts"]


def test_dtype_overrides():
    bf16 = make_plan(K3, ParallelConfig(tp=8), expert_dtype="bfloat16")
    f32 = make_plan(K3, ParallelConfig(tp=8), dtype="float32", expert_dtype="float32")
    mx = make_plan(K3, ParallelConfig(tp=8))
    elements = 896 * 3 * 384 * 3584 * MOE_LAYERS
    assert bf16.per_device_bytes["routed_experts"] == 2 * elements
    assert f32.per_device_bytes["routed_experts"] == 4 * elements
    assert mx.per_device_bytes["routed_experts"] * 32 == 17 * elements
    assert f32.per_device_bytes["shared_experts"] == 2 * mx.per_device_bytes["shared_experts"]
    # the router bias is float32 whatever the weight dtype
    assert mx.per_layer_bytes["moe"]["router"] == 7168 * 896 * 2 + 896 * 4


def test_mxfp4_plan_matches_placed_packed_experts(eight_devices):
    """MXFP4 bytes in the plan are the bytes of really placed packed expert
    arrays (uint8 codes + scales), per device, in TP (padded) and EP layouts."""
    from k3jax import RandomSource, make_mesh
    from k3jax.formats import ExpertStorage
    from k3jax.modules.moe import KimiMoE
    from k3jax.tools.memory import addressable_bytes_per_device
    cfg = TINY.replace(moe_intermediate_size=256, min_moe_intermediate_per_partition=64)
    for parallel in (ParallelConfig(tp=8), ParallelConfig(tp=8, sequence_parallel=True,
                                                          expert_parallel=True)):
        mesh = make_mesh(parallel, eight_devices)
        layout = make_layout(cfg, parallel, mesh, experts=ExpertStorage.MXFP4, dtype=jnp.bfloat16)
        module = KimiMoE(layout, mesh, source=RandomSource(0))
        planned = sum(layer_param_bytes(cfg, parallel, 1, dtype="bfloat16").values())
        resident = addressable_bytes_per_device(module)
        assert set(resident.values()) == {planned}, (parallel, resident, planned)


# ---------------------------------------------------------------------------
# SPEC 6, through the CLI
# ---------------------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, component, nbytes, shown", [
    (["--tp", "8"], "routed_experts", routed_bytes(896, 384), "180.81"),
    (["--tp", "16"], "routed_experts", routed_bytes(896, 256), "120.54"),
    (["--tp", "32"], "routed_experts", routed_bytes(896, 256), "120.54"),
    (["--dp", "2", "--tp", "8", "--sequence-parallel", "--expert-parallel"], "routed_experts",
     routed_bytes(56, 3072), "90.40"),
    (["--dp", "32", "--expert-parallel"], "routed_experts", routed_bytes(28, 3072), "45.20"),
    (["--dp", "16", "--expert-parallel", "--pad-under-ep"], "routed_experts",
     routed_bytes(56, 4096), "120.54"),
    (["--dp", "4", "--tp", "8", "--sequence-parallel", "--expert-parallel", "--pad-under-ep"],
     "routed_experts", routed_bytes(28, 8192), "120.54"),
    (["--tp", "16", "--expert-parallel"], "routed_experts", 90_403_504_128, "90.40"),
    (["--tp", "16", "--expert-parallel", "--pad-under-ep"], "routed_experts", 120_538_005_504,
     "120.54"),
    (["--tp", "4", "--sequence-parallel"], "shared_experts", SHARED_PER_LAYER * 92, "22.640625"),
    (["--tp", "4", "--sequence-parallel", "--shard-shared-expert"], "shared_experts",
     SHARED_PER_LAYER * 92 // 4, "5.66015625"),
])
def test_cli_json_figures(capsys, argv, component, nbytes, shown):
    code, out, err = run_cli(capsys, "--preset", "k3", "--json", *argv)
    assert code == 0, err
    doc = json.loads(out)
    per_device = doc["per_device_bytes"]
    assert set(per_device) == {*COMPONENTS, "total"}
    assert all(type(v) is int for v in per_device.values())
    assert per_device[component] == nbytes
    assert shown in (doc["per_device_gb"][component], doc["per_device_gib"][component])
    assert per_device["total"] == sum(per_device[c] for c in COMPONENTS)
    assert isinstance(doc["padded_moe_intermediate_size"], int)
    assert doc["collectives"] and all({"kind", "axis", "bytes"} <= set(c) for c in doc["collectives"])


def test_cli_json_saving_and_default_preset(capsys):
    code, out, _ = run_cli(capsys, "--json", "--tp", "4", "--sequence-parallel",
                           "--shard-shared-expert")
    doc = json.loads(out)
    assert code == 0 and doc["source"] == "preset k3"
    assert doc["comparisons"]["shared_experts_saved"] == 18_232_639_488
    assert format_gib(doc["comparisons"]["shared_experts_saved"]) == "16.98046875"


def test_cli_human_table(capsys):
    code, out, _ = run_cli(capsys, "--tp", "8")
    assert code == 0
    assert "180.81" in out and "routed_experts" in out and "all-reduce" in out
    code, out, _ = run_cli(capsys, "--tp", "4", "--sequence-parallel", "--shard-shared-expert")
    assert "16.98046875" in out and "5.66015625" in out
    code, out, _ = run_cli(capsys, "--dp", "16", "--expert-parallel", "--pad-under-ep")
    assert "120.54" in out and "90.40" in out


@pytest.mark.parametrize("argv, message", [
    (["--dp", "6", "--expert-parallel"], "not divisible by the EP size"),
    (["--tp", "6", "--expert-parallel"], "not divisible by the EP size"),
    (["--preset", "tiny", "--tp", "8"], "multiple of 32"),
])
def test_cli_errors_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_missing_config_file_is_bad_data_exit_1(capsys):
    code, out, err = run_cli(capsys, "--config", "/nonexistent/config.json")
    assert code == 1 and out == ""
    assert "not found" in err and len(err.strip().splitlines()) == 1


def test_cli_bad_preset_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--preset", "nope"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": K3.to_hf_dict()}))
    code, out, _ = run_cli(capsys, "--config", str(path), "--json", "--tp", "8")
    assert code == 0 and json.loads(out)["per_device_bytes"]["routed_experts"] == routed_bytes(896, 384)


# ---------------------------------------------------------------------------
# The planner vs really placed arrays (tiny, 8 devices, every layout)
# ---------------------------------------------------------------------------
class HostRandomSource:
    """Fresh random host values placed shard by shard with the parameter's
    sharding (jax.make_array_from_callback): real per-device buffers, without
    RandomSource's one compilation per parameter (the values do not matter here)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, decl, sharding):
        host = (self.rng.standard_normal(decl.shape) / np.sqrt(max(decl.fan_in, 1))).astype(decl.dtype)
        return jax.make_array_from_callback(decl.shape, sharding, lambda index: host[index])


# Every layout the layout tests use, plus EP without the sharded shared expert on dp2 x tp4.
TINY_LAYOUTS = {**LAYOUTS, **EXTRA_LAYOUTS,
                "sp_ep_dp2_tp4_repl": ParallelConfig(dp=2, tp=4, sequence_parallel=True,
                                                     expert_parallel=True, shard_shared_expert=False)}


@pytest.mark.parametrize("name", TINY_LAYOUTS)
def test_plan_matches_placed_arrays(eight_devices, name):
    parallel = TINY_LAYOUTS[name]
    mesh = make_mesh(parallel, eight_devices[:parallel.num_devices])
    layout = make_layout(TINY, parallel, mesh, backend="xla")
    plan = make_plan(TINY, parallel, dtype="float32", expert_dtype="float32")
    total = 0
    for layer, kind in ((0, "dense"), (1, "moe")):
        module = build_layer(layout, layer, mesh, source=HostRandomSource(layer))
        real = param_shard_bytes(module)
        assert real == layer_param_bytes(TINY, parallel, layer, dtype="float32", expert_dtype="float32")
        resident = addressable_bytes_per_device(module)
        assert set(resident) == set(mesh.devices.flat)
        planned = plan_layer_bytes(TINY, parallel, layer, dtype="float32", expert_dtype="float32")
        assert planned == plan.per_layer_bytes[kind]
        assert set(resident.values()) == {sum(planned.values())}, resident
        count = TINY.num_dense_layers if kind == "dense" else TINY.num_moe_layers
        total += sum(resident.values()) // len(resident) * count
    assert plan.per_device_bytes["total"] == total
    assert plan.padded_moe_intermediate_size == layout.padded_moe_intermediate


# ---------------------------------------------------------------------------
# Collectives vs the compiled HLO of the real module
# ---------------------------------------------------------------------------
HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "s32": "int32", "f16": "float16"}
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|"
                 r"collective-permute)(?:-start)?\(.*?replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


_PERMUTE = re.compile(r"=\s*(\(.*?\)|\S+)\s+collective-permute(?:-start)?\(")


def hlo_collectives(text: str, parallel: ParallelConfig) -> list[tuple[str, tuple[str, ...], str,
                                                                    tuple[int, ...]]]:
    """(kind, axes, dtype, output shape) of every collective in compiled HLO
    text. A combined (variadic) op contributes one entry per operand, so XLA
    combining several collectives into one does not change the result.
    Fails unless every collective instruction of the text was parsed (one
    printed with another replica_groups syntax would otherwise be dropped)."""
    out = []
    parsed = 0
    for line in text.splitlines():
        m = _OP.search(line)
        if m:
            shapes, kind, axes = m.groups()
            axes = tuple(a.strip().strip("'") for a in axes.split(",") if a.strip())
        elif m := _PERMUTE.search(line):       # source_target_pairs instead of replica_groups
            shapes, kind = m.group(1), "collective-permute"
            axes = tuple(a.strip("'") for a in permute_axes(line, parallel).strip("{}").split(","))
            if shapes.startswith("(("):        # async start: ((operands), outputs)
                shapes = shapes[1:shapes.index(")") + 1]
        else:
            continue
        parsed += 1
        for dtype, dims in _ARRAY.findall(shapes):
            out.append((kind, axes, HLO_DTYPES.get(dtype, dtype),
                        tuple(int(d) for d in dims.split(",") if d)))
    instructions = sum(count_collectives(text).values())
    opcodes = len(re.findall(r"\s(?:all-gather|reduce-scatter|all-reduce|all-to-all|"
                             r"collective-permute)(?:-start)?\(", text))
    assert parsed == instructions == opcodes, (parsed, instructions, opcodes)
    return out


def planned_as_hlo(layout, tokens: int):
    """The plan in the HLO's terms: a reduce-scatter's output is its buffer / group."""
    out = []
    for c in moe_collectives(layout, tokens):
        shape = c.shape
        if c.kind == "reduce-scatter":
            shape = (shape[0] // c.group, *shape[1:])
        out.append((c.kind, c.axes, c.dtype, shape))
    return out


@pytest.mark.parametrize("name", ["tp8", "dp2_tp4", "ep_tp8", "ep_dp2_tp4", "sp_tp8_repl", "sp_tp8_shard",
                                  "sp_tp8_shard_none", "sp_dp2_tp4_shard", "sp_dp2_tp4_shard_none",
                                  "sp_ep_tp8_repl", "sp_ep_tp8_shard", "sp_ep_tp8_shard_none",
                                  "sp_ep_dp2_tp4_shard", "sp_ep_dp2_tp4_shard_none",
                                  "sp_ep_dp2_tp4_repl", "ep_dp8", "dp8"])
def test_collectives_match_compiled_hlo(eight_devices, name):
    """Kinds, mesh axes, dtypes and shapes of the planned collectives equal
    those in the compiled program, for T = 32 global tokens fed in the layout's
    row sharding (no collectives at the block's boundary). Compared as
    multisets of per-operand entries: robust to XLA's scheduling and to it
    combining several collectives into one variadic op."""
    parallel = TINY_LAYOUTS[name]
    mesh = make_mesh(parallel, eight_devices[:parallel.num_devices])
    layout = make_layout(TINY, parallel, mesh, backend="xla")
    module = build_layer(layout, 1, mesh, source=HostRandomSource(3))
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    tokens = 32
    x = jax.device_put(np.random.default_rng(5).standard_normal((tokens, TINY.hidden_size),
                                                                dtype=np.float32),
                       NamedSharding(mesh, layout.x_TD))
    text = forward.lower(state, x).compile().as_text()
    compiled = hlo_collectives(text, parallel)
    assert layout.dtype == jnp.float32
    planned = planned_as_hlo(layout, tokens)
    assert collections.Counter(compiled) == collections.Counter(planned), (compiled, planned)
    assert "all-to-all" not in {k for k, *_ in compiled}


def test_collective_bytes_full_size():
    """Bytes per device at K3 size: EP 16 (dp 2 x tp 8, SP), sharded shared expert, T = 1024."""
    layout = make_layout(K3, ep(16, shard_shared_expert=True, shared_overlap=SharedOverlap.NONE),
                         dtype=jnp.bfloat16)
    got = {(c.kind, c.what): (c.axes, c.bytes) for c in moe_collectives(layout, 1024)}
    assert got[("all-gather", "latent rows")] == (("data", "tensor"), 1024 * 3584 * 2)
    assert got[("all-gather", "top-k expert ids")] == (("data", "tensor"), 1024 * 16 * 4)
    assert got[("reduce-scatter", "routed latent (partial sums)")] == (("data", "tensor"), 1024 * 3584 * 4)
    assert got[("all-gather", "shared-expert input rows")] == (("tensor",), 512 * 7168 * 2)
    assert got[("reduce-scatter", "shared-expert partial sums")] == (("tensor",), 512 * 7168 * 4)
    # the ring form: 7 blocks of [64, D] each way, the same bytes over the wire
    ring = moe_collectives(make_layout(K3, ep(16, shard_shared_expert=True,
                                              shared_overlap=SharedOverlap.RING),
                                       dtype=jnp.bfloat16), 1024)
    permutes = [c for c in ring if c.kind == "collective-permute"]
    assert [(c.axes, c.shape, c.dtype) for c in permutes] == (
        [(("tensor",), (64, 7168), "bfloat16")] * 7 + [(("tensor",), (64, 7168), "float32")] * 7)
    unoverlapped = [c for c in moe_collectives(layout, 1024) if c.axes == ("tensor",)]
    assert sum(c.wire_bytes for c in permutes) == sum(c.wire_bytes for c in unoverlapped)
    assert sum(c.wire_bytes for c in permutes) == 7 * 64 * 7168 * (2 + 4)
    tp = moe_collectives(make_layout(K3, ParallelConfig(tp=8), dtype=jnp.bfloat16), 1000)
    assert [(c.kind, c.axes, c.bytes) for c in tp] == [("all-reduce", ("tensor",), 1000 * (3584 + 7168) * 4)]


def test_cli_shared_overlap_flag(capsys):
    """--shared-overlap reaches the layout: ring lists 2 x 7 permutes of
    [T/8, D], none the all-gather + reduce-scatter; the same wire bytes. The
    default, auto, lists the collectives of the form the table picks."""
    base = ["--preset", "k3", "--json", "--tp", "8", "--sequence-parallel", "--shard-shared-expert",
            "--tokens", "1024"]
    docs = {}
    for flag in ([], ["--shared-overlap", "ring"], ["--shared-overlap", "none"]):
        code, out, err = run_cli(capsys, *base, *flag)
        assert code == 0, err
        docs[tuple(flag)] = json.loads(out)
    ring, none = docs[("--shared-overlap", "ring")], docs[("--shared-overlap", "none")]
    auto = docs[()]
    assert auto["parallel"]["shared_overlap"] == "auto"
    form, scatter = shared_overlap_choice.pick(8, 1, 1024)
    assert auto["layout"]["overlap_forms"]["shared_expert"] == form
    assert auto["layout"]["overlap_forms"]["shared_expert_scatter_dtype"] == scatter
    picked = [c for c in auto["collectives"] if c["what"].startswith("shared-expert")]
    if form == "none":
        assert [(c["kind"], c["dtype"]) for c in picked] == [("all-gather", "bfloat16"),
                                                             ("reduce-scatter", scatter)]
    elif form == "ring":
        assert {c["kind"] for c in picked} == {"collective-permute"} and len(picked) == 14
    else:
        assert [c["kind"] for c in picked] == ["all-gather", "all-gather"]
    assert ring["parallel"]["shared_overlap"] == "ring" and none["parallel"]["shared_overlap"] == "none"
    shared = {k: [c for c in d["collectives"] if c["what"].startswith("shared-expert")]
              for k, d in (("ring", ring), ("none", none))}
    assert [c["kind"] for c in shared["ring"]] == ["collective-permute"] * 14
    assert all(c["shape"] == [128, 7168] for c in shared["ring"])
    assert [c["kind"] for c in shared["none"]] == ["all-gather", "reduce-scatter"]
    assert (sum(c["wire_bytes"] for c in shared["ring"]) == sum(c["wire_bytes"] for c in shared["none"])
            == 7 * 128 * 7168 * (2 + 4))
