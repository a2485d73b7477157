"""Gradients of a layer in every layout, 8 simulated devices.

For the dense layer 0 and the MoE layer 1 of TINY, built from RandomSource(SEED)
(the same logical weights in every layout), ``k3jax.grads.layer_grads`` gives
dx and the gradient of every trainable weight for a fresh random cotangent:

* equal to the single-device gradients (float32: 1e-5 relative, per tensor);
* equal to a float64 torch autograd reference (``TorchKimiMoE`` /
  ``TorchKimiMLP`` with requires_grad weights): 1e-5 in float32, 1e-2 in
  bfloat16, including padding rows (T = 3 on 8 row blocks) and experts / EP
  devices that receive no token (their gradient is exactly zero);
* each weight gradient placed as its weight (output shardings of the compiled
  program and of the arrays), with the padding of TP experts zero;
* in the compiled HLO of the gradient program: the forward's collectives,
  then exactly their mirror (all-gather <-> reduce-scatter over the same axes,
  integer all-gathers have none), and all-reduces only for the forward's own
  (plain TP), their mirror, and one per set of token axes over which
  trainable weights are replicated (XLA combines all-reduces over the same
  axes). Nothing else: in particular no sharded weight's gradient is gathered.

Measured: 82 s of CPU (user + sys) for the whole file, 4 min wall on the
shared 2-core machine at load 11-13; most of it compiles one gradient program
per layout and layer (each is compiled once and shared by the tests).
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_collectives import MOE_EXPECTED

from k3jax import TINY, MlpMode, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
from k3jax.checkpoint.names import layer_prefix
from k3jax.formats import ExpertStorage
from k3jax.grads import checkpoint_tensors, grad_program, layer_grads, param_path, split_trainable
from k3jax.modules.moe import KimiMoE, expert_weights
from k3jax.reference.torch_reference import TorchKimiMLP, TorchKimiMoE
from k3jax.variables import WEIGHTS
from layout_cases import COLLECTIVES, LAYOUTS, MULTI_DEVICE, SEED, UNOVERLAPPED, module
from numerics import rel_err

pytestmark = pytest.mark.tiers(slow=["test_interpret_backend_gradients_match_xla"])

LAYERS = {"dense": 0, "moe": 1}
FP32_TOL, BF16_TOL = 1e-5, 1e-2
TOL_KERNEL = 5e-5   # the bf16x3 Pallas kernels in float32 (tests/test_backend_interpret.py)
T_PLACED = 64      # divides every layout's row blocks: x placed as the layout places rows
T_PAD = 3          # 8 row blocks: 5 of them pure padding; 12 (token, expert) pairs over 16 experts
T_BF16 = 37        # not a multiple of 8 either, and 148 pairs: most experts see several tokens
# padding rows (SP), padded expert intermediate (tp8), EP devices without tokens
SUBSET = ["tp8", "sp_ep_tp8_shard"]
AG, RS, AR = "all-gather", "reduce-scatter", "all-reduce"
MIRROR = {AG: RS, RS: AG, AR: AR, "all-to-all": "all-to-all",
          "collective-permute": "collective-permute"}


def fresh(T: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Fresh normal x_TD and cotangent dy_TD (keys not used by any forward test)."""
    kx, kdy = jax.random.split(jax.random.key(7000 + T))
    x = jax.random.normal(kx, (T, TINY.hidden_size), jnp.float32).astype(dtype)
    return x, jax.random.normal(kdy, (T, TINY.hidden_size), jnp.float32).astype(dtype)


def f64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


# -- k3jax ------------------------------------------------------------------------
@functools.cache
def ag_rs_form(name: str) -> str:
    """The layout ``name`` with an SP-sharded MLP in its all-gather /
    reduce-scatter form (SharedOverlap.NONE), where it has a ring form."""
    return f"{name}_none" if f"{name}_none" in UNOVERLAPPED else name


@functools.cache
def placed_case(name: str, layer: str):
    """(module, compiled program, its HLO text, outputs) of the gradient program
    at T_PLACED with x and dy placed as the layout places rows (so only the
    layer's own collectives appear in the HLO); the program is compiled once
    and its compiled form is also what runs."""
    mod = module(TINY, name, LAYERS[layer])[0]
    _, params, frozen = split_trainable(mod)
    row_spec = P(mod.layout.parallel.token_axes, None)
    x, dy = (jax.device_put(a, NamedSharding(mod.mesh, row_spec)) for a in fresh(T_PLACED, jnp.float32))
    compiled = grad_program(mod).lower(params, frozen, x, dy).compile()
    y, dx, grads = compiled(params, frozen, x, dy)
    return mod, compiled, compiled.as_text(), (x, dy, y, dx, grads)


