"""What each vLLM worker process changes in NIXL and vLLM's NixlConnector. vLLM imports this module
in every worker as its `worker_extension_cls`, before the KV connector builds its worker, so both
patches are in place in time.

1. NIXL's progress thread gets a poll delay. nixl 1.5.1 hard-codes `pthrDelay = 0`, so the UCX
   progress thread spins a core per engine even when idle;
   the delay comes from the engine adapter through KV_LOOP_NIXL_POLL_DELAY_US.
2. The worker keeps computing on its engine's cores. On CPU, vLLM's NixlConnector worker pins the
   thread that builds it to the last core of each NUMA node (meant as cores "for start_load_kv()";
   `os.sched_setaffinity(0, ...)` moves the calling thread, and that thread is the one that runs the
   model). With one engine per core, every engine would then compute on the last core while the
   others idle. The connector's constructor now leaves the thread on the cores it had.
"""

import functools
import inspect
import multiprocessing
import os

POLL_DELAY_ENV = "KV_LOOP_NIXL_POLL_DELAY_US"


def install_poll_delay(delay_us: int) -> bool:
    """Wrap NIXL's agent constructor so every new agent gets `delay_us`; False if NIXL is absent."""
    try:
        from nixl import _api
    except ImportError:
        return False
    bindings = _api.nixlBind
    create = getattr(bindings.nixlAgent, "__wrapped_create__", bindings.nixlAgent)

    def create_with_delay(name, agent_config):
        agent_config.pthrDelay = delay_us
        return create(name, agent_config)

    create_with_delay.__wrapped_create__ = create
    bindings.nixlAgent = create_with_delay
    return True


def keep_cores_across(cls: type) -> None:
    """Make `cls.__init__` give the calling thread back the CPU affinity it had before it ran."""
    init = inspect.unwrap(cls.__init__)

    @functools.wraps(init)
    def init_on_own_cores(self, *args, **kwargs):
        cores = os.sched_getaffinity(0)
        try:
            init(self, *args, **kwargs)
        finally:
            os.sched_setaffinity(0, cores)

    cls.__init__ = init_on_own_cores


def keep_connector_on_engine_cores() -> bool:
    """Apply keep_cores_across to vLLM's NIXL connector worker; False if vLLM has none."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    except ImportError:
        return False
    keep_cores_across(NixlBaseConnectorWorker)
    return True


class NixlWorkerExtension:
    """The worker extension vLLM mixes into its worker; importing this module applies the patches."""


# Only in vLLM's engine processes (multiprocessing children): a Serve replica or the benchmark that
# imports this module for POLL_DELAY_ENV builds no connector and need not import one.
if multiprocessing.parent_process() is not None:
    if os.environ.get(POLL_DELAY_ENV):
        install_poll_delay(int(os.environ[POLL_DELAY_ENV]))
    keep_connector_on_engine_cores()
