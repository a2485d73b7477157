"""K3Config (SPEC 1): fields, presets, from_hf_config (flat, nested, paths), errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k3jax.config import K3, PRESETS, TINY, TINY_GROUPED, K3Config, from_hf_config, preset

# SPEC section 1, key by key.
K3_VALUES = {
    "hidden_size": 7168, "moe_intermediate_size": 3072, "intermediate_size": 33792,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
    "num_expert_group": 1, "topk_group": 1, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 1.0, "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True, "rms_norm_eps": 1e-5, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "num_hidden_layers": 93,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "min_moe_intermediate_per_partition": 256,
}

# The published file: K3's keys nested under text_config, next to unrelated keys,
# and without min_moe_intermediate_per_partition.
K3_PUBLISHED = {
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
    "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
    "text_config": {"model_type": "kimi_linear", "vocab_size": 163840, "torch_dtype": "bfloat16",
                    **{k: v for k, v in K3_VALUES.items()
                       if k != "min_moe_intermediate_per_partition"}},
}


def test_k3_preset_has_every_spec_value():
    assert {f.name for f in dataclasses.fields(K3Config)} == set(K3_VALUES)
    assert {k: getattr(K3, k) for k in K3_VALUES} == K3_VALUES
    assert K3.shared_intermediate_size == 6144
    assert (K3.num_moe_layers, K3.num_dense_layers) == (92, 1)
    assert K3Config() == K3
    assert preset("k3") is K3 and preset("tiny") is TINY and PRESETS["tiny-grouped"] is TINY_GROUPED
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")


def test_config_is_frozen_and_replace_validates():
    with pytest.raises(dataclasses.FrozenInstanceError):
        K3.hidden_size = 1   # type: ignore[misc]
    assert K3.replace(hidden_size=128).hidden_size == 128 and K3.hidden_size == 7168
    with pytest.raises(ValueError, match="hidden_size"):
        K3.replace(hidden_size=0)


def test_tiny_presets():
    assert (TINY.hidden_size, TINY.routed_expert_hidden_size, TINY.moe_intermediate_size) == (96, 64, 64)
    assert (TINY.num_experts, TINY.num_experts_per_token, TINY.num_shared_experts) == (16, 4, 2)
    assert (TINY.num_hidden_layers, TINY.min_moe_intermediate_per_partition) == (3, 16)
    assert TINY.num_expert_group == 1
    assert (TINY_GROUPED.num_expert_group, TINY_GROUPED.topk_group) == (4, 2)
    # Everything else is K3's structure.
    for key in ("moe_router_activation_func", "moe_renormalize", "routed_scaling_factor",
                "latent_moe_use_norm", "rms_norm_eps", "hidden_act", "activation_situ_beta",
                "activation_situ_linear_beta", "first_k_dense_replace", "moe_layer_freq"):
        assert getattr(TINY, key) == getattr(K3, key), key


def test_from_hf_config_flat_dict_and_round_trip():
    assert from_hf_config(K3_VALUES) == K3
    assert from_hf_config(TINY.to_hf_dict()) == TINY
    assert from_hf_config(TINY_GROUPED.to_hf_dict()) == TINY_GROUPED
    # Unknown keys are ignored; absent keys take K3's values, but an absent
    # activation_situ_linear_beta is unset (SPEC 2: up' = up).
    cfg = from_hf_config({"hidden_size": 256, "vocab_size": 99, "rope_theta": 1e6})
    assert cfg == K3.replace(hidden_size=256, activation_situ_linear_beta=None)


def test_absent_linear_beta_is_unset_but_k3_keeps_25():
    assert K3.activation_situ_linear_beta == 25.0
    assert from_hf_config(K3_PUBLISHED).activation_situ_linear_beta == 25.0
    without = {k: v for k, v in K3_VALUES.items() if k != "activation_situ_linear_beta"}
    assert from_hf_config(without) == K3.replace(activation_situ_linear_beta=None)
    assert from_hf_config({**K3_VALUES, "activation_situ_linear_beta": None}) == from_hf_config(without)


def test_from_hf_config_nested_text_config_from_dir_and_file(tmp_path):
    cfg = from_hf_config(K3_PUBLISHED)
    assert cfg == K3                 # min_moe_intermediate_per_partition defaults to 256
    (tmp_path / "config.json").write_text(json.dumps(K3_PUBLISHED))
    assert from_hf_config(tmp_path) == K3                       # a checkpoint directory
    assert from_hf_config(str(tmp_path / "config.json")) == K3  # the file itself
    nested_tiny = {"model_type": "kimi_k3", "text_config": TINY.to_hf_dict()}
    assert from_hf_config(nested_tiny) == TINY


def test_from_hf_config_integer_valued_floats():
    raw = {**TINY.to_hf_dict(), "hidden_size": 96.0, "num_experts": 16.0, "moe_intermediate_size": 64.0,
           "routed_scaling_factor": 2, "activation_situ_linear_beta": None}
    cfg = from_hf_config(raw)
    assert cfg == TINY.replace(routed_scaling_factor=2.0, activation_situ_linear_beta=None)
    assert type(cfg.hidden_size) is int and type(cfg.num_experts) is int


def test_from_hf_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        from_hf_config(tmp_path)                        # a directory without config.json
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 96,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        from_hf_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        from_hf_config(bad)
    bad.write_text(json.dumps({"model_type": "kimi_k3", "text_config": {"num_experts": 8}}))
    with pytest.raises(ValueError, match="no 'hidden_size' key"):
        from_hf_config(bad)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("hidden_size", -96), ("hidden_size", 95.5), ("hidden_size", "96"),
    ("num_experts", True), ("moe_intermediate_size", None), ("num_hidden_layers", 0),
    ("moe_layer_freq", 0), ("min_moe_intermediate_per_partition", 0),
    ("activation_situ_beta", 0.0), ("activation_situ_beta", "4.0"),
    ("activation_situ_linear_beta", -25.0), ("activation_situ_linear_beta", float("nan")),
    ("rms_norm_eps", -1e-5), ("rms_norm_eps", None), ("routed_scaling_factor", 0.0),
    ("routed_scaling_factor", float("inf")), ("moe_renormalize", "false"),
    ("latent_moe_use_norm", 1), ("moe_router_activation_func", "softmax"), ("hidden_act", "silu"),
    ("first_k_dense_replace", -3), ("first_k_dense_replace", 1.5), ("first_k_dense_replace", 500),
    ("first_k_dense_replace", True), ("first_k_dense_replace", None),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"config dict: K3Config.{field}"):
        from_hf_config({**TINY.to_hf_dict(), field: value})


@pytest.mark.parametrize("changes, words", [
    ({"num_experts_per_token": 17}, "num_experts_per_token"),
    ({"num_expert_group": 3}, "num_expert_group"),
    ({"num_expert_group": 4, "topk_group": 5}, "topk_group"),
    ({"num_expert_group": 4, "topk_group": 0}, "topk_group"),
    ({"num_expert_group": 16, "topk_group": 2}, "two best"),
    ({"num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 5}, "topk_group"),
])
def test_inconsistent_values_are_rejected(changes, words):
    with pytest.raises(ValueError, match=words):
        from_hf_config({**TINY.to_hf_dict(), **changes})


def test_is_moe_layer():
    assert [K3.is_moe_layer(i) for i in (0, 1, 2, 92)] == [False, True, True, True]
    assert [TINY.is_moe_layer(i) for i in range(3)] == [False, True, True]
    cfg = TINY.replace(num_hidden_layers=7, first_k_dense_replace=2, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(7)] == [False, False, True, False, True, False, True]
    assert (cfg.num_moe_layers, cfg.num_dense_layers) == (3, 4)
    for bad in (-1, 3, 93):
        with pytest.raises(ValueError, match=f"layer {bad} is out of range"):
            TINY.is_moe_layer(bad)
    with pytest.raises(ValueError, match="layer 93 is out of range: the model has 93 layers"):
        K3.is_moe_layer(93)


def test_first_k_dense_replace_range():
    """0..num_hidden_layers: all MoE, and all dense, are both allowed."""
    assert TINY.replace(first_k_dense_replace=0).num_moe_layers == 3
    assert TINY.replace(first_k_dense_replace=3).num_moe_layers == 0
    with pytest.raises(ValueError, match=r"K3Config.first_k_dense_replace must be an integer in "
                                         r"\[0, num_hidden_layers=3\], got 4"):
        TINY.replace(first_k_dense_replace=4)
