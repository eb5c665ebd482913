"""The vLLM plugin that stops an engine stepping while it only holds blocks for remote readers."""

import queue
from types import SimpleNamespace

import pytest

from app.engine import idle_poll


def core(unfinished=False, finished_ids=(), held_for_readers=False, running=False):
    scheduler = SimpleNamespace(has_unfinished_requests=lambda: unfinished, finished_req_ids=set(finished_ids),
                                has_finished_requests=lambda: held_for_readers or bool(finished_ids))
    return SimpleNamespace(scheduler=scheduler, engines_running=running, batch_queue=None)


@pytest.mark.parametrize("state, idle", [
    ({"held_for_readers": True}, True),
    ({"held_for_readers": True, "unfinished": True}, False),
    ({"held_for_readers": True, "finished_ids": ["r1"]}, False),
    ({"held_for_readers": True, "running": True}, False),
    ({}, False),
])
def test_only_blocks_held_for_remote_readers_count_as_idle(state, idle):
    assert idle_poll.only_awaiting_remote_readers(core(**state)) is idle


def test_the_patch_waits_for_work_only_when_enabled(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc

    processed = []

    def vllm_process_input_queue(self):
        processed.append(True)

    monkeypatch.setattr(EngineCoreProc, "_process_input_queue", vllm_process_input_queue)
    monkeypatch.delenv(idle_poll.IDLE_POLL_ENV, raising=False)
    idle_poll.register()
    assert EngineCoreProc._process_input_queue is vllm_process_input_queue

    monkeypatch.setenv(idle_poll.IDLE_POLL_ENV, "0.01")
    idle_poll.register()
    idle_poll.register()  # vLLM may load plugins more than once: the wrap must not stack
    patched = EngineCoreProc._process_input_queue
    assert patched.__wrapped__ is vllm_process_input_queue

    handled = []
    engine = core(held_for_readers=True)
    engine.input_queue = queue.Queue()
    engine.input_queue.put(("add", "request"))
    engine._handle_client_request = lambda *request: handled.append(request)
    patched(engine)
    assert handled == [("add", "request")] and processed == [True]
    patched(engine)  # nothing queued: waits one poll, then lets vLLM step (which polls the connector)
    assert handled == [("add", "request")] and processed == [True, True]
