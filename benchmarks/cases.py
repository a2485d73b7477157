"""The kernel benchmark's sweep: shapes, cases, routing and the callables timed.

Shapes (``Plan``): the grouped MoE matmuls at K3 shapes for local-expert counts
num_experts / EP, with M = tokens x top_k rows spread over the local experts
(random balanced routing, ``grouped_sizes``), and the fused dense/shared MLP
up-projection at D x F / tp. ``FULL`` is the H200 sweep, ``SMOKE`` a CPU-sized
one. Every other benchmark module (kernel_sweep, model_rows, lower_check)
enumerates the same cases from here, so the timed rows, the cost model's rows
and the lowered configurations are one list.

  op "gate_up_situ": x [rows, latent] @ [w1 | w3] [G, latent, inter] + SiTU-GLU
  op "down":         x [rows, inter] @ w [G, inter, latent]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_glu, situ_mlp_up
from pallas_kernels.backend import Backend, Family, resolve
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab, reference
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights

BETA, LINEAR_BETA = 4.0, 25.0
SITU = {"beta": BETA, "linear_beta": LINEAR_BETA}
DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes swept by one run."""

    latent: int  # routed expert hidden (K of gate/up, N of down)
    inter: int  # expert intermediate (N of gate/up, K of down)
    num_experts: int
    top_k: int
    eps: tuple[int, ...]
    tokens: tuple[int, ...]
    mlp_hidden: int
    mlp_inter: int
    tps: tuple[int, ...]
    mlp_tokens: tuple[int, ...]
    small_tokens: int  # token counts <= this report weight-read bandwidth
    matmul_dim: int  # ceiling matmul is matmul_dim^3
    copy_elems: int  # ceiling copy size (bf16 elements)


FULL = Plan(latent=3584, inter=3072, num_experts=896, top_k=16, eps=(8, 16, 32),
            tokens=(16, 64, 256, 1024, 4096, 16384), mlp_hidden=7168, mlp_inter=6144,
            tps=(1, 4, 8), mlp_tokens=(8, 32, 128, 512, 2048), small_tokens=256,
            matmul_dim=8192, copy_elems=1 << 30)
SMOKE = Plan(latent=64, inter=32, num_experts=16, top_k=2, eps=(4,), tokens=(24,),
             mlp_hidden=64, mlp_inter=64, tps=(2,), mlp_tokens=(8,), small_tokens=8,
             matmul_dim=128, copy_elems=1 << 16)


