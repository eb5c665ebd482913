"""A vLLM general plugin: an engine whose only requests are finished ones holding blocks for a
remote reader (a turn decode retains for the next turn's pull) waits for new work instead of
stepping, and polls its KV connector every KV_LOOP_IDLE_POLL_S.

vLLM's EngineCore steps without pause while any finished request still holds blocks for a remote
reader (`Scheduler.has_finished_requests`), and its worker busy-polls the shared-memory queue for a
second after each step: both keep cores busy for as long as decode retains a turn.
A new request still wakes the engine at once; only the freeing of blocks after a pull or at TTL
is noticed up to one poll later. vLLM loads this in each of its processes through the
`vllm.general_plugins` entry point; it does nothing unless the engine adapter set the variable,
so other engines in the same environment keep vLLM's behaviour.
"""

import os
import queue

IDLE_POLL_ENV = "KV_LOOP_IDLE_POLL_S"


def only_awaiting_remote_readers(core) -> bool:
    scheduler = core.scheduler
    return (not core.engines_running and not core.batch_queue and not scheduler.has_unfinished_requests()
            and not scheduler.finished_req_ids and scheduler.has_finished_requests())


def register() -> None:
    poll_s = float(os.environ.get(IDLE_POLL_ENV) or 0)
    if poll_s <= 0:
        return
    from vllm.v1.engine.core import EngineCoreProc

    process_input_queue = getattr(EngineCoreProc._process_input_queue, "__wrapped__",
                                  EngineCoreProc._process_input_queue)

    def wait_for_work_then_process(self) -> None:
        if only_awaiting_remote_readers(self):
            try:
                self._handle_client_request(*self.input_queue.get(timeout=poll_s))
            except queue.Empty:
                pass
        process_input_queue(self)

    wait_for_work_then_process.__wrapped__ = process_input_queue
    EngineCoreProc._process_input_queue = wait_for_work_then_process
