"""SharedOverlap.AUTO, the default: the form (and scatter dtype) of an
SP-sharded shared expert / dense MLP picked per static token count from the
committed table (k3jax.layout.shared_overlap_choice), resolved by
Layout.for_tokens before anything uses it.

Checked: the resolution itself (per table range, the dense MLP's own pick,
an explicit scatter dtype winning, explicit forms untouched); the layer's
output under AUTO equals, bit for bit, the output of the layout that names
the picked form, on 8 simulated devices, at token counts where the picks
differ (TINY, float32); the overlap contract and the auto table's
eligibility rule; and the CLI's usage and JSON."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import tiers
from k3jax import K3, TINY, EpDispatch, ParallelConfig, SharedOverlap, make_layout
from k3jax.cli import main
from k3jax.layout import shared_overlap_choice
from layout_cases import DENSE_LAYER, EXTRA_LAYOUTS, MOE_LAYER, add_layout, output

AUTO = [name for name in EXTRA_LAYOUTS if name.endswith("_auto")]


def _explicit(name: str, tokens: int, layer_kind: str) -> ParallelConfig:
    """The layout naming the form (and scatter dtype) AUTO resolves to for a
    float32 TINY layer at ``tokens``."""
    par = EXTRA_LAYOUTS[name]
    lay = make_layout(TINY, par).for_tokens(tokens)
    mlp = lay.shared_mlp if layer_kind == "moe" else lay.dense_mlp
    assert mlp.overlap is not SharedOverlap.AUTO
    return dataclasses.replace(par, shared_overlap=mlp.overlap, shared_scatter_dtype=mlp.scatter)


def test_for_tokens_follows_the_table_per_range():
    par = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                         shard_shared_expert=True)
    assert par.shared_overlap is SharedOverlap.AUTO           # the default
    layout = make_layout(K3, par, dtype=jnp.bfloat16)
    assert layout.shared_mlp.overlap is SharedOverlap.AUTO
    seen = set()
    for first in shared_overlap_choice.first_tokens(8, 1):
        for tokens in (first, 2 * first - 1):
            lay = layout.for_tokens(tokens)
            form, scatter = shared_overlap_choice.pick(8, 1, tokens)
            assert lay.shared_mlp.overlap is SharedOverlap(form)
            assert lay.shared_mlp.scatter == scatter
            dense_form, dense_scatter = shared_overlap_choice.pick(8, 1, tokens, layer="dense")
            assert lay.dense_mlp.overlap is SharedOverlap(dense_form)
            assert lay.dense_mlp.scatter == dense_scatter
            assert f"auto -> {form}" in lay.shared_mlp.reason
            assert lay.for_tokens(tokens) is lay                # concrete: itself
            seen.add(form)
    assert len(seen) >= 2, seen                                 # the table does change its pick


def test_an_explicit_scatter_dtype_wins_and_explicit_forms_stay():
    par = ParallelConfig(tp=8, sequence_parallel=True, expert_parallel=True,
                         shard_shared_expert=True, shared_scatter_dtype="float32")
    tokens = next(t for t in range(1, 16385)
                  if shared_overlap_choice.pick(8, 1, t) == ("none", "bfloat16"))
    assert make_layout(K3, par, dtype=jnp.bfloat16).for_tokens(tokens).shared_mlp.scatter == "float32"
    ring = make_layout(K3, dataclasses.replace(par, shared_overlap=SharedOverlap.RING,
                                               ep_dispatch=EpDispatch.GATHER))
    assert ring.for_tokens(tokens) is ring
    # without the explicit dtype: bf16 for a bf16 layer, float32 sums for a float32 one
    auto = dataclasses.replace(par, shared_scatter_dtype=None)
    assert make_layout(K3, auto, dtype=jnp.bfloat16).for_tokens(tokens).shared_mlp.scatter == "bfloat16"
    assert make_layout(K3, auto, dtype=jnp.float32).for_tokens(tokens).shared_mlp.scatter == "float32"


def test_an_unresolved_auto_has_no_collectives_to_list():
    layout = make_layout(K3, ParallelConfig(tp=4, sequence_parallel=True,
                                            shard_shared_expert=True))
    with pytest.raises(ValueError, match="for_tokens"):
        layout.shared_mlp.collectives
    with pytest.raises(ValueError, match="for_tokens"):
        SharedOverlap.AUTO.moves_rows
    assert layout.for_tokens(64).shared_mlp.collectives


@pytest.mark.parametrize("name", AUTO)
@pytest.mark.parametrize("tokens", [16, tiers.slow(8192)])
def test_auto_output_is_the_picked_forms_bit_for_bit(name, tokens):
    """TINY on 8 simulated devices, float32: the MoE layer under AUTO equals
    the layout naming the picked form exactly (the same program)."""
    explicit = add_layout(f"{name}_as_T{tokens}", _explicit(name, tokens, "moe"))
    got = output(TINY, name, MOE_LAYER, tokens)
    want = output(TINY, explicit, MOE_LAYER, tokens)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_auto_dense_layer_is_the_picked_forms_bit_for_bit():
    name, tokens = "sp_tp8_shard_auto", 64
    explicit = add_layout(f"{name}_dense_T{tokens}", _explicit(name, tokens, "dense"))
    got = output(TINY, name, DENSE_LAYER, tokens)
    np.testing.assert_array_equal(got, output(TINY, explicit, DENSE_LAYER, tokens))


def test_the_table_only_picks_forms_whose_schedule_keeps_the_overlap():
    """analysis' generator admits only forms with Layout.shared_overlaps_routed
    (NONE at dp > 1 is not), so AUTO's claim holds wherever it is tabulated."""
    for tp, dp in shared_overlap_choice.tabulated():
        par = ParallelConfig(dp=dp, tp=tp, sequence_parallel=True, expert_parallel=True,
                             shard_shared_expert=True)
        layout = make_layout(K3, par)
        assert layout.shared_overlaps_routed is True, (tp, dp)
        for t in shared_overlap_choice.first_tokens(tp, dp):
            form, _ = shared_overlap_choice.pick(tp, dp, t)
            assert not (dp > 1 and form == "none"), (tp, dp, t)


def test_plan_and_compile_json_record_the_pick(capsys):
    assert main(["plan", "--preset", "k3", "--tp", "8", "--sequence-parallel", "--expert-parallel",
                 "--shard-shared-expert", "--tokens", "8192", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["parallel"]["shared_overlap"] == "auto"
    assert doc["layout"]["overlap_forms"]["shared_expert"] == shared_overlap_choice.pick(8, 1, 8192)[0]


def test_an_explicit_scatter_dtype_under_auto_is_taken(capsys):
    assert main(["plan", "--preset", "k3", "--tp", "8", "--sequence-parallel", "--expert-parallel",
                 "--shard-shared-expert", "--tokens", "2048", "--shared-scatter-dtype",
                 "float32", "--json"]) == 0
    forms = json.loads(capsys.readouterr().out)["layout"]["overlap_forms"]
    assert forms["shared_expert_scatter_dtype"] == "float32"
