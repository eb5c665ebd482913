"""vLLM's KV cache events, from a prefill engine's ZMQ publisher into the KV index, as block hashes only.

engine (KVEventsConfig, zmq PUB on a node-local ipc socket) ──SUB──▶ its replica: forward() decodes
each KVEventBatch, reduce()s it to (kind, hashes) ──Pusher: KVEvents, one call in flight──▶
KVIndexServer.apply_kv_events ──apply()──▶ KVIndex
No event socket is on the network: vLLM's BlockStored events carry the prompt's token ids and the
tenant's cache salt, every tenant's, and the index needs only the hashes. BlockStored / BlockRemoved /
AllBlocksCleared carry the same block hashes the router computes (app/kv/hashing.py), so the index
learns what each replica really holds, LRU evictions included.

Events the index does not get are dropped, never retried: the index is soft state, and a stale one
costs reuse, never correctness. A block it wrongly thinks gone is only not counted. A block it wrongly
thinks held counts as the replica's local tokens (app/turn/decision.py), which only weighs the choice: a
recompute where a pull would have saved tokens, or a prefill replica picked for a prefix it lost.
Nothing is read because the index says prefill holds it (pulls read decode's retained sequences,
recorded by the router, not by these events), and vLLM's prefill computes whatever its cache lacks.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from app.kv.index import KVIndex
from app.protocol import KVEvents

logger = logging.getLogger("ray.serve")

Event = tuple[str, tuple[bytes, ...]]


def preload() -> None:
    """Import vLLM's event types before the feed starts: the import takes seconds, and done at the
    first event it stalls everything else on the event loop behind it (a stall past the registration
    TTL is enough for the index to forget the engines, and the router then answers 503). In the
    replica the engine's start has imported them already, and this keeps it so should vLLM stop
    doing that."""
    import msgspec  # noqa: F401
    import zmq.asyncio  # noqa: F401
    from vllm.distributed import kv_events  # noqa: F401


def reduce(batch) -> tuple[Event, ...]:
    """A decoded KVEventBatch as (kind, block hashes), in its order: nothing else of it leaves."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    events: list[Event] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append((KVEvents.STORED, tuple(bytes(h) for h in event.block_hashes)))
        elif isinstance(event, BlockRemoved):
            events.append((KVEvents.REMOVED, tuple(bytes(h) for h in event.block_hashes)))
        elif isinstance(event, AllBlocksCleared):
            events.append((KVEvents.CLEARED, ()))
    return tuple(events)


def apply(index: KVIndex, events: KVEvents) -> None:
    """Apply in order: a block stored then removed within a batch ends up not held, and vice versa."""
    for kind, hashes in events.events:
        if kind == KVEvents.STORED:
            index.blocks_stored(events.replica_id, list(hashes))
        elif kind == KVEvents.REMOVED:
            index.blocks_removed(events.replica_id, list(hashes))
        elif kind == KVEvents.CLEARED:
            index.blocks_cleared(events.replica_id)


class Pusher:
    """One replica's events to the index, in order: one call in flight at a time, and what arrived
    meanwhile goes in the next one, at most one every `interval_s`. A call that fails or
    times out (the index restarting or full) drops its events with a warning: see the module's
    docstring for why that is safe. A call that timed out may still land after the next one: that
    too only makes the index stale."""

    def __init__(self, replica_id: str, push: Callable[[KVEvents], Awaitable[object]], timeout_s: float,
                 interval_s: float, failed_pause_s: float) -> None:
        self.replica_id, self.timeout_s = replica_id, timeout_s
        self.interval_s, self.failed_pause_s = interval_s, failed_pause_s
        self._push = push
        self._pending: list[Event] = []
        self._arrived = asyncio.Event()
        self.pushed = self.dropped = 0
        """Events (not calls) the index took, and dropped."""

    def add(self, events: Sequence[Event]) -> None:
        if events:
            self._pending.extend(events)
            self._arrived.set()

    async def run(self) -> None:
        """Push for the replica's life."""
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            started, pause = loop.time(), self.interval_s
            events, self._pending = tuple(self._pending), []
            try:
                await asyncio.wait_for(self._push(KVEvents(self.replica_id, events)), self.timeout_s)
                self.pushed += len(events)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the index is soft state: a stale one costs reuse only
                self.dropped += len(events)
                pause = max(pause, self.failed_pause_s)
                logger.warning("KV index did not take %d KV events (%s): dropped", len(events), type(exc).__name__)
            await asyncio.sleep(max(0.0, started + pause - loop.time()))


async def forward(source: str, pusher: Pusher) -> None:
    """Read the engine's publisher on `source` (its node-local ipc socket), and push the index each
    batch's hashes through `pusher`. Runs for the replica's life."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.connect(source)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    pushing = asyncio.get_running_loop().create_task(pusher.run())
    try:
        while True:
            _topic, _seq, payload = await socket.recv_multipart()
            try:
                batch = decoder.decode(payload)
            except msgspec.MsgspecError as exc:  # an event type this vLLM version added: skip the batch
                logger.warning("undecodable KV event batch skipped: %s", exc)
                continue
            pusher.add(reduce(batch))
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a lost feed only makes the index staler, never wrong
        logger.exception("KV event feed of replica %s stopped", pusher.replica_id)
    finally:
        pushing.cancel()
        socket.close(linger=0)
