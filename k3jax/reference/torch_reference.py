"""A torch reference of the Kimi K3 MLP / MoE block, written from docs/spec.md §2.

Independent of the JAX code (it imports only ``k3jax.config``), so it can
cross-check k3jax. Module state_dict keys are the checkpoint names (docs/spec.md
section 3) below ``model.layers.N.mlp.`` / ``model.layers.N.block_sparse_moe.``.
Shapes: T tokens, H hidden, L latent (routed_expert_hidden_size), E experts,
K experts per token, I expert intermediate.
"""

from __future__ import annotations

import glob
import os

import torch
from torch import nn

from k3jax.config import K3Config

__all__ = [
    "TorchKimiMLP",
    "TorchKimiMoE",
    "decode_mxfp4_torch",
    "load_layer_from_safetensors",
    "rms_norm",
    "route",
    "situ_glu",
]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float,
             linear_beta: float | None) -> torch.Tensor:
    """SiTU-GLU: [..., n], [..., n] -> [..., n] in gate's dtype, computed in float32
    (float64 for float64 inputs):
    beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""
    cdt = _compute_dtype(gate, up)
    g = gate.to(cdt)
    u = up.to(cdt)
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., d], weight [d] -> [..., d] in x's dtype,
    x * rsqrt(mean(x**2) + eps) * weight computed in float32 (float64 if x is)."""
    cdt = _compute_dtype(x)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(cdt)).to(x.dtype)


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor,
          cfg: K3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with selection-only bias (and grouped top-k when
    num_expert_group > 1). x [T, H], gate_weight [E, H], bias [E] ->
    (ids [T, K] int64, weights [T, K]); weights are float32 (float64 if x is)."""
    cdt = _compute_dtype(x)
    logits = x.to(cdt) @ gate_weight.to(cdt).T                 # [T, E]
    s = torch.sigmoid(logits)
    biased = s + bias.to(cdt)
    k = cfg.num_experts_per_token
    groups = cfg.num_expert_group
    if groups > 1:
        t, e = biased.shape
        grouped = biased.view(t, groups, e // groups)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)               # [T, G]
        keep = group_score.topk(cfg.topk_group, dim=-1).indices               # [T, kg]
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    ids = biased.topk(k, dim=-1).indices
    weights = s.gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * cfg.routed_scaling_factor
    return ids.to(torch.int64), weights


class TorchKimiMLP(nn.Module):
    """SiTU-GLU MLP: down(situ_glu(gate(x), up(x))). x [T, H] -> [T, H].
    state_dict: gate_proj.weight [F, H], up_proj.weight [F, H], down_proj.weight [H, F]."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float = 4.0,
                 linear_beta: float | None = 25.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.beta = beta
        self.linear_beta = linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(h)


class _Expert(nn.Module):
    """One routed expert in latent space: w2(situ_glu(w1(z), w3(z))). z [T, L] -> [T, L]."""

    def __init__(self, latent: int, intermediate: int, beta: float,
                 linear_beta: float | None, dtype: torch.dtype):
        super().__init__()
        self.beta = beta
        self.linear_beta = linear_beta
        self.w1 = nn.Linear(latent, intermediate, bias=False, dtype=dtype)
        self.w3 = nn.Linear(latent, intermediate, bias=False, dtype=dtype)
        self.w2 = nn.Linear(intermediate, latent, bias=False, dtype=dtype)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(situ_glu(self.w1(z), self.w3(z), self.beta, self.linear_beta))


