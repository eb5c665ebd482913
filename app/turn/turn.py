"""One turn, from plan to settlement: an async context manager that owns everything the turn holds.

    async with loop.turn(spec) as turn:
        await turn.prepare()          plan ──▶ claim ──▶ prompt computed (prefill, or the engine that decodes)
        async for chunk in turn.reply(): ...      decode streamed; an engine that dies hands it to another
        turn.record(conversation, session_key)
    # exit, however it ends (finished, failed, cancelled, client gone): its ledger is settled once

    plan:    hashes ──▶ near cache / kv_index.lookup ──▶ Planner ──▶ RoutingDecision ──▶ kv_index.take
             (a pull owns the sequence it reads; the lookup takes the one the near cache says the turn extends)
    prefill: PrefillRequest(pull?) ──▶ prefill replica ──▶ PrefillResult   (pull failed: recompute)
             its first token goes to the client at once
    decode:  DecodeRequest(prompt + first token, handoff) ──▶ decode replica ──▶ ReplyChunk…
A short append to a conversation a decode replica retains skips prefill: DecodeRequest(prompt, no
handoff) goes to that replica, which computes the new tokens from its prefix cache. Like vLLM's Request
and its one free path, the ledger (app/turn/ledger.py) is the turn's only record of what it holds.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from app.kv.hashing import block_hashes
from app.protocol import (
    Action,
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    Reason,
    ReplyChunk,
    RetainedBlocks,
    Role,
    RoutingDecision,
    SamplingSettings,
)
from app.turn.ledger import TurnLedger, TurnState
from app.turn.reply import EngineGone, NoEngineAlive, ReplyStream, StageTimeout, migrated
from app.turn.spec import CONTINUATION_PRIORITY, Turn

if TYPE_CHECKING:
    from app.turn.loop import TurnLoop

FALLBACK_REASONS = (Reason.PULL_FAILED, Reason.DECODE_FAILED, Reason.ENGINE_FAILED)


class TurnRun:
    def __init__(self, loop: "TurnLoop", turn: Turn) -> None:
        self.loop, self.turn, self.limits = loop, turn, loop.limits
        self.ledger = TurnLedger(turn.request_id)
        self.decision: RoutingDecision | None = None
        self.prefill: PrefillResult | None = None
        self.log_entry: dict[str, Any] = {}
        """This turn's decision-log entry; decode adds its first-token latency to it."""
        self.journaled = False
        self.started_at = self.planned_at = 0.0
        self._reply: ReplyStream | None = None
        """The rest of the reply, already streaming, when the prompt was computed where it decodes."""
        self.conversation: Any = None
        self.session_key: str | None = None

    async def __aenter__(self) -> "TurnRun":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._journal()
        self.loop.settle(self)

    @property
    def cached_tokens(self) -> int:
        return self.prefill.num_cached_tokens

    def record(self, conversation: Any, session_key: str | None) -> None:
        """The chat turn's ConversationRecord, recorded with the turn's settlement."""
        self.conversation, self.session_key = conversation, session_key

    # ---- the prompt ----------------------------------------------------------------------------------
    async def prepare(self) -> None:
        """Plan the turn and compute its prompt's KV: on a prefill replica (ready for decode), or in
        the engine that then streams the reply."""
        turn, config = self.turn, self.loop.config
        # Off the event loop: a long prompt's hashes would stall every other stream of this router.
        self.ledger.hashes = list(turn.block_hashes) or await asyncio.to_thread(
            block_hashes, list(turn.prompt_token_ids), config.block_size, turn.cache_salt, config.prefix_hash_seed,
            config.prefix_hash_algo)
        self.started_at = started = time.perf_counter()
        decision = await self._plan()
        self.planned_at = planned = time.perf_counter()
        result, self._reply, decision = await self._compute_prompt(decision)
        self.decision, self.prefill = decision, result
        prefill_ms = round((time.perf_counter() - planned) * 1e3, 2)
        if result.first_chunk is not None:  # else the first token is decode's: observed when it comes
            self._observe_placement(prefill_ms)
        on_prefill = result.handoff is not None
        measured = {"render_ms": round((started - turn.received_at) * 1e3, 2) if turn.received_at else None,
                    "plan_ms": round((planned - started) * 1e3, 2), "prefill_ms": prefill_ms,
                    "eviction_horizon_s": self.loop.journal.observe_load(result, time.time()) if on_prefill else None,
                    "first_token_from": "prefill" if (on_prefill and result.first_chunk)
                    or decision.action == Action.RUN_ON_PREFILL else "decode",
                    "engine_ms": asdict(result.engine_timing) if result.engine_timing else None}
        self.log_entry = self.loop.journal.entry(turn, decision, result, measured)

    async def _plan(self) -> RoutingDecision:
        loop, turn, hashes = self.loop, self.turn, self.ledger.hashes
        live = await loop.live()
        own = loop.own_retained.lookup(hashes)
        near = loop.planner.near(turn, own, live)
        if near is not None and near.action == Action.PREFILL_ON_DECODE:
            self._claim(near.retained, confirmed=False)
            return near
        extended = loop.planner.extended(turn, own)
        answer = await loop.bookkeep(loop.index.lookup(hashes, extended and extended.key), "index.lookup")
        decision = loop.planner.decide(turn, answer, live)
        if answer is not None and answer.taken:  # ours: pulled, or released at the end as nobody else reads it
            self._claim(answer.retained.retained, confirmed=True)
            return decision
        if (retained := decision.retained) is None:
            return decision
        if decision.action in (Action.PULL, Action.PREFILL_ON_DECODE):
            if await loop.bookkeep(loop.index.take(retained.key), "index.take") is None:
                return loop.planner.without(turn, answer, live)  # another turn took it first: recompute
            self._claim(retained, confirmed=True)
        elif loop.planner.supersedes(turn, retained):
            self._claim(retained, confirmed=False)  # nobody else reads it: release it at the end
        return decision

    def _claim(self, retained: RetainedBlocks, confirmed: bool) -> None:
        self.ledger.claimed, self.ledger.claim_confirmed = retained, confirmed
        self.loop.own_retained.forget_retained(retained.key)

    async def _compute_prompt(self, decision: RoutingDecision
                              ) -> tuple[PrefillResult, ReplyStream | None, RoutingDecision]:
        for attempt in range(self.limits.engine_attempts):
            suffix = str(attempt + 1) if attempt else ""
            try:
                if decision.action in (Action.PREFILL_ON_DECODE, Action.RUN_ON_PREFILL):
                    return *await self._start_whole_turn(decision, suffix), decision
                return await self._prefill(decision, suffix), None, decision
            except (StageTimeout, NoEngineAlive):
                raise
            except Exception as exc:  # noqa: BLE001 - another engine, or the other group, can take the turn
                self.loop.calls.unless_refused(exc, decision.action.value, self.turn.request_id)
                if decision.action == Action.PULL and not isinstance(exc, EngineGone):  # recompute, pulling nothing
                    self.loop.calls.failed("", "kv_pull", self.turn.request_id, exc)
                    decision = replace(decision, action=Action.RECOMPUTE, reason=Reason.PULL_FAILED, pull=None)
                    continue
                failed = decision.prefill_replica_id or (decision.retained.replica_id if decision.retained else "")
                self.loop.calls.failed(failed, decision.action.value, self.turn.request_id, exc)
                decision = self.loop.planner.fallback(decision)
        raise NoEngineAlive("the turn failed on every engine tried")

    async def _prefill(self, decision: RoutingDecision, suffix: str) -> PrefillResult:
        turn = self.turn
        request = PrefillRequest(request_id=f"{turn.request_id}-p{suffix}",
                                 prompt_token_ids=turn.prompt_token_ids, cache_salt=turn.cache_salt,
                                 target_replica_id=decision.prefill_replica_id, pull=decision.pull,
                                 first_token=self._first_token_settings(), priority=turn.priority)
        load = len(turn.prompt_token_ids) - decision.tokens_local - decision.pulled_tokens
        with self.loop.journal.queued(decision.prefill_replica_id, load, turn.later):
            result = await self.loop.calls.prefill(request)
        self.ledger.pulled = decision.action == Action.PULL
        self.ledger.handoff, self.ledger.prefill_replica_id = result.handoff, result.replica_id
        self.ledger.advance(TurnState.PREFILLED)
        return result

    async def _start_whole_turn(self, decision: RoutingDecision, suffix: str) -> tuple[PrefillResult, ReplyStream]:
        """Start the whole turn on one engine (the decode replica retaining the conversation, or the
        engine a degraded mode names), up to its first chunk."""
        turn, on_decode = self.turn, decision.action == Action.PREFILL_ON_DECODE
        role = Role.DECODE if on_decode else Role.PREFILL
        preferred = decision.prefill_replica_id
        if on_decode:
            preferred = decision.retained.replica_id if decision.retained else decision.decode_replica_id
        target = self.loop.engines.pick(role, preferred)
        if target is None:
            raise RuntimeError(f"no live {role.value} replica")
        request = DecodeRequest(request_id=f"{turn.request_id}-{role.value[0]}{suffix}",
                                prompt_token_ids=turn.prompt_token_ids, cache_salt=turn.cache_salt,
                                sampling=turn.sampling, handoff=None, target_replica_id=target, retain=on_decode,
                                priority=turn.priority, tenant=turn.tenant, tool_pause_s=turn.tool_pause_s)
        stream = self.ledger.open_stream = self.loop.calls.stream(role, request)
        with self.loop.journal.queued(target, len(turn.prompt_token_ids) - decision.tokens_local, turn.later):
            try:
                first = await stream.next(self.limits.first_chunk_timeout_s, "first chunk")
            except BaseException:
                stream.close()
                raise
        self.ledger.advance(TurnState.DECODING)
        result = PrefillResult(replica_id=target, handoff=None, num_prompt_tokens=len(turn.prompt_token_ids),
                               num_cached_tokens=first.num_cached_tokens or 0, first_chunk=first,
                               engine_timing=first.engine_timing)
        return result, stream

    def _first_token_settings(self) -> SamplingSettings | None:
        return self.turn.sampling if self.turn.prefill_samples_first_token(
            self.loop.config.first_token_from_prefill) else None

    # ---- the reply -----------------------------------------------------------------------------------
    async def reply(self) -> AsyncIterator[ReplyChunk]:
        """The reply's chunks; an engine that fails mid-reply hands it to another one."""
        ledger, first = self.ledger, self.prefill.first_chunk
        if first is not None:
            self._first_token_sent()
            ledger.advance(TurnState.DECODING)
            yield first
            self._journal()
            if first.finish_reason is not None:
                self._finish(first.retained)
                return
        stream = ledger.open_stream = self._reply or self.loop.calls.continue_reply(self._decode_request())
        # `sent`: what this stream has produced. A turn computed where it decodes already streamed `first`.
        waiting, started = self._reply is None, time.perf_counter()
        sent = [] if waiting or first is None else list(first.token_ids)
        for _ in range(self.limits.engine_attempts):
            try:
                async for chunk in self._chunks(stream, "first decode chunk" if waiting else "reply stream"):
                    if waiting and chunk.token_ids:
                        self.log_entry["decode_first_token_ms"] = round((time.perf_counter() - started) * 1e3, 2)
                        # Read unless the reply moved to an engine that computed the prompt itself.
                        ledger.handoff_read = stream.request.handoff is not None
                        if first is None:
                            self._first_token_sent()
                            self._observe_placement((time.perf_counter() - self.planned_at) * 1e3)
                        waiting = False
                    sent.extend(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        self._finish(chunk.retained)
                    yield chunk
                    self._journal()
                return
            except (StageTimeout, NoEngineAlive):
                raise
            except Exception as exc:  # noqa: BLE001 - the engine died mid-reply: continue it elsewhere
                self.loop.calls.unless_refused(exc, "reply", self.turn.request_id)
                if self.turn.sampling.reads_reply:  # its state (a grammar's, penalties') cannot move
                    raise
                self.loop.calls.failed(stream.replica_id, "reply", self.turn.request_id, exc)
                rest = migrated(stream.request, sent)
                if rest is None:  # it failed after the last token, before saying so
                    self._finish(None)
                    yield ReplyChunk(token_ids=(), text="", finish_reason="length")
                    return
                stream, sent = self.loop.calls.continue_reply(rest), []
                ledger.open_stream = stream
        raise NoEngineAlive("the reply failed on every engine tried")

    async def _chunks(self, stream: ReplyStream, stage: str) -> AsyncIterator[ReplyChunk]:
        timeout = self.limits.first_chunk_timeout_s
        try:
            while True:
                try:
                    chunk = await stream.next(timeout, stage)
                except StopAsyncIteration:
                    return
                timeout, stage = self.limits.stream_idle_timeout_s, "reply stream"
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            stream.close()

    def _decode_request(self) -> DecodeRequest:
        turn, first, retained = self.turn, self.prefill.first_chunk, self.decision.retained
        prompt, sampling = turn.prompt_token_ids, turn.sampling
        if first is not None:  # decode continues after the token prefill sent
            prompt, sampling = prompt + first.token_ids, sampling.after(1)
        return DecodeRequest(request_id=f"{turn.request_id}-d", prompt_token_ids=prompt, cache_salt=turn.cache_salt,
                             sampling=sampling, handoff=self.prefill.handoff,
                             target_replica_id=retained.replica_id if retained else "", priority=CONTINUATION_PRIORITY,
                             tenant=turn.tenant, tool_pause_s=turn.tool_pause_s)

    def _finish(self, retained: RetainedBlocks | None) -> None:
        self.ledger.retained = retained
        self.ledger.advance(TurnState.RECORDED)

    def _observe_placement(self, measured_ms: float) -> None:
        """Fit the placement estimate to the time from plan to the turn's first token, which is what
        it estimates. Where decode samples the first token of a prompt computed on prefill, that is
        decode's first chunk, not prefill's answer: a fit to prefill's answer would learn to drop
        decode's read and step, the larger the busier decode is, and send tool turns to prefill
        exactly when decode is slow to answer them."""
        decision = self.decision
        self.loop.planner.observe(self.turn, decision, decision.reason in FALLBACK_REASONS, measured_ms)

    def _journal(self) -> None:
        """Write the decision-log entry once: after the turn's first token went out (its log line,
        metrics and ring are then not in the turn's time to first token, and the line has the
        TTFT), else as the turn ends."""
        if self.log_entry and not self.journaled:
            self.journaled = True
            self.loop.journal.record(self.turn, self.decision, self.log_entry)

    def _first_token_sent(self) -> None:
        elapsed = time.perf_counter() - self.started_at
        self.log_entry["ttft_ms"] = round(elapsed * 1e3, 2)
        self.loop.metrics.record_ttft(self.turn.turn_index, elapsed)

