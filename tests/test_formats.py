"""Expert weight formats (k3jax.formats): a format that exists only here,
int8 per-output-channel experts, registered through the public registry and
run as a K3 MoE layer in an expert-parallel layout on 8 simulated devices
against the float64 reference; each built-in format's declarations, names
and codec round-trip; the registry's refusals; and model code names no
format (the formats and the kernels are the only places that do)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import TINY, ParallelConfig, RandomSource, build_layer, make_layout, make_mesh
from k3jax.checkpoint.names import TensorRef, layer_prefix, layer_tensors
from k3jax.checkpoint.writer import synthetic_tensors
from k3jax.formats import (
    ExpertStorage,
    ParamDecl,
    StoredTensor,
    WeightFormat,
    get_format,
    register_format,
    registered_formats,
    unregister_format,
)
from k3jax.modules.moe import moe_decls
from numerics import rel_err
from pallas_kernels.mxfp4 import dequant_numpy
from reference_np import np_moe

# -- a format of the test's own: int8 codes, one float32 scale per output channel --
NAMES = {"w1": ("w1_q_ELF", "w1_scale_EF"), "w3": ("w3_q_ELF", "w3_scale_EF"),
         "w2": ("w2_q_EFL", "w2_scale_EL")}


def random_codes(key, shape, fan_in):
    return jax.random.randint(key, shape, -127, 128, jnp.int32)


def random_scales(key, shape, fan_in):   # codes' std ~73: weights ~1 / sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) / (73 * math.sqrt(fan_in))


@dataclasses.dataclass(frozen=True)
class Int8Format(WeightFormat):
    """w [E, in, out] = codes int8 [E, in, out] * scale float32 [E, out],
    dequantized to the activations' dtype in XLA before the grouped matmuls."""

    name = "int8-per-channel"
    packed = True

    def param_decls(self, el):
        """Codes as the dense weight (spec, F padded); scales [E, out] split
        as the weight's E and out axes, padded along F for w1 / w3."""
        E, L, I, F = el.num_experts, el.latent, el.intermediate, el.padded
        decls = []
        for (w, (codes, scales)), spec, (n_in, n_out, f_axis) in zip(
                NAMES.items(), el.specs, ((L, F, 2), (L, F, 2), (F, L, 1))):
            entries = list(spec) + [None] * (3 - len(spec))
            decls += [ParamDecl(codes, (E, n_in, n_out), jnp.dtype(jnp.int8), spec, random_codes,
                                n_in if w != "w2" else I, el.padding(f_axis)),
                      ParamDecl(scales, (E, n_out), jnp.dtype(jnp.float32),
                                P(entries[0], entries[2]) if len(spec) else P(), random_scales,
                                n_in if w != "w2" else I, el.padding(1) if w != "w2" else None)]
        return decls

    def checkpoint_tensors(self):
        return {name: StoredTensor(f"{w}.weight_{'q' if name == codes else 'channel_scale'}",
                                   name == codes, True, ("I8",) if name == codes else ("F32",))
                for w, (codes, scales) in NAMES.items() for name in (codes, scales)}

    def kernel_weights(self, p, dtype):
        return tuple((p[codes].astype(jnp.float32) * p[scales][:, None, :]).astype(dtype)
                     for codes, scales in NAMES.values())

    def describe(self):
        return "int8 per-channel experts"


@pytest.fixture
def int8_format():
    fmt = register_format(Int8Format())
    yield fmt
    unregister_format(fmt.name)


def _reference_tensors(moe) -> dict:
    """The module's weights as float64 [out, in] tensors keyed for np_moe, the
    experts dequantized from their int8 codes and scales."""
    f64 = lambda a: np.asarray(a[...], np.float64)  # noqa: E731
    t = {"gate.weight": f64(moe.router_DE).T, "gate.e_score_correction_bias": f64(moe.router_bias_E),
         "routed_expert_down_proj.weight": f64(moe.lat_down_DL).T,
         "routed_expert_up_proj.weight": f64(moe.lat_up_LD).T,
         "routed_expert_norm.weight": f64(moe.lat_norm_L),
         "shared_experts.gate_proj.weight": f64(moe.shared.gate_DF).T,
         "shared_experts.up_proj.weight": f64(moe.shared.up_DF).T,
         "shared_experts.down_proj.weight": f64(moe.shared.down_FD).T}
    for w, (codes, scales) in NAMES.items():
        dense = f64(getattr(moe, codes)) * f64(getattr(moe, scales))[:, None, :]   # [E, in, out]
        for e in range(dense.shape[0]):
            t[f"experts.{e}.{w}.weight"] = dense[e].T
    return t


