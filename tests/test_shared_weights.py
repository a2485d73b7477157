"""The weight-gathered SP-sharded MLP (SharedOverlap.WEIGHTS) and the bf16
reduce-scatter of the token-side forms (ParallelConfig.shared_scatter_dtype),
8 simulated devices, TINY:

- WEIGHTS equals the replicated layout of the same mesh bit for bit, float32
  and bfloat16, dense layer 0 and MoE layer 1, in every SP-sharded layout of
  tests/layout_cases.py (T = 13 does not divide the row blocks: padding rows);
- its gradients equal the single device's (1e-5 relative per tensor), and the
  compiled gradient program reduce-scatters each weight's gradient over
  TENSOR and gathers none;
- at rest its weights are the SP-sharded layout's (same shardings, same bytes);
- the bf16 reduce-scatter of NONE and RING agrees with their float32 form to
  bf16 rounding on fresh random inputs, and the compiled program sends bf16;
- the CLI refuses ``--shared-overlap weights`` without an SP-sharded MLP (exit 2).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from test_grads import compare, flat_grads, named, placed_case

from k3jax import TINY, AbstractSource, MlpMode, SharedOverlap, build_layer, make_layout, make_mesh
from k3jax.cli import main
from k3jax.layout import TENSOR
from k3jax.tools.plan import format_gib, layer_param_bytes, moe_collectives
from layout_cases import (
    EXTRA_LAYOUTS,
    LAYOUTS,
    REPLICATED_PEER,
    WEIGHTS_FORM,
    module,
    output,
)
from numerics import rel_err

pytestmark = pytest.mark.tiers(slow=["test_weights_form_equals_replicated_bitwise_bf16"])

LAYERS = {"dense": 0, "moe": 1}
FP32_TOL = 1e-5
BF16_TOL = 1e-2
T_PAD = 13


def _bitwise(name: str, layer: str, dtype) -> None:
    par = WEIGHTS_FORM[name]
    lay = make_layout(TINY, par)
    assert lay.shared_mlp.mode is MlpMode.SP_SHARDED
    assert lay.shared_mlp.overlap is SharedOverlap.WEIGHTS
    peer = REPLICATED_PEER[name]
    assert make_layout(TINY, EXTRA_LAYOUTS.get(peer) or LAYOUTS[peer]).shared_mlp.mode \
        is MlpMode.REPLICATED
    got = output(TINY, name, LAYERS[layer], T_PAD, dtype)
    want = output(TINY, peer, LAYERS[layer], T_PAD, dtype)
    assert np.all(np.isfinite(got)) and np.any(got)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", list(WEIGHTS_FORM))
def test_weights_form_equals_replicated_bitwise(eight_devices, name, layer):
    _bitwise(name, layer, jnp.float32)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", list(WEIGHTS_FORM))
def test_weights_form_equals_replicated_bitwise_bf16(eight_devices, name, layer):
    _bitwise(name, layer, jnp.bfloat16)


@pytest.mark.parametrize("name", list(WEIGHTS_FORM))
def test_weights_form_stores_the_sharded_layout(name):
    """At rest nothing changes: the same PartitionSpecs and bytes per device as
    the token-side SP-sharded layout."""
    rows = LAYOUTS[name.removesuffix("_weights")]
    weights, sharded = make_layout(TINY, WEIGHTS_FORM[name]), make_layout(TINY, rows)
    assert weights.shared_mlp.param_specs == sharded.shared_mlp.param_specs
    assert weights.dense_mlp.param_specs == sharded.dense_mlp.param_specs
    for layer in LAYERS.values():
        assert (layer_param_bytes(TINY, WEIGHTS_FORM[name], layer, dtype="bfloat16",
                                  expert_dtype="bfloat16")
                == layer_param_bytes(TINY, rows, layer, dtype="bfloat16", expert_dtype="bfloat16"))


def test_weights_form_plans_two_weight_gathers():
    """moe_collectives: gate/up stacked, then the routed path's, then down,
    in the weights' dtype and independent of the token count."""
    lay = make_layout(TINY, WEIGHTS_FORM["sp_ep_tp8_shard_weights"], dtype=jnp.bfloat16)
    D, F = TINY.hidden_size, TINY.shared_intermediate_size
    for tokens in (8, 4096):
        shared = [c for c in moe_collectives(lay, tokens) if c.what.startswith("shared-expert")]
        assert [(c.kind, c.shape, c.dtype, c.axes) for c in shared] == [
            ("all-gather", (2, D, F), "bfloat16", (TENSOR,)),
            ("all-gather", (F, D), "bfloat16", (TENSOR,))]
    planned = moe_collectives(lay, 64)
    assert planned[0].what == "shared-expert gate/up weights"
    assert planned[-1].what == "shared-expert down weights"


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", ["sp_ep_tp8_shard_weights", "sp_dp2_tp4_shard_weights"])
def test_weights_form_gradients_match_single_device(eight_devices, name, layer):
    mod, _, hlo, (_, _, _, dx, grads) = placed_case(name, layer)
    got = named(mod, layer, dx, flat_grads(grads))
    single = placed_case("single", layer)
    want = named(single[0], layer, single[3][3], flat_grads(single[3][4]))
    err = compare(got, want, FP32_TOL, f"{name} vs single")
    print(f"{name} {layer}: vs single {err:.2g}")
    # The transpose of each weight all-gather: a reduce-scatter over TENSOR
    # onto the weight's shard; no gradient of a sharded weight is gathered.
    D = TINY.hidden_size
    F = TINY.intermediate_size if layer == "dense" else TINY.shared_intermediate_size
    f = F // mod.layout.parallel.tp
    rs = re.findall(r"= (f32\[[\d,]+\])\{[^}]*\} reduce-scatter(?:-start)?\(", hlo)
    rs += re.findall(r"= \(\(f32\[[^\]]*\][^)]*\), (f32\[[\d,]+\])\{[^}]*\}\) reduce-scatter-start\(",
                     hlo)
    assert f"f32[2,{D},{f}]" in rs and f"f32[{f},{D}]" in rs, rs


