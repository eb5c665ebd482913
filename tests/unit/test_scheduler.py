"""Which running chunks sit a step out for a waiting later turn (app/engine/scheduler.py); the real engine's
behaviour is tests/integration/test_scheduler.py."""

from types import SimpleNamespace

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.request import RequestStatus

from app.engine.scheduler import LaterTurnsBeforeChunks
from app.turn.spec import CONTINUATION_PRIORITY as CONTINUATION
from app.turn.spec import turn_priority

FIRST, LATER = turn_priority(later=False), turn_priority(later=True)


def request(request_id: str, priority: int, prefill_chunk: bool = False, status=RequestStatus.WAITING,
            kv_transfer_params=None):
    return SimpleNamespace(request_id=request_id, priority=priority, is_prefill_chunk=prefill_chunk, status=status,
                           kv_transfer_params=kv_transfer_params)


def scheduler(running, waiting, policy=SchedulingPolicy.PRIORITY):
    """`waiting` in the queue's order (vLLM's priority queue iterates by priority, then arrival)."""
    return SimpleNamespace(policy=policy, running=running, waiting=waiting, made_room_for=None)


def pause(state) -> list[str]:
    return [r.request_id for r in LaterTurnsBeforeChunks.chunks_to_pause(state)]


def test_a_waiting_later_turn_pauses_first_turns_chunks_only():
    running = [request("first-chunk", FIRST, prefill_chunk=True), request("first-decoding", FIRST),
               request("later-chunk", LATER, prefill_chunk=True)]
    assert pause(scheduler(running, [request("later", LATER)])) == ["first-chunk"]


def test_nothing_pauses_for_a_first_turn_or_without_priorities():
    running = [request("first-chunk", FIRST, prefill_chunk=True)]
    assert pause(scheduler(running, [request("first", FIRST)])) == []
    assert pause(scheduler(running, [request("later", LATER)], SchedulingPolicy.FCFS)) == []
    assert pause(scheduler(running, [])) == []


def test_a_request_that_reads_its_kv_from_another_engine_pauses_nothing():
    running = [request("first-chunk", FIRST, prefill_chunk=True)]
    assert pause(scheduler(running, [request("later", LATER, status=RequestStatus.WAITING_FOR_REMOTE_KVS)])) == []
    handoff = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    assert pause(scheduler(running, [request("later", LATER, kv_transfer_params=handoff)])) == []
    held = {"do_remote_decode": True}  # computed here, then held for a reader
    assert pause(scheduler(running, [request("later", LATER, kv_transfer_params=held)])) == ["first-chunk"]


def test_a_continuation_reading_its_kv_ahead_of_a_later_turn_does_not_cost_the_later_turn_its_pause():
    running = [request("first-chunk", FIRST, prefill_chunk=True)]
    continuation = request("continuation", CONTINUATION, kv_transfer_params={"remote_block_ids": [[1, 2]]})
    assert pause(scheduler(running, [continuation, request("later", LATER)])) == ["first-chunk"]
    assert pause(scheduler(running, [continuation, request("first", FIRST)])) == []


def test_a_waiting_request_gets_one_pause_only():
    """If it could not start in the step made for it (no free blocks), chunks are not held back again."""
    state = scheduler([request("first-chunk", FIRST, prefill_chunk=True)], [request("later", LATER)])
    assert pause(state) == ["first-chunk"]
    assert pause(state) == []
