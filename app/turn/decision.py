"""Pull or recompute: the router's per-turn choice, from the index's lookup to a RoutingDecision.

Pull only full blocks inside the longest common prefix of the new prompt and the retained
sequence (compared token by token, never one block past it), and never blocks that expire
before the pull can finish. Everything else is recomputed by prefill. Blocks the index believes
prefill holds count against a pull only on a replica whose pool keeps blocks long enough (its
eviction horizon): elsewhere they may be gone by the time the turn runs.

A short append skips prefill altogether (conditional disaggregation): when the decode replica
that retains the conversation holds all but a few of the prompt's tokens, it computes those few
itself, from its own prefix cache, and no KV moves.
"""

from dataclasses import dataclass, replace

from app.kv.hashing import common_prefix_len
from app.protocol import Action, PrefixLookup, Reason, RoutingDecision


@dataclass(frozen=True)
class PullPolicy:
    block_size: int
    threshold_tokens: int
    expiry_margin_s: float
    enabled: bool = True
    min_local_horizon_s: float = 0.0
    """Below this eviction horizon a replica's cached blocks don't make a pull unnecessary."""
    max_decode_prefill_tokens: int = 0
    """Prefill on decode when at most this many prompt tokens are new to it (0: never)."""
    max_recomputed_history: float = 1.0
    """Pull below the threshold when recomputing would compute more than this share of the retained history."""

    @property
    def min_pull_tokens(self) -> int:
        return max(self.threshold_tokens, 1)

    def pull_saves(self, pullable: int, local: int) -> bool:
        missing = pullable - local
        return missing >= self.min_pull_tokens or missing > self.max_recomputed_history * pullable


def pullable_tokens(prompt_ids: list[int], retained_ids: tuple[int, ...], block_size: int) -> int:
    """Full blocks of the common prefix, leaving at least one prompt token for prefill to compute."""
    shared = min(common_prefix_len(prompt_ids, list(retained_ids)), len(prompt_ids) - 1)
    return max(shared, 0) // block_size * block_size


def decide_prefill_on_decode(prompt_ids: list[int], lookup: PrefixLookup, policy: PullPolicy,
                             now: float) -> RoutingDecision | None:
    """The decision to run the whole turn on the retaining decode replica, if the append is short."""
    if not policy.enabled or lookup.retained is None:
        return None
    retained = lookup.retained.retained
    held = pullable_tokens(prompt_ids, retained.token_ids, policy.block_size)
    expires_in_s = retained.handoff.expiry_time - now
    if held == 0 or len(prompt_ids) - held > policy.max_decode_prefill_tokens or expires_in_s < policy.expiry_margin_s:
        return None
    return RoutingDecision(prefill_replica_id="", action=Action.PREFILL_ON_DECODE, reason=Reason.SHORT_APPEND,
                           tokens_local=held, tokens_pullable=held, threshold=policy.max_decode_prefill_tokens,
                           expires_in_s=round(expires_in_s, 3), retained=retained)


def decide(prompt_ids: list[int], lookup: PrefixLookup, prefill_replica_id: str,
           policy: PullPolicy, now: float, horizon_s: float | None = None) -> RoutingDecision:
    """`horizon_s`: the replica's eviction horizon estimate (None: nothing is being evicted)."""
    local = min(lookup.prefill_cached_tokens.get(prefill_replica_id, 0), len(prompt_ids) - 1)
    local = max(local, 0) // policy.block_size * policy.block_size
    base = RoutingDecision(prefill_replica_id=prefill_replica_id, action=Action.RECOMPUTE,
                           reason=Reason.NOTHING_RETAINED, tokens_local=local, tokens_pullable=0,
                           threshold=policy.threshold_tokens)
    if lookup.retained is None:
        return base
    retained = lookup.retained.retained
    pullable = pullable_tokens(prompt_ids, retained.token_ids, policy.block_size)
    expires_in_s = retained.handoff.expiry_time - now
    base = replace(base, tokens_pullable=pullable, expires_in_s=round(expires_in_s, 3), retained=retained)
    if not policy.enabled:
        return replace(base, reason=Reason.PULL_DISABLED)
    saves = policy.pull_saves(pullable, local)
    # vLLM's prefill reads only the blocks it lacks when the turn runs, so pulling past blocks that
    # survive costs little, while trusting blocks that were evicted costs a full recompute.
    at_risk = horizon_s is not None and horizon_s < policy.min_local_horizon_s and pullable >= policy.min_pull_tokens
    if not (saves or at_risk):
        return replace(base, reason=Reason.BELOW_THRESHOLD)
    if expires_in_s < policy.expiry_margin_s:
        return replace(base, reason=Reason.EXPIRES_TOO_SOON)
    return replace(base, action=Action.PULL, reason=Reason.PULL_SAVES_TOKENS if saves else Reason.LOCAL_AT_RISK,
                   pull=retained.handoff.prefix(pullable, policy.block_size))
