"""A mesh the user built (k3jax.layout.user_mesh): ``jax.make_mesh`` with
its default Explicit axis types, a mesh under other axis names mapped by
``ParallelConfig(axis_names=...)`` (also with the axes in another order),
each layer's output against the single device (float32), whether the input
is a plain array or placed on the user's mesh, eagerly, under jax.jit and
under ``jax.set_mesh``; the input placed on the user's mesh moves no data;
and what make_layout refuses, naming the axis."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax import TINY, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
from k3jax.layout import DATA, NODE, TENSOR, abstract_mesh, check_mesh
from k3jax.layout.user_mesh import layer_spec, role_devices
from numerics import rel_err

SP_EP = dict(sequence_parallel=True, expert_parallel=True)
BATCH_MODEL = {"data": "batch", "tensor": "model"}


@functools.cache
def _single_output(T: int) -> np.ndarray:
    mesh = make_mesh(ParallelConfig(), jax.devices()[:1])
    layer = build_layer(make_layout(TINY, ParallelConfig(), mesh), 1, mesh, source=RandomSource(0))
    return np.asarray(layer(_x(T)))


def _x(T: int) -> jax.Array:
    return jax.random.normal(jax.random.key(T), (T, TINY.hidden_size), jnp.float32)


# (user mesh shape, its axis names, ParallelConfig, the input's spec on the user's mesh)
MESHES = {
    "make_mesh_explicit": ((1, 8), ("data", "tensor"), ParallelConfig(tp=8, **SP_EP), P("tensor")),
    "batch_model": ((1, 8), ("batch", "model"),
                    ParallelConfig(tp=8, axis_names=BATCH_MODEL, **SP_EP), P("model")),
    "model_batch_transposed": ((4, 2), ("model", "batch"),
                               ParallelConfig(dp=2, tp=4, axis_names=BATCH_MODEL, **SP_EP),
                               P(("batch", "model"))),
    "batch_model_plain_tp": ((2, 4), ("batch", "model"),
                             ParallelConfig(dp=2, tp=4, axis_names=BATCH_MODEL), P("batch")),
}


def _user_mesh(name: str, devices) -> Mesh:
    shape, names, _, _ = MESHES[name]
    return jax.make_mesh(shape, names, devices=devices[:int(np.prod(shape))])


@pytest.mark.parametrize("name", list(MESHES))
def test_layer_on_the_users_mesh_equals_the_single_device(name, eight_devices):
    _, _, parallel, spec = MESHES[name]
    mesh = _user_mesh(name, eight_devices)
    assert all(t == AxisType.Explicit for t in mesh.axis_types)          # JAX's default
    layer = build_layer(make_layout(TINY, parallel, mesh), 1, mesh, source=RandomSource(0))
    assert sorted(layer.mesh.axis_names) == sorted(parallel.mesh_axes)
    assert list(layer.mesh.devices.flat) == list(mesh.devices.flat)      # the user's device order
    assert all(t == AxisType.Auto for t in layer.mesh.axis_types)
    T = 32
    want = _single_output(T)
    x_user = jax.device_put(_x(T), NamedSharding(mesh, spec))
    got = {"plain x": layer(_x(T)), "x on the user's mesh": layer(x_user)}
    placed = got["x on the user's mesh"].sharding                          # placed like the input
    assert placed.mesh == mesh and placed.is_equivalent_to(x_user.sharding, 2)
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x) + x)  # a residual on x's mesh
    got["jit"] = step(state, x_user) - x_user
    with jax.sharding.set_mesh(mesh):
        got["jit under set_mesh"] = step(state, x_user) - x_user
    for how, y in got.items():
        assert rel_err(y, want) <= 1e-5, (name, how, rel_err(y, want))
    assert rel_err(layer(_x(37)), _single_output(37)) <= 1e-5           # padding rows


@pytest.mark.parametrize("spec", [P("batch", "model"), P(None, "model"), P("batch")])
def test_batch_sequence_input_sharded_on_the_users_mesh(spec, eight_devices):
    """x [B, S, D] sharded over its sequence on the user's Explicit mesh: the
    rows are flattened on the layer's mesh, the output placed back like x."""
    parallel = ParallelConfig(dp=2, tp=4, axis_names=BATCH_MODEL, **SP_EP)
    mesh = jax.make_mesh((2, 4), ("batch", "model"), devices=eight_devices)
    layer = build_layer(make_layout(TINY, parallel, mesh), 1, mesh, source=RandomSource(0))
    x = jax.device_put(_x(32).reshape(4, 8, TINY.hidden_size), NamedSharding(mesh, spec))
    want = _single_output(32).reshape(4, 8, TINY.hidden_size)
    for y in (layer(x), jax.jit(lambda x: layer(x))(x)):
        assert y.sharding.mesh == mesh and y.sharding.is_equivalent_to(x.sharding, 3)
        assert rel_err(y, want) <= 1e-5


