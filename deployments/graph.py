"""The Serve application: `serve run app:graph [key=value ...]`.

    HTTP ──▶ Frontend ──▶ Router ──▶ PrefillServer × N ──NIXL──▶ DecodeServer × M
                            │  ▲             ▲─────────NIXL (reverse pull)──────┘
                            ▼  │
                          KVIndexServer  ◀── heartbeats of every engine replica
Building the graph starts nothing and builds no model; replicas do that when they start.
Every concurrency cap, queue bound and health-check period comes from `AppConfig.limits`.
"""

from typing import TYPE_CHECKING, Any

from app.config import AppConfig, EngineGroupConfig, Limits, load_config
from app.conversations.tenants import with_secrets

if TYPE_CHECKING:  # vLLM imports this package in every engine process: keep Ray out of it
    from ray.serve import Application


def _backpressure(limits: Limits):
    from ray.serve.config import BackpressureConfig

    return BackpressureConfig(status_code=503, retry_after_s=limits.retry_after_s)


def _replica_options(config: AppConfig, **actor_options: Any) -> dict[str, Any]:
    """What every deployment sets: how Serve runs its Python (config.replica_runtime), its health
    checks and drain, with its actor options."""
    runtime, limits = config.replica_runtime, config.limits
    # A request crosses from the frontend to a router replica over Serve's replica gRPC, whose
    # servers take 4 MiB by default: a body under max_request_bytes must never be refused there.
    env = {**runtime.env_vars(), "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2 * limits.max_request_bytes + 2**20)}
    return {"ray_actor_options": {**actor_options, "runtime_env": {"env_vars": env}},
            "logging_config": {"enable_access_log": runtime.access_log},
            "health_check_period_s": limits.health_check_period_s,
            "health_check_timeout_s": limits.health_check_timeout_s,
            "graceful_shutdown_timeout_s": limits.drain_timeout_s}


def _engine_options(config: AppConfig, group: EngineGroupConfig) -> dict[str, Any]:
    """One bundle per engine replica that holds the whole engine: the replica actor takes its GPUs and
    vLLM's multiprocessing executor starts one worker process per rank under it (docs/design.md,
    "Engine placement"). STRICT_PACK keeps it on one node."""
    limits, gpus = config.limits, config.gpus_per_engine
    bundle = {"CPU": group.cpus_per_replica, **({"GPU": gpus} if gpus else {}), **group.bundle_resources}
    return {**_replica_options(config, num_cpus=group.cpus_per_replica, num_gpus=gpus,
                               resources=dict(group.bundle_resources)),
            "placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK",
            "max_ongoing_requests": limits.engine_max_ongoing_requests,
            "max_queued_requests": limits.engine_max_queued_requests}


def build_graph(config: AppConfig) -> "Application":
    from deployments.autoscaling import decode_replica_options, prefill_replica_options, router_replica_options
    from deployments.decode import DecodeServer
    from deployments.frontend import Frontend
    from deployments.kv_index import KVIndexServer
    from deployments.prefill import PrefillServer
    from deployments.router import Router

    config = with_secrets(config)  # what every replica gets: key digests, a salt secret
    limits = config.limits
    index = KVIndexServer.options(max_ongoing_requests=limits.index_max_ongoing_requests,
                                  max_queued_requests=limits.index_max_queued_requests,
                                  **_replica_options(config, num_cpus=0)).bind(config)
    # Replica counts: fixed, or autoscaled on each group's own signal (deployments/autoscaling.py).
    prefill = PrefillServer.options(name="prefill", **prefill_replica_options(config),
                                    **_engine_options(config, config.prefill)).bind(config, index)
    # Decode sends its releases through prefill (an engine cannot notify itself over NIXL).
    decode = DecodeServer.options(name="decode", **decode_replica_options(config),
                                  **_engine_options(config, config.decode)).bind(config, index, prefill)
    # A stream holds a slot in the frontend and in the router until [DONE]. Each frontend replica
    # admits what one router replica holds (ongoing + queued) and answers the rest 503 + Retry-After
    # in the OpenAI error shape. Serve's queue bounds behind it are backstops that never bind first
    # (a frontend's handle queues at most what it admitted; its refusal would be plain text, and
    # under a burst it is approximate). The frontend scales by the router's rule.
    router_options = {**router_replica_options(config), **_replica_options(config, num_cpus=0)}
    holds = limits.router_holds
    router = Router.options(name="router", **router_options, max_ongoing_requests=limits.router_max_ongoing_requests,
                            max_queued_requests=holds).bind(config, index, prefill, decode)
    return Frontend.options(name="frontend", **router_options, max_ongoing_requests=2 * holds,
                            max_queued_requests=limits.router_max_queued_requests,
                            backpressure_config=_backpressure(limits)).bind(config, router)


def graph(args: dict[str, Any] | None = None) -> "Application":
    """The Serve application builder; `args` are the key=value pairs of `serve run`."""
    return build_graph(load_config(args))
