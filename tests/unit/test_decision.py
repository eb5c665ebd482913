from app.protocol import Action, PrefixLookup, Reason, RetainedMatch
from app.turn.decision import PullPolicy, decide, pullable_tokens
from tests.factories import BLOCK, retained

NOW = 1000.0
POLICY = PullPolicy(block_size=BLOCK, threshold_tokens=32, expiry_margin_s=5.0)


def _lookup(history, expiry=NOW + 60, local=0):
    match = RetainedMatch(retained=retained(history, expiry), matched_blocks=len(history) // BLOCK)
    return PrefixLookup(prefill_cached_tokens={"p0": local}, retained=match)


def test_pull_covers_full_blocks_of_the_common_prefix_only():
    history = list(range(300))
    prompt = history[:250] + [9999] * 60  # diverges at token 250
    decision = decide(prompt, _lookup(history), "p0", POLICY, NOW)
    assert decision.action == Action.PULL and decision.reason == Reason.PULL_SAVES_TOKENS
    assert decision.tokens_pullable == 224  # 7 full blocks inside the 250-token prefix, never the 8th
    assert decision.pull.num_tokens == 224
    assert decision.pull.block_ids == (tuple(range(100, 107)),)


def test_prefill_always_computes_at_least_one_token():
    history = list(range(128))
    assert pullable_tokens(history, tuple(history + [1, 2, 3]), BLOCK) == 96


def test_recompute_when_local_cache_is_as_good():
    history = list(range(300))
    decision = decide(history + [5], _lookup(history, local=288), "p0", POLICY, NOW)
    assert decision.action == Action.RECOMPUTE and decision.reason == Reason.BELOW_THRESHOLD


def test_pull_below_the_threshold_when_recomputing_would_redo_more_than_the_history_share():
    history = list(range(1900))  # an agent's history: its last tool turn ran on decode, prefill lacks it
    policy = PullPolicy(block_size=BLOCK, threshold_tokens=256, expiry_margin_s=5.0, max_recomputed_history=0.05)
    decision = decide(history + [5], _lookup(history, local=1664), "p0", policy, NOW)
    assert decision.action == Action.PULL and decision.reason == Reason.PULL_SAVES_TOKENS
    assert decision.pull.num_tokens == 1888
    only_the_reply = decide(history + [5], _lookup(history, local=1856), "p0", policy, NOW)
    assert only_the_reply.reason == Reason.BELOW_THRESHOLD, "32 of 1888 tokens: under the share, and the threshold"


def test_pull_anyway_when_prefill_evicts_faster_than_its_cached_blocks_can_be_trusted():
    history = list(range(300))
    policy = PullPolicy(block_size=BLOCK, threshold_tokens=32, expiry_margin_s=5.0, min_local_horizon_s=30.0)
    for horizon_s in (None, 30.0, 600.0):  # nothing evicted, or slowly: the cached blocks count
        assert decide(history + [5], _lookup(history, local=288), "p0", policy, NOW, horizon_s).reason \
            == Reason.BELOW_THRESHOLD
    decision = decide(history + [5], _lookup(history, local=288), "p0", policy, NOW, 2.5)
    assert decision.action == Action.PULL and decision.reason == Reason.LOCAL_AT_RISK
    assert decision.pull.num_tokens == 288, "all of it: vLLM reads only the blocks prefill lacks by then"


def test_recompute_when_blocks_expire_before_the_pull_finishes():
    history = list(range(300))
    decision = decide(history + [5], _lookup(history, expiry=NOW + 2), "p0", POLICY, NOW)
    assert decision.action == Action.RECOMPUTE and decision.reason == Reason.EXPIRES_TOO_SOON
    assert decision.pull is None


def test_recompute_when_nothing_is_retained_or_pulls_are_off():
    assert decide([1] * 100, PrefixLookup(), "p0", POLICY, NOW).reason == Reason.NOTHING_RETAINED
    off = PullPolicy(block_size=BLOCK, threshold_tokens=32, expiry_margin_s=5.0, enabled=False)
    history = list(range(300))
    assert decide(history + [1], _lookup(history), "p0", off, NOW).reason == Reason.PULL_DISABLED
