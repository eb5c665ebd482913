"""Which prefill replica runs a turn: four policies over the index's lookup and the router's loads.

| policy           | picks                                                          | needs          |
|------------------|----------------------------------------------------------------|----------------|
| kv_aware         | least cost: tokens still to compute x cost_per_token           | index, loads   |
|                  |   + queued prefill tokens x load_weight + pulled x transfer    |                |
| session_affinity | the conversation's replica on a consistent-hash ring           | affinity key   |
| round_robin      | the next replica in turn                                       | -              |
| least_loaded     | fewest queued prefill tokens                                   | loads          |
Every policy is followed by the same pull/recompute decision for the chosen replica.
"""

import bisect
import enum
from dataclasses import dataclass

import xxhash

from app.protocol import PrefixLookup, RoutingDecision
from app.turn.decision import PullPolicy, decide


class RoutingPolicy(str, enum.Enum):
    KV_AWARE = "kv_aware"
    SESSION_AFFINITY = "session_affinity"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class CostWeights:
    cost_per_token: float = 1.0
    load_weight: float = 0.5
    transfer_cost_per_token: float = 0.05


class HashRing:
    """Consistent hashing: adding a replica moves only about 1/N of the keys."""

    def __init__(self, replica_ids: list[str], virtual_nodes: int = 64) -> None:
        points = sorted((_hash(f"{r}#{v}"), r) for r in replica_ids for v in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._replicas = [r for _, r in points]

    def replica_for(self, key: str) -> str:
        i = bisect.bisect(self._hashes, _hash(key)) % len(self._hashes)
        return self._replicas[i]


def _hash(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def turn_cost(decision: RoutingDecision, prompt_tokens: int, queued_tokens: int, weights: CostWeights) -> float:
    to_compute = prompt_tokens - decision.tokens_local - decision.pulled_tokens
    return (to_compute * weights.cost_per_token + queued_tokens * weights.load_weight
            + decision.pulled_tokens * weights.transfer_cost_per_token)


class NoPrefillReplica(RuntimeError):
    """No prefill replica has registered yet (the engines are starting): the router answers 503."""


class PrefillChooser:
    def __init__(self, policy: RoutingPolicy, pull_policy: PullPolicy, weights: CostWeights) -> None:
        self.policy, self.pull_policy, self.weights = policy, pull_policy, weights
        self._turns = 0
        self._ring: HashRing | None = None
        self._ring_members: tuple[str, ...] = ()

    def choose(self, prompt_ids: list[int], lookup: PrefixLookup, queued_tokens: dict[str, int],
               affinity_key: str, now: float, pull: PullPolicy | None = None,
               horizons: dict[str, float] | None = None) -> RoutingDecision:
        """`horizons`: each replica's latest eviction horizon estimate, where known."""
        replicas = sorted(lookup.prefill_cached_tokens)
        if not replicas:
            raise NoPrefillReplica("no prefill engine is ready yet; retry shortly")
        self._turns += 1
        start = self._turns % len(replicas)
        rotated = replicas[start:] + replicas[:start]  # ties go to the next replica in turn
        pull, horizons = pull or self.pull_policy, horizons or {}
        if self.policy == RoutingPolicy.KV_AWARE:
            decisions = [decide(prompt_ids, lookup, r, pull, now, horizons.get(r)) for r in rotated]
            return min(decisions, key=lambda d: turn_cost(d, len(prompt_ids), queued_tokens.get(
                d.prefill_replica_id, 0), self.weights))
        if self.policy == RoutingPolicy.SESSION_AFFINITY:
            target = self._ring_for(replicas).replica_for(affinity_key)
        elif self.policy == RoutingPolicy.LEAST_LOADED:
            target = min(rotated, key=lambda r: queued_tokens.get(r, 0))
        else:
            target = rotated[0]
        return decide(prompt_ids, lookup, target, pull, now, horizons.get(target))

    def _ring_for(self, replicas: list[str]) -> HashRing:
        if self._ring is None or tuple(replicas) != self._ring_members:
            self._ring, self._ring_members = HashRing(replicas), tuple(replicas)
        return self._ring
