"""The KV event feed: a prefill engine's events reach the index as block hashes only, in order,
one call in flight per replica, never through a network socket."""

import asyncio
import dataclasses
import pickle
import tempfile
import time

from app.kv import events as kv_events
from app.kv.index import KVIndex
from app.protocol import KVEvents
from tests.factories import BLOCK, replica

SALT = "tenant-a-secret-salt"
PROMPT = [7301 + i for i in range(2 * BLOCK)]
H0, H1, H2 = (bytes([i]) * 32 for i in range(1, 4))


def _stored(hashes: list[bytes], token_ids: list[int]):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=token_ids, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=[(SALT,)] + [None] * (len(hashes) - 1),
                       session_id="tenant-a-session")


def _removed(hashes: list[bytes]):
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=hashes, medium="GPU")


def _batch(*events, ts: float = 0.0):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=ts, events=list(events))


def _assert_hashes_only(pushed: KVEvents) -> None:
    assert [f.name for f in dataclasses.fields(KVEvents)] == ["replica_id", "events"]
    for kind, hashes in pushed.events:
        assert kind in (KVEvents.STORED, KVEvents.REMOVED, KVEvents.CLEARED)
        assert all(type(h) is bytes and len(h) == 32 for h in hashes)
    wire = pickle.dumps(pushed)
    assert SALT.encode() not in wire and b"tenant-a-session" not in wire


def test_what_vllm_s_publisher_encodes_is_reduced_to_its_hashes_in_order():
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

    batch = _batch(_stored([H0, H1], PROMPT), _removed([H1]), AllBlocksCleared(), _stored([H2], PROMPT[:BLOCK]))
    payload = msgspec.msgpack.Encoder().encode(batch)  # as ZmqEventPublisher's thread encodes it
    events = kv_events.reduce(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload))
    assert events == ((KVEvents.STORED, (H0, H1)), (KVEvents.REMOVED, (H1,)), (KVEvents.CLEARED, ()),
                      (KVEvents.STORED, (H2,)))
    _assert_hashes_only(KVEvents("p0", events))


def test_the_order_within_a_batch_decides_what_the_index_holds():
    index = KVIndex(block_size=BLOCK)
    index.register(replica("p0"))
    kv_events.apply(index, KVEvents("p0", kv_events.reduce(_batch(_stored([H0], PROMPT[:BLOCK]), _removed([H0])))))
    assert index.lookup([H0]).prefill_cached_tokens["p0"] == 0, "stored, then evicted"
    kv_events.apply(index, KVEvents("p0", kv_events.reduce(_batch(_removed([H0]), _stored([H0], PROMPT[:BLOCK])))))
    assert index.lookup([H0]).prefill_cached_tokens["p0"] == BLOCK, "evicted, then stored again"


class _Index:
    """The index's apply_kv_events as a Serve call: each call waits until the test lets it finish."""

    def __init__(self, fail_first: bool = False) -> None:
        self.calls: list[KVEvents] = []
        self.started: list[float] = []
        self.in_flight = self.most_in_flight = 0
        self.fail_first = fail_first
        self.release = asyncio.Event()

    async def push(self, events: KVEvents) -> None:
        self.calls.append(events)
        self.started.append(time.monotonic())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.fail_first and len(self.calls) == 1:
                raise RuntimeError("index restarting")
            await self.release.wait()
        finally:
            self.in_flight -= 1


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_one_call_in_flight_and_what_arrives_meanwhile_goes_in_the_next():
    async def run():
        index = _Index()
        pusher = kv_events.Pusher("p0", index.push, timeout_s=10.0, interval_s=0.3, failed_pause_s=1.0)
        task = asyncio.get_running_loop().create_task(pusher.run())
        pusher.add([(KVEvents.STORED, (H0,))])
        await _until(lambda: index.calls)
        pusher.add([(KVEvents.REMOVED, (H0,))])
        pusher.add([])
        pusher.add([(KVEvents.STORED, (H1,)), (KVEvents.CLEARED, ())])
        await asyncio.sleep(0.05)
        assert len(index.calls) == 1, "the next call waits for the one in flight"
        index.release.set()
        await _until(lambda: pusher.pushed == 4)
        task.cancel()
        return index, pusher

    index, pusher = asyncio.run(run())
    assert index.most_in_flight == 1
    assert index.started[1] - index.started[0] >= 0.3, "at most one call every interval_s"
    assert [c.events for c in index.calls] == [((KVEvents.STORED, (H0,)),),
                                               ((KVEvents.REMOVED, (H0,)), (KVEvents.STORED, (H1,)),
                                                (KVEvents.CLEARED, ()))]
    assert {c.replica_id for c in index.calls} == {"p0"}


