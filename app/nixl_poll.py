"""Give NIXL's progress thread a poll delay, in every vLLM worker process that imports this module.

nixl 1.5.1 hard-codes `pthrDelay = 0`, so the UCX progress thread spins a core per engine even
when idle (field notes: 65-90 % of a core each). vLLM imports this module in each worker as its
`worker_extension_cls` before the KV connector creates its agent, so the patch is in place in
time; the delay comes from the engine adapter through KV_LOOP_NIXL_POLL_DELAY_US.
"""

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


class NixlPollDelay:
    """The worker extension vLLM mixes into its worker; importing this module applies the delay."""


if os.environ.get(POLL_DELAY_ENV):
    install_poll_delay(int(os.environ[POLL_DELAY_ENV]))
