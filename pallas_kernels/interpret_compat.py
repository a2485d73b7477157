"""Mosaic GPU interpret mode (jax 0.11.2): correct under a multi-device
shard_map, free of thread-pool deadlocks, and every wait bounded.

Shared state. The GPU interpreter simulates every device of the surrounding
mesh in one process-wide shared memory; XLA runs the device programs
concurrently, and the interpreter assumes a single cluster runs at a time. Two
host callbacks act on *all* devices' state while other devices are mid-kernel:

* ``cluster_finished`` (after every grid point) calls
  ``reset_per_cluster_state``, which resets every thread's register-buffer ids,
  named barriers and clocks: another device still inside its cluster then
  reuses a live buffer id (``KeyError: HostAllocationKey(...)`` on deallocation);
* ``_assert_no_barriers_allocated`` (end of kernel) asserts that no device
  holds a barrier, and fails on the pipeline barriers of a device still
  running ("Barrier remains allocated").

``install()`` wraps both so that, with more than one simulated device, the
devices first meet on the shared memory's all-device ``threading.Barrier``
(sized to the device count, otherwise unused by the GPU interpreter, and
aborted when any device fails): the per-cluster reset then runs once, between
two meetings, while no device is inside a cluster, and the barrier check runs
once every device has finished its kernel. The devices run the same SPMD
program, so each reaches these callbacks the same number of times.

Thread pools. The interpreter runs each simulated warpgroup of a cluster (when
there is more than one) as its own XLA computation, started from a Python
thread, and its waits (mbarrier waits, the all-device meetings) block inside
host callbacks. XLA:CPU runs the independent thunks of a computation on its
thread pools, so a blocked callback can hold a pool thread; once blocked
callbacks hold them all, the work queued behind them never runs and the mesh
stops without using any CPU. The pools are sized once, when the CPU client
starts (``xla_pool_threads``). Each party that can block at once (every
device's program and every simulated warpgroup) needs a thread, plus one for
the work they wait on: ``pool_threads_needed``. ``reserve_pool_threads`` sets
PJRT_NPROC before the backend starts; a kernel that finds the pools smaller
raises PoolTooSmallError naming the size to set, before anything waits.
Collectives need no bound here: XLA:CPU ends a rendezvous that waits past
its own timeout (xla_cpu_collective_call_terminate_timeout_seconds).

Stalls. Every interpreter wait is bounded by ``stall_timeout_s()``: an mbarrier
wait, an all-device meeting or the end-of-kernel clean-up that waits longer
raises InterpretStall naming who waited for what; the interpreter then aborts
every other waiter, so the run ends with that error. ``take_error_line()``
returns the first such message, one line, for command-line reports.

Idempotent; ``install()`` does nothing when the wrapped internals are absent
(other jax versions).
"""

from __future__ import annotations

import functools
import math
import os
import threading

STALL_ENV = "K3JAX_INTERPRET_STALL_S"
STALL_TIMEOUT_S = 120.0  # default bound on any one interpreter wait
POOL_ENV = "PJRT_NPROC"  # read by XLA:CPU when its client starts
# The most simulated warpgroups one device runs at once in this package's
# kernels: 4 a CTA (3 consumers and the TMA producer) x 8 CTAs, the largest
# portable Hopper cluster.
MAX_THREADS_PER_DEVICE = 4 * 8

_lock = threading.Lock()
_installed = False
_bounded_memory = None  # the shared memory whose clean-up barrier is bounded
_error_line: str | None = None


class InterpretStall(RuntimeError):
    """A simulated thread or device waited longer than ``stall_timeout_s()``."""


class PoolTooSmallError(RuntimeError):
    """XLA:CPU's thread pools cannot hold every wait a kernel may block in."""


def stall_timeout_s() -> float:
    """Seconds any one interpreter wait may block: K3JAX_INTERPRET_STALL_S, else
    STALL_TIMEOUT_S; 0 makes every wait that would block a stall."""
    text = os.environ.get(STALL_ENV)
    if text is None:
        return STALL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{STALL_ENV}={text!r}: expected a number of seconds >= 0")
    return value


def xla_pool_threads() -> int:
    """Threads in each of XLA:CPU's pools, as its client sizes them when it
    starts (DefaultThreadPoolSize in xla/pjrt/cpu/cpu_client.cc): PJRT_NPROC,
    else NPROC, else the CPUs this process may run on."""
    for name in (POOL_ENV, "NPROC"):
        try:
            return max(int(os.environ.get(name, "")), 0)
        except ValueError:
            continue
    return len(os.sched_getaffinity(0))


