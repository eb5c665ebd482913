"""The turn loop: rendered prompt in, KV located, prefill run (pull or recompute), decode streamed,
and what decode retained recorded for the next turn.

    plan:    hashes ──▶ kv_index.lookup ──▶ decide() ──▶ RoutingDecision
    prefill: PrefillRequest(pull?) ──▶ prefill replica ──▶ PrefillResult   (pull failed: recompute)
             its first token goes to the client at once
    decode:  DecodeRequest(prompt + first token, handoff) ──▶ decode replica ──▶ ReplyChunk…
             ──▶ kv_index.record_*
    A short append to a conversation a decode replica retains skips prefill: DecodeRequest(prompt,
    no handoff) goes to that replica, which computes the new tokens from its prefix cache.
"""

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from app.config import AppConfig
from app.conversations import RenderDiagnostics
from app.decision import PullPolicy, decide_prefill_on_decode
from app.hashing import block_hashes
from app.horizon import EvictionHorizon
from app.kv_index import KVIndex
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
    RoutingDecision,
    SamplingSettings,
)
from app.routing import CostWeights, PrefillChooser, RoutingPolicy

logger = logging.getLogger("ray.serve")
OWN_RETAINED_EXPIRY_S = 5.0
"""How often the router drops expired entries from its own record of retained sequences."""


@dataclass(frozen=True)
class Turn:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str
    sampling: SamplingSettings
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


@dataclass(frozen=True)
class PreparedTurn:
    """A turn whose prompt KV sits in a prefill replica, ready for decode."""

    turn: Turn
    decision: RoutingDecision
    prefill: PrefillResult
    hashes: list[bytes]
    log_entry: dict[str, Any]
    """This turn's decision-log entry; decode adds its first-token latency to it."""
    started_at: float
    reply: AsyncIterator[ReplyChunk] | None = None
    """The rest of the reply, already streaming, when decode computed the prompt itself."""

    @property
    def cached_tokens(self) -> int:
        return self.prefill.num_cached_tokens


