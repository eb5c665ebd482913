"""The Serve application: `serve run app:graph [key=value ...]`.

    HTTP ──▶ Router ──▶ PrefillServer × N ──NIXL──▶ DecodeServer × M
               │  ▲             ▲─────────NIXL (reverse pull)──────┘
               ▼  │
             KVIndexServer
Building the graph starts nothing and builds no model; replicas do that when they start.
"""

from typing import TYPE_CHECKING, Any

from app.config import AppConfig, EngineGroupConfig, load_config

if TYPE_CHECKING:  # vLLM imports this package in every engine process: keep Ray out of it
    from ray.serve import Application


def _engine_options(config: AppConfig, group: EngineGroupConfig) -> dict[str, Any]:
    bundle = {"CPU": group.cpus_per_replica, **({"GPU": group.gpus_per_replica} if group.gpus_per_replica else {}),
              **group.bundle_resources}
    return {"num_replicas": group.replicas,
            "ray_actor_options": {"num_cpus": group.cpus_per_replica, "num_gpus": group.gpus_per_replica,
                                  "resources": dict(group.bundle_resources)},
            "placement_group_bundles": [bundle], "placement_group_strategy": "STRICT_PACK",
            "max_ongoing_requests": 64, "health_check_period_s": 10, "health_check_timeout_s": 60}


def build_graph(config: AppConfig) -> "Application":
    from deployments.decode import DecodeServer
    from deployments.kv_index import KVIndexServer
    from deployments.prefill import PrefillServer
    from deployments.router import Router

    index = KVIndexServer.bind(config)
    prefill = PrefillServer.options(name="prefill", **_engine_options(config, config.prefill)).bind(config, index)
    decode = DecodeServer.options(name="decode", **_engine_options(config, config.decode)).bind(config, index)
    return Router.options(name="router", num_replicas=config.router_replicas).bind(config, index, prefill, decode)


def graph(args: dict[str, Any] | None = None) -> "Application":
    """The Serve application builder; `args` are the key=value pairs of `serve run`."""
    return build_graph(load_config(args))
