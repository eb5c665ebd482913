"""vLLM's KV cache events, from an engine's ZMQ publisher into the KV index.

engine (KVEventsConfig, zmq PUB on a node-local ipc socket) ──forward()──▶ PUB on the node's own
address ──▶ subscribe() (KV index: topic | seq | msgpack KVEventBatch) ──▶ apply()
BlockStored / BlockRemoved / AllBlocksCleared carry the same block hashes the router computes
(app/hashing.py), so the index learns what each replica really holds, LRU evictions included.
"""

import logging
from collections.abc import AsyncIterator

from app.kv_index import KVIndex

logger = logging.getLogger("ray.serve")


def preload() -> None:
    """Import vLLM's event types before the index serves: the import takes seconds, and done at the
    first engine's feed it stalled every index call behind it (in CI for over the registration
    TTL, so the index forgot both engines and the router answered 503)."""
    import msgspec  # noqa: F401
    import zmq.asyncio  # noqa: F401
    from vllm.distributed import kv_events  # noqa: F401


def apply(index: KVIndex, replica_id: str, batch) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    for event in batch.events:
        if isinstance(event, BlockStored):
            index.blocks_stored(replica_id, [bytes(h) for h in event.block_hashes])
        elif isinstance(event, BlockRemoved):
            index.blocks_removed(replica_id, [bytes(h) for h in event.block_hashes])
        elif isinstance(event, AllBlocksCleared):
            index.blocks_cleared(replica_id)


async def forward(source: str, destination: str) -> None:
    """Relay every message from the engine's local publisher to a PUB bound on `destination`
    (vLLM itself binds only every interface or ipc). Runs for the replica's life."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    sub, pub = context.socket(zmq.SUB), context.socket(zmq.PUB)
    sub.connect(source)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub.bind(destination)
    try:
        while True:
            await pub.send_multipart(await sub.recv_multipart())
    finally:
        sub.close(linger=0)
        pub.close(linger=0)


async def subscribe(endpoint: str) -> AsyncIterator:
    """Decoded KVEventBatch objects from one engine's publisher, forever."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        while True:
            _topic, _seq, payload = await socket.recv_multipart()
            yield decoder.decode(payload)
    finally:
        socket.close(linger=0)
