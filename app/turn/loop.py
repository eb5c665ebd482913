"""The turn loop: rendered prompt in, KV located, prefill run (pull or recompute), decode streamed,
and what the turn held released or recorded for the next turn.

    plan:    hashes ──▶ kv_index.lookup ──▶ decide() ──▶ RoutingDecision ──▶ kv_index.take (a pull owns
             the sequence it reads)
    prefill: PrefillRequest(pull?) ──▶ prefill replica ──▶ PrefillResult   (pull failed: recompute)
             its first token goes to the client at once
    decode:  DecodeRequest(prompt + first token, handoff) ──▶ decode replica ──▶ ReplyChunk…
    close:   TurnLedger ──settle()──▶ releases, kv_index.record_*   (off the reply's path)
A short append to a conversation a decode replica retains skips prefill: DecodeRequest(prompt,
no handoff) goes to that replica, which computes the new tokens from its prefix cache.
Degraded, never down: no live decode replica ──▶ the whole turn on a prefill engine; no live
prefill replica ──▶ on a decode engine; an engine that dies mid-reply ──▶ the reply continues on
another engine from the prompt plus the tokens already sent (greedy replies stay token-exact). A
request an engine refuses itself (vLLM's checks; the engine lives on) is the client's error: no
engine is suspected and none is tried next (app/turn/reply.py refusal).
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from app.config import AppConfig
from app.conversations.records import RenderDiagnostics
from app.kv.hashing import block_hashes, common_prefix_len
from app.kv.index import KVIndex
from app.metrics import TurnMetrics
from app.protocol import (
    Action,
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    PrefixLookup,
    Reason,
    ReplyChunk,
    RetainedBlocks,
    Role,
    RoutingDecision,
    SamplingSettings,
    TurnRecords,
)
from app.turn.decision import PullPolicy, decide_prefill_on_decode
from app.turn.journal import TurnJournal
from app.turn.ledger import Release, Settlement, TurnLedger, TurnState, settle
from app.turn.membership import LiveEngines
from app.turn.placement import Calibration, PlacementPolicy, place
from app.turn.reply import EngineGone, NoEngineAlive, ReplyStream, StageTimeout, migrated, refusal, timed, unless_gone
from app.turn.routing import CostWeights, PrefillChooser, RoutingPolicy

logger = logging.getLogger("ray.serve")
CONTINUATION_PRIORITY, LATER_TURN_PRIORITY, FIRST_TURN_PRIORITY = 0, 1, 2
"""vLLM request priorities (lower runs first). A continuation, decode's reply to a prompt computed on
prefill, goes ahead of every prompt waiting on decode: its user already has the first token, and
starting it costs decode no step budget (vLLM reads its KV asynchronously). At the continuation's
turn priority it waited behind the first turns placed on decode before it: at 64 conversations a
first turn computed on prefill streamed its reply at 42 ms a token against 24 for one computed on
decode, about 570 ms more a reply (docs/design.md#later-turns-first-inside-each-engine)."""
OWN_RETAINED_EXPIRY_S = 5.0
"""How often the router drops expired entries from its own record of retained sequences."""
MAX_ATTEMPTS = 3
"""Engines tried for one stage of a turn (the planned one, then others or the other group)."""
FALLBACK_REASONS = (Reason.PULL_FAILED, Reason.DECODE_FAILED, Reason.ENGINE_FAILED)
"""The planned engine or pull failed: the turn's time says nothing about the placement estimate."""


def turn_priority(later: bool) -> int:
    """vLLM's request priority of a conversation's turn (lower runs first): a later turn, whose
    user waits on a short append, goes ahead of first turns waiting in the same engine."""
    return LATER_TURN_PRIORITY if later else FIRST_TURN_PRIORITY


@dataclass(frozen=True)
class Turn:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str
    sampling: SamplingSettings
    tenant: str = ""
    """Whose quotas the turn counts against (decode's retained KV, the records)."""
    tool_pause_s: float = 0.0
    """The reply may end in tool calls: decode keeps its sequence this long ahead of others."""
    reverse_pull: bool = True
    rendering: RenderDiagnostics | None = None
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    affinity_key: str = ""
    """The conversation's identity for session affinity (session id, or its first messages)."""
    turn_index: int = 1
    previous_replica: str = ""
    """Where the conversation's previous turn was prefilled, if known."""
    prefill_on_decode: bool = True
    """May a short append run whole on the decode replica that retains the conversation?"""
    load_aware: bool = True
    """Place the prompt by both sides' load and costs (app/turn/placement.py), not by the fixed rule."""
    received_at: float = 0.0
    """time.perf_counter() when the router received the request (0: unknown)."""

    @property
    def later(self) -> bool:
        return self.turn_index > 1

    @property
    def priority(self) -> int:
        return turn_priority(self.later)


@dataclass(frozen=True)
class PreparedTurn:
    """A turn whose prompt KV is computed: in a prefill replica (ready for decode), or in the engine
    already streaming the reply."""

    turn: Turn
    decision: RoutingDecision
    prefill: PrefillResult
    ledger: TurnLedger
    log_entry: dict[str, Any]
    """This turn's decision-log entry; decode adds its first-token latency to it."""
    started_at: float
    reply: ReplyStream | None = None
    """The rest of the reply, already streaming, when the prompt was computed where it decodes."""

    @property
    def cached_tokens(self) -> int:
        return self.prefill.num_cached_tokens


class TurnLoop:
    def __init__(self, config: AppConfig, index: Any, prefill: Any, decode: Any, metrics: TurnMetrics) -> None:
        self.config, self.limits = config, config.limits
        self.index, self.groups = index, {Role.PREFILL: prefill, Role.DECODE: decode}
        self.metrics = metrics
        self.policy = PullPolicy(block_size=config.block_size, threshold_tokens=config.recompute_threshold_tokens,
                                 expiry_margin_s=config.expiry_margin_s, enabled=config.reverse_pull,
                                 min_local_horizon_s=config.min_local_horizon_s,
                                 max_decode_prefill_tokens=config.max_decode_prefill_tokens)
        self.placement = PlacementPolicy(config.placement.itl_weight,
                                         config.placement.kv_high_watermark, config.max_decode_prefill_tokens,
                                         config.placement.prior_pull_share)
        self.calibrations = {later: Calibration(config.placement.calibration_ttl_s) for later in (False, True)}
        """First turns and later turns fit apart. Fitted together at 64 conversations, a burst of
        first turns (estimated up to 19 s on decode, measured 3 s) left decode's fit predicting 0 ms
        for the appends after it (measured 100-480 ms): 82 of 128 later turns went to decode and
        waited there up to 1.5 s."""
        weights = CostWeights(config.cost_per_token, config.load_weight, config.transfer_cost_per_token)
        self.choosers = {p: PrefillChooser(p, self.policy, weights) for p in RoutingPolicy}
        self.journal = TurnJournal(config.block_size, metrics)
        self.engines = LiveEngines(self.limits.suspect_replica_s)
        self.own_retained = KVIndex(config.block_size, hash_seed=config.prefix_hash_seed,
                                    hash_algo=config.prefix_hash_algo)
        """The retained sequences this router recorded in the index, as a near cache: a short append
        to one of them goes to decode without an index call. Stale entries cost speed, never
        correctness: decode's prefix cache checks every block by hash."""
        self._own_expired_at = 0.0
        self._tasks: set[asyncio.Task] = set()

    @property
    def decisions(self):
        return self.journal.decisions

    # ---- the KV index: bounded calls, never fatal to a turn ----------------------------------------
    async def ask_index(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """The index's answer, or None when it is unreachable or slow (it is being restarted)."""
        return await self._bookkeep(getattr(self.index, method).remote(*args), f"index.{method}", timeout_s)

    async def _bookkeep(self, call: Awaitable, what: str, timeout_s: float | None = None) -> Any:
        try:
            return await asyncio.wait_for(call, timeout_s or self.limits.bookkeeping_timeout_s)
        except Exception as exc:  # noqa: BLE001 - bookkeeping never decides whether the user gets a reply
            logger.warning(json.dumps({"event": "bookkeeping_failed", "call": what,
                                       "error": f"{type(exc).__name__}: {exc}"[:300]}))
            self.metrics.record_bookkeeping_failure(what)
            return None

    async def follow_membership(self) -> None:
        """Keep the live view of engines current (the index's heartbeats) and hand the turn metrics
        to Ray; runs for the router's life."""
        while True:
            await self.refresh_membership()
            self.metrics.flush()
            await asyncio.sleep(self.limits.heartbeat_interval_s)

    async def refresh_membership(self, timeout_s: float | None = None) -> None:
        """`timeout_s`: longer than a bookkeeping call's for a new router replica's first ask, whose
        call also resolves where the index runs (up to 4 s on 2 cores): a turn planned before the
        answer finds neither its conversation's record nor its retained KV, so it recomputes."""
        if (members := await self.ask_index("membership", timeout_s=timeout_s)) is not None:
            self.engines.update(members)

    def spawn(self, coro: Awaitable, what: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the bookkeeping still running (tests; a router shutting down)."""
        await asyncio.gather(*[t for t in self._tasks if t.get_name() != "membership"])

    # ---- one turn ------------------------------------------------------------------------------------
    async def prepare(self, turn: Turn, ledger: TurnLedger) -> PreparedTurn:
        # Off the event loop: a long prompt's hashes would stall every other stream of this router.
        hashes = await asyncio.to_thread(block_hashes, list(turn.prompt_token_ids), self.config.block_size,
                                         turn.cache_salt, self.config.prefix_hash_seed, self.config.prefix_hash_algo)
        ledger.hashes = hashes
        started = time.perf_counter()
        decision = await self._plan(turn, hashes, ledger)
        planned = time.perf_counter()
        result, reply, decision = await self._compute_prompt(turn, decision, ledger)
        on_prefill = result.handoff is not None
        prefill_ms = round((time.perf_counter() - planned) * 1e3, 2)
        if decision.placement is not None and decision.reason not in FALLBACK_REASONS:
            self.calibrations[turn.later].observe(decision.placement, decision.action == Action.PREFILL_ON_DECODE,
                                                  prefill_ms)
        measured = {"render_ms": round((started - turn.received_at) * 1e3, 2) if turn.received_at else None,
                    "plan_ms": round((planned - started) * 1e3, 2), "prefill_ms": prefill_ms,
                    "eviction_horizon_s": self.journal.observe_load(result, time.time()) if on_prefill else None,
                    "first_token_from": "prefill" if (on_prefill and result.first_chunk)
                    or decision.action == Action.RUN_ON_PREFILL else "decode",
                    "engine_ms": asdict(result.engine_timing) if result.engine_timing else None}
        entry = self.journal.log(turn, decision, result, measured)
        return PreparedTurn(turn=turn, decision=decision, prefill=result, ledger=ledger, log_entry=entry,
                            started_at=started, reply=reply)

    async def reply(self, prepared: PreparedTurn) -> AsyncIterator[ReplyChunk]:
        """The reply's chunks; an engine that fails mid-reply hands it to another one."""
        ledger, first = prepared.ledger, prepared.prefill.first_chunk
        if first is not None:
            self._first_token_sent(prepared)
            ledger.advance(TurnState.DECODING)
            yield first
            if first.finish_reason is not None:
                self._finish(ledger, first.retained)
                return
        stream = ledger.open_stream = prepared.reply or self._continue(self._decode_request(prepared))
        # `sent`: what this stream has produced. A turn computed where it decodes already streamed `first`.
        waiting, started = prepared.reply is None, time.perf_counter()
        sent = [] if waiting or first is None else list(first.token_ids)
        for _ in range(MAX_ATTEMPTS):
            try:
                async for chunk in self._chunks(stream, "first decode chunk" if waiting else "reply stream"):
                    if waiting and chunk.token_ids:
                        prepared.log_entry["decode_first_token_ms"] = round((time.perf_counter() - started) * 1e3, 2)
                        # Read unless the reply moved to an engine that computed the prompt itself.
                        ledger.handoff_read = stream.request.handoff is not None
                        if first is None:
                            self._first_token_sent(prepared)
                        waiting = False
                    sent.extend(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        self._finish(ledger, chunk.retained)
                    yield chunk
                return
            except (StageTimeout, NoEngineAlive):
                raise
            except Exception as exc:  # noqa: BLE001 - the engine died mid-reply: continue it elsewhere
                self._unless_refused(exc, "reply", prepared.turn.request_id)
                if prepared.turn.sampling.reads_reply:  # its state (a grammar's, penalties') cannot move
                    raise
                self._failed(stream.replica_id, "reply", prepared.turn.request_id, exc)
                rest = migrated(stream.request, sent)
                if rest is None:  # it failed after the last token, before saying so
                    self._finish(ledger, None)
                    yield ReplyChunk(token_ids=(), text="", finish_reason="length")
                    return
                stream, sent = self._continue(rest), []
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

    def close(self, turn: Turn, ledger: TurnLedger, conversation: Any = None, session_key: str | None = None) -> None:
        """The one way out of a turn, from the router's `finally` (before the client sees the end of
        the reply): settle what the ledger holds, and record `conversation` (a chat turn's
        ConversationRecord) with it. The near cache learns the retained sequence at once and the
        index call leaves now, so the client's next turn finds them; a failed release or record is
        logged and counted, never the user's error."""
        ledger.advance(TurnState.ABORTED)
        if ledger.open_stream is not None:
            ledger.open_stream.close()
        settlement = settle(ledger, turn.reverse_pull)
        retained, hashes = settlement.record_retained, ()
        if retained is not None:
            hashes = self._remember(turn.cache_salt, retained)
        records = TurnRecords(turn.cache_salt, retained, hashes, ledger.prefill_replica_id,
                              tuple(ledger.hashes) if settlement.record_prefill else (), conversation, session_key,
                              tuple(r.confirm_key for r in settlement.releases if r.confirm_key is not None))
        self.spawn(self._apply(records, settlement), "settle")

    async def _apply(self, records: TurnRecords, settlement: Settlement) -> None:
        taken = (await self.ask_index("record_turn", records) or ()) if records else ()
        for release in settlement.releases:
            # A claim the index did not hand over belongs to another turn (it may be pulling it now).
            if release.confirm_key is None or release.confirm_key in taken:
                await self._release(release)

    async def _release(self, release: Release) -> None:
        sender = Role.PREFILL if release.owner == Role.DECODE else Role.DECODE
        if not self.engines.live(sender):  # nobody to send the notification: the owner's TTL frees it
            self.metrics.record_bookkeeping_failure("release.no_sender")
            return
        await self._bookkeep(self.groups[sender].release.remote(release.handoff), "release")

    # ---- planning ------------------------------------------------------------------------------------
    async def _plan(self, turn: Turn, hashes: list[bytes], ledger: TurnLedger) -> RoutingDecision:
        prefill_live, decode_live = self.engines.live(Role.PREFILL), self.engines.live(Role.DECODE)
        if not prefill_live or not decode_live:  # engines may have just started: ask before degrading
            await self.refresh_membership()
            prefill_live, decode_live = self.engines.live(Role.PREFILL), self.engines.live(Role.DECODE)
        if not prefill_live and not decode_live:
            raise NoEngineAlive("no engine is ready; retry shortly")
        policy = self.policy if turn.reverse_pull else replace(self.policy, enabled=False)
        near = self._on_decode(turn, self.own_retained.lookup(hashes), policy, decode_live)
        if near is not None and not self._latest(turn, near):
            near = None
        if near is not None and prefill_live:  # prefill's side as if it held nothing: no index call
            least_queued = min(prefill_live, key=lambda r: self.journal.queued_tokens[r])
            near = self._place(turn, replace(near, action=Action.PULL, prefill_replica_id=least_queued, tokens_local=0,
                                             pull=near.retained.handoff), near)
        if near is not None and near.action == Action.PREFILL_ON_DECODE:
            self._claim(ledger, near.retained, confirmed=False)
            return near
        answer = await self.ask_index("lookup", hashes)
        lookup = _live_only(answer or PrefixLookup(), prefill_live, decode_live)
        on_decode, decision = self._on_decode(turn, lookup, policy, decode_live), self._choose(turn, lookup, policy)
        if answer is None and decision.reason == Reason.NOTHING_RETAINED:
            decision = replace(decision, reason=Reason.INDEX_UNREACHABLE)
        if decision.action in (Action.PULL, Action.RECOMPUTE):
            decision = self._place(turn, decision, on_decode)
        elif on_decode is not None and decision.reason == Reason.NO_PREFILL_ALIVE:
            decision = on_decode
        retained = decision.retained
        if retained is None:
            return decision
        if decision.action in (Action.PULL, Action.PREFILL_ON_DECODE):
            if await self.ask_index("take", (retained.replica_id, retained.handoff.request_id)) is None:
                # Another turn took it first (a branch of the same history): this one recomputes.
                return self._choose(turn, replace(lookup, retained=None), policy)
            self._claim(ledger, retained, confirmed=True)
        elif common_prefix_len(list(turn.prompt_token_ids), list(retained.token_ids)) == len(retained.token_ids):
            self._claim(ledger, retained, confirmed=False)  # this turn supersedes it: release it at the end
        return decision

    def _latest(self, turn: Turn, near: RoutingDecision) -> bool:
        """Whether this router's own record of what decode retains holds the conversation's previous
        turn. Under several router replicas another may have served the turns since: claiming this
        one's stale sequence left the latest (in the index) held for nobody until its TTL."""
        if turn.rendering is None or not turn.rendering.shared_tokens:
            return True
        block = self.config.block_size
        return near.tokens_pullable >= (turn.rendering.shared_tokens - 1) // block * block

    def _place(self, turn: Turn, on_prefill: RoutingDecision, on_decode: RoutingDecision | None
               ) -> RoutingDecision:
        """The prefill decision or the decode one (`on_decode`: the replica retaining the
        conversation; with nothing retained, the best live decode replica), whichever is estimated
        to give the first token sooner (app/turn/placement.py)."""
        if not turn.load_aware:
            return on_decode or on_prefill
        if on_decode is None and (on_prefill.retained is not None or not turn.prefill_on_decode):
            return on_prefill
        candidates = [on_decode] if on_decode else [
            RoutingDecision(prefill_replica_id="", action=Action.PREFILL_ON_DECODE, reason=Reason.DECODE_SOONER,
                            tokens_local=0, tokens_pullable=0, threshold=self.placement.max_decode_prefill_tokens,
                            decode_replica_id=r) for r in self.engines.live(Role.DECODE)]
        ahead = self.journal.queued_later_tokens if turn.later and self.config.later_turns_first else (
            self.journal.queued_tokens)
        return place(len(turn.prompt_token_ids), on_prefill, candidates, self.engines.load,
                     ahead, self.calibrations[turn.later], self.placement, turn.sampling.reads_reply)

    def _on_decode(self, turn: Turn, lookup: PrefixLookup, policy: PullPolicy,
                   decode_live: list[str]) -> RoutingDecision | None:
        retained = lookup.retained.retained if lookup.retained else None
        if not turn.prefill_on_decode or retained is None or retained.replica_id not in decode_live:
            return None
        return decide_prefill_on_decode(list(turn.prompt_token_ids), lookup, policy, time.time())

    def _choose(self, turn: Turn, lookup: PrefixLookup, policy: PullPolicy) -> RoutingDecision:
        if not lookup.prefill_cached_tokens:
            return self._degraded(Reason.NO_PREFILL_ALIVE)
        decision = self.choosers[turn.routing_policy].choose(
            list(turn.prompt_token_ids), lookup, self.journal.queued_tokens, turn.affinity_key, time.time(),
            policy, self.journal.horizons)
        if not self.engines.live(Role.DECODE):
            return replace(decision, action=Action.RUN_ON_PREFILL, reason=Reason.NO_DECODE_ALIVE, pull=None)
        return decision

    def _degraded(self, reason: Reason, prefill_replica_id: str = "") -> RoutingDecision:
        """The whole turn on one engine: a prefill one when no decode replica is live, else a decode one."""
        action = Action.RUN_ON_PREFILL if prefill_replica_id else Action.PREFILL_ON_DECODE
        return RoutingDecision(prefill_replica_id=prefill_replica_id, action=action, reason=reason,
                               tokens_local=0, tokens_pullable=0, threshold=self.policy.threshold_tokens)

    def _claim(self, ledger: TurnLedger, retained: RetainedBlocks, confirmed: bool) -> None:
        ledger.claimed, ledger.claim_confirmed = retained, confirmed
        self.own_retained.forget_retained((retained.replica_id, retained.handoff.request_id))

    # ---- computing the prompt ------------------------------------------------------------------------
    async def _compute_prompt(self, turn: Turn, decision: RoutingDecision, ledger: TurnLedger
                              ) -> tuple[PrefillResult, ReplyStream | None, RoutingDecision]:
        for attempt in range(MAX_ATTEMPTS):
            suffix = str(attempt + 1) if attempt else ""
            try:
                if decision.action in (Action.PREFILL_ON_DECODE, Action.RUN_ON_PREFILL):
                    return *await self._start_whole_turn(turn, decision, ledger, suffix), decision
                return await self._prefill(turn, decision, ledger, suffix), None, decision
            except (StageTimeout, NoEngineAlive):
                raise
            except Exception as exc:  # noqa: BLE001 - another engine, or the other group, can take the turn
                self._unless_refused(exc, decision.action.value, turn.request_id)
                if decision.action == Action.PULL and not isinstance(exc, EngineGone):  # recompute, pulling nothing
                    self._failed("", "kv_pull", turn.request_id, exc)
                    decision = replace(decision, action=Action.RECOMPUTE, reason=Reason.PULL_FAILED, pull=None)
                    continue
                failed = decision.prefill_replica_id or (decision.retained.replica_id if decision.retained else "")
                self._failed(failed, decision.action.value, turn.request_id, exc)
                decision = self._fallback(decision)
        raise NoEngineAlive("the turn failed on every engine tried")

    def _fallback(self, failed: RoutingDecision) -> RoutingDecision:
        """After an engine failed: recompute through another prefill replica, else the whole turn on decode."""
        target = self.engines.pick(Role.PREFILL)
        if target is None:
            if not self.engines.live(Role.DECODE):
                raise NoEngineAlive("no engine is ready; retry shortly")
            return self._degraded(Reason.NO_PREFILL_ALIVE)
        if not self.engines.live(Role.DECODE):
            return self._degraded(Reason.NO_DECODE_ALIVE, target)
        reason = Reason.DECODE_FAILED if failed.action == Action.PREFILL_ON_DECODE else Reason.ENGINE_FAILED
        return replace(self._degraded(reason, target), action=Action.RECOMPUTE)

    async def _prefill(self, turn: Turn, decision: RoutingDecision, ledger: TurnLedger, suffix: str) -> PrefillResult:
        request = PrefillRequest(request_id=f"{turn.request_id}-p{suffix}",
                                 prompt_token_ids=turn.prompt_token_ids, cache_salt=turn.cache_salt,
                                 target_replica_id=decision.prefill_replica_id, pull=decision.pull,
                                 first_token=self._first_token_settings(turn), priority=turn.priority)
        load = len(turn.prompt_token_ids) - decision.tokens_local - decision.pulled_tokens
        with self.journal.queued(decision.prefill_replica_id, load, turn.later):
            gone = partial(self.engines.gone, Role.PREFILL, request.target_replica_id)
            result = await timed(unless_gone(self.groups[Role.PREFILL].prefill.remote(request), gone),
                                 self.limits.prefill_timeout_s, "prefill")
        ledger.pulled = decision.action == Action.PULL
        ledger.handoff, ledger.prefill_replica_id = result.handoff, result.replica_id
        ledger.advance(TurnState.PREFILLED)
        return result

    async def _start_whole_turn(self, turn: Turn, decision: RoutingDecision, ledger: TurnLedger, suffix: str
                                ) -> tuple[PrefillResult, ReplyStream]:
        """Start the whole turn on one engine (the decode replica retaining the conversation, or the
        engine a degraded mode names), up to its first chunk."""
        on_decode = decision.action == Action.PREFILL_ON_DECODE
        role = Role.DECODE if on_decode else Role.PREFILL
        preferred = decision.prefill_replica_id
        if on_decode:
            preferred = decision.retained.replica_id if decision.retained else decision.decode_replica_id
        target = self.engines.pick(role, preferred)
        if target is None:
            raise RuntimeError(f"no live {role.value} replica")
        request = DecodeRequest(request_id=f"{turn.request_id}-{role.value[0]}{suffix}",
                                prompt_token_ids=turn.prompt_token_ids, cache_salt=turn.cache_salt,
                                sampling=turn.sampling, handoff=None, target_replica_id=target, retain=on_decode,
                                priority=turn.priority, tenant=turn.tenant, tool_pause_s=turn.tool_pause_s)
        stream = ledger.open_stream = self._stream(role, request)
        with self.journal.queued(target, len(turn.prompt_token_ids) - decision.tokens_local, turn.later):
            try:
                first = await stream.next(self.limits.first_chunk_timeout_s, "first chunk")
            except BaseException:
                stream.close()
                raise
        ledger.advance(TurnState.DECODING)
        result = PrefillResult(replica_id=target, handoff=None, num_prompt_tokens=len(turn.prompt_token_ids),
                               num_cached_tokens=first.num_cached_tokens or 0, first_chunk=first,
                               engine_timing=first.engine_timing)
        return result, stream

    # ---- decoding ------------------------------------------------------------------------------------
    def _decode_request(self, prepared: PreparedTurn) -> DecodeRequest:
        turn, first, retained = prepared.turn, prepared.prefill.first_chunk, prepared.decision.retained
        prompt, sampling = turn.prompt_token_ids, turn.sampling
        if first is not None:  # decode continues after the token prefill sent
            prompt, sampling = prompt + first.token_ids, sampling.after(1)
        return DecodeRequest(request_id=f"{turn.request_id}-d", prompt_token_ids=prompt, cache_salt=turn.cache_salt,
                             sampling=sampling, handoff=prepared.prefill.handoff,
                             target_replica_id=retained.replica_id if retained else "", priority=CONTINUATION_PRIORITY,
                             tenant=turn.tenant, tool_pause_s=turn.tool_pause_s)

    def _continue(self, request: DecodeRequest) -> ReplyStream:
        """Stream `request` on a live decode replica (its preferred one if live), else compute it
        whole on a prefill replica."""
        if target := self.engines.pick(Role.DECODE, request.target_replica_id):
            return self._stream(Role.DECODE, replace(request, target_replica_id=target))
        if target := self.engines.pick(Role.PREFILL):
            return self._stream(Role.PREFILL, replace(request, target_replica_id=target, handoff=None,
                                                           retain=False))
        raise NoEngineAlive("no engine is ready; retry shortly")

    def _stream(self, role: Role, request: DecodeRequest) -> ReplyStream:
        return ReplyStream(self.groups[role], self.engines.streams, role, request,
                           gone=partial(self.engines.gone, role, request.target_replica_id))

    @staticmethod
    def _unless_refused(exc: BaseException, stage: str, request_id: str) -> None:
        """Raise the client's error if the engine refused the request itself (app/turn/reply.py refusal):
        no engine is suspected and none is tried next."""
        if (refused := refusal(exc)) is not None:
            logger.warning(json.dumps({"event": "engine_refused_request", "stage": stage, "request_id": request_id,
                                       "error": f"{type(exc).__name__}: {exc}"[:500]}))
            raise refused from None

    def _failed(self, replica_id: str, stage: str, request_id: str, exc: BaseException) -> None:
        self.engines.suspect(replica_id)
        self.metrics.record_engine_failure(stage)
        logger.warning(json.dumps({"event": "engine_call_failed", "stage": stage, "replica": replica_id,
                                   "request_id": request_id, "error": f"{type(exc).__name__}: {exc}"[:500]}))

    def _finish(self, ledger: TurnLedger, retained: RetainedBlocks | None) -> None:
        ledger.retained = retained
        ledger.advance(TurnState.RECORDED)

    def _first_token_sent(self, prepared: PreparedTurn) -> None:
        elapsed = time.perf_counter() - prepared.started_at
        prepared.log_entry["ttft_ms"] = round(elapsed * 1e3, 2)
        self.metrics.record_ttft(prepared.turn.turn_index, elapsed)

    def _first_token_settings(self, turn: Turn) -> SamplingSettings | None:
        """Prefill samples the first token unless stop strings, or sampling that reads the reply
        (a grammar, penalties, bad words), must see the whole reply in one engine (decode would
        start them afresh after the first token, which it reads as prompt)."""
        settings = turn.sampling
        if not self.config.first_token_from_prefill or settings.stop or settings.reads_reply:
            return None
        return settings

    def _remember(self, salt: str, retained: RetainedBlocks) -> tuple[bytes, ...]:
        """Put `retained` in the near cache; its block hashes."""
        now = time.time()
        if now - self._own_expired_at > OWN_RETAINED_EXPIRY_S:  # lookups skip expired ones meanwhile
            self.own_retained.expire(now)
            self._own_expired_at = now
        hashes = self.own_retained.retained_hashes(salt, retained)
        self.own_retained.record_retained(salt, retained, hashes)
        return tuple(hashes)


def _live_only(lookup: PrefixLookup, prefill_live: list[str], decode_live: list[str]) -> PrefixLookup:
    """The lookup restricted to live engines (every live prefill replica is a candidate)."""
    cached = {r: lookup.prefill_cached_tokens.get(r, 0) for r in prefill_live}
    retained = lookup.retained if lookup.retained and lookup.retained.retained.replica_id in decode_live else None
    return PrefixLookup(prefill_cached_tokens=cached, retained=retained)
