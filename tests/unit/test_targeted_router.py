import asyncio
from types import SimpleNamespace

from deployments.targeted_router import ConversationRequestRouter, TargetedRequestRouter


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


def test_gone_or_no_target_means_two_replicas_at_random_as_serve_s_default():
    assert _choose("", [_replica("a")]) == [["a"]]
    seen = [_choose("gone", [_replica("a"), _replica("b"), _replica("c")]) for _ in range(60)]
    assert all(len(ranks) == 1 and len(set(ranks[0])) == 2 for ranks in seen)
    assert {r for ranks in seen for r in ranks[0]} == {"a", "b", "c"}, "any of them"


def _first_router(key: str, replica_ids: list[str]) -> str:
    router = ConversationRequestRouter.__new__(ConversationRequestRouter)
    pending = SimpleNamespace(args=[SimpleNamespace(affinity_key=key)],
                              routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas([_replica(r) for r in replica_ids], pending))
    assert len(ranks[0]) == 1 and len(ranks[1]) == len(replica_ids) - 1, "one first, the rest after it"
    return ranks[0][0].replica_id.unique_id


def test_a_conversation_keeps_to_one_router_replica_and_a_new_replica_takes_only_its_share():
    keys = [f"conversation {i}" for i in range(300)]
    before = {k: _first_router(k, ["a", "b", "c"]) for k in keys}
    assert before == {k: _first_router(k, ["c", "a", "b"]) for k in keys}, "whatever order Serve lists them in"
    assert set(before.values()) == {"a", "b", "c"}
    after = {k: _first_router(k, ["a", "b", "c", "d"]) for k in keys}
    assert all(after[k] in (before[k], "d") for k in keys), "a conversation moves only to the new replica"
    assert 40 < sum(after[k] == "d" for k in keys) < 110
    gone = {k: _first_router(k, ["a", "c"]) for k in keys}
    assert all(gone[k] == before[k] for k in keys if before[k] != "b"), "only the gone replica's conversations move"
