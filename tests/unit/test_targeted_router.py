import asyncio
from types import SimpleNamespace

from deployments.targeted_router import TargetedRequestRouter


def _replica(unique_id):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


def _choose(target, replicas):
    router = TargetedRequestRouter.__new__(TargetedRequestRouter)
    pending = SimpleNamespace(args=[SimpleNamespace(target_replica_id=target)],
                              routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert pending.routing_context.should_backoff, "an empty rank must not spin Serve's retry loop"
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_target_first_then_the_rest():
    assert _choose("b", [_replica("a"), _replica("b"), _replica("c")]) == [["b"], ["a", "c"]]


def test_gone_or_no_target_means_any_replica():
    assert _choose("gone", [_replica("a"), _replica("b")]) == [["a", "b"]]
    assert _choose("", [_replica("a")]) == [["a"]]