@dataclasses.dataclass(frozen=True)
class GroupedCase:
    """One grouped MoE matmul: op at EP ``ep`` with tokens x top_k rows over
    the ``local_experts`` = num_experts / ep experts of one device.

    op "gate_up_situ": x [rows, latent] -> [rows, inter], two weights;
    op "down":         x [rows, inter] -> [rows, latent], one weight.
    mxfp4: the weights are MXFP4 (packed uint8 [G, N, K/2] + UE8M0 scales
    [G, K/32, N] each, as Mxfp4Weights holds them; label "<op>_mxfp4"):
    timed here by the Triton kernels (bench_mxfp4.py times the "pallas"
    MXFP4 kernel), modelled by benchmarks.model_rows.
    """

    op: str
    ep: int
    local_experts: int
    tokens: int
    rows: int
    k: int
    n: int
    num_weights: int
    mxfp4: bool = False

    @property
    def label(self) -> str:
        return self.op + "_mxfp4" * self.mxfp4

    @property
    def name(self) -> str:
        return f"{self.label} ep={self.ep} tokens={self.tokens}"

    def fields(self) -> dict:
        return {"op": self.label, "ep": self.ep, "local_experts": self.local_experts,
                "tokens": self.tokens, "rows": self.rows, "K": self.k, "N": self.n}

    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """(x_MK, *w_GKN, group_sizes_G) shapes of the kernel's arguments."""
        S = jax.ShapeDtypeStruct
        if self.mxfp4:
            w = [S((self.local_experts, self.n, self.k // 2), jnp.uint8),
                 S((self.local_experts, self.k // 32, self.n), jnp.uint8)]
        else:
            w = [S((self.local_experts, self.k, self.n), DTYPE)]
        return (S((self.rows, self.k), DTYPE), *w * self.num_weights,
                S((self.local_experts,), jnp.int32))

    def fn(self, backend: Backend) -> Callable:
        """The op on ``backend`` as f(x, *weights, group_sizes); MXFP4 weights
        come as (packed, scale) pairs: "triton" dequantizes them in the kernel,
        "xla" decodes them in XLA (bf16) before the reference."""
        if self.mxfp4:
            return mxfp4_fn(self.op, backend)
        if self.op == "gate_up_situ":
            return lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend=backend, **SITU)
        return lambda x, w, s: grouped_matmul(x, w, s, backend=backend)

    def epilogue(self, *products_f32):
        """What the kernel applies to its f32 products (for the spot check)."""
        return situ_glu(*products_f32, **SITU) if self.op == "gate_up_situ" else products_f32[0]


def dequant_GKN(packed_GNH, scale_GSN):
    """MXFP4 [G, N, K/2] + [G, K/32, N] -> bf16 [G, K, N] (dequant along K)."""
    return Mxfp4Weights(packed_GNH, scale_GSN, Mxfp4Dequant.EXACT).dequantize(DTYPE)


def mxfp4_fn(op: str, backend: Backend, dequant: Mxfp4Dequant = Mxfp4Dequant.FAST) -> Callable:
    """f(x, *(packed, scale) per weight, group_sizes) on "triton", "xla" (XLA
    decode + ragged_dot) or "pallas" / "interpret" (mosaic_sm90_mxfp4.py's
    in-kernel decode, through the grouped ops' MXFP4 dispatch, of weights
    declared ``dequant``: FAST, what real checkpoints and these benchmarks'
    random scale bytes allow, runs the fast kernels; EXACT the exact one)."""
    family = resolve(backend).family
    if family is Family.MOSAIC:
        if op == "gate_up_situ":
            return lambda x, gp, gs, up, us, s: grouped_situ_glu(
                x, Mxfp4Weights(gp, gs, dequant), Mxfp4Weights(up, us, dequant), s,
                backend=backend, **SITU)
        return lambda x, p, sc, s: grouped_matmul(x, Mxfp4Weights(p, sc, dequant), s,
                                                  backend=backend)
    if family is Family.XLA:
        if op == "gate_up_situ":
            return lambda x, gp, gs, up, us, s: reference.grouped_situ_glu(
                x, dequant_GKN(gp, gs), dequant_GKN(up, us), s, **SITU)
        return lambda x, p, sc, s: reference.grouped_matmul(x, dequant_GKN(p, sc), s)
    from pallas_kernels.grouped_matmul import triton_sm80
    if op == "gate_up_situ":
        return lambda x, gp, gs, up, us, s: triton_sm80.grouped_situ_glu_mxfp4(
            x, gp, gs, up, us, s, **SITU)
    return lambda x, p, sc, s: triton_sm80.grouped_matmul_mxfp4(x, p, sc, s)


def dense_weights(case: GroupedCase, ws: tuple) -> tuple:
    """The weights as dense bf16 [G, K, N] (MXFP4 (packed, scale) pairs decoded)
    for the spot check; the arrays themselves for bf16 cases."""
    if not case.mxfp4:
        return ws
    return tuple(dequant_GKN(ws[i], ws[i + 1]) for i in range(0, len(ws), 2))


def triton_available() -> bool:
    """jax-triton (the ``triton`` extra) is installed."""
    return importlib.util.find_spec("jax_triton") is not None


@dataclasses.dataclass(frozen=True)
class MlpCase:
    """The fused MLP up-projection x [tokens, d] @ gate/up [d, f], f = F / tp."""

    tp: int
    tokens: int
    d: int
    f: int

    @property
    def name(self) -> str:
        return f"situ_mlp_up tp={self.tp} tokens={self.tokens}"

    def fields(self) -> dict:
        return {"op": "situ_mlp_up", "tp": self.tp, "tokens": self.tokens, "D": self.d,
                "F": self.f}

    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        S = jax.ShapeDtypeStruct
        return S((self.tokens, self.d), DTYPE), S((self.d, self.f), DTYPE), S((self.d, self.f), DTYPE)

    @staticmethod
    def fn(backend: str) -> Callable:
        return lambda x, gate, up: situ_mlp_up(x, gate, up, backend=backend, **SITU)


def grouped_cases(plan: Plan, mxfp4: bool = False) -> list[GroupedCase]:
    """Every grouped config of the plan, ordered by tokens, then EP, then op
    (then bf16 before MXFP4 weights when ``mxfp4``): a run cut short by
    --time-budget loses the largest token counts of every EP rather than a
    whole EP."""
    ops = (("gate_up_situ", plan.latent, plan.inter, 2), ("down", plan.inter, plan.latent, 1))
    return [GroupedCase(op, ep, plan.num_experts // ep, tokens, tokens * plan.top_k, k, n, num_w,
                        mx)
            for tokens in plan.tokens for ep in plan.eps for op, k, n, num_w in ops
            for mx in ((False, True) if mxfp4 else (False,))]


def mlp_cases(plan: Plan) -> list[MlpCase]:
    """Every MLP config of the plan, ordered by tp, then tokens."""
    return [MlpCase(tp, tokens, plan.mlp_hidden, plan.mlp_inter // tp)
            for tp in plan.tps for tokens in plan.mlp_tokens]


def routed_group_sizes(rows: int, groups: int, seed: int) -> np.ndarray:
    """int32 [groups]: rows assigned to experts uniformly at random (sum = rows)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(rows, np.full(groups, 1.0 / groups)).astype(np.int32)


def grouped_sizes(case: GroupedCase) -> np.ndarray:
    """The sweep's routing for ``case`` (the GPU run and the model use the same)."""
    return routed_group_sizes(case.rows, case.local_experts, seed=case.tokens + case.ep)


def jax_mosaic_ragged_dot(case: GroupedCase) -> Callable:
    """Peer for "down": jax's own Mosaic GPU ragged_dot
    (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu), one fixed tiling like
    ours (64-row tiles at decode, 128 at prefill); not autotuned."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    block_m = 128 if case.rows >= 128 * case.local_experts else 64
    return lambda x, w, s: ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=s, block_m=block_m, block_n=128, block_k=64, max_concurrent_steps=4,
        grid_block_n=4 if case.n % 512 == 0 else 1)


def decode_fn(case: GroupedCase, config: mosaic_sm90_swap_ab.SwapABConfig) -> Callable:
    """The decode kernel with a fixed tiling, as case.fn's signature."""
    if case.op == "gate_up_situ":
        return lambda x, w1, w3, s: mosaic_sm90_swap_ab.grouped_situ_glu(
            x, w1, w3, s, config=config, **SITU)
    return lambda x, w, s: mosaic_sm90_swap_ab.grouped_matmul(x, w, s, config=config)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """--ep / --tokens / --tp / --mlp-tokens: a slice of the plan's sweep."""
    p.add_argument("--ep", type=positive_int, nargs="+",
                   help="EP sizes to sweep (default 8 16 32; must divide the expert count)")
    p.add_argument("--tokens", type=positive_int, nargs="+", help="grouped token counts to sweep")
    p.add_argument("--tp", type=positive_int, nargs="+",
                   help="MLP tp sizes (F = 6144 / tp; must divide it)")
    p.add_argument("--mlp-tokens", type=positive_int, nargs="+", help="MLP token counts to sweep")


def plan_from_args(p: argparse.ArgumentParser, args: argparse.Namespace, base: Plan) -> Plan:
    """``base`` with the flags of add_plan_flags applied; a usage error (exit 2,
    naming the flag) when an EP does not divide the experts or a tp the MLP
    intermediate size."""
    overrides = {"eps": args.ep, "tokens": args.tokens, "tps": args.tp,
                 "mlp_tokens": args.mlp_tokens}
    plan = dataclasses.replace(base, **{k: tuple(v) for k, v in overrides.items() if v})
    for ep in plan.eps:
        if plan.num_experts % ep:
            p.error(f"--ep {ep} does not divide the {plan.num_experts} experts")
    for tp in plan.tps:
        if plan.mlp_inter % tp:
            p.error(f"--tp {tp} does not divide the MLP intermediate size {plan.mlp_inter}")
    return plan
