"""Routing across replicas: two prefill replicas (prefix caching on) and one decode replica, seven
concurrent three-turn conversations per policy; then one prefill replica whose cache is never
trusted. Replaces the session's app (own_app: after every test on it)."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from ray import serve

from app.config import EngineGroupConfig
from app.kv.hashing import common_prefix_len
from app.ops import faults
from app.ops.launch import APP_NAME, replace_app
from tests.integration.conftest import (
    SYSTEM_PROMPT,
    USER_TURNS,
    decisions_by_request,
    reference_ids,
    run_conversation,
)

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
CONVERSATIONS = 7
"""Odd: when the conversations' turns arrive in lockstep, round robin over two replicas then
sends each turn to the other replica than the last (with eight it sent each to the same one)."""
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def two_prefill_replicas(base_url, app_config):
    # A threshold no pull meets and a 1 % history share: the share alone makes decode's short replies
    # worth a pull, so the second test sees the pull compose with routing and the share decide it.
    replace_app(replace(app_config, prefill=EngineGroupConfig(replicas=2, cpus_per_replica=0.5),
                        decode=EngineGroupConfig(replicas=1, cpus_per_replica=0.5), recompute_threshold_tokens=4096,
                        max_recomputed_history=0.01))
    # Serve calls the app ready when every replica started; the router learns of a prefill replica
    # at its next membership refresh (up to heartbeat_interval_s later). Before, it places on one.
    faults.wait_whole(base_url)
    return base_url


def _conversations(client, policy: str, reverse_pull: bool):
    def one(i):
        return run_conversation(client, f"[{policy}-{reverse_pull}-{i}] {SYSTEM_PROMPT}", USER_TURNS[:3],
                                MAX_TOKENS, routing_policy=policy, reverse_pull=reverse_pull, prefill_on_decode=False)

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        return list(pool.map(one, range(CONVERSATIONS)))


def _hit_rate(conversations, block_size: int, with_generated: bool) -> float:
    """Share of later turns whose every full block of the reusable prefix was cached or pulled."""
    hits = total = 0
    for turns in conversations:
        for previous, current in zip(turns, turns[1:]):
            reusable = previous.prompt_ids + (previous.output_ids if with_generated else [])
            shared = common_prefix_len(current.prompt_ids, reusable)
            hits += current.cached_tokens >= min(shared, current.prompt_tokens - 1) // block_size * block_size
            total += 1
    return hits / total


def test_kv_aware_finds_the_replica_that_holds_the_conversation(two_prefill_replicas, client, http, app_config):
    block = app_config.block_size
    kv_aware = _conversations(client, "kv_aware", reverse_pull=False)
    round_robin = _conversations(client, "round_robin", reverse_pull=False)
    kv_rate, rr_rate = _hit_rate(kv_aware, block, False), _hit_rate(round_robin, block, False)
    decisions = decisions_by_request(http)
    print(f"later-turn hit rate without pulls: kv_aware {kv_rate:.2f}, round_robin {rr_rate:.2f}")
    for name, runs in (("kv_aware", kv_aware), ("round_robin", round_robin)):
        print(name, [[(decisions[t.request_id]["prefill_replica"], t.cached_tokens, t.prompt_tokens) for t in turns]
                     for turns in runs])
    assert kv_rate >= 0.9, kv_rate
    assert rr_rate <= kv_rate - 0.25, (rr_rate, kv_rate)
    used = {decisions[t.request_id]["prefill_replica"] for turns in kv_aware for t in turns}
    assert len(used) == 2, "load spreads over both replicas"
    stats = serve.get_deployment_handle("KVIndexServer", APP_NAME).stats.remote().result()
    assert stats["events_applied"] > 0, "the index follows the prefill engines' own KV cache events"


def test_kv_aware_with_reverse_pull_reuses_the_whole_previous_sequence(two_prefill_replicas, client, http,
                                                                       app_config, reference):
    conversations = _conversations(client, "kv_aware", reverse_pull=True)
    assert _hit_rate(conversations, app_config.block_size, with_generated=True) >= 0.9
    decisions = decisions_by_request(http)
    pulls = [decisions[t.request_id] for turns in conversations for t in turns[1:]
             if decisions[t.request_id]["action"] == "pull"]
    assert pulls and all(d["reason"] == "pull_saves_tokens" and d["pulled_tokens"] < d["threshold"] for d in pulls)
    assert [t.output_ids for t in conversations[0]] == reference_ids(reference, conversations[0], MAX_TOKENS)


@pytest.fixture(scope="module")
def untrusted_prefill_cache(base_url, app_config):
    # Every eviction horizon counts as too short: prefill's cached history no longer excuses a pull.
    replace_app(replace(app_config, prefill=EngineGroupConfig(prefix_caching=True), min_local_horizon_s=1e9))
    return base_url


def test_an_untrusted_prefill_cache_pulls_and_prefill_reads_only_what_it_lacks(untrusted_prefill_cache, client,
                                                                                  http, reference):
    turns = run_conversation(client, "[untrusted] " + SYSTEM_PROMPT, USER_TURNS[:3], MAX_TOKENS,
                             prefill_on_decode=False)
    decisions = decisions_by_request(http)
    later = [decisions[t.request_id] for t in turns[1:]]
    assert [d["reason"] for d in later] == ["local_at_risk"] * 2, later
    assert all(d["tokens_local"] > 0 and d["pulled_tokens"] < d["threshold"] for d in later)
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
