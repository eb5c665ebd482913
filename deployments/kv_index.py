"""The KV index actor: one replica holding app.kv.index.KVIndex and the shared conversation records.

engine replicas ──register (heartbeat)──▶ here ◀──lookup/take/record──▶ router replicas
prefill replicas ──apply_kv_events (their engines' KV cache events, block hashes only)──▶ here
Its state is soft: after a restart the engines' heartbeats make the membership whole within
seconds, and lost records, retained sequences or KV events cost reuse, never correctness.
"""

import asyncio
import logging
import time

from ray import serve
from ray.serve import metrics

from app.config import AppConfig
from app.conversations.bounded import TenantLRU
from app.conversations.records import ConversationStore, HistoryMatch
from app.kv import events as kv_events
from app.kv.index import KVIndex, SequenceKey
from app.protocol import (
    KVEvents,
    Membership,
    PrefixLookup,
    ReplicaInfo,
    RetainedBlocks,
    Role,
    StoredResponse,
    TurnRecords,
)

logger = logging.getLogger("ray.serve")



@serve.deployment(num_replicas=1)
class KVIndexServer:
    """Every method is async: they all run on the replica's event loop, one at a time, so the index
    needs no lock (sync methods would run in a thread pool)."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.started = time.monotonic()
        self.index = KVIndex.of(config)
        self.conversations = ConversationStore(config.record_bounds)
        self.responses: TenantLRU[StoredResponse] = TenantLRU(config.record_bounds)
        self._expiry_task = asyncio.get_event_loop().create_task(self._expire_forever())
        self._size = metrics.Gauge("kv_loop_index_size", "KV index entries by kind.", tag_keys=("entries",))
        self.events_applied = 0

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.limits.index_sweep_interval_s)
            self.index.expire()
            for replica_id in self.index.expire_replicas(self.config.limits.registration_ttl_s):
                logger.warning("replica %s stopped renewing its registration: forgotten", replica_id)
            for name, value in (await self.stats()).items():
                self._size.set(value, {"entries": name})

    async def register(self, info: ReplicaInfo) -> None:
        """A replica's start and each of its heartbeats."""
        self.index.register(info)

    async def apply_kv_events(self, events: KVEvents) -> None:
        """A prefill replica's KV cache events, in its engine's order (app/kv/events.py). Ignored from
        a replica the index does not know: one forgotten when its heartbeats stopped (its blocks went
        with it) or not registered again yet after the index restarted; its next registration starts
        its blocks afresh, and what the index missed meanwhile costs reuse only."""
        if events.replica_id in self.index.replicas:
            kv_events.apply(self.index, events)
            self.events_applied += len(events.events)

    async def membership(self) -> Membership:
        prefill, decode = self.index.replica_ids(Role.PREFILL), self.index.replica_ids(Role.DECODE)
        settled = time.monotonic() - self.started >= self.config.limits.registration_ttl_s
        return Membership(prefill=tuple(prefill), decode=tuple(decode),
                          loads={r: self.index.replicas[r].load for r in (*prefill, *decode)}, settled=settled)

    async def lookup(self, hashes: list[bytes], take: SequenceKey | None = None) -> PrefixLookup:
        return self.index.lookup(hashes, take=take)

    async def take(self, key: SequenceKey) -> RetainedBlocks | None:
        """Claim a retained sequence: the caller becomes its only reader or releaser (None: taken already)."""
        return self.index.forget_retained(key)

    async def take_all(self, keys: list[SequenceKey]) -> tuple[SequenceKey, ...]:
        """Claim each of `keys` still in the index; the keys claimed (the caller releases those)."""
        return tuple(key for key in keys if self.index.forget_retained(key) is not None)

    async def held(self, keys: list[SequenceKey]) -> tuple[SequenceKey, ...]:
        """Which of `keys` nobody has taken yet, without claiming them."""
        return tuple(key for key in keys if self.index.holds(key))

    async def record_turn(self, records: TurnRecords) -> tuple[SequenceKey, ...]:
        """Record the turn, then take its `take_keys`: the keys taken (the caller releases those)."""
        if records.retained is not None:
            self.index.record_retained(records.cache_salt, records.retained, list(records.retained_hashes) or None)
        if records.prefill_hashes:
            self.index.record_prefill(records.prefill_replica_id, list(records.prefill_hashes))
        if records.conversation is not None:
            self.conversations.put(records.conversation, records.session_key)
        return await self.take_all(list(records.take_keys))

    async def match_conversation(self, chain: list[str], last_assistant: int,
                                 session_key: str | None) -> HistoryMatch:
        return self.conversations.match(chain, last_assistant, session_key)

    async def store_response(self, stored: StoredResponse) -> bool:
        self.responses.put(stored.response_id, stored, stored.tenant, stored.nbytes)
        return True

    async def load_response(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The stored response, for its own tenant only, within `conversation_ttl_s`."""
        stored = self.responses.get(response_id)
        if stored is None or stored.tenant != tenant:
            return None
        if time.time() - stored.created_at > self.config.conversation_ttl_s:
            self.responses.drop(response_id)
            return None
        return stored

    async def stats(self) -> dict[str, int]:
        return {**self.index.stats(), "conversations": len(self.conversations),
                "conversation_bytes": self.conversations.nbytes, "responses": len(self.responses),
                "response_bytes": self.responses.nbytes, "events_applied": self.events_applied}
