"""What to compute where, for one turn: pull, recompute, or run on the decode replica that retains the
conversation, and on which engines. Pure: it reads the router's live view and loads and calls nothing;
the turn (app/turn/turn.py) makes the index calls around it and claims what it decides to read.

    near cache (the router's own record of retained sequences) ──near()──▶ a short append on decode?
    index lookup ──decide()──▶ RoutingDecision (pull / recompute on a prefill replica, or on decode)
    an engine failed ──fallback()──▶ another prefill replica, else the whole turn on decode
"""

import time
from dataclasses import replace

from app.config import AppConfig
from app.protocol import Action, PrefixLookup, Reason, RetainedBlocks, Role, RoutingDecision
from app.turn.decision import PullPolicy, decide_prefill_on_decode
from app.turn.journal import TurnJournal
from app.turn.membership import LiveEngines
from app.turn.placement import Calibration, PlacementPolicy, place
from app.turn.reply import NoEngineAlive
from app.turn.routing import CostWeights, PrefillChooser, RoutingPolicy
from app.turn.spec import Turn


class Planner:
    def __init__(self, config: AppConfig, engines: LiveEngines, journal: TurnJournal) -> None:
        self.config, self.engines, self.journal = config, engines, journal
        self.policy = PullPolicy(block_size=config.block_size, threshold_tokens=config.recompute_threshold_tokens,
                                 max_recomputed_history=config.max_recomputed_history,
                                 expiry_margin_s=config.expiry_margin_s, enabled=config.reverse_pull,
                                 min_local_horizon_s=config.min_local_horizon_s,
                                 max_decode_prefill_tokens=config.max_decode_prefill_tokens)
        self.policies = {True: self.policy, False: replace(self.policy, enabled=False)}
        """By whether the turn allows reverse pulls."""
        self.placement = PlacementPolicy(config.placement.itl_weight,
                                         config.placement.kv_high_watermark, config.max_decode_prefill_tokens,
                                         config.placement.prior_pull_share)
        self.calibrations = {later: Calibration(config.placement.calibration_ttl_s) for later in (False, True)}
        """First turns and later turns fit apart: a burst of first turns, long on decode, would otherwise
        make decode's fit predict nothing for the short appends after it."""
        weights = CostWeights(config.cost_per_token, config.load_weight, config.transfer_cost_per_token)
        self.choosers = {p: PrefillChooser(p, self.policy, weights) for p in RoutingPolicy}

    def live(self) -> tuple[list[str], list[str]]:
        """The live prefill and decode replicas; NoEngineAlive when neither group has one."""
        prefill_live, decode_live = self.engines.live(Role.PREFILL), self.engines.live(Role.DECODE)
        if not prefill_live and not decode_live:
            raise NoEngineAlive("no engine is ready; retry shortly")
        return prefill_live, decode_live

    def near(self, turn: Turn, lookup: PrefixLookup, live: tuple[list[str], list[str]]) -> RoutingDecision | None:
        """The decision from the router's near cache alone, when it holds the conversation's latest turn."""
        prefill_live, decode_live = live
        near = self._on_decode(turn, lookup, decode_live)
        if near is None or not self._latest(turn, near):
            return None
        if prefill_live:  # prefill's side as if it held nothing: no index call
            least_queued = min(prefill_live, key=lambda r: self.journal.queued_tokens[r])
            near = self._place(turn, replace(near, action=Action.PULL, prefill_replica_id=least_queued,
                                             tokens_local=0, pull=near.retained.handoff), near)
        return near

    def decide(self, turn: Turn, answer: PrefixLookup | None, live: tuple[list[str], list[str]]) -> RoutingDecision:
        """The decision from the index's answer (None: the index did not answer)."""
        lookup = _live_only(answer or PrefixLookup(), *live)
        on_decode, decision = self._on_decode(turn, lookup, live[1]), self.choose(turn, lookup)
        if answer is None and decision.reason == Reason.NOTHING_RETAINED:
            decision = replace(decision, reason=Reason.INDEX_UNREACHABLE)
        if decision.action in (Action.PULL, Action.RECOMPUTE):
            return self._place(turn, decision, on_decode)
        if on_decode is not None and decision.reason == Reason.NO_PREFILL_ALIVE:
            return on_decode
        return decision

    def choose(self, turn: Turn, lookup: PrefixLookup) -> RoutingDecision:
        """A prefill replica by the turn's routing policy (`lookup` restricted to live engines)."""
        if not lookup.prefill_cached_tokens:
            return self.degraded(Reason.NO_PREFILL_ALIVE)
        decision = self.choosers[turn.routing_policy].choose(
            list(turn.prompt_token_ids), lookup, self.journal.queued_tokens, turn.affinity_key, time.time(),
            self._policy(turn), self.journal.horizons)
        if not self.engines.live(Role.DECODE):
            return replace(decision, action=Action.RUN_ON_PREFILL, reason=Reason.NO_DECODE_ALIVE, pull=None)
        return decision

    def without(self, turn: Turn, answer: PrefixLookup | None, live: tuple[list[str], list[str]]) -> RoutingDecision:
        """The decision once another turn took the retained sequence first (a branch of the same history)."""
        return self.choose(turn, replace(_live_only(answer or PrefixLookup(), *live), retained=None))

    @staticmethod
    def supersedes(turn: Turn, retained: RetainedBlocks) -> bool:
        """The turn's prompt extends the whole retained sequence: nobody else will read it."""
        return tuple(turn.prompt_token_ids[:len(retained.token_ids)]) == tuple(retained.token_ids)

    def extended(self, turn: Turn, own: PrefixLookup) -> RetainedBlocks | None:
        """The sequence in the router's near cache that the turn supersedes: the turn may take it
        with its index lookup, whatever it decides (pulled, read on decode, or released at the end)."""
        retained = own.retained.retained if own.retained else None
        return retained if retained is not None and self.supersedes(turn, retained) else None

    def fallback(self, failed: RoutingDecision) -> RoutingDecision:
        """After an engine failed: recompute through another prefill replica, else the whole turn on decode."""
        target = self.engines.pick(Role.PREFILL)
        if target is None:
            if not self.engines.live(Role.DECODE):
                raise NoEngineAlive("no engine is ready; retry shortly")
            return self.degraded(Reason.NO_PREFILL_ALIVE)
        if not self.engines.live(Role.DECODE):
            return self.degraded(Reason.NO_DECODE_ALIVE, target)
        reason = Reason.DECODE_FAILED if failed.action == Action.PREFILL_ON_DECODE else Reason.ENGINE_FAILED
        return replace(self.degraded(reason, target), action=Action.RECOMPUTE)

    def degraded(self, reason: Reason, prefill_replica_id: str = "") -> RoutingDecision:
        """The whole turn on one engine: a prefill one when no decode replica is live, else a decode one."""
        action = Action.RUN_ON_PREFILL if prefill_replica_id else Action.PREFILL_ON_DECODE
        return RoutingDecision(prefill_replica_id=prefill_replica_id, action=action, reason=reason,
                               tokens_local=0, tokens_pullable=0, threshold=self.policy.threshold_tokens)

    def observe(self, turn: Turn, decision: RoutingDecision, fallback: bool, first_token_ms: float) -> None:
        """Fit the placement estimate to the measured time from plan to the turn's first token (not
        after a fallback: its time says nothing about the estimate)."""
        if decision.placement is not None and not fallback:
            self.calibrations[turn.later].observe(decision.placement, decision.action == Action.PREFILL_ON_DECODE,
                                                  first_token_ms)

    def _policy(self, turn: Turn) -> PullPolicy:
        return self.policies[turn.reverse_pull]

    def _latest(self, turn: Turn, near: RoutingDecision) -> bool:
        """Whether the near cache holds the conversation's previous turn. Under several router
        replicas another may have served the turns since: claiming this one's stale sequence left
        the latest (in the index) held for nobody until its TTL."""
        if turn.rendering is None or not turn.rendering.shared_tokens:
            return True
        block = self.config.block_size
        return near.tokens_pullable >= (turn.rendering.shared_tokens - 1) // block * block

    def _place(self, turn: Turn, on_prefill: RoutingDecision, on_decode: RoutingDecision | None) -> RoutingDecision:
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
                     ahead, self.calibrations[turn.later], self.placement,
                     not turn.prefill_samples_first_token(self.config.first_token_from_prefill))

    def _on_decode(self, turn: Turn, lookup: PrefixLookup, decode_live: list[str]) -> RoutingDecision | None:
        retained = lookup.retained.retained if lookup.retained else None
        if not turn.prefill_on_decode or retained is None or retained.replica_id not in decode_live:
            return None
        return decide_prefill_on_decode(list(turn.prompt_token_ids), lookup, self._policy(turn), time.time())


def _live_only(lookup: PrefixLookup, prefill_live: list[str], decode_live: list[str]) -> PrefixLookup:
    """The lookup restricted to live engines (every live prefill replica is a candidate)."""
    cached = {r: lookup.prefill_cached_tokens.get(r, 0) for r in prefill_live}
    retained = lookup.retained if lookup.retained and lookup.retained.retained.replica_id in decode_live else None
    return PrefixLookup(prefill_cached_tokens=cached, retained=retained)
