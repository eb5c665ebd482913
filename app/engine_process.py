"""A vLLM general plugin for vLLM's engine processes (EngineCore and its workers): what each does
to itself when it starts.

1. It lowers its CPU priority to KV_LOOP_ENGINE_NICE, so that on a CPU machine the serving path's
   Python processes, which need little CPU but must not wait, run ahead of a prefill's compute on
   the shared cores. Threads created afterwards (the compute threads) inherit the value. Nothing
   happens unless the variable is set, so other engines in the same environment keep theirs.
2. It exits when the process that started it dies. Ray's raylet kills the children of a worker
   that dies, but when the raylet goes too (`ray stop --force`), vLLM's engine processes outlived
   their Serve replica, with a share of the cores and 1.8 GB each, until killed by hand. The
   kernel's parent-death signal would follow the thread that started the engine, not the process,
   so a thread watches the parent instead.

vLLM loads this in each of its processes; only its spawned children (multiprocessing children,
not the process that owns the engine) act, so a Serve replica or vLLM's API server is untouched.
"""

import multiprocessing
import os
import signal
import threading
import time

ENGINE_NICE_ENV = "KV_LOOP_ENGINE_NICE"
PARENT_POLL_S = 1.0
"""How often an engine process checks that its parent still lives."""
SHUTDOWN_GRACE_S = 10.0
"""How long an orphaned engine process has to shut down on SIGTERM before it exits outright."""


def register() -> None:
    if multiprocessing.parent_process() is None:
        return
    lower_priority(int(os.environ.get(ENGINE_NICE_ENV) or 0))
    exit_with_parent()


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