def test_a_failed_or_timed_out_push_drops_its_events_and_the_next_goes_on():
    async def run():
        index = _Index(fail_first=True)
        pusher = kv_events.Pusher("p0", index.push, timeout_s=0.1, interval_s=0.0, failed_pause_s=0.0)
        task = asyncio.get_running_loop().create_task(pusher.run())
        pusher.add([(KVEvents.STORED, (H0,))])
        await _until(lambda: pusher.dropped == 1)
        pusher.add([(KVEvents.STORED, (H1,))])
        await _until(lambda: pusher.dropped == 2)  # the index never answers: timed out
        index.release.set()
        pusher.add([(KVEvents.STORED, (H2,))])
        await _until(lambda: pusher.pushed == 1)
        task.cancel()
        return index

    index = asyncio.run(run())
    assert [c.events for c in index.calls] == [((KVEvents.STORED, (h,)),) for h in (H0, H1, H2)]


def _after_warm_up(pushed: list[KVEvents]) -> list:
    events = [e for p in pushed for e in p.events]
    while events and events[0][0] == KVEvents.CLEARED:
        events.pop(0)
    return events


def test_a_real_vllm_publisher_s_events_reach_the_index_as_hashes_only():
    """vLLM's own ZMQ publisher on a node-local ipc socket, read by forward() as a prefill replica does."""
    from vllm.distributed.kv_events import AllBlocksCleared, ZmqEventPublisher

    async def run(endpoint: str) -> list[KVEvents]:
        pushed: list[KVEvents] = []

        async def push(events: KVEvents) -> None:
            pushed.append(events)

        publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
        feed = asyncio.get_running_loop().create_task(
            kv_events.forward(endpoint, kv_events.Pusher("p0", push, timeout_s=5.0, interval_s=0.0,
                                                          failed_pause_s=1.0)))
        try:
            deadline = time.monotonic() + 10.0
            while not pushed:  # a subscriber gets only what is published after it joined
                assert time.monotonic() < deadline, "the feed never received a batch"
                publisher.publish(_batch(AllBlocksCleared()))
                await asyncio.sleep(0.05)
            publisher.publish(_batch(_stored([H0, H1], PROMPT), _removed([H1]), ts=1.0))
            publisher.publish(_batch(_removed([H0]), _stored([H1], PROMPT[BLOCK:]), ts=2.0))
            await _until(lambda: len(_after_warm_up(pushed)) >= 4)
        finally:
            feed.cancel()
            publisher.shutdown()
        return pushed

    with tempfile.TemporaryDirectory() as directory:
        pushed = asyncio.run(run(f"ipc://{directory}/events"))
    for events in pushed:
        assert events.replica_id == "p0"
        _assert_hashes_only(events)
    assert _after_warm_up(pushed) == [(KVEvents.STORED, (H0, H1)), (KVEvents.REMOVED, (H1,)), (KVEvents.REMOVED, (H0,)),
                      (KVEvents.STORED, (H1,))]


def test_the_index_ignores_events_from_a_replica_it_does_not_know():
    from deployments.kv_index import KVIndexServer

    server = object.__new__(KVIndexServer.func_or_class)
    server.index, server.events_applied = KVIndex(block_size=BLOCK), 0
    events = KVEvents("p0", ((KVEvents.STORED, (H0,)), (KVEvents.STORED, (H1,))))
    asyncio.run(server.apply_kv_events(events))
    assert server.events_applied == 0
    server.index.register(replica("p0"))
    asyncio.run(server.apply_kv_events(events))
    assert server.events_applied == 2
    assert server.index.lookup([H0, H1]).prefill_cached_tokens["p0"] == 2 * BLOCK
    server.index.unregister("p0")
    asyncio.run(server.apply_kv_events(events))
    assert server.events_applied == 2, "a forgotten replica's events are not applied"
