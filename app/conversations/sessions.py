"""Append-only chat sessions: render each turn so that it extends the previous turn's exact tokens.

request messages ──match──▶ ConversationStore ──preserve: append / template: render──▶ prompt ids
finished turn (prompt + generated ids, reply text) ──▶ ConversationStore (the next turn's record)
The store here is the router replica's near copy; the KV index keeps the shared one, asked on a
miss, so a restarted router or another replica keeps a conversation's append-only rendering.
"""

import json
import time
from dataclasses import dataclass
from typing import Any

from app.conversations.bounded import RecordBounds
from app.conversations.records import (
    REASONING_END,
    ConversationRecord,
    ConversationStore,
    HistoryMatch,
    RenderDiagnostics,
    RenderMode,
    compact,
    diagnose,
    message_chain,
)
from app.conversations.rendering import PromptRenderer


@dataclass(frozen=True)
class HistoryQuery:
    """Which recorded turn a request's messages continue: asked of the local store, then the index."""

    chain: tuple[str, ...]
    last_assistant: int
    """Index of the last assistant message (-1: a first turn, nothing to look up)."""
    session_key: str | None
    tenant: str
    """Whose quota the turn's record counts against (the key's tenant, whatever its cache scope)."""


@dataclass(frozen=True)
class RenderedTurn:
    prompt_ids: list[int]
    diagnostics: RenderDiagnostics
    chain: tuple[str, ...]
    tenant: str
    session_key: str | None
    affinity_key: str
    """The conversation's identity: its session, else its messages up to the first user turn."""
    turn_index: int
    """1 for a conversation's first turn: one more than the replies its history holds. Counting user
    messages instead made every turn of an agent loop (one question, then tool results) a first turn:
    first turns' priority in the engines, and placement fitted to first turns' long prompts."""
    previous_replica: str
    """The prefill replica of the previous turn, when its record was found."""


class ChatSessions:
    def __init__(self, renderer: PromptRenderer, block_size: int, bounds: RecordBounds) -> None:
        self.renderer, self.block_size = renderer, block_size
        self.store = ConversationStore(bounds)

    def query(self, messages: list[dict[str, Any]], scope: str, tenant: str, session_id: str | None,
              tools: list[dict[str, Any]] | None = None) -> HistoryQuery:
        """`scope`: what may share records and KV (the tenant, or tenant/user). The tools offered
        root the chain: the template renders them first, so other tools make another conversation."""
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        root = f"{scope}\x00tools:{json.dumps(tools, sort_keys=True)}" if tools else scope
        return HistoryQuery(tuple(message_chain(root, messages)), last_assistant,
                            f"{scope}\x00{session_id}" if session_id else None, tenant)

    def match(self, query: HistoryQuery) -> HistoryMatch:
        return self.store.match(list(query.chain), query.last_assistant, query.session_key)

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any], query: HistoryQuery,
               match: HistoryMatch, mode: RenderMode) -> RenderedTurn:
        prompt_ids = None
        if mode == RenderMode.PRESERVE and match.exact:
            prompt_ids = self.renderer.append(match.record, messages, query.last_assistant, template_kwargs)
        if prompt_ids is None:
            prompt_ids = self.renderer.chat(messages, template_kwargs)
        diagnostics = diagnose(prompt_ids, match, mode, self.block_size, query.last_assistant + 1,
                               match.record is not None and self._has_reasoning(match.record), time.time())
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
        return RenderedTurn(prompt_ids, diagnostics, query.chain, query.tenant, query.session_key,
                            affinity_key=query.session_key or query.chain[first_user],
                            turn_index=1 + sum(m["role"] == "assistant" for m in messages),
                            previous_replica=match.record.prefill_replica_id if match.record else "")

    def _has_reasoning(self, record: ConversationRecord) -> bool:
        """Did the recorded reply think out loud? (Models may spell </think> as one token or several.)"""
        reply = self.renderer.tokenizer.decode(record.token_ids[record.num_prompt_tokens:])
        return REASONING_END in reply

    def finish(self, turn: RenderedTurn, generated_ids: list[int], reply: dict[str, Any],
               prefill_replica_id: str) -> ConversationRecord:
        """Record the finished turn, keyed by the message (`reply`: content, tool calls) a faithful
        client will replay next."""
        reply_key = message_chain(turn.chain[-1], [reply])[0]
        record = ConversationRecord(token_ids=compact((*turn.prompt_ids, *generated_ids)),
                                    num_prompt_tokens=len(turn.prompt_ids),
                                    message_keys=(*turn.chain, reply_key), created_at=time.time(),
                                    prefill_replica_id=prefill_replica_id, tenant=turn.tenant)
        self.store.put(record, turn.session_key)
        return record
