"""What a turn needs from the rest of the graph, as Protocols: the KV index and the two engine groups.

deployments/handles.py adapts Ray Serve handles to them; tests/fakes.py implements them in memory. Each
method returns an awaitable (a Serve DeploymentResponse satisfies it without a coroutine around it) or,
for a reply, an EngineStream of chunks.
"""

from collections.abc import Awaitable
from typing import Protocol, runtime_checkable

from app.conversations.records import HistoryMatch
from app.kv.index import SequenceKey
from app.protocol import (
    DecodeRequest,
    KVHandoff,
    Membership,
    PrefillRequest,
    PrefillResult,
    PrefixLookup,
    ReplyChunk,
    RetainedBlocks,
    StoredResponse,
    TurnRecords,
)


@runtime_checkable
class EngineStream(Protocol):
    """A streamed engine call: chunks until the reply finishes; `cancel` aborts the engine request."""

    def __anext__(self) -> Awaitable[ReplyChunk]: ...

    def cancel(self) -> None: ...


@runtime_checkable
class KVIndexClient(Protocol):
    def membership(self) -> Awaitable[Membership]: ...

    def lookup(self, hashes: list[bytes], take: SequenceKey | None = None) -> Awaitable[PrefixLookup]:
        """`take`: claim this retained sequence too, if it is the longest match (PrefixLookup.taken)."""

    def take(self, key: SequenceKey) -> Awaitable[RetainedBlocks | None]:
        """The retained sequence, now owned by the caller; None when another turn took it first."""

    def record_turn(self, records: TurnRecords) -> Awaitable[tuple[SequenceKey, ...]]:
        """Records the turn; the keys of `records.take_keys` it took for the caller."""

    def match_conversation(self, chain: list[str], last_assistant: int,
                           session_key: str | None) -> Awaitable[HistoryMatch]: ...

    def store_response(self, stored: StoredResponse) -> Awaitable[bool]: ...

    def load_response(self, tenant: str, response_id: str) -> Awaitable[StoredResponse | None]: ...


@runtime_checkable
class EngineGroup(Protocol):
    """Either group streams a whole turn (`generate`) and frees blocks the other group will not read."""

    def generate(self, request: DecodeRequest) -> EngineStream: ...

    def release(self, handoff: KVHandoff) -> Awaitable[None]: ...


@runtime_checkable
class PrefillGroup(EngineGroup, Protocol):
    def prefill(self, request: PrefillRequest) -> Awaitable[PrefillResult]: ...
