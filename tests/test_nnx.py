"""The K3 block as a Flax NNX citizen: an NNX model holding KimiMoE trained
with optax through nnx.Optimizer(wrt=nnx.Param) under nnx.jit (dense and
packed MXFP4 experts); the Variable types that say what trains (the router
bias and packed experts untouched, bit for bit); construction from
nnx.Rngs and under nnx.eval_shape; inputs of any leading shape and the dtype
rule; the aux-loss-free bias update; save_layer / load_layer bit-exact; one
style of argument (strings and enums) and the refusal of a dtype no kernel
takes."""

from __future__ import annotations

import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import TINY, ParallelConfig, build_layer, make_layout, make_mesh
from k3jax.checkpoint import Mxfp4Mode, load_layer, save_layer
from k3jax.checkpoint import writer as checkpoint_writer
from k3jax.formats import ExpertStorage
from k3jax.layout import EpDispatch, SharedOverlap
from k3jax.modules import (
    WEIGHTS,
    KimiMLP,
    KimiMoE,
    PackedWeight,
    RandomSource,
    RouterBias,
    module_decls,
    update_router_bias,
)
from k3jax.tools.memory import param_shard_bytes
from pallas_kernels.backend import XLA, BackendName

D, VOCAB = TINY.hidden_size, 32
SINGLE = ParallelConfig()
EP = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True)


@functools.cache
def layout_of(parallel: ParallelConfig, experts: str, dtype: str = "float32"):
    mesh = make_mesh(parallel)
    return make_layout(TINY, parallel, mesh, backend="xla", experts=experts, dtype=dtype), mesh


class TinyLM(nnx.Module):
    """Embedding -> KimiMoE -> head, as a researcher would hold the block."""

    def __init__(self, layout, mesh, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.moe = KimiMoE(layout, mesh, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens_BS):
        return self.head(self.moe(self.embed(tokens_BS)))


def _loss(model, tokens_BS, labels_BS):
    logits = model(tokens_BS)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels_BS).mean()


def _host(state) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, VOCAB)
    return tokens, jnp.roll(tokens, -1, axis=1)


@pytest.mark.parametrize("experts", ["dense", "mxfp4"])
def test_adamw_with_weight_decay_trains_the_params_and_nothing_else(experts):
    layout, mesh = layout_of(SINGLE, experts)
    model = TinyLM(layout, mesh, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)
    frozen = nnx.Any(RouterBias, PackedWeight)
    frozen_before = _host(nnx.state(model, frozen))
    params_before = _host(nnx.state(model, nnx.Param))
    assert ("moe", "router_bias_E") in frozen_before
    assert any(isinstance(v, PackedWeight) for _, v in nnx.to_flat_state(nnx.state(model)))\
        == (experts == "mxfp4")

    @nnx.jit
    def step(model, optimizer, tokens, labels):
        loss, grads = nnx.value_and_grad(_loss)(model, tokens, labels)
        optimizer.update(model, grads)
        return loss

    tokens, labels = _batch()
    losses = [float(step(model, optimizer, tokens, labels)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    after = _host(nnx.state(model, frozen))
    assert after.keys() == frozen_before.keys()
    for path, value in frozen_before.items():      # bias and packed codes / scales: bit for bit
        np.testing.assert_array_equal(after[path], value, err_msg=str(path))
    moved = _host(nnx.state(model, nnx.Param))
    assert not np.array_equal(moved[("moe", "router_DE")], params_before[("moe", "router_DE")])
    if experts == "dense":
        assert not np.array_equal(moved[("moe", "w1_ELF")], params_before[("moe", "w1_ELF")])
    opt_paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(optimizer))}
    assert not any("router_bias_E" in p or "packed" in p or "scale_" in p for p in opt_paths)


def test_plain_nnx_grad_differentiates_the_params_of_packed_experts():
    layout, mesh = layout_of(SINGLE, "mxfp4")
    model = TinyLM(layout, mesh, nnx.Rngs(0))
    grads = nnx.grad(_loss)(model, *_batch())
    names = {p[-1] for p, _ in nnx.to_flat_state(grads)}
    assert "router_DE" in names and "gate_DF" in names and "kernel" in names
    assert not names & {"router_bias_E", "w1_packed_EFL", "w1_scale_ELF"}
    assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(grads))


def test_variable_types_say_what_trains():
    layout, mesh = layout_of(SINGLE, "mxfp4")
    moe = build_layer(layout, 1, mesh, rngs=nnx.Rngs(0))
    kinds = {".".join(map(str, p)): type(v) for p, v in nnx.to_flat_state(nnx.state(moe, WEIGHTS))}
    assert kinds["router_bias_E"] is RouterBias
    assert {n for n, k in kinds.items() if k is PackedWeight} == {
        f"{w}_{kind}" for w, kind in (("w1", "packed_EFL"), ("w3", "packed_EFL"),
                                      ("w2", "packed_ELF"), ("w1", "scale_ELF"),
                                      ("w3", "scale_ELF"), ("w2", "scale_EFL"))}
    assert set(kinds) == set(module_decls(moe))          # WEIGHTS: every weight, nothing else
    assert set(param_shard_bytes(moe)) == set(kinds)     # the planner prices all of them
    trainable = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
    assert trainable == {n for n, k in kinds.items() if k is nnx.Param}


