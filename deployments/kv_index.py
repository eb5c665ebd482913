"""The KV index actor: one replica holding app.kv_index.KVIndex for the whole graph.

router and engine replicas ──record/register──▶ here ──PrefixLookup──▶ router
"""

import asyncio

from ray import serve

from app.config import AppConfig
from app.kv_index import KVIndex, SequenceKey
from app.protocol import PrefixLookup, ReplicaInfo, RetainedBlocks

EXPIRE_EVERY_S = 5.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class KVIndexServer:
    def __init__(self, config: AppConfig) -> None:
        self.index = KVIndex(block_size=config.block_size, hash_seed=config.prefix_hash_seed)
        self._expiry_task = asyncio.get_event_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            self.index.expire()

    def register(self, info: ReplicaInfo) -> None:
        self.index.register(info)

    def lookup(self, hashes: list[bytes]) -> PrefixLookup:
        return self.index.lookup(hashes)

    def record_retained(self, salt: str, retained: RetainedBlocks) -> None:
        self.index.record_retained(salt, retained)

    def forget_retained(self, key: SequenceKey) -> None:
        self.index.forget_retained(key)

    def record_prefill(self, replica_id: str, hashes: list[bytes]) -> None:
        self.index.record_prefill(replica_id, hashes)

    def stats(self) -> dict[str, int]:
        return self.index.stats()