@functools.cache
def padded_case(name: str, layer: str, dtype_name: str = "float32", T: int = T_PAD):
    """layer_grads at T rows (x replicated: T does not split over 8 blocks)."""
    mod = module(TINY, name, LAYERS[layer], jnp.dtype(dtype_name))[0]
    x, dy = fresh(T, jnp.dtype(dtype_name))
    return mod, x, dy, layer_grads(mod, x, dy)


def named(mod, layer: str, dx, grads: dict) -> dict[str, np.ndarray]:
    """{"input": dx, checkpoint name: gradient} as float64 (padding removed)."""
    out = checkpoint_tensors(mod, LAYERS[layer], {k: f64(v) for k, v in grads.items()})
    return {"input": f64(dx), **out}


def flat_grads(state) -> dict[str, jax.Array]:
    return {param_path(p): v.get_value() for p, v in nnx.to_flat_state(state)}


# -- torch autograd reference ---------------------------------------------------------
def torch_grads(layer: str, tensors: dict[str, np.ndarray], x, dy) -> dict[str, np.ndarray]:
    """Float64 torch autograd through the reference layer: {"input": dx, name: grad}.
    ``tensors``: checkpoint name -> float64 weight; experts that receive no
    token get no torch gradient, i.e. zero."""
    prefix = layer_prefix(LAYERS[layer], layer == "moe")
    if layer == "moe":
        ref = TorchKimiMoE(TINY, torch.float64)
    else:
        ref = TorchKimiMLP(TINY.hidden_size, TINY.intermediate_size, TINY.activation_situ_beta,
                           TINY.activation_situ_linear_beta, torch.float64)
    ref.load_state_dict({k[len(prefix):]: torch.from_numpy(v) for k, v in tensors.items()})
    xt = torch.from_numpy(f64(x)).requires_grad_(True)
    ref(xt).backward(torch.from_numpy(f64(dy)))
    out = {"input": xt.grad.numpy()}
    for k, p in ref.named_parameters():
        if p.requires_grad:
            out[prefix + k] = (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
    return out


def weight_tensors(mod, layer: str) -> dict[str, np.ndarray]:
    """The module's weights as float64 checkpoint tensors (dense experts)."""
    state = {param_path(p): f64(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(mod, WEIGHTS))}
    return checkpoint_tensors(mod, LAYERS[layer], state)


@functools.cache
def torch_reference(layer: str, T: int, dtype_name: str = "float32") -> dict[str, np.ndarray]:
    single = module(TINY, "single", LAYERS[layer], jnp.dtype(dtype_name))[0]
    return torch_grads(layer, weight_tensors(single, layer), *fresh(T, jnp.dtype(dtype_name)))


def compare(got: dict, want: dict, tol: float, what: str) -> float:
    """Max per-tensor relative error; tensors whose reference is zero must be zero."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    worst = 0.0
    for k, w in want.items():
        g = got[k]
        assert np.all(np.isfinite(g)), f"{what}: {k} is not finite"
        if not np.any(w):
            assert not np.any(g), f"{what}: {k} should be zero (no token reaches it)"
            continue
        err = rel_err(g, w)
        assert err < tol, f"{what}: {k} relative error {err:.3g}"
        worst = max(worst, err)
    return worst


# -- numerics ---------------------------------------------------------------------------
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradients_match_single_device_and_torch(eight_devices, name, layer):
    """T = 64 placed, every layout: vs the single-device gradients and torch f64."""
    mod, _, _, (x, dy, _, dx, grads) = placed_case(name, layer)
    got = named(mod, layer, dx, flat_grads(grads))
    single = placed_case("single", layer)
    want_single = named(single[0], layer, single[3][3], flat_grads(single[3][4]))
    err_single = compare(got, want_single, FP32_TOL, f"{name} vs single")
    err_torch = compare(got, torch_reference(layer, T_PLACED), FP32_TOL, f"{name} vs torch")
    print(f"{name} {layer}: vs single {err_single:.2g}, vs torch f64 {err_torch:.2g}")


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", SUBSET)
def test_gradients_with_padding_rows_and_idle_experts(eight_devices, name, layer):
    """T = 3: padding rows under SP, experts and EP devices that no token reaches."""
    mod, x, dy, g = padded_case(name, layer)
    got = named(mod, layer, g.dx_TD, g.weights)
    want = torch_reference(layer, T_PAD)
    err = compare(got, want, FP32_TOL, f"{name} T={T_PAD}")
    print(f"{name} {layer} T={T_PAD}: vs torch f64 {err:.2g}")
    if layer == "moe":
        idle = [e for e in range(TINY.num_experts)
                if not np.any(want[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"])]
        assert idle, "no expert went without tokens: the case does not test idle experts"
        if make_layout(TINY, LAYOUTS[name]).parallel.ep == 8:
            idle_devices = {e // 2 for e in idle} - {e // 2 for e in range(16) if e not in idle}
            assert idle_devices, "every EP device received a token"
        assert g.frozen == ("router_bias_E",)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", ["sp_ep_tp8_shard"])
def test_bfloat16_gradients_match_torch(eight_devices, name, layer):
    """bf16 weights, input and cotangent (torch gets the same rounded values),
    T = 37. A gradient passes about six bf16 roundings (gate, up, the hidden
    activation, the latent and expert cotangents, the result), each up to
    2^-9 relative; with T = 37 the largest entries sum several tokens."""
    mod, x, dy, g = padded_case(name, layer, "bfloat16", T_BF16)
    assert g.dx_TD.dtype == jnp.bfloat16
    assert all(v.dtype == jnp.bfloat16 for v in g.weights.values())
    got = named(mod, layer, g.dx_TD, g.weights)
    want = torch_reference(layer, T_BF16, "bfloat16")
    err = compare(got, want, BF16_TOL, f"{name} bf16")
    assert err > FP32_TOL, "the bf16 run did not round to bf16"
    print(f"{name} {layer} bf16: vs torch f64 {err:.2g}")


# -- placement -------------------------------------------------------------------------
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", MULTI_DEVICE)
def test_weight_gradients_keep_their_weights_sharding(eight_devices, name, layer):
    mod, compiled, _, (*_, grads) = placed_case(name, layer)
    _, params, _ = split_trainable(mod)
    weights = flat_grads(params)
    _, _, grad_shardings = compiled.output_shardings
    for path, g in flat_grads(grads).items():
        w = weights[path]
        assert g.shape == w.shape and g.dtype == w.dtype, path
        assert g.sharding.is_equivalent_to(w.sharding, w.ndim), \
            f"{name} {path}: gradient {g.sharding.spec}, weight {w.sharding.spec}"
    for path, s in flat_grads(grad_shardings).items():
        assert s.is_equivalent_to(weights[path].sharding, weights[path].ndim), (path, s)
    # TP experts are padded (SPEC 5): the padding's gradient is zero
    layout = make_layout(TINY, LAYOUTS[name])
    if layer == "moe" and layout.padded_moe_intermediate > TINY.moe_intermediate_size:
        w1 = np.asarray(flat_grads(grads)["w1_ELF"])
        F_local = layout.padded_moe_intermediate // layout.expert_shards
        real = TINY.moe_intermediate_size // layout.expert_shards
        blocks = w1.reshape(*w1.shape[:2], layout.expert_shards, F_local)
        assert not np.any(blocks[..., real:]) and np.any(blocks[..., :real])


# -- collectives in the compiled gradient program ---------------------------------------
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")   # as layout_cases
_GROUPS = re.compile(r"replica_groups=(?:mesh\[[^\]]*\]\s*(\{[^}]*\})|(\{\{[^=]*\}\}))")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_RESULT_TYPE = re.compile(r"=\s*\(?([a-z]+[0-9]*)\[")


def collectives(hlo_text: str) -> list[tuple[str, str, bool, bool]]:
    """[(opcode, axes "{'data','tensor'}", on floats, in the backward)] of every
    collective (async pairs once). The backward is what jax transposed (its
    op_name says "transpose(")."""
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(1).endswith("-done"):
            continue
        op = m.group(1).removesuffix("-start")
        if op not in COLLECTIVES:
            continue
        groups, name, result = _GROUPS.search(line), _OP_NAME.search(line), _RESULT_TYPE.search(line)
        assert groups and name and result, f"unparsed collective: {line.strip()[:200]}"
        found.append((op, groups.group(1) or groups.group(2), result.group(1).startswith(("f", "bf")),
                      "transpose(" in name.group(1)))
    return found


def axes_text(axes) -> str:
    return "{" + ",".join(f"'{a}'" for a in axes) + "}"


def spec_axes(spec: P) -> set[str]:
    return {a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part)}


def weight_all_reduces(mod) -> Counter:
    """One all-reduce per set of token axes over which some trainable weight is
    replicated (each device's gradient covers only its rows; XLA combines the
    gradients of one axis set into one all-reduce)."""
    _, params, _ = split_trainable(mod)
    token_axes = mod.layout.parallel.token_axes
    sets = {tuple(a for a in token_axes if a not in spec_axes(v.get_value().sharding.spec))
            for _, v in nnx.to_flat_state(params)}
    return Counter({(AR, axes_text(s)): 1 for s in sets if s})


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name", MULTI_DEVICE)
def test_backward_collectives_mirror_the_forward(eight_devices, name, layer):
    """All-gathers, reduce-scatters (and any other collective but the
    all-reduce): the forward's exactly, and their mirror exactly. All-reduces:
    XLA's combiner may merge a forward all-reduce with backward ones over the
    same axes (plain TP's dense MLP: the output's and dx's in one), so per
    axis set there are at least one and at most the forward's, their mirror
    and the weight gradients' all-reduces together. An SP-sharded MLP is
    checked in its all-gather / reduce-scatter form (``_none``; the ring's
    gradients are checked numerically above)."""
    name = ag_rs_form(name)
    mod, _, hlo, _ = placed_case(name, layer)
    found = collectives(hlo)
    forward = [(op, axes, on_floats) for op, axes, on_floats, bwd in found if not bwd]
    backward = Counter((op, axes) for op, axes, _, bwd in found if bwd and op != AR)
    layout = make_layout(TINY, {**LAYOUTS, **UNOVERLAPPED}[name])
    # the forward's own collectives (tests/test_collectives.py); its all-reduces are over TENSOR
    want_forward = MOE_EXPECTED[name] if layer == "moe" else Counter(layout.dense_mlp.collectives)
    assert Counter(op for op, _, _ in forward if op != AR) == want_forward - Counter({AR: want_forward[AR]})
    assert {axes for op, axes, _ in forward if op == AR} <= {axes_text(["tensor"])}
    mirror = Counter((MIRROR[op], axes) for op, axes, on_floats in forward if on_floats and op != AR)
    assert backward == mirror, f"{name} {layer}: backward {dict(backward)}, expected {dict(mirror)}"
    all_reduces = Counter(axes for op, axes, _, _ in found if op == AR)
    most = Counter({axes_text(["tensor"]): 2 * want_forward[AR]})
    most.update({axes: n for (_, axes), n in weight_all_reduces(mod).items()})
    assert set(all_reduces) == set(+most), (dict(all_reduces), dict(most))
    for axes, n in all_reduces.items():
        assert 1 <= n <= most[axes], (axes, n, most[axes])
    print(f"{name} {layer}: forward {dict(Counter((op, a) for op, a, _ in forward))}, backward "
          f"{dict(Counter((op, a) for op, a, _, bwd in found if bwd))}")


@pytest.mark.parametrize("name", [n for n in MULTI_DEVICE
                                  if make_layout(TINY, LAYOUTS[n]).shared_mlp.mode is MlpMode.SP_SHARDED])
def test_sp_sharded_mlp_one_gather_and_one_scatter_per_direction(eight_devices, name):
    """The SP-sharded MLP (dense layer; the shared expert where the MoE's own
    dispatch runs over other axes): forward AG + RS, backward AG + RS, all
    over the tensor axis; its weights' gradients need no collective of their
    own over the tensor axis (they are all-reduced over data only)."""
    tensor = axes_text(["tensor"])
    name = ag_rs_form(name)
    dense = collectives(placed_case(name, "dense")[2])
    on_tensor = Counter((op, bwd) for op, axes, _, bwd in dense if axes == tensor)
    assert on_tensor == Counter({(AG, False): 1, (RS, False): 1, (AG, True): 1, (RS, True): 1})
    assert {axes for _, axes, _, _ in dense if axes != tensor} <= {axes_text(["data"])}
    if make_layout(TINY, UNOVERLAPPED[name]).dispatch_axes == ("data", "tensor"):
        moe = collectives(placed_case(name, "moe")[2])
        on_tensor = Counter((op, bwd) for op, axes, _, bwd in moe if axes == tensor)
        assert on_tensor == Counter({(AG, False): 1, (RS, False): 1, (AG, True): 1, (RS, True): 1})


def test_single_device_gradient_program_does_not_communicate():
    for layer in LAYERS:
        found = collectives(placed_case("single", layer)[2])
        assert all(axes == "{{0}}" for _, axes, _, _ in found), found


# -- MXFP4 experts: frozen ---------------------------------------------------------------
@functools.cache
def mxfp4_case(name: str):
    par = LAYOUTS[name]
    mesh = make_mesh(par)
    layout = make_layout(TINY, par, mesh, backend="xla", experts=ExpertStorage.MXFP4)
    mod = build_layer(layout, LAYERS["moe"], mesh, source=RandomSource(SEED))
    x, dy = fresh(T_PAD, jnp.float32)
    return mod, x, dy, layer_grads(mod, x, dy)


def test_mxfp4_experts_are_frozen_and_the_input_gradient_flows(eight_devices):
    name = "sp_ep_tp8_shard"
    mod, x, dy, g = mxfp4_case(name)
    packed_params = mod.layout.experts.param_names()
    assert len(packed_params) == 6
    assert set(g.frozen) == {"router_bias_E", *packed_params}
    assert not set(g.weights) & set(packed_params)
    assert set(g.weights) == {"router_DE", "lat_down_DL", "lat_norm_L", "lat_up_LD",
                              "shared.gate_DF", "shared.up_DF", "shared.down_FD"}
    # torch f64 with the decoded experts (exact in float32), every weight trainable there
    tensors = checkpoint_tensors(mod, 1, {k: f64(v) for k, v in flat_grads(
        nnx.state(mod, WEIGHTS)).items() if k not in packed_params})
    prefix = layer_prefix(1, True)
    for w, packed in zip(("w1", "w3", "w2"), expert_weights(mod.weights(), mod.layout)):
        a = packed.dequantize(jnp.float32)
        for e in range(TINY.num_experts):
            tensors[f"{prefix}experts.{e}.{w}.weight"] = f64(a[e]).T
    want = torch_grads("moe", tensors, x, dy)
    want = {k: v for k, v in want.items() if ".experts." not in k}   # frozen here
    err = compare(named(mod, "moe", g.dx_TD, g.weights), want, FP32_TOL, f"{name} mxfp4")
    print(f"{name} mxfp4: vs torch f64 {err:.2g}")


def test_layer_grads_rejects_bad_shapes(eight_devices):
    mod = module(TINY, "single", LAYERS["moe"])[0]
    x, dy = fresh(T_PAD, jnp.float32)
    with pytest.raises(ValueError, match=r"x_TD must be \[T, 96\]"):
        layer_grads(mod, x[:, :10], dy)
    with pytest.raises(ValueError, match=r"dy_TD must have x_TD's shape \[3, 96\], got \[2, 96\]"):
        layer_grads(mod, x, dy[:2])
    assert isinstance(mod, KimiMoE)


# -- the Pallas kernels (interpret mode) ------------------------------------------------
@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(
    tp=2, sequence_parallel=True, expert_parallel=True, shard_shared_expert=True)],
    ids=["single", "sp_ep_tp2_shard"])
def test_interpret_backend_gradients_match_xla(parallel):
    """--backend interpret (the Mosaic GPU kernels in interpret mode), dense
    and MoE layer: the XLA path's gradients (themselves checked against torch
    above) within the bf16x3 kernels' float32 tolerance, TOL_KERNEL of
    tests/test_backend_interpret.py. At most 2 devices: interpret mode under
    shard_map on 8 simulated devices can deadlock XLA:CPU's thread pool on 2
    cores."""
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    x, dy = fresh(T_PAD, jnp.float32)
    for layer in LAYERS.values():
        got, want = (layer_grads(build_layer(make_layout(TINY, parallel, mesh, backend=backend),
                                             layer, mesh, source=RandomSource(SEED)), x, dy)
                     for backend in ("interpret", "xla"))
        assert rel_err(got.dx_TD, want.dx_TD) < TOL_KERNEL
        assert set(got.weights) == set(want.weights)
        for k, w in want.weights.items():
            assert rel_err(got.weights[k], w) < TOL_KERNEL, k
