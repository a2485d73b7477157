"""Make Mosaic GPU interpret mode correct under a multi-device shard_map (jax 0.11.2).

The GPU interpreter simulates every device of the surrounding mesh in one
process-wide shared memory; XLA runs the device programs concurrently, and
the interpreter assumes a single cluster runs at a time. Two host callbacks
then act on *all* devices' state while other devices are mid-kernel:

* ``cluster_finished`` (after every grid point) calls
  ``reset_per_cluster_state``, which resets every thread's register-buffer ids,
  named barriers and clocks: another device still inside its cluster then
  reuses a live buffer id (``KeyError: HostAllocationKey(...)`` on deallocation);
* ``_assert_no_barriers_allocated`` (end of kernel) asserts that no device
  holds a barrier, and fails on the pipeline barriers of a device still
  running ("Barrier remains allocated").

``install()`` wraps both so that, with more than one simulated device, the
devices first meet on the shared memory's all-device ``threading.Barrier``
(sized to the device count, otherwise unused by the GPU interpreter and
aborted when any device fails, so a failure cannot hang the others): the
per-cluster reset then runs once, between two meetings, while no device is
inside a cluster, and the barrier check runs once every device has finished
its kernel, which makes it exact again. The devices run the same SPMD
program, so each reaches these callbacks the same number of times. With one
simulated device nothing changes. Idempotent; does nothing when the wrapped
internals are absent (other jax versions).
"""

from __future__ import annotations

import functools
import threading

_lock = threading.Lock()
# A device that never arrives (a bug, not slowness) breaks the barrier after
# this long instead of hanging every other device forever.
_BARRIER_TIMEOUT_S = 300.0
_installed = False


def _all_device_barrier(shared_memory) -> threading.Barrier | None:
    """The interpreter's barrier over all simulated devices, or None with one device."""
    barrier = getattr(shared_memory, "barrier", None)
    if getattr(shared_memory, "num_devices", 1) > 1 and isinstance(barrier, threading.Barrier):
        return barrier
    return None


def install() -> bool:
    """Wrap the two interpreter callbacks (once); True when the wrappers are active."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
        except ImportError:
            return False
        assert_original = getattr(gpu_callbacks, "_assert_no_barriers_allocated", None)
        cluster_original = getattr(gpu_callbacks, "cluster_finished", None)
        if (assert_original is None or cluster_original is None
                or not hasattr(gpu_callbacks, "fail_on_exception")
                or not hasattr(gpu_callbacks, "_get_shared_memory")):
            return False

        @gpu_callbacks.fail_on_exception
        @functools.wraps(assert_original)
        def assert_no_barriers_allocated(token):
            barrier = _all_device_barrier(gpu_callbacks._get_shared_memory())
            if barrier is None or barrier.wait(_BARRIER_TIMEOUT_S) == 0:  # every device finished its kernel
                assert_original(token)
            if barrier is not None:
                barrier.wait(_BARRIER_TIMEOUT_S)  # nobody frees the shared memory before the check ran
            return token

        @gpu_callbacks.fail_on_exception
        @functools.wraps(cluster_original)
        def cluster_finished(*, token):
            barrier = _all_device_barrier(gpu_callbacks._get_shared_memory())
            if barrier is None:
                return cluster_original(token=token)
            if barrier.wait(_BARRIER_TIMEOUT_S) == 0:  # every device finished this grid point
                cluster_original(token=token)
            barrier.wait(_BARRIER_TIMEOUT_S)  # nobody starts the next grid point before the reset
            return token

        gpu_callbacks._assert_no_barriers_allocated = assert_no_barriers_allocated
        gpu_callbacks.cluster_finished = cluster_finished
        _installed = True
        return True
