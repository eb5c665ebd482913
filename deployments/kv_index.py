"""The KV index actor: one replica holding app.kv_index.KVIndex for the whole graph.

router and engine replicas ──record/register──▶ here ──PrefixLookup──▶ router
"""

import asyncio
import logging

from ray import serve
from ray.serve import metrics

from app import kv_events
from app.config import AppConfig
from app.kv_index import KVIndex, SequenceKey
from app.protocol import PrefixLookup, ReplicaInfo, RetainedBlocks, Role

logger = logging.getLogger("ray.serve")

EXPIRE_EVERY_S = 5.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class KVIndexServer:
    """Every method is async: they all run on the replica's event loop, one at a time, beside the
    KV-event feeds, so the index needs no lock (sync methods would run in a thread pool)."""

    def __init__(self, config: AppConfig) -> None:
        self.index = KVIndex(block_size=config.block_size, hash_seed=config.prefix_hash_seed)
        self._expiry_task = asyncio.get_event_loop().create_task(self._expire_forever())
        self._subscriptions: dict[str, asyncio.Task] = {}
        self._size = metrics.Gauge("kv_loop_index_size", "KV index entries by kind.", tag_keys=("entries",))
        self.events_applied = 0

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            self.index.expire()
            for name, value in self.index.stats().items():
                self._size.set(value, {"entries": name})

    async def register(self, info: ReplicaInfo) -> None:
        self.index.register(info)
        if info.events_endpoint and info.role == Role.PREFILL:
            self._subscriptions[info.replica_id] = asyncio.get_event_loop().create_task(
                self._follow_events(info.replica_id, info.events_endpoint))

    async def _follow_events(self, replica_id: str, endpoint: str) -> None:
        try:
            async for batch in kv_events.subscribe(endpoint):
                kv_events.apply(self.index, replica_id, batch)
                self.events_applied += len(batch.events)
        except Exception:  # noqa: BLE001 - a lost feed only makes the index staler, never wrong
            logger.exception("KV event feed of replica %s stopped", replica_id)

    async def lookup(self, hashes: list[bytes]) -> PrefixLookup:
        return self.index.lookup(hashes)

    async def record_retained(self, salt: str, retained: RetainedBlocks) -> None:
        self.index.record_retained(salt, retained)

    async def forget_retained(self, key: SequenceKey) -> None:
        self.index.forget_retained(key)

    async def record_prefill(self, replica_id: str, hashes: list[bytes]) -> None:
        self.index.record_prefill(replica_id, hashes)

    async def ready(self) -> bool:
        """At least one prefill and one decode engine have started and registered."""
        return all(self.index.replica_ids(role) for role in Role)

    async def stats(self) -> dict[str, int]:
        return {**self.index.stats(), "events_applied": self.events_applied}
