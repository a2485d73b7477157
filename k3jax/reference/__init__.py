"""Torch reference of the K3 MLP / MoE block (the optional ``torch`` extra).

Written from the math of docs/spec.md only, independent of the JAX implementation, for
cross-checking k3jax. Needs torch: ``pip install k3jax[torch]``.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("k3jax.reference needs torch; install the extra: "
                      "pip install 'k3jax[torch]'") from e

from k3jax.reference import torch_reference
from k3jax.reference.torch_reference import *  # noqa: F403 (the names in __all__)

__all__ = torch_reference.__all__
