"""A vLLM general plugin for vLLM's engine processes (EngineCore and its workers): what each does
to itself when it starts.

1. It lowers its CPU priority to KV_LOOP_ENGINE_NICE, so that on a CPU machine the serving path's
   Python processes, which need little CPU but must not wait, run ahead of a prefill's compute on
   the shared cores. Threads created afterwards (the compute threads) inherit the value. Nothing
   happens unless the variable is set, so other engines in the same environment keep theirs.
2. It exits when the process that started it dies. Ray's raylet kills the children of a worker
   that dies, but when the raylet goes too (`ray stop --force`), vLLM's engine processes outlive
   their Serve replica, holding cores and memory until killed by hand. The
   kernel's parent-death signal would follow the thread that started the engine, not the process,
   so a thread watches the parent instead.
3. Its shared-memory queue readers (the worker waiting for the next step, EngineCore for the
   worker's answer) spin for KV_LOOP_SHM_BUSY_POLL_S after each message, then block on the
   writer's notification and recheck the queue every KV_LOOP_SHM_RECHECK_MS. vLLM spins for 1 s,
   so a reader spins through the whole of every step on the other side, on cores the other engine
   and the serving path need. vLLM rechecks every 5 s, and its notification can be lost (a turn
   then waits out the whole recheck), so a blocked reader rechecks often. An idle reader backs off:
   it rechecks every IDLE_RECHECK_SHARE of the time since its last message, between
   KV_LOOP_SHM_RECHECK_MS and KV_LOOP_SHM_IDLE_RECHECK_MS, so an idle engine's worker does not wake
   hundreds of times a second. A notification still wakes it at once; only a lost one after an idle
   spell costs up to the idle recheck instead of the recheck.
4. It builds every gloo process group on one gloo device. vLLM makes 13 per worker even at world
   size 1 (a CPU and a device group for each of its parallel groups), torch gives each its own
   device, and each device's transport thread wakes every 10 ms (gloo's fixed epoll timeout): 1,300
   wakeups a second in an idle worker. One device serves any number of groups.

vLLM loads this in each of its processes; only its spawned children (multiprocessing children,
not the process that owns the engine) act, so a Serve replica or vLLM's API server is untouched.
"""

import functools
import inspect
import multiprocessing
import os
import signal
import threading
import time

ENGINE_NICE_ENV = "KV_LOOP_ENGINE_NICE"
SHM_BUSY_POLL_ENV = "KV_LOOP_SHM_BUSY_POLL_S"
SHM_RECHECK_ENV = "KV_LOOP_SHM_RECHECK_MS"
SHM_IDLE_RECHECK_ENV = "KV_LOOP_SHM_IDLE_RECHECK_MS"
ONE_GLOO_DEVICE_ENV = "KV_LOOP_ONE_GLOO_DEVICE"
IDLE_RECHECK_SHARE = 0.05
"""A blocked reader idle for t rechecks its queue every t times this (within the two rechecks): busy
readers keep the short recheck, and one idle for a second or more waits the idle recheck."""
PARENT_POLL_S = 1.0
"""How often an engine process checks that its parent still lives."""
SHUTDOWN_GRACE_S = 10.0
"""How long an orphaned engine process has to shut down on SIGTERM before it exits outright."""


def plugin_env(nice: int, busy_poll_s: float, recheck_ms: int, idle_recheck_ms: int = 0) -> dict[str, str]:
    """The variables this plugin reads, for a CPU engine's environment."""
    return {ENGINE_NICE_ENV: str(nice), SHM_BUSY_POLL_ENV: str(busy_poll_s), SHM_RECHECK_ENV: str(recheck_ms),
            SHM_IDLE_RECHECK_ENV: str(max(idle_recheck_ms, recheck_ms)), ONE_GLOO_DEVICE_ENV: "1"}


def register() -> None:
    if multiprocessing.parent_process() is None:
        return
    lower_priority(int(os.environ.get(ENGINE_NICE_ENV) or 0))
    exit_with_parent()
    if (busy_poll_s := os.environ.get(SHM_BUSY_POLL_ENV)) and (recheck_ms := os.environ.get(SHM_RECHECK_ENV)):
        limit_shared_memory_spin(float(busy_poll_s), int(recheck_ms),
                                 int(os.environ.get(SHM_IDLE_RECHECK_ENV) or recheck_ms))
    if os.environ.get(ONE_GLOO_DEVICE_ENV):
        share_one_gloo_device()


def lower_priority(nice: int) -> None:
    # Only ever lower the priority: raising it needs a privilege pods rarely have.
    if nice > 0:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))


def exit_with_parent(poll_s: float = PARENT_POLL_S, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Once the parent is gone: SIGTERM to itself (vLLM's engine shuts down on it), then exit."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="kv-loop-exit-with-parent", daemon=True).start()


def limit_shared_memory_spin(busy_poll_s: float, recheck_ms: int, idle_recheck_ms: int = 0) -> None:
    """Readers of vLLM's shared-memory queues created from now on spin `busy_poll_s` at most, and
    every blocked reader rechecks its queue every `recheck_ms`, or, idle, up to `idle_recheck_ms`."""
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    wait = inspect.unwrap(shm_broadcast.SpinCondition.wait)
    if idle_recheck_ms > recheck_ms:
        @functools.wraps(wait)
        def wait_backing_off(self, timeout_ms: int | None = None) -> None:
            # vLLM caps each wait at the recheck interval; a shorter timeout is a deadline: kept.
            if timeout_ms == recheck_ms:
                idle_ms = (time.monotonic() - self.last_read) * 1e3
                timeout_ms = int(min(idle_recheck_ms, max(recheck_ms, idle_ms * IDLE_RECHECK_SHARE)))
            wait(self, timeout_ms)

        shm_broadcast.SpinCondition.wait = wait_backing_off
    else:
        shm_broadcast.SpinCondition.wait = wait
    init = inspect.unwrap(shm_broadcast.SpinCondition.__init__)

    @functools.wraps(init)
    def with_busy_poll(self, is_reader, context, notify_address, busy_loop_s: float = busy_poll_s) -> None:
        init(self, is_reader, context, notify_address, busy_loop_s)

    shm_broadcast.SpinCondition.__init__ = with_busy_poll


def share_one_gloo_device() -> None:
    """Gloo process groups created from now on share one device (its transport thread). torch builds
    each group's backend with `ProcessGroupGloo(store, rank, size, timeout=...)` inside
    `_new_process_group_helper`, so the name points at a builder with the shared device only while
    that runs: torch's isinstance checks elsewhere keep the real class."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    gloo, helper, devices = c10d.ProcessGroupGloo, inspect.unwrap(c10d._new_process_group_helper), []

    class OneDeviceGloo(gloo):
        def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta = c10d.default_pg_timeout):
            devices[:] = devices or [gloo.create_default_device()]
            options = gloo._Options()
            options._devices, options._timeout = devices, timeout
            super().__init__(store, rank, size, options)

    @functools.wraps(helper)
    def helper_with_one_device(*args, **kwargs):
        c10d.ProcessGroupGloo = OneDeviceGloo
        try:
            return helper(*args, **kwargs)
        finally:
            c10d.ProcessGroupGloo = gloo

    c10d._new_process_group_helper = helper_with_one_device
