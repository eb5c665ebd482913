"""The turn loop's decision log and load estimates: each planned turn ──▶ a log entry (the
`/admin/decisions` ring, the structured log line, Serve metrics), written once the turn's first
token is out, and each prefill ──▶ its replica's eviction horizon."""

import dataclasses
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from app.conversations.records import RenderDiagnostics
from app.kv.horizon import EvictionHorizon
from app.metrics import TurnMetrics
from app.protocol import PrefillResult, RoutingDecision

logger = logging.getLogger("ray.serve")


class TurnJournal:
    def __init__(self, block_size: int, metrics: TurnMetrics, size: int = 1000, replica_id: str = "") -> None:
        self.block_size, self.metrics, self.replica_id = block_size, metrics, replica_id
        self.decisions: deque[dict[str, Any]] = deque(maxlen=size)
        self.horizon = EvictionHorizon()
        self.horizons: dict[str, float] = {}
        """Each prefill replica's latest eviction horizon estimate."""
        self.queued_tokens: Counter[str] = Counter()
        """Prompt tokens this router has sent each replica to compute (not to pull), not yet finished: its load."""
        self.queued_later_tokens: Counter[str] = Counter()
        """The later turns' part of it: with later turns first, all an engine runs before a later turn."""

    @contextmanager
    def queued(self, replica_id: str, tokens: int, later: bool) -> Iterator[None]:
        """Counts `tokens` as queued on the replica while the block runs."""
        counters = (self.queued_tokens, self.queued_later_tokens) if later else (self.queued_tokens,)
        for counter in counters:
            counter[replica_id] += tokens
        try:
            yield
        finally:
            for counter in counters:
                counter[replica_id] -= tokens

    def entry(self, turn, decision: RoutingDecision, result: PrefillResult, measured: dict[str, Any]) -> dict[str, Any]:
        """The turn's decision-log entry, written by record() once its first token is out."""
        pulled = decision.pulled_tokens
        entry = {"event": "kv_decision", "request_id": turn.request_id, "time": time.time(),
                 "prompt_tokens": len(turn.prompt_token_ids), "cached_tokens": result.num_cached_tokens,
                 "pulled_tokens": pulled, "prefill_replica": result.replica_id,
                 # Not asdict: it would deep-copy the retained sequence's token ids on the hot path.
                 **{f.name: getattr(decision, f.name) for f in dataclasses.fields(decision)
                    if f.name not in ("pull", "retained", "placement")},
                 "placement": dataclasses.asdict(decision.placement) if decision.placement else None,
                 "action": decision.action.value, "reason": decision.reason.value,
                 "pull_source": decision.pull.source.engine_id if decision.pull else None,
                 "policy": turn.routing_policy.value, "router_replica": self.replica_id, **measured,
                 "rendering": _rendering_log(turn.rendering)}
        if turn.rendering is not None and turn.rendering.previous_tokens:
            reusable_tokens = turn.rendering.reusable_blocks * self.block_size
            entry["later_turn_hit"] = result.num_cached_tokens >= reusable_tokens
            entry["same_replica"] = result.replica_id == turn.previous_replica
        return entry

    def record(self, turn, decision: RoutingDecision, entry: dict[str, Any]) -> None:
        """The entry into the `/admin/decisions` ring, the structured log and Serve's metrics."""
        self.metrics.record_turn(decision, entry["prompt_tokens"], entry["cached_tokens"], entry["pulled_tokens"])
        if turn.rendering is not None:
            self.metrics.record_rendering(turn.rendering)
        if "later_turn_hit" in entry:
            self.metrics.record_later_turn(turn.routing_policy.value, entry["later_turn_hit"], entry["same_replica"])
        self.decisions.append(entry)
        logger.info(json.dumps(entry))

    def observe_load(self, result: PrefillResult, now: float) -> float | None:
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