def _scatter(name: str, dtype: str) -> str:
    """layout_cases name of ``name`` with its partials reduce-scattered in ``dtype``."""
    return name if dtype == "float32" else f"{name}_bf16scatter"


BF16_SCATTER = ["sp_tp8_shard", "sp_tp8_shard_none"]   # RING, NONE; layout_cases has their bf16 forms


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", BF16_SCATTER)
def test_bf16_scatter_agrees_with_float32(eight_devices, name, layer):
    """float32 activations and weights; only the partial sums on the wire are
    bf16. Agrees to bf16 rounding and differs from the float32 form (the bf16
    path is taken). Max and mean relative error printed (-s)."""
    got = output(TINY, _scatter(name, "bfloat16"), LAYERS[layer], 64)
    want = output(TINY, name, LAYERS[layer], 64)
    assert np.all(np.isfinite(got))
    err = rel_err(got, want)
    d = np.abs(got - want)
    print(f"{name} {layer}: bf16 scatter vs float32: rel_err {err:.3g}, "
          f"max|d|/max|y| {d.max() / np.abs(want).max():.3g}, "
          f"mean|d|/mean|y| {d.mean() / np.abs(want).mean():.3g}")
    assert 0 < err < BF16_TOL


def _lowered(name: str, layer: int, T: int) -> str:
    """The layer's forward lowered (StableHLO, before XLA's passes) with
    abstract weights and x_TD [T, D] placed as the layout places rows."""
    par = EXTRA_LAYOUTS.get(name) or LAYOUTS[name]
    mesh = make_mesh(par)
    layout = make_layout(TINY, par, mesh, backend="xla", dtype=jnp.float32)
    graph, state = nnx.split(build_layer(layout, layer, mesh, source=AbstractSource()))
    x_TD = jax.ShapeDtypeStruct((T, TINY.hidden_size), jnp.float32,
                                sharding=NamedSharding(mesh, layout.x_TD))
    return jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, x_TD).as_text()


@pytest.mark.parametrize("name", BF16_SCATTER)
def test_bf16_scatter_sends_bf16(eight_devices, name):
    """The program the dense layer hands XLA sums its partials over the wire
    in bf16 (the reduce-scatter of NONE, the running-sum permutes of RING),
    and only those: the input rows travel in the activations' float32."""
    op = "reduce_scatter" if name.endswith("_none") else "collective_permute"
    # the operand type of each op: "...(%x) <{...}> ({region}) : (tensor<64x96xbf16>) -> ..."
    pattern = re.compile(rf'"stablehlo.{op}".*?: \(tensor<[\dx]+x(\w+)>\)', re.S)
    bf16 = pattern.findall(_lowered(_scatter(name, "bfloat16"), 0, 64))
    f32 = pattern.findall(_lowered(name, 0, 64))
    permutes_per_ring = 8 - 1
    if op == "reduce_scatter":
        assert bf16 == ["bf16"] and f32 == ["f32"], (bf16, f32)
    else:   # tp - 1 input-row blocks (float32) then tp - 1 running sums
        assert bf16 == ["f32"] * permutes_per_ring + ["bf16"] * permutes_per_ring, bf16
        assert f32 == ["f32"] * 2 * permutes_per_ring, f32


@pytest.mark.parametrize("argv, words", [
    (["plan", "--tp", "8", "--shared-overlap", "weights"],
     "--shared-overlap weights needs --sequence-parallel"),
    (["plan", "--tp", "8", "--sequence-parallel", "--shared-overlap", "weights"],
     "--shared-overlap weights needs --shard-shared-expert"),
    (["compile", "--tp", "8", "--sequence-parallel", "--shared-overlap", "weights"],
     "--shared-overlap weights needs --shard-shared-expert"),
    (["run", "--tp", "8", "--devices", "8", "--shared-overlap", "weights"],
     "--shared-overlap weights needs --sequence-parallel"),
])
def test_weights_form_usage_errors_exit_2(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("K3JAX_SHARD_SP_SHARED_EXPERT", raising=False)
    assert main(argv) == 2
    assert words in " ".join(capsys.readouterr().err.split())


def test_scatter_dtype_choice_is_checked(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--shared-scatter-dtype", "float16"])
    assert e.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_cli_weights_form_plan(capsys):
    """The flags reach the layout; the planner's saving at tp 4 is unchanged."""
    code = main(["plan", "--preset", "k3", "--tp", "4", "--sequence-parallel",
                 "--shard-shared-expert", "--shared-overlap", "weights", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert doc["parallel"]["shared_overlap"] == "weights"
    assert doc["layout"]["shared_expert_overlap"] == "weights"
    assert format_gib(doc["comparisons"]["shared_experts_saved"]) == "16.98046875"
    assert main(["plan", "--preset", "k3", "--tp", "4", "--sequence-parallel",
                 "--shard-shared-expert", "--shared-scatter-dtype", "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["shared_scatter_dtype"] == "bfloat16"


def test_module_weights_are_sharded(eight_devices):
    """The built module's shared expert weights are placed TP-sharded in the
    weights form (nothing gathered at rest)."""
    mod = module(TINY, "sp_ep_tp8_shard_weights", 1)[0]
    gate = mod.shared.gate_DF[...]
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, TENSOR)
    shard = gate.addressable_shards[0].data
    assert shard.shape == (TINY.hidden_size, TINY.shared_intermediate_size // 8)