def pool_threads_needed(num_devices: int, threads_per_device: int) -> int:
    """Pool threads for a kernel of ``threads_per_device`` simulated
    warpgroups (CTA warpgroups x cluster CTAs) on each of ``num_devices``
    devices: one for every program that can block (each device's, and each
    warpgroup's when there are several), plus one for the work they wait on."""
    nested = threads_per_device if threads_per_device > 1 else 0
    parties = num_devices * (1 + nested)
    return parties + 1 if parties > 1 else 1


def reserve_pool_threads(num_devices: int) -> None:
    """Before the CPU backend starts: set PJRT_NPROC to what kernels on
    ``num_devices`` simulated devices need (never lower than the default; a
    PJRT_NPROC already set stands). Once the backend has started the pools
    are fixed, and each kernel checks what it needs when it starts."""
    needed = pool_threads_needed(num_devices, MAX_THREADS_PER_DEVICE)
    if xla_pool_threads() >= needed or POOL_ENV in os.environ:
        return
    from jax._src import xla_bridge
    if not xla_bridge.backends_are_initialized():
        os.environ[POOL_ENV] = str(needed)


def take_error_line() -> str | None:
    """The first stall or pool-size message since the last call (one line), or
    None. Taking a message forgets the failed kernel (``reset_state``)."""
    global _error_line
    with _lock:
        line, _error_line = _error_line, None
    if line is not None:
        reset_state()
    return line


def reset_state() -> None:
    """Forget a failed kernel: the interpreter's shared state, the message, and
    JAX's tokens of ordered effects (which hold the failure and would raise it
    again at exit)."""
    global _error_line
    from jax._src import dispatch
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.reset_gpu_interpret_mode_state()
    dispatch.runtime_tokens.clear()
    with _lock:
        _error_line = None


def _noted(error: RuntimeError) -> RuntimeError:
    global _error_line
    with _lock:
        if _error_line is None:
            _error_line = str(error)
    return error


def _pool_message(num_devices, threads_per_device, needed, have) -> str:
    return (f"GPU interpret mode: a kernel of {threads_per_device} simulated warpgroup(s) on "
            f"{num_devices} device(s) can block {needed - 1} of XLA:CPU's pool threads in host "
            f"callbacks and needs {needed}, and this process has {have}: set "
            f"{POOL_ENV}={needed} (or more) before JAX starts")


def _stall_hint() -> str:
    return f"(a deadlock in the kernel or the mesh; {STALL_ENV} sets the bound)"


class _BoundedCondition(threading.Condition):
    """An interpreter mbarrier's condition: an untimed wait returns within
    ``stall_timeout_s()`` (woken by an arrival or an abort) or raises."""

    def __init__(self, barrier):
        super().__init__()
        self._barrier = barrier

    def wait(self, timeout=None):
        if timeout is not None:
            return super().wait(timeout)
        limit = stall_timeout_s()
        if super().wait(limit):
            return True
        b = self._barrier
        raise InterpretStall(f"waited {limit:g} s at an mbarrier for phase {b.phase} "
                             f"({b.arrivals_count} of {b.num_arrivals} arrivals)")


def _meet(barrier: threading.Barrier, what: str, limit: float | None = None) -> int:
    """Wait at ``barrier`` (one party per simulated device) for at most
    ``limit`` (default ``stall_timeout_s()``) s: raises the failure of another
    device, or InterpretStall."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    limit = stall_timeout_s() if limit is None else limit
    try:
        return threading.Barrier.wait(barrier, limit)
    except threading.BrokenBarrierError:
        memory = gpu_callbacks._shared_memory
        if memory is not None:
            memory.check_failed()  # another device failed first: raise its failure
        raise _noted(InterpretStall(
            f"GPU interpret mode stalled: a simulated device waited {limit:g} s at {what} "
            f"for the other {barrier.parties - 1} device(s) {_stall_hint()}")) from None


class _CleanUpBarrier(threading.Barrier):
    """The end-of-kernel clean-up meeting, which the interpreter also waits at
    when a device fails (``set_failed``): bounded like every meeting."""

    def __init__(self, parties: int, action, limit: float):
        super().__init__(parties, action=action)
        self._limit = limit

    def wait(self, timeout=None):
        return _meet(self, "the end-of-kernel clean-up", self._limit if timeout is None else timeout)


def install() -> bool:
    """Wrap the interpreter's callbacks and barriers (once); True when active."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
            from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
        except ImportError:
            return False
        names = ("_assert_no_barriers_allocated", "cluster_finished", "fail_on_exception",
                 "_get_shared_memory", "_initialize_shared_memory", "_clear_shared_memory",
                 "reset_gpu_interpret_mode_state")
        if not all(hasattr(gpu_callbacks, name) for name in names) or not hasattr(memory, "Barrier"):
            return False
        _wrap_meetings(gpu_callbacks)
        _wrap_kernel_start(gpu_callbacks)
        _bound_mbarriers(memory)
        _installed = True
        return True


