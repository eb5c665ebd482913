"""The benchmark's conversation generator produces what its parameters say (issue 5)."""

import random
import statistics

import pytest

from app.model.tiny import ensure_tiny_model
from benchmarks.workload import Profile, plan_conversation, think_time

PROFILE = Profile(system_tokens=300, user_tokens=40, reply_tokens=16, turns=10)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_sizes_match_the_profile(tokenizer):
    plan = plan_conversation(tokenizer, PROFILE, "nonce", think_mean_s=1.0)
    assert len(tokenizer.encode(plan.system)) == pytest.approx(PROFILE.system_tokens, abs=2)
    assert len(plan.user_turns) == PROFILE.turns and len(plan.think_s) == PROFILE.turns - 1
    assert all(len(tokenizer.encode(u)) == pytest.approx(PROFILE.user_tokens, abs=2) for u in plan.user_turns)


def test_the_nonce_makes_each_conversation_unique_in_its_first_block(tokenizer):
    first_blocks = {tuple(tokenizer.encode(plan_conversation(tokenizer, PROFILE, f"c{i}").system)[:32])
                    for i in range(20)}
    assert len(first_blocks) == 20


@pytest.mark.parametrize("distribution,mean,spread", [("exponential", 1.0, (0.9, 1.1)), ("uniform", 2.0, (1.9, 2.1)),
                                                      ("constant", 0.5, (0.5, 0.5))])
def test_think_times_have_the_configured_mean(distribution, mean, spread):
    rng = random.Random(7)
    samples = [think_time(rng, mean, distribution) for _ in range(20_000)]
    assert spread[0] <= statistics.fmean(samples) <= spread[1]
    assert min(samples) >= 0 and max(samples) <= 5 * mean


def test_an_unknown_distribution_is_refused():
    with pytest.raises(ValueError, match="exponential"):
        think_time(random.Random(0), 1.0, "pareto")
