"""Every message that crosses a deployment boundary, defined once.

frontend ──ClientRequest(validated body, credentials, Resume?)──▶ router ──ReplyStart(first chunk), ReplyChunk…
──▶ frontend
router ──PrefillRequest──▶ prefill ──PrefillResult(KVHandoff, first ReplyChunk)──▶ router
router ──DecodeRequest(KVHandoff)──▶ decode ──ReplyChunk…, last one with RetainedBlocks──▶ router
router ──DecodeRequest(no handoff: a short append)──▶ decode ──ReplyChunk…──▶ router
router ──RetainedBlocks / prefill hashes──▶ kv_index ──PrefixLookup──▶ router
engine replicas ──ReplicaInfo (heartbeat)──▶ kv_index ──Membership──▶ router
prefill ──KVEvents (its engine's KV cache events, block hashes only)──▶ kv_index
No live decode replica: router ──DecodeRequest(no handoff)──▶ prefill, which streams the whole turn.
"""

from app.protocol.engines import EngineEndpoint, EngineStatus, KVEvents, LoadReport, Membership, ReplicaInfo, Role
from app.protocol.kv import KVHandoff, RetainedBlocks, TurnRecords
from app.protocol.routing import Action, Estimate, PrefixLookup, Reason, RetainedMatch, RoutingDecision
from app.protocol.turns import (
    ClientRequest,
    DecodeRequest,
    EngineTiming,
    PrefillRequest,
    PrefillResult,
    ReplyChunk,
    ReplyStart,
    Resume,
    SamplingSettings,
    StoredResponse,
    TokenLogprobs,
)

__all__ = [
    "EngineEndpoint",
    "EngineStatus",
    "KVEvents",
    "LoadReport",
    "Membership",
    "ReplicaInfo",
    "Role",
    "KVHandoff",
    "RetainedBlocks",
    "TurnRecords",
    "Action",
    "Estimate",
    "PrefixLookup",
    "Reason",
    "RetainedMatch",
    "RoutingDecision",
    "ClientRequest",
    "DecodeRequest",
    "EngineTiming",
    "PrefillRequest",
    "PrefillResult",
    "ReplyChunk",
    "ReplyStart",
    "Resume",
    "SamplingSettings",
    "StoredResponse",
    "TokenLogprobs",
]
