"""Each group's autoscaling decision from fake Serve contexts; the typed config and what Serve gets."""

from types import SimpleNamespace

import pytest

from app.config import AppConfig, PrefillScaling, load_config
from app.ops.preflight import deployments as _deployments
from deployments.autoscaling import (
    KV_CACHE_USAGE,
    QUEUED_PREFILL_TOKENS,
    RUNNING_SEQS,
    WAITING_SEQS,
    DecodeLoadPolicy,
    QueuedPrefillTokensPolicy,
    QueuedTokens,
    replica_options,
)
from deployments.graph import build_graph


def context(metrics: dict | None, current: int = 1, target: int = 1, state: dict | None = None):
    """What Serve's controller hands a policy: each replica's metrics averaged over the look-back."""
    return SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=current, target_num_replicas=target,
                           policy_state=state or {}, deployment_name="group")


def test_queued_tokens_report_their_time_average_since_the_last_read():
    now = [0.0]
    queued = QueuedTokens(clock=lambda: now[0])
    queued.add(1000)  # one call in flight for 0.5 s of the second, then another for 0.25 s
    now[0] = 0.5
    queued.add(-1000)
    now[0] = 0.75
    queued.add(2000)
    now[0] = 1.0
    assert queued.mean_since_read() == pytest.approx(1000.0)
    now[0] = 2.0
    assert queued.mean_since_read() == pytest.approx(2000.0), "still in flight: the level since the read"


@pytest.mark.parametrize("per_replica, desired", [
    ({"a": 5000.0}, 2),
    ({"a": 3000.0, "b": 1000.0}, 1),
    ({"a": 3000.0, "b": 2000.0}, 2),
    ({"a": 0.0, "b": 0.0}, 0),  # Serve then bounds it to min_replicas
])
def test_prefill_asks_for_its_queued_tokens_over_the_target(per_replica, desired):
    policy = QueuedPrefillTokensPolicy(target_queued_tokens=4096)
    assert policy(context({QUEUED_PREFILL_TOKENS: per_replica, RUNNING_SEQS: {"a": 9.0}}))[0] == desired


def test_a_policy_holds_the_current_target_until_a_replica_has_reported():
    for policy in (QueuedPrefillTokensPolicy(4096), DecodeLoadPolicy(64, 0.8)):
        assert policy(context({}, current=1, target=2)) == (2, {})
        assert policy(context(None, current=1, target=2)) == (2, {})


@pytest.mark.parametrize("running, waiting, usage, desired", [
    ({"a": 70.0}, {"a": 0.0}, {"a": 0.3}, 2),   # sequences
    ({"a": 60.0}, {"a": 10.0}, {"a": 0.3}, 2),  # waiting ones count
    ({"a": 10.0}, {"a": 0.0}, {"a": 0.95}, 2),  # KV
    ({"a": 10.0, "b": 5.0}, {"a": 0.0, "b": 0.0}, {"a": 0.5, "b": 0.2}, 1),
    ({"a": 100.0, "b": 100.0}, {"a": 0.0, "b": 0.0}, {"a": 0.9, "b": 0.9}, 4),
])
def test_decode_asks_for_enough_replicas_for_its_sequences_and_its_kv(running, waiting, usage, desired):
    policy = DecodeLoadPolicy(target_sequences=64, target_kv_cache_usage=0.8)
    metrics = {RUNNING_SEQS: running, WAITING_SEQS: waiting, KV_CACHE_USAGE: usage}
    assert policy(context(metrics))[0] == desired


def test_the_policy_remembers_what_it_asked_for():
    policy = QueuedPrefillTokensPolicy(4096)
    desired, state = policy(context({QUEUED_PREFILL_TOKENS: {"a": 5000.0}}))
    assert state == {"desired": desired}


def test_autoscaling_is_off_by_default_and_groups_keep_their_fixed_counts():
    config = AppConfig()
    assert not any(s.enabled for s in (config.autoscaling.prefill, config.autoscaling.decode,
                                       config.autoscaling.router))
    assert replica_options(3, config.autoscaling.prefill, 2) == {"num_replicas": 3}
    deployments = {d.name: d._deployment_config for d in _deployments(build_graph(config))}
    assert all(d.autoscaling_config is None for d in deployments.values())
    assert deployments["prefill"].num_replicas == 1 and deployments["router"].num_replicas == 1


