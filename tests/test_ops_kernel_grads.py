"""jax.grad through k3jax's ops on the Pallas kernels (GPU interpret mode)
equals jax.grad on "xla": routed_experts (grouped SiTU-GLU + grouped down,
through their custom VJPs) run expert-parallel under shard_map on 2 devices
(the custom VJPs inside shard_map),
and the dense situ_mlp (fused gate/up + SiTU), at TINY sizes, float32.

Tolerance: the kernels' float32 path is a split-bf16 (bf16x3) product, so
TOL_KERNEL = 5e-5 as in tests/kernels (the "xla" gradients themselves are
checked against float64 numpy in tests/kernels/test_kernels_vjp.py).
Interpret mode is slow on 2 cores: each test runs 9 / 6 kernel launches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3jax.config import TINY
from k3jax.layout import TENSOR
from k3jax.ops import SiTU, routed_experts, situ_mlp
from numerics import rel_err

pytestmark = pytest.mark.slow

TOL_KERNEL = 5e-5
ACT = SiTU.from_config(TINY)


def _assert_grads_match(got, want, names):
    for g, w, name in zip(got, want, names):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert np.all(np.isfinite(np.asarray(g))), name
        err = rel_err(g, w)
        assert err <= TOL_KERNEL, f"d{name}: interpret vs xla relative error {err:.3g}"


def test_routed_experts_grad_interpret_equals_xla(eight_devices):
    """EP over 2 devices (8 experts each; group sizes traced per device, one
    padding row routed nowhere), on "interpret" and on "xla", against one
    device on "xla": every gradient (input, routing weights, expert weights).

    Guards two shard_map typing fixes: kernel outputs typed varying like their
    inputs (pallas_kernels/vma.py), and routed_experts' argsort order typed
    varying (jax 0.11.2 types it invariant; d lat_TL and d weights_TK were
    then wrong on every backend, "xla" included)."""
    rng = np.random.default_rng(161)
    T, K, E = 6, TINY.num_experts_per_token, TINY.num_experts
    L, F = TINY.routed_expert_hidden_size, TINY.moe_intermediate_size
    lat_TL = jnp.asarray(rng.standard_normal((T, L)), jnp.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
    ids[2] = E  # a padding row: its pairs go to no expert
    ids_TK = jnp.asarray(ids, jnp.int32)
    weights_TK = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)), jnp.float32)
    w1_ELF, w3_ELF = (jnp.asarray(rng.standard_normal((E, L, F)) / np.sqrt(L), jnp.float32)
                      for _ in range(2))
    w2_EFL = jnp.asarray(rng.standard_normal((E, F, L)) / np.sqrt(F), jnp.float32)
    cot_TL = jnp.asarray(rng.standard_normal((T, L)), jnp.float32)
    args = (lat_TL, weights_TK, w1_ELF, w3_ELF, w2_EFL)

    def loss_xla(lat, w, w1, w3, w2):
        return jnp.sum(routed_experts(lat, ids_TK, w, w1, w3, w2, ACT, backend="xla") * cot_TL)

    devices = 2
    mesh = Mesh(np.array(eight_devices[:devices]), (TENSOR,),
                axis_types=(jax.sharding.AxisType.Auto,))

    def local(lat, w, w1, w3, w2, *, backend):
        first = jax.lax.axis_index(TENSOR) * w1.shape[0]
        part = routed_experts(lat, ids_TK, w, w1, w3, w2, ACT, first_expert=first,
                              backend=backend)
        return jax.lax.psum(part, TENSOR)

    def ep_loss(backend):
        ep = jax.shard_map(functools.partial(local, backend=backend), mesh=mesh,
                           in_specs=(P(), P(), P(TENSOR), P(TENSOR), P(TENSOR)), out_specs=P())
        return lambda *a: jnp.sum(ep(*a) * cot_TL)

    argnums = tuple(range(len(args)))
    single = jax.jit(jax.grad(loss_xla, argnums))(*args)
    ep_xla = jax.jit(jax.grad(ep_loss("xla"), argnums))(*args)
    ep_interpret = jax.jit(jax.grad(ep_loss("interpret"), argnums))(*args)
    names = ["lat_TL", "weights_TK", "w1_ELF", "w3_ELF", "w2_EFL"]
    _assert_grads_match(ep_xla, single, names)
    _assert_grads_match(ep_interpret, single, names)
    assert np.any(np.asarray(ep_interpret[2]) != 0.0)  # a real gradient, not an all-zero one


def test_situ_mlp_grad_interpret_equals_xla():
    rng = np.random.default_rng(162)
    T, D, F = 9, TINY.hidden_size, TINY.intermediate_size
    x_TD = jnp.asarray(2.0 * rng.standard_normal((T, D)), jnp.float32)
    gate_DF, up_DF = (jnp.asarray(s * rng.standard_normal((D, F)) / np.sqrt(D), jnp.float32)
                      for s in (1.0, 4.0))
    down_FD = jnp.asarray(rng.standard_normal((F, D)) / np.sqrt(F), jnp.float32)
    cot_TD = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    args = (x_TD, gate_DF, up_DF, down_FD)

    def grads(backend):
        def loss(*a):
            return jnp.sum(situ_mlp(*a, ACT, backend=backend) * cot_TD)
        return jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)

    _assert_grads_match(grads("interpret"), grads("xla"), ["x_TD", "gate_DF", "up_DF", "down_FD"])
