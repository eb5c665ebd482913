"""The relations between keys of different sections, checked once the whole config is built.

Each message names every key it relates, as a dotted path. A key's own range is its type's
(app/config/types.py); relations inside one section are that section's own validator.
"""

from typing import TYPE_CHECKING

from app.config.engines import Device

if TYPE_CHECKING:
    from app.config.app_config import AppConfig

def relation_problems(config: "AppConfig") -> list[str]:
    return [message for message, holds in {**_engines(config), **_reuse(config), **_admission(config),
                                           **_autoscaling(config)}.items() if not holds]


def _engines(c: "AppConfig") -> dict[str, bool]:
    checks = {
        "block_size must be a multiple of 32 on CPU (vLLM's CPU attention)":
            c.device != Device.CPU or c.block_size % 32 == 0,
        "max_model_len must hold at least two blocks (2 x block_size)": c.max_model_len >= 2 * c.block_size,
        "placement.probe_tokens must be below max_model_len": c.placement.probe_tokens < c.max_model_len,
        "engine_idle_recheck_ms must be >= engine_queue_recheck_ms":
            c.engine_idle_recheck_ms >= c.engine_queue_recheck_ms,
    }
    return checks


def _reuse(c: "AppConfig") -> dict[str, bool]:
    return {
        "retention_ttl_s must exceed expiry_margin_s (a pull must finish before the blocks expire)":
            c.retention_ttl_s > c.expiry_margin_s,
        "tool_pause_s must be <= retention_ttl_s (vLLM frees a retained sequence at its TTL)":
            c.tool_pause_s <= c.retention_ttl_s,
        # Decode extends prefill's lease every retention_ttl_s / 6 (vLLM's rule) by 2/3 of the lease:
        # at least three heartbeats inside each extension.
        "decode's lease heartbeat (retention_ttl_s / 6) must come 3x inside prefill's lease extension "
        "(handoff_lease_s * 2 / 3)": int(c.retention_ttl_s) // 6 * 3 <= c.handoff_lease_s * 2 // 3,
    }


def _admission(c: "AppConfig") -> dict[str, bool]:
    limits = c.limits
    return {
        # Each stream holds an engine replica's slot until its last token: a replica admitting
        # fewer than its engine runs leaves the rest of the batch empty.
        "limits.engine_max_ongoing_requests must be >= engine_max_num_seqs":
            limits.engine_max_ongoing_requests >= c.engine_max_num_seqs,
        # Every reply streams through a router replica: routers admitting fewer than the decode
        # group runs cap the service below what its engines hold.
        "router_replicas * limits.router_max_ongoing_requests must be >= decode.replicas * engine_max_num_seqs":
            c.router_replicas * limits.router_max_ongoing_requests >= c.decode.replicas * c.engine_max_num_seqs,
    }


def _autoscaling(c: "AppConfig") -> dict[str, bool]:
    scaling, limits = c.autoscaling, c.limits
    starts = {"prefill": c.prefill.replicas, "decode": c.decode.replicas, "router": c.router_replicas}
    checks = {
        f"an autoscaled group's replica count must lie within its min and max replicas "
        f"({'router_replicas' if name == 'router' else name + '.replicas'}: {count}, autoscaling.{name}: "
        f"{getattr(scaling, name).min_replicas}..{getattr(scaling, name).max_replicas})":
            not getattr(scaling, name).enabled
            or getattr(scaling, name).min_replicas <= count <= getattr(scaling, name).max_replicas
        for name, count in starts.items()}
    checks["autoscaling.decode.target_kv_cache_usage must exceed limits.retained_pool_share"] = (
        not scaling.decode.enabled or scaling.decode.target_kv_cache_usage > limits.retained_pool_share)
    checks["autoscaling.router.target_ongoing_requests must not exceed limits.router_max_ongoing_requests"] = (
        not scaling.router.enabled or scaling.router.target_ongoing_requests <= limits.router_max_ongoing_requests)
    return checks
