"""The SiTU-GLU activation's parameters as one value (the math itself lives in
``pallas_kernels.situ``, shared with the kernels' fused epilogues)."""

from __future__ import annotations

import dataclasses

from k3jax.config import K3Config
from pallas_kernels.situ import situ_glu


@dataclasses.dataclass(frozen=True)
class SiTU:
    """gate' = beta*tanh(gate/beta)*sigmoid(gate); up' = linear_beta*tanh(up/linear_beta)."""

    beta: float
    linear_beta: float | None

    @classmethod
    def from_config(cls, cfg: K3Config) -> "SiTU":
        return cls(cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def __call__(self, gate, up):
        """gate, up: [..., F] -> [..., F] in gate's dtype (computed in float32)."""
        return situ_glu(gate, up, beta=self.beta, linear_beta=self.linear_beta)