class TurnLoop:
    def __init__(self, config: AppConfig, index: Any, prefill: Any, decode: Any, metrics: TurnMetrics,
                 decision_log_size: int = 1000) -> None:
        self.config = config
        self.index, self.prefill_group, self.decode_group = index, prefill, decode
        self.metrics = metrics
        self.policy = PullPolicy(block_size=config.block_size, threshold_tokens=config.recompute_threshold_tokens,
                                 expiry_margin_s=config.expiry_margin_s, enabled=config.reverse_pull,
                                 min_local_horizon_s=config.min_local_horizon_s,
                                 max_decode_prefill_tokens=config.max_decode_prefill_tokens)
        weights = CostWeights(config.cost_per_token, config.load_weight, config.transfer_cost_per_token)
        self.choosers = {p: PrefillChooser(p, self.policy, weights) for p in RoutingPolicy}
        self.decisions: deque[dict[str, Any]] = deque(maxlen=decision_log_size)
        self.horizon = EvictionHorizon()
        self.horizons: dict[str, float] = {}
        """Each prefill replica's latest eviction horizon estimate."""
        self.queued_tokens: Counter[str] = Counter()
        """Prefill tokens this router has sent to each replica and not seen finish: its load."""
        self.own_retained = KVIndex(config.block_size, hash_seed=config.prefix_hash_seed)
        """The retained sequences this router recorded in the index, as a near cache: a short append
        to one of them goes to decode without an index call. Stale entries cost speed, never
        correctness: decode's prefix cache checks every block by hash."""
        self._own_expired_at = 0.0

    async def prepare(self, turn: Turn) -> PreparedTurn:
        hashes = block_hashes(list(turn.prompt_token_ids), self.config.block_size, turn.cache_salt,
                              self.config.prefix_hash_seed)
        started = time.perf_counter()
        decision = await self._plan(turn, hashes)
        planned = time.perf_counter()
        result, reply, decision = await self._compute_prompt(turn, decision, hashes)
        on_prefill = result.handoff is not None
        measured = {"plan_ms": round((planned - started) * 1e3, 2),
                    "prefill_ms": round((time.perf_counter() - planned) * 1e3, 2),
                    "eviction_horizon_s": self._observe_load(result, time.time()) if on_prefill else None,
                    "first_token_from": "prefill" if on_prefill and result.first_chunk else "decode"}
        entry = self._log(turn, decision, result, measured)
        return PreparedTurn(turn=turn, decision=decision, prefill=result, hashes=hashes, log_entry=entry,
                            started_at=started, reply=reply)

    async def decode(self, prepared: PreparedTurn) -> AsyncIterator[ReplyChunk]:
        first = prepared.prefill.first_chunk
        if first is not None:
            self._first_token_sent(prepared)
            yield first
            if first.finish_reason is not None:
                await self._record(prepared, first.retained)
                return
        reply = prepared.reply or self.decode_group.options(stream=True).decode.remote(self._decode_request(prepared))
        started, waiting = time.perf_counter(), prepared.reply is None
        async for chunk in reply:
            if waiting and chunk.token_ids:
                prepared.log_entry["decode_first_token_ms"] = round((time.perf_counter() - started) * 1e3, 2)
                if first is None:
                    self._first_token_sent(prepared)
                waiting = False
            if chunk.retained is not None:
                await self._record(prepared, chunk.retained)
            yield chunk

    def _decode_request(self, prepared: PreparedTurn) -> DecodeRequest:
        turn, first = prepared.turn, prepared.prefill.first_chunk
        prompt, sampling = turn.prompt_token_ids, turn.sampling
        if first is not None:  # decode continues after the token prefill sent
            prompt, sampling = prompt + first.token_ids, replace(sampling, max_tokens=sampling.max_tokens - 1)
        return DecodeRequest(request_id=f"{turn.request_id}-d", prompt_token_ids=prompt,
                             cache_salt=turn.cache_salt, sampling=sampling, handoff=prepared.prefill.handoff,
                             target_replica_id=prepared.decision.retained.replica_id
                             if prepared.decision.retained else "")

    def _first_token_sent(self, prepared: PreparedTurn) -> None:
        elapsed = time.perf_counter() - prepared.started_at
        prepared.log_entry["ttft_ms"] = round(elapsed * 1e3, 2)
        self.metrics.record_ttft(prepared.turn.turn_index, elapsed)

    def _first_token_settings(self, turn: Turn) -> SamplingSettings | None:
        """Prefill samples the first token unless stop strings or a grammar must see the whole
        reply in one engine (decode would start them afresh after the first token)."""
        settings = turn.sampling
        if not self.config.first_token_from_prefill or settings.stop or settings.regex:
            return None
        return settings

    async def _plan(self, turn: Turn, hashes: list[bytes]) -> RoutingDecision:
        policy = self.policy if turn.reverse_pull else replace(self.policy, enabled=False)
        if on_decode := self._prefill_on_decode_decision(turn, self.own_retained.lookup(hashes), policy):
            return on_decode
        lookup = await self.index.lookup.remote(hashes)
        if on_decode := self._prefill_on_decode_decision(turn, lookup, policy):
            return on_decode
        return self.choosers[turn.routing_policy].choose(list(turn.prompt_token_ids), lookup, self.queued_tokens,
                                                         turn.affinity_key, time.time(), policy, self.horizons)

    @staticmethod
    def _prefill_on_decode_decision(turn: Turn, lookup: PrefixLookup, policy: PullPolicy) -> RoutingDecision | None:
        if not turn.prefill_on_decode:
            return None
        return decide_prefill_on_decode(list(turn.prompt_token_ids), lookup, policy, time.time())

    async def _compute_prompt(self, turn: Turn, decision: RoutingDecision, hashes: list[bytes]
                              ) -> tuple[PrefillResult, AsyncIterator[ReplyChunk] | None, RoutingDecision]:
        """The prompt's KV, on the retaining decode replica (whose reply is then streaming) or on prefill."""
        if decision.action == Action.PREFILL_ON_DECODE:
            if started := await self._prefill_on_decode(turn, decision):
                return *started, decision
            # Recompute through prefill, and pull nothing from that replica.
            decision = replace(await self._plan(replace(turn, reverse_pull=False), hashes), reason=Reason.DECODE_FAILED)
        result, decision = await self._prefill(turn, decision)
        return result, None, decision

    async def _prefill_on_decode(self, turn: Turn, decision: RoutingDecision
                                 ) -> tuple[PrefillResult, AsyncIterator[ReplyChunk]] | None:
        """Start the whole turn on the decode replica that retains the conversation, up to its
        first chunk; None if that failed."""
        retained = decision.retained
        self._forget(retained)
        request = DecodeRequest(request_id=f"{turn.request_id}-d", prompt_token_ids=turn.prompt_token_ids,
                                cache_salt=turn.cache_salt, sampling=turn.sampling, handoff=None,
                                target_replica_id=retained.replica_id)
        reply = self.decode_group.options(stream=True).decode.remote(request)
        try:
            first = await reply.__anext__()
        except Exception as exc:  # noqa: BLE001 - the turn can still run through prefill
            logger.warning(json.dumps({"event": "prefill_on_decode_failed", "request_id": turn.request_id,
                                       "error": f"{type(exc).__name__}: {exc}"[:500]}))
            return None
        result = PrefillResult(replica_id=retained.replica_id, handoff=None,
                               num_prompt_tokens=len(turn.prompt_token_ids),
                               num_cached_tokens=first.num_cached_tokens or 0, first_chunk=first)
        return result, reply

    async def _prefill(self, turn: Turn, decision: RoutingDecision) -> tuple[PrefillResult, RoutingDecision]:
        request = PrefillRequest(request_id=f"{turn.request_id}-p", prompt_token_ids=turn.prompt_token_ids,
                                 cache_salt=turn.cache_salt, target_replica_id=decision.prefill_replica_id,
                                 pull=decision.pull, first_token=self._first_token_settings(turn))
        if decision.retained is not None and decision.action == Action.PULL:
            self._forget(decision.retained)
        load = len(turn.prompt_token_ids) - decision.tokens_local
        self.queued_tokens[decision.prefill_replica_id] += load
        try:
            return await self.prefill_group.prefill.remote(request), decision
        except Exception as exc:  # noqa: BLE001 - any failed pull falls back to recomputing
            if decision.action != Action.PULL:
                raise
            logger.warning(json.dumps({"event": "kv_pull_failed", "request_id": turn.request_id,
                                       "error": f"{type(exc).__name__}: {exc}"[:500]}))
            fallback = replace(decision, action=Action.RECOMPUTE, reason=Reason.PULL_FAILED, pull=None)
            retry = replace(request, request_id=f"{turn.request_id}-p2", pull=None)
            return await self.prefill_group.prefill.remote(retry), fallback
        finally:
            self.queued_tokens[decision.prefill_replica_id] -= load

    async def _record(self, prepared: PreparedTurn, retained: RetainedBlocks | None) -> None:
        """Prefill's hashes to the index, with what decode retained for the next turn's pull; blocks
        nobody will read are freed now, not at TTL. `retained` None after prefill: the turn ended
        with prefill's token, so decode never reads the blocks prefill kept for it."""
        handoff = prepared.prefill.handoff
        if handoff is None:  # prefilled on decode: the new sequence supersedes the one it extended
            calls = [self.prefill_group.release.remote(prepared.decision.retained.handoff)]
        else:
            calls = [self.index.record_prefill.remote(prepared.prefill.replica_id, prepared.hashes)]
        if retained is None:
            calls += [self.decode_group.release.remote(handoff)] if handoff is not None else []
        elif prepared.turn.reverse_pull:
            self._remember(prepared.turn.cache_salt, retained)
            calls.append(self.index.record_retained.remote(prepared.turn.cache_salt, retained))
        else:  # without reverse pulls nothing will read decode's blocks
            calls.append(self.prefill_group.release.remote(retained.handoff))
        await asyncio.gather(*calls)

    def _remember(self, salt: str, retained: RetainedBlocks) -> None:
        now = time.time()
        if now - self._own_expired_at > OWN_RETAINED_EXPIRY_S:  # lookups skip expired ones meanwhile
            self.own_retained.expire(now)
            self._own_expired_at = now
        self.own_retained.record_retained(salt, retained)

    def _forget(self, retained: RetainedBlocks) -> None:
        """A retained sequence serves one turn: a pull frees its blocks, a turn on decode extends it.
        Not awaited: the index applies it in order, and this turn need not wait."""
        key = (retained.replica_id, retained.handoff.request_id)
        self.own_retained.forget_retained(key)
        self.index.forget_retained.remote(key)

    def _log(self, turn: Turn, decision: RoutingDecision, result: PrefillResult,
             measured: dict[str, float | None]) -> dict[str, Any]:
        pulled = decision.pulled_tokens
        entry = {"event": "kv_decision", "request_id": turn.request_id, "time": time.time(),
                 "prompt_tokens": len(turn.prompt_token_ids), "cached_tokens": result.num_cached_tokens,
                 "pulled_tokens": pulled, "prefill_replica": result.replica_id,
                 # Not asdict: it would deep-copy the retained sequence's token ids on the hot path.
                 **{f.name: getattr(decision, f.name) for f in dataclasses.fields(decision)
                    if f.name not in ("pull", "retained")},
                 "action": decision.action.value, "reason": decision.reason.value,
                 "pull_source": decision.pull.source.engine_id if decision.pull else None,
                 "policy": turn.routing_policy.value, **measured,
                 "rendering": _rendering_log(turn.rendering)}
        self.metrics.record_turn(decision, len(turn.prompt_token_ids), result.num_cached_tokens, pulled)
        if turn.rendering is not None:
            self.metrics.record_rendering(turn.rendering)
        if turn.rendering is not None and turn.rendering.previous_tokens:
            reusable_tokens = turn.rendering.reusable_blocks * self.config.block_size
            entry["later_turn_hit"] = result.num_cached_tokens >= reusable_tokens
            entry["same_replica"] = result.replica_id == turn.previous_replica
            self.metrics.record_later_turn(turn.routing_policy.value, entry["later_turn_hit"], entry["same_replica"])
        self.decisions.append(entry)
        logger.info(json.dumps(entry))
        return entry

    def _observe_load(self, result: PrefillResult, now: float) -> float | None:
        replica = result.replica_id
        self.horizon.observe(replica, result.num_prompt_tokens - result.num_cached_tokens, now)
        estimate = self.horizon.estimate_s(replica, result.pool_tokens, self.queued_tokens[replica], now)
        if estimate is None:  # nothing computed lately: nothing is being evicted
            self.horizons.pop(replica, None)
        else:
            self.horizons[replica] = estimate
            self.metrics.record_horizon(replica, estimate)
        return estimate


def _rendering_log(rendering: RenderDiagnostics | None) -> dict[str, Any] | None:
    if rendering is None:
        return None
    return {**dataclasses.asdict(rendering), "mode": rendering.mode.value, "cause": rendering.cause.value}
