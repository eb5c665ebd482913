"""Each group scales on its own signal, through Ray Serve's autoscaler (`autoscaling.*` in config).

    engine replica ──record_autoscaling_stats(), every metrics interval──▶ Serve controller
    controller: each replica's values averaged over look_back_period_s ──ctx.aggregated_metrics──▶
    policy ──replicas the load needs──▶ Serve applies upscale/downscale_delay_s, min/max_replicas

| group   | signal                                               | policy                          |
|---------|------------------------------------------------------|---------------------------------|
| prefill | queued prefill tokens (`QueuedTokens`)               | `QueuedPrefillTokensPolicy`     |
| decode  | sequences in the engine, KV cache usage (vLLM's)     | `DecodeLoadPolicy`              |
| router  | ongoing requests per replica                         | Serve's built-in, explicit target |

Serve pickles a policy class by value into its controller: the policies use nothing from the app.
"""

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.config import AppConfig, ScalingBounds

logger = logging.getLogger("ray.serve")

QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"
RUNNING_SEQS = "running_seqs"
WAITING_SEQS = "waiting_seqs"
KV_CACHE_USAGE = "kv_cache_usage"


class QueuedTokens:
    """Prompt tokens of the prefill calls in flight on one replica, and their mean since the last read.

    vLLM's scheduler stats count waiting requests, not their tokens, so prefill counts its own: a
    call's prompt tokens less those pulled from decode, from its arrival until the engine returns
    the first token (then every token is prefilled). Tokens its prefix cache will serve count too
    (unknown until the engine schedules them). The mean, not the level at the read: a call on a
    small model lasts a fraction of the read interval, so a level read once a second mostly reads 0."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.level = 0
        self.area = 0.0
        """Token-seconds since the last read, up to `changed`."""
        self.read_at = self.changed = clock()

    def add(self, tokens: int) -> None:
        now = self.clock()
        self.area += self.level * (now - self.changed)
        self.level, self.changed = self.level + tokens, now

    def mean_since_read(self) -> float:
        now = self.clock()
        area, elapsed = self.area + self.level * (now - self.changed), now - self.read_at
        self.area, self.read_at, self.changed = 0.0, now, now
        return area / elapsed if elapsed > 0 else float(self.level)


def group_total(metrics: Mapping[str, Mapping[Any, float]], name: str) -> float | None:
    """A metric summed over the group's replicas (each averaged by Serve); None before any report."""
    per_replica = metrics.get(name)
    return sum(per_replica.values()) if per_replica else None


def replicas_for(total: float, target_per_replica: float) -> int:
    return math.ceil(total / target_per_replica)


def prefill_replicas(metrics: Mapping[str, Mapping[Any, float]], target_queued_tokens: float) -> int | None:
    queued = group_total(metrics, QUEUED_PREFILL_TOKENS)
    return None if queued is None else replicas_for(queued, target_queued_tokens)


def decode_replicas(metrics: Mapping[str, Mapping[Any, float]], target_sequences: float,
                    target_kv_cache_usage: float) -> int | None:
    """Enough replicas for both: the sequences in the engines (running and waiting) and their KV."""
    running, usage = group_total(metrics, RUNNING_SEQS), group_total(metrics, KV_CACHE_USAGE)
    if running is None or usage is None:
        return None
    sequences = running + (group_total(metrics, WAITING_SEQS) or 0.0)
    return max(replicas_for(sequences, target_sequences), replicas_for(usage, target_kv_cache_usage))


def decide(ctx, desired: int | None, signal: str) -> tuple[int, dict[str, Any]]:
    """The policy's answer to Serve: `desired`, or the current target while no replica has reported.
    Logs (in the controller's log) each change of what the load asks for."""
    if desired is None:
        return ctx.target_num_replicas, {}
    if ctx.policy_state.get("desired") != desired:
        logger.info("autoscaling %s: %s over %d running replicas asks for %d (target %d)", ctx.deployment_name,
                    signal, ctx.current_num_replicas, desired, ctx.target_num_replicas)
    return desired, {"desired": desired}


class QueuedPrefillTokensPolicy:
    """Prefill replicas = the group's queued prefill tokens / target_queued_tokens per replica."""

    def __init__(self, target_queued_tokens: float) -> None:
        self.target_queued_tokens = target_queued_tokens

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        queued = group_total(metrics, QUEUED_PREFILL_TOKENS)
        return decide(ctx, prefill_replicas(metrics, self.target_queued_tokens), f"{queued or 0:.0f} queued tokens")


class DecodeLoadPolicy:
    """Decode replicas = the more of sequences / target_sequences and KV usage / target_kv_cache_usage."""

    def __init__(self, target_sequences: float, target_kv_cache_usage: float) -> None:
        self.target_sequences, self.target_kv_cache_usage = target_sequences, target_kv_cache_usage

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        desired = decode_replicas(metrics, self.target_sequences, self.target_kv_cache_usage)
        signal = (f"{group_total(metrics, RUNNING_SEQS) or 0:.1f} running sequences, "
                  f"KV usage {group_total(metrics, KV_CACHE_USAGE) or 0:.2f}")
        return decide(ctx, desired, signal)


# ---- Serve deployment options --------------------------------------------------------------------
def prefill_replica_options(config: "AppConfig") -> dict[str, Any]:
    scaling = config.autoscaling.prefill
    return replica_options(config.prefill.replicas, scaling, config.limits.engine_max_ongoing_requests,
                           QueuedPrefillTokensPolicy, {"target_queued_tokens": scaling.target_queued_tokens})


def decode_replica_options(config: "AppConfig") -> dict[str, Any]:
    scaling = config.autoscaling.decode
    return replica_options(config.decode.replicas, scaling, config.limits.engine_max_ongoing_requests,
                           DecodeLoadPolicy, {"target_sequences": scaling.target_sequences,
                                              "target_kv_cache_usage": scaling.target_kv_cache_usage})


def router_replica_options(config: "AppConfig") -> dict[str, Any]:
    scaling = config.autoscaling.router
    return replica_options(config.router_replicas, scaling, scaling.target_ongoing_requests)


def replica_options(replicas: int, scaling: "ScalingBounds", target_ongoing_requests: float,
                    policy: type | None = None, policy_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Serve options for a group's replica count: `replicas`, or autoscaling that starts there.
    `policy`: a custom policy class (Serve instantiates it once with `policy_kwargs`); None: Serve's
    built-in policy on `target_ongoing_requests` (custom policies ignore that target)."""
    if not scaling.enabled:
        return {"num_replicas": replicas}
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    chosen = ({"policy": AutoscalingPolicy(policy_function=policy, policy_kwargs=dict(policy_kwargs or {}))}
              if policy else {})
    return {"autoscaling_config": AutoscalingConfig(
        min_replicas=scaling.min_replicas, max_replicas=scaling.max_replicas, initial_replicas=replicas,
        target_ongoing_requests=target_ongoing_requests,
        metrics_interval_s=scaling.metrics_interval_s, look_back_period_s=scaling.look_back_period_s,
        upscale_delay_s=scaling.upscale_delay_s, downscale_delay_s=scaling.downscale_delay_s,
        # The policies return the count the load needs: no damping on top of the delays.
        upscaling_factor=1.0, downscaling_factor=1.0, aggregation_function="mean", **chosen)}
