"""Serve request router for engine groups: send each call to the replica the turn loop chose.

The router deployment decides (from the KV index) which replica should run a turn and names it in
the request's `target_replica_id`. The others rank second: Serve moves on to them when the
target is gone or at its `max_ongoing_requests`. The choice only affects cache hits, never
correctness.
"""

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class TargetedRequestRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Without backoff an empty choice makes Serve retry in a tight loop.
            pending_request.routing_context.should_backoff = True
        target = _target_of(pending_request)
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        others = [r for r in candidate_replicas if r.replica_id.unique_id != target]
        return [chosen, others] if chosen else [candidate_replicas]


def _target_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], "target_replica_id", None)
