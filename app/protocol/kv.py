"""KV blocks that move between engines: a handoff (blocks one engine holds for another to read), a sequence
decode retains for the next turn, and what a finished turn records in the index."""

from dataclasses import dataclass, replace
from typing import Any

from app.protocol.engines import EngineEndpoint


@dataclass(frozen=True)
class KVHandoff:
    """KV blocks one engine holds for another to read: prefill→decode, or decode→next prefill."""

    source: EngineEndpoint
    block_ids: tuple[tuple[int, ...], ...]
    """One tuple of block ids per KV-cache group, as vLLM lays them out."""
    num_tokens: int
    request_id: str
    """The engine's id of the request that owns the blocks; the reader's notification frees them."""
    expiry_time: float = 0.0
    """Unix time after which the owner may free the blocks (0: until read)."""
    engine_expiry: float | None = None
    """The same deadline on the owner's monotonic clock, as the engine reads it."""

    def prefix(self, num_tokens: int, block_size: int) -> "KVHandoff":
        """The same blocks cut to those holding the first `num_tokens` tokens."""
        num_blocks = -(-num_tokens // block_size)
        return replace(self, block_ids=tuple(group[:num_blocks] for group in self.block_ids),
                       num_tokens=min(num_tokens, self.num_tokens))


@dataclass(frozen=True)
class RetainedBlocks:
    """Block metadata of a finished sequence that a decode replica keeps for the next turn."""

    replica_id: str
    handoff: KVHandoff
    token_ids: tuple[int, ...]
    """The tokens the retained blocks hold: prompt plus generated, minus the last sampled one."""
    num_prompt_tokens: int
    tenant: str = ""
    """Whose share of decode's retained KV the blocks count against."""
    paused_until: float = 0.0
    """Unix time until which the sequence waits out a tool's run: decode's trimming takes it last."""

    @property
    def key(self) -> tuple[str, str]:
        """The index's key for the sequence: (decode replica id, engine request id)."""
        return self.replica_id, self.handoff.request_id


@dataclass(frozen=True)
class TurnRecords:
    """What a finished turn tells the KV index, in one call after the reply: the sequence decode
    retains (with the block hashes the router already computed), the blocks prefill computed, the
    conversation record, and the retained sequences to take before the router releases them. One
    call instead of four: each Serve call costs both ends CPU."""

    cache_salt: str
    retained: RetainedBlocks | None = None
    retained_hashes: tuple[bytes, ...] = ()
    prefill_replica_id: str = ""
    prefill_hashes: tuple[bytes, ...] = ()
    conversation: Any = None
    """The turn's app.conversations.records.ConversationRecord, for a chat turn."""
    session_key: str | None = None
    take_keys: tuple[tuple[str, str], ...] = ()
    """(replica id, request id) of sequences this turn claimed without taking them (a near-cache
    claim, a superseded one): the index takes each after recording, and the router releases only
    those it took."""

    def __bool__(self) -> bool:
        return (self.retained is not None or bool(self.prefill_hashes) or self.conversation is not None
                or bool(self.take_keys))