class _Router(nn.Module):
    """Holds gate.weight [E, H] and gate.e_score_correction_bias [E] (float32,
    float64 when the module is float64)."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        bias_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=bias_dtype), requires_grad=False)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)


class _Norm(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))


class TorchKimiMoE(nn.Module):
    """The K3 latent MoE block with its shared expert. x [T, H] -> [T, H].
    state_dict keys are the checkpoint suffixes under ``block_sparse_moe.``."""

    def __init__(self, cfg: K3Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        h, lat = cfg.hidden_size, cfg.routed_expert_hidden_size
        beta, lbeta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
        self.gate = _Router(h, cfg.num_experts, dtype)
        self.routed_expert_down_proj = nn.Linear(h, lat, bias=False, dtype=dtype)
        if cfg.latent_moe_use_norm:
            self.routed_expert_norm = _Norm(lat, dtype)
        self.routed_expert_up_proj = nn.Linear(lat, h, bias=False, dtype=dtype)
        self.shared_experts = TorchKimiMLP(h, cfg.shared_intermediate_size, beta, lbeta, dtype)
        self.experts = nn.ModuleList(
            _Expert(lat, cfg.moe_intermediate_size, beta, lbeta, dtype)
            for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"TorchKimiMoE expects x [T, {self.cfg.hidden_size}], "
                             f"got {tuple(x.shape)}")
        ids, weights = route(x, self.gate.weight, self.gate.e_score_correction_bias, self.cfg)
        lat = self.routed_expert_down_proj(x)                          # [T, L]
        acc = torch.zeros(lat.shape, dtype=weights.dtype, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = expert(lat[tok]).to(acc.dtype)
            acc.index_add_(0, tok, weights[tok, slot].unsqueeze(-1) * h)
        if self.cfg.latent_moe_use_norm:
            acc = rms_norm(acc, self.routed_expert_norm.weight, self.cfg.rms_norm_eps)
        routed = self.routed_expert_up_proj(acc.to(lat.dtype))
        return routed + self.shared_experts(x)


# -- checkpoint loading ------------------------------------------------------

_E2M1_MAGNITUDE_BITS = 3


def decode_mxfp4_torch(packed: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> dtype: packed uint8 [..., n/2] (low nibble first), scales
    uint8 [..., n/32] (UE8M0, 255 = NaN) -> [..., n]. Decoded from the code
    bits (sign bit 3, exponent bits 1-2, mantissa bit 0) in float64."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scales.dtype}")
    n = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or n % 32 or scales.shape[-1] * 32 != n:
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)}, "
                         f"scales {tuple(scales.shape)}")
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*packed.shape[:-1], n)
    sign = 1.0 - 2.0 * ((codes >> _E2M1_MAGNITUDE_BITS) & 1).to(torch.float64)
    exp = ((codes >> 1) & 3).to(torch.float64)
    man = (codes & 1).to(torch.float64)
    mag = torch.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * torch.exp2(exp - 1.0))
    s = scales.to(torch.float64)
    scale = torch.where(s == 255, torch.full_like(s, float("nan")), torch.exp2(s - 127.0))
    out = (sign * mag).reshape(*scales.shape, 32) * scale.unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], n).to(dtype)


def _collect_layer_tensors(ckpt_dir: str, stem: str) -> dict[str, torch.Tensor]:
    """All tensors named ``[language_model.]{stem}<suffix>`` in ckpt_dir/*.safetensors,
    keyed by suffix."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(os.fspath(ckpt_dir), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt_dir}")
    prefixes = (stem, "language_model." + stem)
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is None:
                    continue
                suffix = name[len(prefix):]
                if suffix in out:
                    raise ValueError(f"tensor {suffix!r} of {stem!r} appears twice: "
                                     f"{where[suffix]} and {name} in {path}")
                out[suffix] = f.get_tensor(name)
                where[suffix] = f"{name} in {path}"
    return out


def load_layer_from_safetensors(ckpt_dir, layer: int, cfg: K3Config,
                                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load layer ``layer`` of a HF checkpoint dir: a TorchKimiMLP for a dense
    layer (``model.layers.N.mlp.*``), a TorchKimiMoE for a MoE layer
    (``model.layers.N.block_sparse_moe.*``). MXFP4 weights
    (``.weight_packed`` + ``.weight_scale``) are decoded."""
    moe = cfg.is_moe_layer(layer)
    stem = f"model.layers.{layer}." + ("block_sparse_moe." if moe else "mlp.")
    raw = _collect_layer_tensors(ckpt_dir, stem)
    if not raw:
        raise KeyError(f"no tensors named [language_model.]{stem}* in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            scale_name = base + "_scale"
            if scale_name not in raw:
                raise KeyError(f"{stem}{name} has no matching {scale_name}")
            if base in raw:
                raise ValueError(f"{stem}{base} is stored both plain and as MXFP4")
            state[base] = decode_mxfp4_torch(t, raw[scale_name], torch.float32)
        elif name.endswith(".weight_scale"):
            if name[: -len("_scale")] + "_packed" not in raw:
                raise KeyError(f"{stem}{name} has no matching weight_packed")
        else:
            state[name] = t
    if moe:
        module: nn.Module = TorchKimiMoE(cfg, dtype=dtype)
    else:
        module = TorchKimiMLP(cfg.hidden_size, cfg.intermediate_size,
                              cfg.activation_situ_beta, cfg.activation_situ_linear_beta, dtype)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"layer {layer} in {ckpt_dir}: missing {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                       f"{'...' if len(unexpected) > 8 else ''}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"layer {layer}: {stem}{name} has shape {tuple(t.shape)}, "
                             f"expected {tuple(expected[name].shape)} for this config")
    module.load_state_dict(state, strict=True)   # copies, casting to each parameter's dtype
    return module
