"""Serve request routers that rank one replica first: the engine call's target, or the router
replica that serves the conversation.

Engine groups: the router deployment decides (from the KV index) which replica should run a turn and
names it in the request's `target_replica_id`. The router deployment: each conversation keeps to
one replica (rendezvous hashing of ClientRequest.affinity_key over the live replicas), whose near
copies of its record and retained sequences answer without a call to the KV index. The others rank
second: Serve moves on to them when the first is gone or at its `max_ongoing_requests`. The choice
only affects speed, never correctness. A call without a first choice (health, the decision log) goes
as Serve's default router sends it: the less loaded of two replicas picked at random.
"""

import random

import xxhash
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class _FirstChoiceRouter(RequestRouter):
    def first_choice(self, request, candidates: list[RunningReplica]) -> str | None:
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = None
        if pending_request is not None and pending_request.args:
            # Without backoff an empty choice makes Serve retry in a tight loop.
            pending_request.routing_context.should_backoff = True
            target = self.first_choice(pending_request.args[0], candidate_replicas)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        return [chosen, others] if chosen else [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


class TargetedRequestRouter(_FirstChoiceRouter):
    def first_choice(self, request, candidates: list[RunningReplica]) -> str | None:
        return getattr(request, "target_replica_id", None)


class ConversationRequestRouter(_FirstChoiceRouter):
    def first_choice(self, request, candidates: list[RunningReplica]) -> str | None:
        key = getattr(request, "affinity_key", "")
        if not key or not candidates:
            return None
        ids = (r.replica_id.unique_id for r in candidates)
        return max(ids, key=lambda replica_id: xxhash.xxh3_64_intdigest(f"{key}\x00{replica_id}".encode()))
