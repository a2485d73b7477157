"""The environment variables the ``k3jax`` command reads, checked before any
work: a value that does not parse is a usage error (exit status 2) naming the
variable, whichever sub-command runs and whether or not it would have read it.

Each check is the reader the library itself uses, so the accepted values are
the library's: K3JAX_SELFCHECK (0, 1, strict), K3JAX_SELFCHECK_TIMEOUT and
K3JAX_TUNE_REPEATS (> 0), K3JAX_AUTOTUNE and K3JAX_SHARD_SP_SHARED_EXPERT
(0 or 1), K3JAX_INTERPRET_STALL_S (seconds >= 0), K3JAX_HEARTBEAT_TIMEOUT
and K3JAX_INIT_TIMEOUT (whole seconds >= 1), JAX_NUM_PROCESSES and
JAX_PROCESS_ID (integers; their consistency is checked where a run is set
up, k3jax.runtime.startup.spec_from_args).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from k3jax.cli.common import UsageError

AUTOTUNE_VALUES = ("", "0", "1")


def _autotune(environ: Mapping[str, str]) -> None:
    from pallas_kernels.selfcheck.tune import TUNE_ENV
    value = environ.get(TUNE_ENV, "").strip()
    if value not in AUTOTUNE_VALUES:
        raise ValueError(f"{TUNE_ENV}={value!r}: expected 0 or 1")


def _checks() -> list[Callable[[Mapping[str, str]], object]]:
    """Each variable's reader, as a function of the environment."""
    from k3jax.layout.parallel import _shard_shared_expert_from_env
    from k3jax.runtime import startup
    from pallas_kernels import interpret_compat
    from pallas_kernels.selfcheck import gate, tune

    return [lambda env: gate.mode(), lambda env: gate.timeout_s(), lambda env: tune.repeats(),
            _autotune, lambda env: interpret_compat.stall_timeout_s(),
            lambda env: _shard_shared_expert_from_env(),
            startup.heartbeat_timeout_s, startup.init_timeout_s,
            lambda env: startup.env_int(env, startup.ENV_NUM_PROCESSES),
            lambda env: startup.env_int(env, startup.ENV_PROCESS_ID)]


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """UsageError naming the first variable whose value does not parse.
    (The library's readers read os.environ; ``environ`` is passed to those
    that take it.)"""
    for check in _checks():
        try:
            check(environ)
        except ValueError as e:
            raise UsageError(f"environment variable {e}") from None
