"""What every process of a run must agree on, and host arrays across processes.

:func:`check_agreement` publishes each process's identity of the run (flags,
config, checkpoint fingerprint, input hash, or the error that stopped it) in
the coordination service's key-value store under ``k3jax/agreement/<id>``,
reads every other process's, and raises :class:`ProcessMismatchError` naming
each item that differs and its value on each process. Every process computes
the same message from the same views, so all of them fail alike. It needs no
devices, so it works even when the processes would build different meshes.

:func:`agree_backends` does the same for the kernel backend of every
kernel configuration (pallas_kernels.selfcheck): each process checks its own
devices, and a configuration that fell back to "xla" on any process runs
"xla" on all of them, so that every process runs the same program.

:func:`agree_mxfp4_dequant` does it for the in-kernel dequant of packed MXFP4
experts (pallas_kernels.mxfp4.Mxfp4Dequant): each process reads only its
blocks of the scales, so each may see a different verdict; the agreed one is
EXACT for a layer where any process saw a byte outside the fast range, and
every process compiles the same program.

:func:`replicated` and :func:`gather` move host arrays onto and off a mesh
that spans every process; both are collective (every process calls them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np

from k3jax.runtime.startup import DistributedError, ProcessSpec, init_timeout_s
from pallas_kernels.backend import XLA
from pallas_kernels.mxfp4 import Mxfp4Dequant

_AGREEMENT_KEY = "k3jax/agreement/"
_BACKENDS_KEY = "k3jax/kernel-backends/"


class ProcessMismatchError(DistributedError):
    """The processes were started with different flags or files (every
    process raises it, with the same message)."""


def _client():
    from jax._src import distributed as jax_distributed  # the client jax.distributed started
    client = jax_distributed.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialized")
    return client


def fingerprint_array(x: np.ndarray) -> str:
    """dtype, shape and a content hash: equal only for equal arrays."""
    digest = hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]
    return f"{x.dtype}{list(x.shape)} sha256:{digest}"


def check_agreement(spec: ProcessSpec, items: Mapping[str, str] | None,
                    error: str | None = None) -> None:
    """Compare ``items`` (what must be equal, by name) across all processes.

    A process that could not compute its items passes ``error`` instead;
    every process then reports it. Waits at most K3JAX_INIT_TIMEOUT s for each
    peer's view. Raises ProcessMismatchError, the same in every process,
    naming what differs and each process's value."""
    client = _client()
    mine = json.dumps({"error": error, "items": dict(items or {})}, sort_keys=True)
    client.key_value_set(f"{_AGREEMENT_KEY}{spec.process_id}", mine)
    timeout_ms = init_timeout_s() * 1000
    views = {}
    for p in range(spec.num_processes):
        views[p] = json.loads(client.blocking_key_value_get(f"{_AGREEMENT_KEY}{p}", timeout_ms))
    message = describe_disagreement(views)
    if message:
        raise ProcessMismatchError(message)


def describe_disagreement(views: Mapping[int, Mapping]) -> str | None:
    """One line naming each failed process and each differing item, or None.

    ``views``: process id -> {"error": str | None, "items": {name: value}}; an
    item one process lacks reads "(missing)" there."""
    failed = [f"process {p} failed: {v['error']}" for p, v in sorted(views.items()) if v["error"]]
    if failed:
        return "; ".join(failed)
    names: list[str] = []
    for v in views.values():
        names += [n for n in v["items"] if n not in names]
    differing = []
    for name in names:
        values = {p: v["items"].get(name, "(missing)") for p, v in sorted(views.items())}
        if len(set(values.values())) > 1:
            differing.append(f"{name} (" + ", ".join(f"process {p}: {val}"
                                                     for p, val in values.items()) + ")")
    if not differing:
        return None
    return ("the processes disagree on " + "; ".join(differing)
            + "; start every process with the same flags, checkpoint files and input")


def agree_backends(spec: ProcessSpec, backends: Mapping[str, str]) -> dict[str, str]:
    """Publish this process's backend per kernel configuration name, read
    every other process's and return the agreed ones (combine_backends);
    every process returns the same dict."""
    client = _client()
    client.key_value_set(f"{_BACKENDS_KEY}{spec.process_id}", json.dumps(dict(backends)))
    timeout_ms = init_timeout_s() * 1000
    views = {p: json.loads(client.blocking_key_value_get(f"{_BACKENDS_KEY}{p}", timeout_ms))
             for p in range(spec.num_processes)}
    return combine_backends(views)


def combine_backends(views: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """process id -> {config name: backend} -> {config name: agreed backend}:
    the processes' common backend where they all name the same one, else
    "xla" (the path every process can run). A configuration a process did not
    check (its check off) takes the others' verdict."""
    names = sorted({name for view in views.values() for name in view})
    agreed = {}
    for name in names:
        seen = {view[name] for view in views.values() if name in view}
        agreed[name] = seen.pop() if len(seen) == 1 else XLA.name
    return agreed


def agree_mxfp4_dequant(local: Sequence[Mxfp4Dequant]) -> list[Mxfp4Dequant]:
    """This process's dequant verdict per packed MXFP4 layer -> the verdicts
    every process agrees on (combine_mxfp4_dequant of all processes'),
    the same list on every process. Collective when jax runs several
    processes (each calls it with one verdict per layer, the same layers);
    with one process, ``local`` itself."""
    import jax
    local = list(local)
    if jax.process_count() == 1 or not local:
        return combine_mxfp4_dequant([local])
    from jax.experimental import multihost_utils
    exact = np.array([d is Mxfp4Dequant.EXACT for d in local], np.int32)
    views = np.asarray(multihost_utils.process_allgather(exact))   # [processes, layers]
    return combine_mxfp4_dequant([[Mxfp4Dequant.EXACT if e else Mxfp4Dequant.FAST for e in row]
                                  for row in views.reshape(-1, len(local))])


def combine_mxfp4_dequant(views: Sequence[Sequence[Mxfp4Dequant]]) -> list[Mxfp4Dequant]:
    """Each process's verdicts, one per layer in the same order -> per layer
    the combined one (Mxfp4Dequant.combine: EXACT when any process's is).
    ValueError when the processes hold different numbers of verdicts."""
    lengths = {len(v) for v in views}
    if len(lengths) > 1:
        raise ValueError(f"combine_mxfp4_dequant: the processes hold {sorted(lengths)} verdicts "
                         f"(one per packed MXFP4 layer, the same layers on every process)")
    return [Mxfp4Dequant.combine(parts) for parts in zip(*views)]


def replicated(x: np.ndarray, mesh):
    """The same host array on every device of ``mesh`` (every process passes
    its own, equal, copy)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, PartitionSpec()),
                                        lambda index: x[index])


def gather(array) -> np.ndarray:
    """The whole global ``array`` on every process (a collective: every
    process must call it)."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