def test_rngs_place_each_weight_like_random_source_and_eval_shape_is_abstract(eight_devices):
    single_layout, single_mesh = layout_of(SINGLE, "dense")
    ep_layout, ep_mesh = layout_of(EP, "dense")
    one = build_layer(single_layout, 1, single_mesh, rngs=nnx.Rngs(0))
    ep = build_layer(ep_layout, 1, ep_mesh, rngs=nnx.Rngs(0))
    decls = module_decls(ep)
    for path, var in nnx.to_flat_state(nnx.state(ep, WEIGHTS)):
        name = ".".join(map(str, path))
        assert var.get_value().sharding == NamedSharding(ep_mesh, decls[name].spec), name
    a, b = _host(nnx.state(one, WEIGHTS)), _host(nnx.state(ep, WEIGHTS))
    for path in a:              # the same Rngs: the same logical weights in every layout
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    assert not np.array_equal(a[("router_DE",)],
                              _host(nnx.state(build_layer(single_layout, 1, single_mesh,
                                                          rngs=nnx.Rngs(1)), nnx.Param))[
                                  ("router_DE",)])

    abstract = nnx.eval_shape(lambda: build_layer(ep_layout, 1, ep_mesh, rngs=nnx.Rngs(0)))
    for path, var in nnx.to_flat_state(nnx.state(abstract, WEIGHTS)):
        value, name = var.get_value(), ".".join(map(str, path))
        assert isinstance(value, jax.ShapeDtypeStruct), name
        assert (value.shape, value.dtype) == (decls[name].shape, decls[name].dtype)
        assert value.sharding == NamedSharding(ep_mesh, decls[name].spec), name
    with pytest.raises(TypeError, match="exactly one of rngs="):
        KimiMoE(ep_layout, ep_mesh)
    with pytest.raises(TypeError, match="exactly one of rngs="):
        build_layer(ep_layout, 1, ep_mesh, rngs=nnx.Rngs(0), source=RandomSource(0))


def test_any_leading_shape_and_the_dtype_rule():
    layout, mesh = layout_of(SINGLE, "dense")
    for layer, who in ((1, "KimiMoE"), (0, "KimiMLP")):
        module = build_layer(layout, layer, mesh, rngs=nnx.Rngs(0))
        x_BSD = jax.random.normal(jax.random.key(2), (2, 3, D))
        y_BSD = module(x_BSD)
        assert y_BSD.shape == (2, 3, D) and y_BSD.dtype == layout.dtype
        np.testing.assert_array_equal(y_BSD.reshape(6, D), module(x_BSD.reshape(6, D)))
        one = module(x_BSD[0, 0])                  # one row [D] (T = 1: another program)
        assert one.shape == (D,)
        np.testing.assert_allclose(one, y_BSD[0, 0], rtol=1e-5, atol=1e-5)
        # floating inputs are cast to the layout's dtype; others refused before tracing
        y16 = module(x_BSD.astype(jnp.bfloat16))
        assert y16.dtype == layout.dtype
        np.testing.assert_array_equal(y16, module(x_BSD.astype(jnp.bfloat16).astype(jnp.float32)))
        with pytest.raises(TypeError, match=f"{who}: x must have a floating dtype, got int32"):
            module(jnp.ones((2, 3, D), jnp.int32))
        with pytest.raises(ValueError, match=rf"{who}: x must be \[\.\.\., {D}\].*got \[2, 3, 5\]"):
            module(jnp.ones((2, 3, 5)))


def test_update_router_bias_is_the_aux_loss_free_rule():
    layout, mesh = layout_of(SINGLE, "dense")
    moe = build_layer(layout, 1, mesh, rngs=nnx.Rngs(0))
    bias0 = np.asarray(moe.router_bias_E.get_value())
    E = TINY.num_experts
    counts = np.arange(E) % 5                     # mean 1.875: 0, 1 under; 2, 3, 4 over
    step = np.float32(0.01) * np.sign(counts.mean() - counts).astype(np.float32)
    want = bias0 + step                           # float32 arithmetic, as the layer's
    got = update_router_bias(moe, counts, 0.01)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(moe.router_bias_E.get_value()), want)   # in place
    np.testing.assert_array_equal(update_router_bias(bias0, np.full(E, 3), 0.5), bias0)
    stats = types.SimpleNamespace(tokens_per_expert=counts)     # as the router statistics give it
    np.testing.assert_array_equal(update_router_bias(bias0, stats, 0.01), want)

    @nnx.jit
    def balance(moe, counts):
        update_router_bias(moe.router_bias_E, counts, 0.01)

    balance(moe, jnp.asarray(counts))
    np.testing.assert_allclose(np.asarray(moe.router_bias_E.get_value()),
                               want + step, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"tokens_per_expert must be \[{E}\].*got \[3\]"):
        update_router_bias(moe, np.ones(3), 0.01)


