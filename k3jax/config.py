"""K3Config: the numbers that define one Kimi K3 MoE block (docs/spec.md §1).

A frozen dataclass whose field names are the HF ``config.json`` keys of the
``kimi_linear`` model type, so a config file maps onto it one to one.
``from_hf_config`` accepts the flat file and the ``text_config``-nested form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class K3Config:
    """The model's numbers. Letters used across k3jax: D = hidden_size,
    L = routed_expert_hidden_size (latent), F = an MLP intermediate,
    E = num_experts, K = num_experts_per_token."""

    hidden_size: int = 7168
    moe_intermediate_size: int = 3072
    intermediate_size: int = 33792
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    num_expert_group: int = 1
    topk_group: int = 1
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    num_hidden_layers: int = 93
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    min_moe_intermediate_per_partition: int = 256

    def __post_init__(self) -> None:
        _check_positive(self, "hidden_size", "moe_intermediate_size", "intermediate_size",
                        "num_experts", "num_experts_per_token", "num_shared_experts",
                        "num_expert_group", "topk_group", "routed_expert_hidden_size",
                        "num_hidden_layers", "moe_layer_freq",
                        "min_moe_intermediate_per_partition")
        fkd = self.first_k_dense_replace
        if not isinstance(fkd, int) or isinstance(fkd, bool) or not 0 <= fkd <= self.num_hidden_layers:
            raise ValueError(f"K3Config.first_k_dense_replace must be an integer in "
                             f"[0, num_hidden_layers={self.num_hidden_layers}], got {fkd!r}")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError("K3Config.moe_router_activation_func: only 'sigmoid' is "
                             f"supported, got {self.moe_router_activation_func!r}")
        if self.hidden_act != "situ":
            raise ValueError(f"K3Config.hidden_act: only 'situ' is supported, got {self.hidden_act!r}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"K3Config: num_experts_per_token ({self.num_experts_per_token}) "
                             f"exceeds num_experts ({self.num_experts})")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"K3Config: num_experts ({self.num_experts}) is not divisible by "
                             f"num_expert_group ({self.num_expert_group})")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"K3Config: topk_group ({self.topk_group}) must lie in "
                             f"[1, num_expert_group={self.num_expert_group}]")
        if self.num_expert_group > 1:
            per_group = self.num_experts // self.num_expert_group
            if per_group < 2:
                raise ValueError("K3Config: grouped top-k scores a group by its two best "
                                 f"experts, but a group holds {per_group}")
            if self.topk_group * per_group < self.num_experts_per_token:
                raise ValueError(f"K3Config: topk_group={self.topk_group} groups of {per_group} "
                                 f"experts cannot supply num_experts_per_token="
                                 f"{self.num_experts_per_token}")
        for name in ("moe_renormalize", "latent_moe_use_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"K3Config.{name} must be true or false, got {getattr(self, name)!r}")
        _check_number(self, "activation_situ_beta", "routed_scaling_factor")
        _check_number(self, "rms_norm_eps", allow_zero=True)
        if self.activation_situ_linear_beta is not None:
            _check_number(self, "activation_situ_linear_beta")

    # Derived sizes -------------------------------------------------------
    @property
    def shared_intermediate_size(self) -> int:
        """Width of the one MLP that holds all shared experts: I x num_shared_experts."""
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` holds a MoE block (else the dense MLP)."""
        if not 0 <= layer < self.num_hidden_layers:
            raise ValueError(f"layer {layer} is out of range: the model has "
                             f"{self.num_hidden_layers} layers (0..{self.num_hidden_layers - 1})")
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def to_hf_dict(self) -> dict[str, Any]:
        """The flat ``config.json`` form (model_type kimi_linear)."""
        return {"model_type": "kimi_linear", **dataclasses.asdict(self)}

    def replace(self, **changes: Any) -> "K3Config":
        return dataclasses.replace(self, **changes)


def _check_positive(cfg: K3Config, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"K3Config.{name} must be a positive integer, got {value!r}")


def _check_number(cfg: K3Config, *names: str, allow_zero: bool = False) -> None:
    """Each field must be a finite real number > 0 (>= 0 with ``allow_zero``)."""
    for name in names:
        value = getattr(cfg, name)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (value > 0 or (allow_zero and value == 0)))
        if not ok:
            raise ValueError(f"K3Config.{name} must be a finite number {'>=' if allow_zero else '>'} 0"
                             f"{' (or null)' if name == 'activation_situ_linear_beta' else ''}, "
                             f"got {value!r}")


_FIELDS = {f.name: f for f in dataclasses.fields(K3Config)}
_INT_FIELDS = {name for name, f in _FIELDS.items() if f.type == "int"}
_ABSENT_MEANS_UNSET = ("activation_situ_linear_beta",)

TENSOR_KEYS = ("hidden_size", "moe_intermediate_size", "intermediate_size", "num_experts",
               "num_shared_experts", "routed_expert_hidden_size", "latent_moe_use_norm",
               "num_hidden_layers", "first_k_dense_replace", "moe_layer_freq")
