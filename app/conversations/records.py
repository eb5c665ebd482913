"""Conversation records: the exact tokens each finished turn saw and produced, keyed by the
replayed messages, so the next turn can append to them instead of re-rendering history.

    turn k finishes ──▶ record(key = H(tenant, messages + [assistant reply]), prompt + generated ids)
    turn k+1 arrives ──▶ key of its messages up to the last assistant reply ──▶ the record, if any

Keys chain over messages (H(m0), H(m0,m1), ...), so a miss still finds the record sharing the
longest message prefix: that tells where and why the client's history diverged.
Bounded by count, by bytes and by age (RecordBounds); with tenants, each tenant by its share of the
bytes, so that one tenant's long conversations push out its own oldest records, not others'. Losing
a record costs reuse only, never correctness.
"""

import enum
import json
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xxhash

from app.conversations.bounded import RecordBounds, TenantLRU
from app.kv.hashing import common_prefix_len

REASONING_END = "</think>"


def message_chain(parent: str, messages: list[dict[str, Any]]) -> list[str]:
    """One key per message prefix: key[i] identifies messages[: i + 1] after `parent` (the tenant
    for a whole conversation, or the last key of a chain to extend it)."""
    keys = []
    for message in messages:
        body = json.dumps(message_identity(message))
        parent = xxhash.xxh3_128_hexdigest(body.encode(), seed=xxhash.xxh3_64_intdigest(parent.encode()))
        keys.append(parent)
    return keys


def message_identity(message: dict[str, Any]) -> list[Any]:
    """What of a message decides whether a client replayed it: an assistant reply's answer and tool
    calls, not its reasoning, which clients replay in `content`, in a field of its own or not at
    all (the record keeps the tokens the model produced either way); tool calls by name and
    arguments, not by their ids or the arguments' spacing."""
    if message.get("role") != "assistant":
        return [message.get("role"), message.get("content")]
    answer = (message.get("content") or "").split(REASONING_END)[-1].lstrip("\n")
    calls = [_call_identity(call) for call in message.get("tool_calls") or ()]
    return ["assistant", answer, *calls]


def _call_identity(call: dict[str, Any]) -> list[Any]:
    function = call.get("function") or call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return [function.get("name"), json.dumps(arguments, sort_keys=True)]


RECORD_OVERHEAD_BYTES = 512
"""A record's cost beside its tokens and keys: the objects around them, its index entries."""


def compact(token_ids) -> array:
    """Token ids at 4 bytes each: a tuple of ints costs about 36 per token."""
    return array("I", token_ids)


@dataclass(frozen=True)
class ConversationRecord:
    token_ids: array
    """Prompt plus generated tokens, exactly as the engines saw and produced them (compact())."""
    num_prompt_tokens: int
    message_keys: tuple[str, ...]
    """The chain keys of the messages this record ends (its last one is the assistant reply)."""
    created_at: float
    prefill_replica_id: str = ""
    """Where this turn was prefilled: the next turn 'lands where the previous ran' if it goes there."""
    tenant: str = ""
    """Whose quota of the store the record counts against."""

    @property
    def nbytes(self) -> int:
        return self.token_ids.itemsize * len(self.token_ids) + 48 * len(self.message_keys) + RECORD_OVERHEAD_BYTES


@dataclass(frozen=True)
class HistoryMatch:
    record: ConversationRecord | None
    exact: bool
    """The messages up to the last assistant reply are exactly the record's."""
    diverged_at_message: int | None = None
    """For an inexact match: the index of the first message that differs from the record's."""