def test_gradients_through_the_users_mesh(eight_devices):
    from k3jax.grads import layer_grads
    _, _, parallel, spec = MESHES["batch_model"]
    mesh = _user_mesh("batch_model", eight_devices)
    layer = build_layer(make_layout(TINY, parallel, mesh), 1, mesh, source=RandomSource(0))
    single_mesh = make_mesh(ParallelConfig(), eight_devices[:1])
    single = build_layer(make_layout(TINY, ParallelConfig(), single_mesh), 1, single_mesh,
                         source=RandomSource(0))
    x = _x(32)
    dy = jax.random.normal(jax.random.key(5), x.shape)
    got = layer_grads(layer, jax.device_put(x, NamedSharding(mesh, spec)), dy)
    want = layer_grads(single, x, dy)
    assert rel_err(got.dx_TD, want.dx_TD) <= 1e-5
    for path, g in want.weights.items():
        assert rel_err(got.weights[path], g) <= 1e-5, path


def _collectives(text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))
            for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                       "collective-permute")}


def test_an_input_on_the_users_mesh_moves_no_data(eight_devices):
    """The same collectives whether x is placed on the user's mesh or on the
    layer's: moving it onto the layer's mesh is a change of names."""
    _, _, parallel, spec = MESHES["batch_model"]
    mesh = _user_mesh("batch_model", eight_devices)
    layer = build_layer(make_layout(TINY, parallel, mesh), 1, mesh, source=RandomSource(0))
    graphdef, state = nnx.split(layer)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    on_user = jax.device_put(_x(32), NamedSharding(mesh, spec))
    on_layer = jax.device_put(_x(32), NamedSharding(layer.mesh, layer_spec(spec, parallel)))
    assert layer_spec(spec, parallel) == P(TENSOR)
    assert (_collectives(step.lower(state, on_user).compile().as_text())
            == _collectives(step.lower(state, on_layer).compile().as_text()))


def test_the_layer_mesh_keeps_the_users_devices(sixteen_devices):
    """Axes in another order, an extra axis of size 1, a mapped node axis,
    no data axis (dp / nodes = 1): the layer's mesh holds the same devices
    in the same order under k3jax's names; in role order, device (n, t) is
    the user's (model t, host n)."""
    grid = np.array(sixteen_devices, dtype=object).reshape(8, 1, 2)       # (model, pipe, host)
    mesh = Mesh(grid, ("model", "pipe", "host"))
    parallel = ParallelConfig(dp=2, tp=8, nodes=2, axis_names={"node": "host", "tensor": "model"})
    layer_mesh = check_mesh(mesh, parallel, "test")
    assert dict(layer_mesh.shape) == {DATA: 1, TENSOR: 8, NODE: 2}
    assert list(layer_mesh.devices.flat) == list(grid.flat)
    assert role_devices(layer_mesh) == [grid[t, 0, n] for n in range(2) for t in range(8)]
    assert check_mesh(layer_mesh, parallel, "again") is layer_mesh
    make_layout(TINY, parallel, mesh)
    abstract = AbstractMesh((8, 2), ("model", "host"))                   # Explicit by default
    assert dict(check_mesh(abstract, parallel, "test").shape) == {DATA: 1, TENSOR: 8, NODE: 2}
    assert role_devices(make_mesh(ParallelConfig(dp=2, tp=8, nodes=2), sixteen_devices)) == \
        list(make_mesh(ParallelConfig(dp=2, tp=8, nodes=2), sixteen_devices).devices.flat)


