"""The check on first use, where the ops dispatch: ``trusted_backend``.

Every grouped_matmul / grouped_situ_glu / situ_mlp_up launch on a kernel
backend (pallas, interpret, triton) asks ``trusted_backend(config)`` at
trace time which backend to run. The first time in a process it sees a
configuration, it reads the cache (pallas_kernels.selfcheck.cache) or, on a
miss, runs the check (pallas_kernels.selfcheck.check) eagerly and stores
its result. A configuration whose check failed runs XLA, and k3jax prints
one warning line naming it and the error (once per process). Backends
here are KernelBackend values; ``Record.backend`` and ``agree`` speak
their names (the text the processes exchange).

Environment:
  K3JAX_SELFCHECK          unset / "1": check; "0": no check (the kernel
                           runs unchecked); "strict": a failed check raises
                           SelfCheckError
  K3JAX_SELFCHECK_PERTURB  a configuration name (or an fnmatch pattern of
                           names): its kernel output is perturbed before
                           the comparison (a test hook)
  K3JAX_SELFCHECK_TIMEOUT  seconds one check may take (default 300)
  K3JAX_AUTOTUNE           "1": a configuration without a tuned result is
                           tuned (pallas_kernels.selfcheck.tune) instead of
                           checked; a cached tuned pick is used either way

``records()`` lists what this process decided, in first-launch order (the
``k3jax selfcheck`` table). ``agree`` installs backends that every
process of a multi-process run agreed on (k3jax.runtime.agreement); they
take precedence over this process's own verdicts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import sys
import threading
from collections.abc import Iterator, Mapping

from pallas_kernels.backend import XLA, Backend, Family, KernelBackend, resolve
from pallas_kernels.selfcheck import cache, tune
from pallas_kernels.selfcheck.cache import CheckResult
from pallas_kernels.selfcheck.check import run_check
from pallas_kernels.selfcheck.config import (
    KernelConfig,
    environment,
    grouped_config,
    mlp_config,
    positive_env,
)

MODE_ENV = "K3JAX_SELFCHECK"
PERTURB_ENV = "K3JAX_SELFCHECK_PERTURB"
TIMEOUT_ENV = "K3JAX_SELFCHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
MODES = ("0", "1", "strict")


class SelfCheckError(RuntimeError):
    """K3JAX_SELFCHECK=strict and a configuration failed its check."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What one configuration runs: ``kernel_backend`` (its kernel's, or XLA
    after a failed check; ``backend`` its name); ``result`` the check's
    (None: not checked); ``cached`` whether the result came from the cache;
    ``cache_file``."""

    config: KernelConfig
    kernel_backend: KernelBackend
    result: CheckResult | None
    cached: bool
    cache_file: str | None

    @property
    def backend(self) -> str:
        """The name of the backend it runs ("xla" after a failed check)."""
        return self.kernel_backend.name

    def to_json(self) -> dict:
        r = self.result
        return {"config": self.config.name, "backend": self.backend,
                "verdict": None if r is None else r.verdict,
                "max_rel_err": None if r is None else r.max_rel_err,
                "seconds": None if r is None else round(r.seconds, 4),
                "cached": self.cached, "error": None if r is None else r.error,
                "tuned": None if r is None else r.tuned,
                "timings_us": None if r is None else r.timings_us,
                "checked_groups": None if r is None else r.checked_groups}


_LOCK = threading.RLock()
_RECORDS: dict[str, Record] = {}
_AGREED: dict[str, KernelBackend] = {}
_NOTES: set[str] = set()
_FORCED_MODE: list[str] = []
_FORCED_TUNE: list[bool] = []
_COLLECTING: list[list[KernelConfig]] = []


def mode() -> str:
    """The check's mode (K3JAX_SELFCHECK, or what ``force_mode`` set)."""
    if _FORCED_MODE:
        return _FORCED_MODE[-1]
    value = os.environ.get(MODE_ENV, "1").strip() or "1"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def force_mode(value: str | None) -> None:
    """Override K3JAX_SELFCHECK in this process (None: back to the environment)."""
    if value is not None and value not in MODES:
        raise ValueError(f"selfcheck mode {value!r} is not one of {MODES}")
    _FORCED_MODE.clear()
    if value is not None:
        _FORCED_MODE.append(value)


def tune_on() -> bool:
    """Tune on a miss: K3JAX_AUTOTUNE=1, or what ``force_tune`` set."""
    return _FORCED_TUNE[-1] if _FORCED_TUNE else tune.requested()


def force_tune(value: bool | None) -> None:
    """Override K3JAX_AUTOTUNE in this process (None: back to the environment)."""
    _FORCED_TUNE.clear()
    if value is not None:
        _FORCED_TUNE.append(value)


def timeout_s() -> float:
    return positive_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float, "seconds > 0")


def note(line: str) -> None:
    """Print ``line`` to stderr once per process."""
    with _LOCK:
        if line in _NOTES:
            return
        _NOTES.add(line)
    print(line, file=sys.stderr, flush=True)