class ConversationStore:
    def __init__(self, bounds: RecordBounds) -> None:
        self.bounds = bounds
        self._records: TenantLRU[ConversationRecord] = TenantLRU(bounds, on_drop=self._unindex)
        self._by_prefix: dict[str, str] = {}  # message-prefix key -> key of a record extending it
        self._sessions: OrderedDict[str, str] = OrderedDict()  # X-Session-ID -> its latest record key

    @property
    def nbytes(self) -> int:
        return self._records.nbytes

    def put(self, record: ConversationRecord, session_key: str | None = None) -> None:
        key = record.message_keys[-1]
        if session_key:
            self._sessions[session_key] = key
            self._sessions.move_to_end(session_key)
            if len(self._sessions) > self.bounds.max_records:
                self._sessions.popitem(last=False)
        self._records.drop(key)
        for prefix in record.message_keys:
            self._by_prefix[prefix] = key
        self._records.put(key, record, record.tenant, record.nbytes)

    def match(self, chain: list[str], last_assistant: int, session_key: str | None = None,
              now: float | None = None) -> HistoryMatch:
        """The record for messages[: last_assistant + 1]; else the session's latest record, or the
        record sharing the most leading messages, with the first message that differs."""
        now = time.time() if now is None else now
        record = self._live(chain[last_assistant], now) if last_assistant >= 0 else None
        if record is not None:
            return HistoryMatch(record=record, exact=True)
        candidate = self._live(self._sessions.get(session_key), now) if session_key else None
        if candidate is None:
            depth = next((d for d in range(last_assistant, -1, -1) if chain[d] in self._by_prefix), -1)
            candidate = self._live(self._by_prefix[chain[depth]], now) if depth >= 0 else None
        if candidate is None:
            return HistoryMatch(record=None, exact=False)
        same = common_prefix_len(list(candidate.message_keys), chain)
        return HistoryMatch(record=candidate, exact=False, diverged_at_message=same)

    def _live(self, key: str | None, now: float) -> ConversationRecord | None:
        record = self._records.get(key)
        if record is not None and now - record.created_at > self.bounds.ttl_s:
            self._records.drop(key)
            return None
        return record

    def _unindex(self, key: str, record: ConversationRecord) -> None:
        for prefix in record.message_keys:
            if self._by_prefix.get(prefix) == key:
                del self._by_prefix[prefix]

    def __len__(self) -> int:
        return len(self._records)


class RenderMode(str, enum.Enum):
    PRESERVE = "preserve"
    """Append the new messages' rendering to the recorded tokens of the previous turn."""
    TEMPLATE = "template"
    """Render the whole conversation with the model's chat template every turn."""


class BreakCause(str, enum.Enum):
    NONE = "none"
    NO_RECORD = "no_record"
    TEMPLATE_REWRITE = "template_rewrite"
    REASONING_STRIPPED = "reasoning_stripped"
    RETOKENIZATION_DRIFT = "retokenization_drift"
    EDITED_HISTORY = "edited_history"
    TRUNCATION = "truncation"
    VOLATILE_TOP = "volatile_top"


@dataclass(frozen=True)
class RenderDiagnostics:
    mode: RenderMode
    prompt_tokens: int
    previous_tokens: int
    """Tokens of the previous turn's full sequence (prompt + generated); 0 without a record."""
    shared_tokens: int
    reusable_blocks: int
    cause: BreakCause
    pause_s: float = 0.0
    """From the previous turn's end to this turn's rendering (a tool's run, the user's think time)."""


def diagnose(prompt_ids: list[int], match: HistoryMatch, mode: RenderMode, block_size: int,
             num_history_messages: int, reasoning_in_reply: bool, now: float = 0.0) -> RenderDiagnostics:
    """How much of the previous turn's sequence this prompt keeps, and why it stops where it does."""
    record = match.record
    if record is None:
        return RenderDiagnostics(mode, len(prompt_ids), 0, 0, 0, BreakCause.NO_RECORD)
    shared = common_prefix_len(prompt_ids, list(record.token_ids))
    cause = _break_cause(shared, record, match, num_history_messages, reasoning_in_reply)
    return RenderDiagnostics(mode, len(prompt_ids), len(record.token_ids), shared,
                             min(shared, len(prompt_ids) - 1) // block_size, cause,
                             pause_s=round(max(now - record.created_at, 0.0), 3) if now else 0.0)


def _break_cause(shared: int, record: ConversationRecord, match: HistoryMatch, num_history_messages: int,
                 reasoning_in_reply: bool) -> BreakCause:
    if shared == len(record.token_ids):
        return BreakCause.NONE
    if not match.exact:  # the client's messages differ from what the record saw
        if match.diverged_at_message == 0:
            return BreakCause.VOLATILE_TOP
        if num_history_messages < len(record.message_keys):
            return BreakCause.TRUNCATION
        return BreakCause.EDITED_HISTORY
    if shared < record.num_prompt_tokens:  # same messages, rendered differently
        return BreakCause.TEMPLATE_REWRITE
    if reasoning_in_reply:
        return BreakCause.REASONING_STRIPPED
    return BreakCause.RETOKENIZATION_DRIFT