@pytest.mark.parametrize("parallel, experts, mxfp4", [
    (SINGLE, "dense", "packed"), (SINGLE, "mxfp4", Mxfp4Mode.PACKED),
    (EP, "dense", "packed"), (EP, ExpertStorage.MXFP4, "packed")])
def test_save_layer_round_trips_bit_exact(parallel, experts, mxfp4, tmp_path, eight_devices):
    layout, mesh = layout_of(parallel, experts, "bfloat16")
    for layer in (0, 1):
        module = build_layer(layout, layer, mesh, rngs=nnx.Rngs(5))
        if layer == 1:     # a trained bias: not the random init's
            update_router_bias(module, np.arange(TINY.num_experts), 0.25)
        directory = tmp_path / f"layer{layer}"
        save_layer(module, directory, layer=None if layer == 1 else 0)
        loaded = load_layer(directory, layer, parallel, mesh, dtype="bfloat16", backend="xla",
                            mxfp4=mxfp4)
        assert type(loaded) is type(module) and loaded.layout == module.layout
        want, got = nnx.state(module, WEIGHTS), nnx.state(loaded, WEIGHTS)
        for (path, a), (_, b) in zip(nnx.to_flat_state(want), nnx.to_flat_state(got)):
            a, b = a.get_value(), b.get_value()
            assert type(a) is type(b) and a.sharding == b.sharding, path
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                          err_msg=str(path))


def test_save_layer_is_atomic_and_refuses_what_it_cannot_write(tmp_path, monkeypatch):
    layout, mesh = layout_of(SINGLE, "mxfp4")
    moe = build_layer(layout, 1, mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer"):
        save_layer(moe, tmp_path / "x", layer=0)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_writer, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_layer(moe, tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []              # no half-written directory, no temporary
    monkeypatch.undo()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("")
    with pytest.raises(FileExistsError):
        save_layer(moe, tmp_path / "full")
    abstract = nnx.eval_shape(lambda: build_layer(layout, 1, mesh, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="abstract"):
        save_layer(abstract, tmp_path / "abstract")


def test_a_dtype_no_kernel_takes_is_refused_at_make_layout():
    for bad in (jnp.int8, "int32", jnp.float64, "not-a-dtype"):
        with pytest.raises(ValueError, match=r"make_layout: dtype \S+ is not one the kernels take; "
                                             r"choose one of float32, bfloat16, float16"):
            make_layout(TINY, SINGLE, dtype=bad)
    with pytest.raises(ValueError, match="dtype int8"):
        make_layout(TINY, SINGLE, dtype=jnp.int8)
    assert make_layout(TINY, SINGLE, dtype="bfloat16").dtype == jnp.bfloat16


def test_every_choice_takes_strings_and_enums():
    par = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                         ep_dispatch="all-to-all", shared_overlap="ring",
                         shared_scatter_dtype=jnp.bfloat16)
    assert par.ep_dispatch is EpDispatch.ALL_TO_ALL and par.shared_overlap is SharedOverlap.RING
    assert par.shared_scatter_dtype == "bfloat16"
    assert par == ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                                 ep_dispatch=EpDispatch.ALL_TO_ALL,
                                 shared_overlap=SharedOverlap.RING, shared_scatter_dtype="bfloat16")
    with pytest.raises(ValueError, match="ep_dispatch must be one of 'gather', 'hierarchical', "
                                         "'all-to-all', 'auto'.*got 'alltoall'"):
        ParallelConfig(ep_dispatch="alltoall")
    layouts = [make_layout(TINY, SINGLE, backend=b, experts=e)
               for b, e in (("xla", "mxfp4"), (BackendName.XLA, ExpertStorage.MXFP4),
                            (XLA, "mxfp4"))]
    assert layouts[0] == layouts[1] == layouts[2]
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        make_layout(TINY, SINGLE, backend="cuda")
    with pytest.raises(ValueError, match="unknown expert format 'fp4'; registered: dense, mxfp4"):
        make_layout(TINY, SINGLE, experts="fp4")
    with pytest.raises(ValueError, match="mxfp4 must be one of 'packed', 'dequantize'"):
        load_layer("/nonexistent", 1, mxfp4="unpacked")


def test_kimi_mlp_takes_rngs_too():
    layout, mesh = layout_of(SINGLE, "dense")
    mlp = KimiMLP(layout, layout.dense_mlp, mesh, rngs=nnx.Rngs(0))
    assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(nnx.state(mlp, WEIGHTS)))