def _all_device_barrier(shared_memory) -> threading.Barrier | None:
    """The interpreter's barrier over all simulated devices, or None with one device."""
    if shared_memory.num_devices > 1:
        return shared_memory.barrier
    return None


def _wrap_meetings(gpu_callbacks) -> None:
    assert_original = gpu_callbacks._assert_no_barriers_allocated
    cluster_original = gpu_callbacks.cluster_finished

    @gpu_callbacks.fail_on_exception
    @functools.wraps(assert_original)
    def assert_no_barriers_allocated(token):
        barrier = _all_device_barrier(gpu_callbacks._get_shared_memory())
        if barrier is None or _meet(barrier, "the end of a kernel") == 0:
            assert_original(token)  # every device finished its kernel
        if barrier is not None:
            _meet(barrier, "the barrier check")  # nobody frees the memory before it ran
        return token

    @gpu_callbacks.fail_on_exception
    @functools.wraps(cluster_original)
    def cluster_finished(*, token):
        barrier = _all_device_barrier(gpu_callbacks._get_shared_memory())
        if barrier is None:
            return cluster_original(token=token)
        if _meet(barrier, "the end of a grid point") == 0:  # every device finished it
            cluster_original(token=token)
        _meet(barrier, "the per-cluster reset")  # nobody starts the next grid point before it
        return token

    gpu_callbacks._assert_no_barriers_allocated = assert_no_barriers_allocated
    gpu_callbacks.cluster_finished = cluster_finished


def _wrap_kernel_start(gpu_callbacks) -> None:
    init_original = gpu_callbacks._initialize_shared_memory

    @functools.wraps(init_original)
    def initialize_shared_memory(*, token, num_gpus, num_threads_per_block,
                                 num_blocks_per_cluster, interpret_params):
        global _bounded_memory
        num_devices = int(num_gpus)
        threads = int(num_threads_per_block) * int(num_blocks_per_cluster)
        needed, have = pool_threads_needed(num_devices, threads), xla_pool_threads()
        if have < needed:
            raise _noted(PoolTooSmallError(_pool_message(num_devices, threads, needed, have)))
        with _lock:
            memory = gpu_callbacks._shared_memory
            if memory is not None and memory.clean_up_barrier.broken:
                gpu_callbacks.reset_gpu_interpret_mode_state()  # left by a stalled kernel
            token = init_original(token=token, num_gpus=num_gpus,
                                  num_threads_per_block=num_threads_per_block,
                                  num_blocks_per_cluster=num_blocks_per_cluster,
                                  interpret_params=interpret_params)
            memory = gpu_callbacks._shared_memory
            if memory is not _bounded_memory:
                # The interpreter's own failure path waits here too (set_failed).
                memory.clean_up_barrier = _CleanUpBarrier(
                    memory.clean_up_barrier.parties, gpu_callbacks._clear_shared_memory,
                    stall_timeout_s())
                _bounded_memory = memory
        return token

    gpu_callbacks._initialize_shared_memory = initialize_shared_memory


def _bound_mbarriers(memory) -> None:
    init_original, wait_original = memory.Barrier.__init__, memory.Barrier.wait

    @functools.wraps(init_original)
    def barrier_init(self, *args, **kwargs):
        init_original(self, *args, **kwargs)
        self.cv = _BoundedCondition(self)

    @functools.wraps(wait_original)
    def barrier_wait(self, thread, logging_info=None):
        try:
            return wait_original(self, thread, logging_info)
        except InterpretStall as e:
            where = ""
            if logging_info is not None and logging_info.source_info is not None:
                where = f" in {logging_info.get_source_info_str()}"
            raise _noted(InterpretStall(
                f"GPU interpret mode stalled: {thread} {e}{where}, and no simulated thread "
                f"arrived {_stall_hint()}")) from None

    memory.Barrier.__init__ = barrier_init
    memory.Barrier.wait = barrier_wait