def test_each_group_gets_serve_autoscaling_on_its_own_signal_with_the_configured_bounds():
    prefill = {"enabled": "true", "max_replicas": "3", "target_queued_tokens": "1000", "upscale_delay_s": "2",
               "downscale_delay_s": "20", "metrics_interval_s": "1", "look_back_period_s": "5"}
    config = load_config({**{f"autoscaling.prefill.{key}": value for key, value in prefill.items()},
                          "autoscaling.decode.enabled": "true", "autoscaling.router.enabled": "true",
                          "autoscaling.router.target_ongoing_requests": "50"})
    deployments = {d.name: d._deployment_config for d in _deployments(build_graph(config))}
    prefill = deployments["prefill"].autoscaling_config
    assert (prefill.min_replicas, prefill.max_replicas, prefill.initial_replicas) == (1, 3, 1)
    assert (prefill.upscale_delay_s, prefill.downscale_delay_s) == (2, 20)
    assert (prefill.metrics_interval_s, prefill.look_back_period_s) == (1, 5)
    assert prefill.policy.policy_kwargs == {"target_queued_tokens": 1000}
    # The class Serve's controller unpickles (by value) and instantiates once with the kwargs.
    serve_policy = prefill.policy.get_policy()(**prefill.policy.policy_kwargs)
    assert serve_policy(context({QUEUED_PREFILL_TOKENS: {"a": 2500.0}}))[0] == 3
    decode = deployments["decode"].autoscaling_config
    assert decode.policy.policy_kwargs == {"target_sequences": 64, "target_kv_cache_usage": 0.8}
    router = deployments["router"].autoscaling_config
    assert router.policy.is_default_policy_function() and router.target_ongoing_requests == 50


def test_serve_applies_the_delays_and_bounds_to_the_policy_s_answer():
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingContext

    scaling = PrefillScaling(enabled=True, max_replicas=2, target_queued_tokens=1000, upscale_delay_s=0.0,
                             metrics_interval_s=1, look_back_period_s=5)
    serve_config = replica_options(1, scaling, 128, QueuedPrefillTokensPolicy,
                                   {"target_queued_tokens": 1000})["autoscaling_config"]
    policy = _apply_autoscaling_config(QueuedPrefillTokensPolicy(1000))

    def decide(queued: float) -> int:
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="prefill", app_name="app", current_num_replicas=1,
            target_num_replicas=1, running_replicas=["a"], total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={QUEUED_PREFILL_TOKENS: {"a": queued}}, raw_metrics=None,
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=2, policy_state={},
            last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=serve_config)
        return policy(ctx)[0]

    assert decide(1500.0) == 2
    assert decide(0.0) == 1, "downscale_delay_s has not passed"


@pytest.mark.parametrize("args, message", [
    ({"autoscaling.prefill.min_replicas": "3"}, "autoscaling.prefill: 1 <= min_replicas <= max_replicas"),
    ({"autoscaling.decode.target_kv_cache_usage": "1.5"}, "autoscaling.decode: target_kv_cache_usage"),
    ({"autoscaling.router.look_back_period_s": "5"}, "metrics_interval_s < look_back_period_s"),
    ({"autoscaling.prefill.target_queued_tokens": "0"}, "target_queued_tokens must be > 0"),
    ({"autoscaling.prefill.enabled": "true", "prefill.replicas": "3"}, "must lie within its min and max"),
    ({"autoscaling.decode.enabled": "true", "autoscaling.decode.target_kv_cache_usage": "0.4"},
     "must exceed limits.retained_pool_share"),
    ({"autoscaling.router.enabled": "true", "autoscaling.router.target_ongoing_requests": "1000"},
     "must not exceed limits.router_max_ongoing_requests"),
])
def test_bad_autoscaling_config_is_refused_with_the_reason(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)