def warning_line(config: KernelConfig, result: CheckResult) -> str:
    return (f"k3jax selfcheck: {config.name} failed its check ({result.verdict}: {result.error}); "
            f"it runs the xla path")


def cache_key(config: KernelConfig) -> dict:
    return cache.key_of(config.to_json(), environment())


def lookup(config: KernelConfig) -> tuple[CheckResult | None, str]:
    """(the cached result or None, the cache file); an unusable file is named once."""
    key = cache_key(config)
    path = cache.path_of(cache.cache_dir(), key)
    result, why = cache.load(path, key)
    if why:
        note(f"k3jax selfcheck: ignoring {why}; checking {config.name} again")
    return result, str(path)


def save(config: KernelConfig, result: CheckResult) -> str:
    """Store ``result``; a directory that cannot be written is said once."""
    key = cache_key(config)
    path = cache.path_of(cache.cache_dir(), key)
    problem = cache.store(path, key, result)
    if problem:
        note(f"k3jax selfcheck: {problem}; checks run again on every start")
    return str(path)


def check(config: KernelConfig) -> CheckResult:
    """Run the check of ``config`` now (K3JAX_SELFCHECK_PERTURB applied)."""
    return run_check(config, timeout_s=timeout_s(), perturb=_perturbed(config))


def _perturbed(config: KernelConfig) -> bool:
    pattern = os.environ.get(PERTURB_ENV)
    return pattern is not None and fnmatch.fnmatchcase(config.name, pattern)


def decide(config: KernelConfig) -> Record:
    """The Record of ``config``: from this process's memory, the cache, or a
    check. A failure prints its warning line (once per process), or raises
    SelfCheckError under K3JAX_SELFCHECK=strict."""
    with _LOCK:
        record = _RECORDS.get(config.name)
        if record is None:
            result, path = lookup(config)
            cached = result is not None
            if tune_on() and (result is None or result.timings_us is None):
                tuned = tune.tune(config, timeout_s=timeout_s(), perturb=_perturbed(config))
                if tuned is not None:
                    result, cached = tuned, False
                    path = save(config, result)
            if result is None:
                result = check(config)
                path = save(config, result)
            tune.install(config, result)
            record = Record(config, config.backend if result.ok else XLA, result, cached, path)
            _RECORDS[config.name] = record
    if not record.result.ok:
        line = warning_line(config, record.result)
        if mode() == "strict":
            raise SelfCheckError(line.removesuffix("; it runs the xla path"))
        note(line)
    return record


@contextlib.contextmanager
def collecting() -> Iterator[list[KernelConfig]]:
    """Within: no check runs; every launch traced adds its KernelConfig
    (once) to the yielded list and runs its own backend (for reports that
    compile a layer's kernels without running them)."""
    found: list[KernelConfig] = []
    with _LOCK:
        _COLLECTING.append(found)
    try:
        yield found
    finally:
        with _LOCK:
            _COLLECTING.remove(found)


def trusted_backend(config: KernelConfig) -> KernelBackend:
    """The backend ``config`` runs: an agreed one (``agree``), else its own
    kernel's when the check passes (or is off), else XLA."""
    with _LOCK:
        if _COLLECTING:
            if config not in _COLLECTING[-1]:
                _COLLECTING[-1].append(config)
            return config.backend
        if config.name in _AGREED:
            return _AGREED[config.name]
    if mode() == "0":
        return config.backend
    return decide(config).kernel_backend


def _passes_through(backend: KernelBackend) -> bool:
    """XLA launches are never checked; with the check off (and nothing agreed
    or collected) no launch needs its KernelConfig."""
    return backend.family is Family.XLA or (mode() == "0" and not (_AGREED or _COLLECTING))


def grouped(op: str, x_MK, w_GKN, backend: KernelBackend, beta: float | None = None,
            linear_beta: float | None = None) -> KernelBackend:
    """trusted_backend of a grouped launch (XLA launches pass through)."""
    if _passes_through(backend):
        return backend
    return trusted_backend(grouped_config(op, x_MK, w_GKN, backend, beta, linear_beta))


def mlp(x_TD, gate_DF, backend: KernelBackend, beta: float,
        linear_beta: float | None) -> KernelBackend:
    """trusted_backend of a situ_mlp_up launch (XLA launches pass through)."""
    if _passes_through(backend):
        return backend
    return trusted_backend(mlp_config(x_TD, gate_DF, backend, beta, linear_beta))


def records() -> list[Record]:
    """This process's decisions, in first-launch order."""
    with _LOCK:
        return list(_RECORDS.values())


def agree(backends: Mapping[str, Backend]) -> None:
    """Install the backends (config name -> backend name or KernelBackend)
    that every process agreed on."""
    resolved = {name: resolve(backend) for name, backend in backends.items()}
    with _LOCK:
        _AGREED.update(resolved)


def reset() -> None:
    """Forget this process's decisions, agreed backends, tuned picks and printed notes
    (tests; a new selfcheck run in the same process)."""
    from pallas_kernels.grouped_matmul import tile_choice

    with _LOCK:
        _RECORDS.clear()
        _AGREED.clear()
        _NOTES.clear()
        tile_choice.clear_tuned()
