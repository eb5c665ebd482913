"""Ray Serve autoscaling, per group on its own signal (deployments/autoscaling.py): prefill on queued
prefill tokens, decode on sequences and KV usage, the router on ongoing requests. Off by default."""

from pydantic import Field, model_validator

from app.config.types import Bool, Count, Delay, Float, Int, Seconds, refuse, section


@section
class ScalingBounds:
    """One group's bounds and delays; off, the group keeps its fixed replica count."""

    enabled: Bool = False
    """On: Serve starts the group's configured replica count and scales it within these bounds."""
    min_replicas: Count = 1
    """The fewest replicas the group scales down to."""
    max_replicas: Count = 2
    """The most replicas the group scales up to."""
    upscale_delay_s: Delay = 30.0
    """How long the load must ask for more replicas before one starts: a burst shorter than an
    engine's start is better queued than answered with a replica."""
    downscale_delay_s: Delay = 300.0
    """How long the load must ask for fewer before a replica stops; a stopped engine replica takes
    its prefix cache and retained sequences with it (reuse lost, not correctness)."""
    metrics_interval_s: Seconds = 10.0
    """How often each replica sends its metrics to Serve's controller (Serve's default)."""
    look_back_period_s: Seconds = 30.0
    """Serve averages each replica's metrics over this window: longer is steadier and slower to react."""

    def problems(self) -> list[str]:
        return [message for message, holds in {
            "1 <= min_replicas <= max_replicas must hold": self.min_replicas <= self.max_replicas,
            "0 < metrics_interval_s < look_back_period_s": self.metrics_interval_s < self.look_back_period_s,
        }.items() if not holds]

    @model_validator(mode="after")
    def _relations(self) -> "ScalingBounds":
        refuse(self.problems())
        return self


@section
class PrefillScaling(ScalingBounds):
    target_queued_tokens: Int = Field(default=4096, gt=0)
    """Queued prefill tokens per replica (prompt tokens in calls not yet prefilled, less pulled
    ones). A new prompt waits about queued tokens / the replica's prefill rate: set it from the
    time-to-first-token budget and a measured prefill rate."""


@section
class DecodeScaling(ScalingBounds):
    target_sequences: Int = Field(default=64, gt=0)
    """Sequences (running and waiting) per decode engine: the batch whose inter-token latency you accept."""
    target_kv_cache_usage: Float = 0.8
    """KV pool usage per decode engine (vLLM's), in (0, 1]; above limits.retained_pool_share, so
    sequences kept for next turns alone never hold a replica up."""

    def problems(self) -> list[str]:
        usage = [] if 0 < self.target_kv_cache_usage <= 1 else ["target_kv_cache_usage must lie in (0, 1]"]
        return super().problems() + usage


@section
class RouterScaling(ScalingBounds):
    target_ongoing_requests: Int = Field(default=128, gt=0)
    """Requests per router replica (Serve's built-in policy); a stream holds its request until
    [DONE]. At most limits.router_max_ongoing_requests: below it, the next replica starts before
    requests queue."""


@section
class Autoscaling:
    """Per group, off by default; on, a group starts at its replica count and Serve scales it."""

    prefill: PrefillScaling = Field(default_factory=PrefillScaling)
    decode: DecodeScaling = Field(default_factory=DecodeScaling)
    router: RouterScaling = Field(default_factory=RouterScaling)