"""Keys a checkpoint's tensors confirm: they set tensor shapes, or which
tensors a layer holds. A checkpoint whose config.json lacks one of them and
whose tensors do not fit the default is an error naming the key."""

MATH_KEYS = ("num_experts_per_token", "num_expert_group", "topk_group",
             "moe_router_activation_func", "moe_renormalize", "routed_scaling_factor",
             "rms_norm_eps", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta")
"""Keys that change the layer's math and that no tensor confirms: a config
that lacks one gets K3's default (None for activation_situ_linear_beta:
unset), which ``describe_defaults`` names for a warning."""


def read_hf_config(source: str | os.PathLike | Mapping[str, Any]) -> tuple[K3Config, dict[str, Any]]:
    """(config, defaults): ``from_hf_config``'s config, and {key: value used}
    for every key of TENSOR_KEYS or MATH_KEYS the source lacks.

    A default that cannot hold is a ValueError naming the missing key: K3's
    top-k of 16 for a config with 16 or fewer experts (every token would take
    every expert), or any default the config's other values contradict."""
    if isinstance(source, Mapping):
        raw = dict(source)
        origin = "config dict"
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        origin = path
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ValueError(f"config file {path} is a directory") from None
        except UnicodeDecodeError:
            raise ValueError(f"config file {path} is not a UTF-8 text file") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        except OSError as e:
            raise OSError(f"cannot read config file {path}: {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{origin}: expected a JSON object")
    if isinstance(raw.get("text_config"), Mapping):
        raw = dict(raw["text_config"])
    values: dict[str, Any] = dict.fromkeys(_ABSENT_MEANS_UNSET)
    for name, value in raw.items():
        if name not in _FIELDS:
            continue
        if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        values[name] = value
    if "hidden_size" not in raw:
        raise ValueError(f"{origin}: no 'hidden_size' key (neither flat nor under 'text_config')")
    missing = [k for k in (*TENSOR_KEYS, *MATH_KEYS) if k not in raw]
    defaults = {k: values[k] if k in values else _FIELDS[k].default for k in missing}
    try:
        cfg = K3Config(**values)
    except ValueError as e:
        named = [k for k in missing if re.search(rf"\b{k}\b", str(e))]
        raise ValueError(f"{origin}: {e}" + (f" ({describe_defaults(named, defaults)})"
                                             if named else "")) from None
    if "num_experts_per_token" in missing and cfg.num_experts_per_token >= cfg.num_experts:
        raise ValueError(f"{origin}: no 'num_experts_per_token' key, and K3's default "
                         f"{cfg.num_experts_per_token} would route every token to all "
                         f"{cfg.num_experts} experts: add the key")
    return cfg, defaults


def describe_defaults(keys, defaults: Mapping[str, Any]) -> str:
    """The words naming absent ``keys`` and the defaults used for them:
    ``no 'a', 'b' keys: K3's defaults a=1, b=2 used``."""
    keys = list(keys)
    plural = "s" if len(keys) > 1 else ""
    return (f"no {', '.join(repr(k) for k in keys)} key{plural}: K3's default{plural} "
            + ", ".join(f"{k}={defaults[k]!r}" for k in keys) + " used")


def from_hf_config(source: str | os.PathLike | Mapping[str, Any]) -> K3Config:
    """Build a K3Config from an HF config: a dict, a ``config.json`` path, or a
    checkpoint directory holding one. Accepts the flat kimi_linear keys and the
    form nested under ``text_config``. Unknown keys are ignored; absent keys
    take the K3 defaults (``min_moe_intermediate_per_partition`` is absent in
    K3's own file), except ``activation_situ_linear_beta``: absent means unset
    (None, ``up' = up``, docs/spec.md §2), as it does for the HF model; K3's file sets
    it to 25.0, and the ``K3`` preset keeps 25.0. ``read_hf_config`` also
    returns which keys were absent."""
    return read_hf_config(source)[0]


K3 = K3Config()
"""The full-size Kimi K3 text model."""

TINY = K3Config(
    hidden_size=96,
    moe_intermediate_size=64,
    intermediate_size=160,
    num_experts=16,
    num_experts_per_token=4,
    num_shared_experts=2,
    routed_expert_hidden_size=64,
    num_hidden_layers=3,
    min_moe_intermediate_per_partition=16,
)
"""Same structure as K3 at sizes that run in seconds on a CPU. Its
``min_moe_intermediate_per_partition`` of 16 makes the padding rule bite at
tp = 8 (64 / 8 = 8 < 16), as 256 does for K3 at 16 shards."""

TINY_GROUPED = TINY.replace(num_expert_group=4, topk_group=2)
"""TINY with grouped top-k active (4 groups of 4 experts, keep 2)."""

PRESETS: dict[str, K3Config] = {"k3": K3, "tiny": TINY, "tiny-grouped": TINY_GROUPED}


def preset(name: str) -> K3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