def test_a_registered_format_runs_an_expert_parallel_layer(eight_devices, int8_format):
    """TINY's MoE layer with int8 per-channel experts, whole experts over 8
    devices (SP + EP), float32 on XLA, fresh random inputs, against float64
    numpy from the dequantized weights: relative error <= 1e-5."""
    par = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True)
    mesh = make_mesh(par, eight_devices)
    layout = make_layout(TINY, par, mesh, backend="xla", experts=int8_format.name)
    assert layout.experts is int8_format and "int8 per-channel experts" in layout.describe()
    moe = build_layer(layout, 1, mesh, source=RandomSource(5))
    assert moe.w1_q_ELF.dtype == jnp.int8
    assert moe.w2_scale_EL.sharding.spec == P(layout.expert_axes, None)
    x = np.random.default_rng(17).standard_normal((13, TINY.hidden_size)).astype(np.float32)
    got = np.asarray(moe(jnp.asarray(x)), np.float64)
    err = rel_err(got, np_moe(x.astype(np.float64), _reference_tensors(moe), TINY))
    assert err <= 1e-5, err


# -- the built-in formats -----------------------------------------------------------
@pytest.mark.parametrize("storage", list(ExpertStorage), ids=lambda s: s.value)
def test_each_built_in_format_round_trips_its_declarations_and_names(storage):
    """Name <-> format <-> ExpertStorage; the declarations are the checkpoint
    table's parameters, which the loader's names table holds; a synthetic
    checkpoint written in the format holds a tensor of each stored shape."""
    fmt = get_format(storage)
    assert fmt.name == storage.value and get_format(fmt.name) is fmt is storage.format
    assert registered_formats()[fmt.name] is fmt and storage.packed is fmt.packed
    layout = make_layout(TINY, ParallelConfig(), experts=storage)
    decls = {d.name: d for d in moe_decls(layout)}
    names = fmt.param_names()
    assert set(names) <= set(decls) and set(names) == set(fmt.checkpoint_tensors())
    refs, prefix = layer_tensors(True), layer_prefix(1, True)
    written = dict(synthetic_tensors(TINY.replace(num_hidden_layers=2), 0, dtype="float32",
                                     experts="dense" if storage is ExpertStorage.DENSE else "mxfp4"))
    for name in names:
        stored = fmt.checkpoint_tensors()[name]
        assert refs[name] == TensorRef.of_expert(stored)
        shape, tensor = decls[name].shape[1:], refs[name].name(prefix, 3)
        if stored.raw:
            assert written[tensor].shape == (shape[::-1] if stored.transpose else shape), name
        elif fmt.decodes is None:   # a float weight, stored as such
            assert written[tensor].shape == shape[::-1], name
        else:                       # ... or in the tensors of the codec it decodes

            def check(stored_name, stored_shape, dtypes):
                assert written[stored_name].shape == stored_shape, stored_name
            get_format(fmt.decodes).check_stored(check, tensor, *shape[::-1])


def test_the_mxfp4_codec_round_trips_through_its_stored_tensors():
    fmt = get_format("mxfp4")
    w = np.random.default_rng(2).standard_normal((8, 96)).astype(np.float32)
    stored = dict(zip(fmt.stored_names("experts.0.w1.weight"), fmt.encode(w)))
    assert sorted(stored) == ["experts.0.w1.weight_packed", "experts.0.w1.weight_scale"]

    def read(name, index, check=None):
        block = stored[name][tuple(index)]
        if check is not None:
            check(block)
        return block
    want = dequant_numpy(*stored.values())
    got = fmt.decode(read, "experts.0.w1.weight", slice(2, 6), slice(40, 77))
    np.testing.assert_array_equal(got, want[2:6, 40:77])
    seen = []
    fmt.check_stored(lambda *a: seen.append(a), "x.weight", 8, 96)
    assert seen == [("x.weight_packed", (8, 48), {"U8"}), ("x.weight_scale", (8, 3), {"U8"})]
    with pytest.raises(ValueError, match="input width 48 to be a multiple of 32"):
        fmt.check_stored(lambda *a: None, "x.weight", 8, 48)


def test_the_registry_refuses_what_would_clash(int8_format):
    with pytest.raises(ValueError, match="'int8-per-channel' is registered already"):
        register_format(Int8Format())

    @dataclasses.dataclass(frozen=True)
    class Clash(Int8Format):
        name = "clash"

        def checkpoint_tensors(self):
            return {"w1_ELF": StoredTensor("w1.weight", False)}
    with pytest.raises(ValueError, match="declares parameter 'w1_ELF'"):
        register_format(Clash())
    assert "clash" not in registered_formats()
    with pytest.raises(ValueError, match="unknown expert format 'int4'; registered: dense"):
        get_format("int4")
    with pytest.raises(ValueError, match="'mxfp4' is built in"):
        unregister_format("mxfp4")


def test_model_code_names_no_format():
    """k3jax/modules, ops, layout and parallel never say "mxfp4" (any case);
    only k3jax/formats and pallas_kernels test for the packed weights' type."""
    root = Path(__file__).resolve().parents[1]
    named = [str(p.relative_to(root)) for d in ("modules", "ops", "layout", "parallel")
             for p in sorted((root / "k3jax" / d).rglob("*.py")) if "mxfp4" in p.read_text().lower()]
    assert not named, named
    probe = re.compile(r"isinstance\([^)]*Mxfp4Weights")
    testing = [str(p.relative_to(root)) for p in sorted((root / "k3jax").rglob("*.py"))
               if probe.search(p.read_text()) and "formats" not in p.parts]
    assert not testing, testing