def test_make_mesh_and_abstract_mesh_use_the_mapped_names(eight_devices):
    parallel = ParallelConfig(dp=2, tp=4, axis_names=BATCH_MODEL)
    mesh = make_mesh(parallel, eight_devices)
    assert mesh.axis_names == ("batch", "model") and parallel.named_mesh_axes == ("batch", "model")
    assert abstract_mesh(parallel).axis_names == ("batch", "model")
    assert check_mesh(mesh, parallel, "test").axis_names == (DATA, TENSOR)
    make_layout(TINY, parallel, mesh)
    assert "mesh axes data=batch, tensor=model" in parallel.describe()
    assert parallel.axis_names == (("data", "batch"), ("tensor", "model"))
    assert hash(parallel) == hash(ParallelConfig(dp=2, tp=4, axis_names={"tensor": "model",
                                                                         "data": "batch"}))


REFUSALS = [
    ((1, 8), ("batch", "model"), ParallelConfig(tp=8),
     r"no axis 'tensor' for role tensor \(ParallelConfig tp = 8\)"),
    ((1, 8), ("batch", "model"), ParallelConfig(tp=8, axis_names={"data": "batch", "tensor": "mdl"}),
     r"role tensor is mapped to axis 'mdl', which the mesh does not have"),
    ((1, 8), ("data", "tensor"), ParallelConfig(tp=8, axis_names={"node": "host"}),
     r"role node is mapped to axis 'host', which the mesh does not have"),
    ((2, 4), ("batch", "model"), ParallelConfig(tp=8, axis_names=BATCH_MODEL),
     r"axis 'batch' \(role data\) has size 2, but ParallelConfig dp / nodes = 1"),
    ((1, 8), ("data", "tensor"), ParallelConfig(dp=2, tp=4),
     r"axis 'data' \(role data\) has size 1, but ParallelConfig dp / nodes = 2"),
    ((2, 8), ("pipe", "tensor"), ParallelConfig(tp=8),
     r"axis 'pipe' of size 2 has no role"),
    ((2, 1, 8), ("host", "data", "tensor"), ParallelConfig(dp=2, tp=8, nodes=2),
     r"no axis 'node' for role node \(ParallelConfig nodes = 2\)"),
]


@pytest.mark.parametrize("shape, names, parallel, match", REFUSALS)
def test_make_layout_refuses_a_mesh_it_cannot_use_naming_the_axis(shape, names, parallel, match,
                                                                   sixteen_devices):
    mesh = jax.make_mesh(shape, names, devices=sixteen_devices[:int(np.prod(shape))])
    with pytest.raises(ValueError, match=r"^make_layout: mesh \{.*" + match):
        make_layout(TINY, parallel, mesh)


def test_a_manual_axis_is_refused(eight_devices):
    mesh = jax.make_mesh((1, 8), ("data", "tensor"), devices=eight_devices,
                         axis_types=(AxisType.Auto, AxisType.Manual))
    with pytest.raises(ValueError, match=r"axis 'tensor' is Manual"):
        make_layout(TINY, ParallelConfig(tp=8), mesh)


@pytest.mark.parametrize("axis_names, match", [
    ({"batch": "b"}, r"'batch' is not a role; the roles are node, data, tensor"),
    ({"data": ""}, r"axis_names\['data'\] must be a mesh axis name"),
    ({"data": "tensor"}, r"'tensor': that is k3jax's name of role tensor"),
    ({"data": "x", "tensor": "x"}, r"roles data and tensor both name mesh axis 'x'"),
])
def test_axis_names_are_checked_at_construction(axis_names, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(tp=8, axis_names=axis_names)


def test_a_checkpoint_loads_onto_a_mesh_under_other_axis_names(eight_devices, tmp_path):
    """load_layer on the user's mesh (batch / model, Explicit axes) gives the
    layer the single device gives from the same checkpoint."""
    from k3jax.checkpoint import load_layer, save_layer

    one = make_mesh(ParallelConfig(), jax.devices()[:1])
    layer = build_layer(make_layout(TINY, ParallelConfig(), one), 1, one, source=RandomSource(0))
    save_layer(layer, tmp_path / "ck")
    name = "batch_model"
    _, _, parallel, _ = MESHES[name]
    loaded = load_layer(tmp_path / "ck", 1, parallel, _user_mesh(name, eight_devices))
    x = _x(13)
    assert rel_err(np.asarray(loaded(x)), np.asarray(layer(x))) <= 1e-5
