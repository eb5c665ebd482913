import pytest

from app.protocol import Action, PrefixLookup, RetainedMatch
from app.turn.decision import PullPolicy
from app.turn.routing import CostWeights, HashRing, NoPrefillReplica, PrefillChooser, RoutingPolicy
from tests.factories import BLOCK, retained

NOW = 1000.0
PULL = PullPolicy(block_size=BLOCK, threshold_tokens=32, expiry_margin_s=5.0)
PROMPT = list(range(1000))


def _chooser(policy: RoutingPolicy) -> PrefillChooser:
    return PrefillChooser(policy, PULL, CostWeights(cost_per_token=1.0, load_weight=0.5))


def test_kv_aware_picks_the_replica_holding_the_longest_prefix():
    lookup = PrefixLookup(prefill_cached_tokens={"a": 0, "b": 960, "c": 320})
    decision = _chooser(RoutingPolicy.KV_AWARE).choose(PROMPT, lookup, {}, "k", NOW)
    assert decision.prefill_replica_id == "b" and decision.tokens_local == 960


def test_kv_aware_avoids_a_replica_whose_queue_outweighs_its_hits():
    lookup = PrefixLookup(prefill_cached_tokens={"a": 0, "b": 960})
    chooser = _chooser(RoutingPolicy.KV_AWARE)
    assert chooser.choose(PROMPT, lookup, {"b": 1000}, "k", NOW).prefill_replica_id == "b"  # 40+500 < 1000
    assert chooser.choose(PROMPT, lookup, {"b": 4000}, "k", NOW).prefill_replica_id == "a"  # 40+2000 > 1000


def test_kv_aware_counts_a_pull_from_decode_for_every_replica():
    match = RetainedMatch(retained=retained(PROMPT[:900], NOW + 60), matched_blocks=900 // BLOCK)
    lookup = PrefixLookup(prefill_cached_tokens={"a": 0, "b": 0}, retained=match)
    decision = _chooser(RoutingPolicy.KV_AWARE).choose(PROMPT, lookup, {"a": 50}, "k", NOW)
    assert decision.prefill_replica_id == "b" and decision.action == Action.PULL


def test_round_robin_and_least_loaded():
    lookup = PrefixLookup(prefill_cached_tokens={"a": 0, "b": 0, "c": 0})
    chooser = _chooser(RoutingPolicy.ROUND_ROBIN)
    assert {chooser.choose(PROMPT, lookup, {}, "k", NOW).prefill_replica_id for _ in range(3)} == {"a", "b", "c"}
    least = _chooser(RoutingPolicy.LEAST_LOADED)
    assert least.choose(PROMPT, lookup, {"a": 9, "b": 1, "c": 5}, "k", NOW).prefill_replica_id == "b"


def test_affinity_is_sticky_and_adding_a_replica_moves_about_one_in_n():
    keys = [f"conversation-{i}" for i in range(4000)]
    four = HashRing(["r0", "r1", "r2", "r3"])
    five = HashRing(["r0", "r1", "r2", "r3", "r4"])
    moved = sum(four.replica_for(k) != five.replica_for(k) for k in keys) / len(keys)
    assert 0.12 < moved < 0.28, moved  # ideal 1/5
    assert all(five.replica_for(k) == "r4" for k in keys if four.replica_for(k) != five.replica_for(k))
    chooser = _chooser(RoutingPolicy.SESSION_AFFINITY)
    lookup = PrefixLookup(prefill_cached_tokens={"r0": 0, "r1": 0, "r2": 0, "r3": 0})
    assert len({chooser.choose(PROMPT, lookup, {}, "same", NOW).prefill_replica_id for _ in range(5)}) == 1


@pytest.mark.parametrize("policy", list(RoutingPolicy))
def test_before_any_prefill_engine_registers_every_policy_says_so(policy):
    # The router answers this with 503 and Retry-After, as /health does until engines register.
    with pytest.raises(NoPrefillReplica, match="retry"):
        _chooser(policy).choose(PROMPT, PrefixLookup(prefill_cached_tokens={}), {}, "k", NOW)
