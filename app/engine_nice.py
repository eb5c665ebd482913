"""A vLLM general plugin: vLLM's engine processes (EngineCore and its workers) lower their own CPU
priority to KV_LOOP_ENGINE_NICE, so that on a CPU machine the serving path's Python processes,
which need little CPU but must not wait, run ahead of a prefill's compute on the shared cores.

vLLM loads this in each of its processes; only its spawned children (multiprocessing children,
not the process that owns the engine) act, so a Serve replica or vLLM's API server keeps its
priority. Threads created afterwards (the compute threads) inherit the value. Nothing happens
unless the variable is set, so other engines in the same environment keep their priority.
"""

import multiprocessing
import os

ENGINE_NICE_ENV = "KV_LOOP_ENGINE_NICE"


def register() -> None:
    nice = int(os.environ.get(ENGINE_NICE_ENV) or 0)
    if nice > 0 and multiprocessing.parent_process() is not None:
        # Only ever lower the priority: raising it needs a privilege pods rarely have.
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
