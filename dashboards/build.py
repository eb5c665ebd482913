"""Builds dashboards/kv-loop.json, the Grafana dashboard of kv-loop, with grafana-foundation-sdk.

    python dashboards/build.py            # rewrite kv-loop.json
    python dashboards/build.py --check    # exit 1 if kv-loop.json is not what this script builds

Every query reads Ray's Prometheus names: `ray_` + the name given to ray.util.metrics / ray.serve.metrics
(vLLM's `vllm:x` becomes `ray_vllm_x`), counters with `_total`, histograms as `_bucket`/`_sum`/`_count`,
gauges as they are. tests/unit/test_dashboard.py checks each name against what the code exports.
"""

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import StackingConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).with_name("kv-loop.json")
UID = "kv-loop"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"


def query(expr: str, legend: str, ref_id: str) -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)


def panel(title: str, description: str, unit: str, queries: list[tuple[str, str]], width: int = 12,
          stacked: bool = False, legend_calcs: tuple[str, ...] = ("mean", "max")) -> Timeseries:
    """A time series panel; `queries` are (PromQL, legend format) pairs."""
    built = (Timeseries().title(title).description(description).unit(unit).min(0).span(width).height(8)
             .datasource(DATASOURCE)
             .legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.TABLE)
                     .placement(LegendPlacement.BOTTOM).calcs(list(legend_calcs))))
    if stacked:
        built = built.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30)
    for i, (expr, legend) in enumerate(queries):
        built = built.with_target(query(expr, legend, chr(ord("A") + i)))
    return built


def ttft_quantile(q: float) -> str:
    return (f'histogram_quantile({q}, sum by (le, turn) '
            f'(rate(ray_kv_loop_ttft_s_bucket{{turn!="1"}}{RATE})))')


def build_dashboard() -> Dashboard:
    return (
        Dashboard("kv-loop").uid(UID).tags(["kv-loop", "ray-serve", "vllm"])
        .description("kv-loop: multi-turn KV reuse across prefill/decode on Ray Serve. "
                     "Fed by Ray's metrics endpoints (ray_ prefix). Built by dashboards/build.py.")
        .refresh("30s").time("now-1h", "now").timezone("browser")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))

        .with_row(Row("Turn loop (router)"))
        .with_panel(panel(
            "Later-turn TTFT by turn (p50 / p99)",
            "Router time to first token for turns 2+, from the kv_loop_ttft_s histogram by turn index "
            "(10+ groups turns 10 and later).",
            "s", [(ttft_quantile(0.5), "p50 turn {{turn}}"), (ttft_quantile(0.99), "p99 turn {{turn}}")],
            legend_calcs=("mean", "max", "lastNotNull")))
        .with_panel(panel(
            "Later-turn hit rate by routing policy",
            "Share of later turns whose every reusable full block was cached or pulled (hit=true), "
            "and share that landed on the replica of the previous turn.",
            "percentunit",
            [('sum by (policy) (rate(ray_kv_loop_later_turns_total{hit="true"}' + RATE + ')) / '
              'sum by (policy) (rate(ray_kv_loop_later_turns_total' + RATE + '))', "hit {{policy}}"),
             ('sum by (policy) (rate(ray_kv_loop_later_turns_total{same_replica="true"}' + RATE + ')) / '
              'sum by (policy) (rate(ray_kv_loop_later_turns_total' + RATE + '))', "same replica {{policy}}")]))
        .with_panel(panel(
            "Prompt tokens by KV source",
            "Prompt tokens per second by where their KV came from: pulled from decode, cached locally "
            "on the prefill replica, or computed.",
            "short", [("sum by (source) (rate(ray_kv_loop_prompt_tokens_total" + RATE + "))", "{{source}}")],
            width=8, stacked=True))
        .with_panel(panel(
            "Pull vs recompute decisions",
            "Turn-loop decisions per second by action (pull, recompute, prefill_on_decode) and reason.",
            "ops", [("sum by (action, reason) (rate(ray_kv_loop_decisions_total" + RATE + "))",
                     "{{action}} / {{reason}}")],
            width=8, stacked=True))
        .with_panel(panel(
            "KV bytes pulled",
            "Bytes per second of KV pulled from decode replicas (pulled tokens x KV bytes per token).",
            "Bps", [("sum(rate(ray_kv_loop_bytes_pulled_total" + RATE + "))", "pulled")], width=8))

        .with_row(Row("KV state"))
        .with_panel(panel(
            "Eviction horizon per prefill replica",
            "Estimated seconds an idle block survives on each prefill replica: (pool - pinned) / new-token rate. "
            "The shortest estimate among router replicas.",
            "s", [("min by (prefill_replica) (ray_kv_loop_eviction_horizon_s)", "{{prefill_replica}}")],
            width=8, legend_calcs=("mean", "min", "lastNotNull")))
        .with_panel(panel(
            "KV index size",
            "Entries held by the KV index actor, by kind (retained sequences and hashes, prefill blocks, "
            "replicas, conversations).",
            "short", [("max by (entries) (ray_kv_loop_index_size)", "{{entries}}")],
            width=8, legend_calcs=("mean", "max", "lastNotNull")))
        .with_panel(panel(
            "Kept sequences released early",
            "Sequences decode kept for a next turn and released before their TTL, per second: past "
            "limits.retained_pool_share of its pool (pool_share) or for requests waiting for blocks "
            "(waiting). Steadily above 0: the decode pool is too small for the conversations' think time.",
            "ops", [("sum by (cause) (rate(ray_kv_loop_kept_released_total" + RATE + "))", "{{cause}}")],
            width=8))

        .with_row(Row("Serve queues"))
        .with_panel(panel(
            "Queue depth per deployment",
            "Ray Serve: requests waiting for a replica (queued, at the callers' routers) and requests "
            "submitted to the deployment's replicas (ongoing), summed over callers.",
            "short",
            [("sum by (deployment) (ray_serve_deployment_queued_queries)", "queued {{deployment}}"),
             ("sum by (deployment) (ray_serve_num_ongoing_requests_at_replicas)", "ongoing {{deployment}}")],
            legend_calcs=("mean", "max", "lastNotNull")))
        .with_panel(panel(
            "Requests per deployment and per turn",
            "Ray Serve: requests per second processed by each deployment's replicas; kv-loop: router requests "
            "per second by turn index.",
            "reqps",
            [("sum by (deployment) (rate(ray_serve_deployment_request_counter_total" + RATE + "))",
              "{{deployment}}"),
             ("sum by (turn) (rate(ray_kv_loop_requests_total" + RATE + "))", "turn {{turn}}")]))

        .with_row(Row("vLLM engines"))
        .with_panel(panel(
            "Engine KV cache usage",
            "vLLM KV cache usage per engine (1 = full), by Serve replica id (prefill and decode).",
            "percentunit", [("max by (ReplicaId) (ray_vllm_kv_cache_usage_perc)", "{{ReplicaId}}")],
            legend_calcs=("mean", "max", "lastNotNull")))
        .with_panel(panel(
            "Engine running / waiting requests",
            "vLLM scheduler: requests in the running batch and requests waiting, per engine.",
            "short",
            [("max by (ReplicaId) (ray_vllm_num_requests_running)", "running {{ReplicaId}}"),
             ("max by (ReplicaId) (ray_vllm_num_requests_waiting)", "waiting {{ReplicaId}}")],
            legend_calcs=("mean", "max", "lastNotNull")))
        .with_panel(panel(
            "Engine prompt / generation throughput",
            "vLLM tokens per second per engine: prompt (prefill) tokens processed and tokens generated.",
            "short",
            [("sum by (ReplicaId) (rate(ray_vllm_prompt_tokens_total" + RATE + "))", "prompt {{ReplicaId}}"),
             ("sum by (ReplicaId) (rate(ray_vllm_generation_tokens_total" + RATE + "))",
              "generation {{ReplicaId}}")]))
        .with_panel(panel(
            "Engine prompt tokens by source",
            "vLLM prompt tokens per second by source: computed (local_compute), prefix-cache hit "
            "(local_cache_hit), received over NIXL (external_kv_transfer).",
            "short",
            [("sum by (source) (rate(ray_vllm_prompt_tokens_by_source_total" + RATE + "))", "{{source}}")],
            stacked=True))
    )


def render() -> str:
    dashboard = build_dashboard().build()
    for panel_id, built in enumerate(dashboard.panels or [], start=1):
        built.id_val = panel_id  # unique ids, rows included, so links and panel JSON edits stay stable
    return JSONEncoder(sort_keys=True, indent=2).encode(dashboard) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if kv-loop.json is out of date")
    args = parser.parse_args()
    text = render()
    json.loads(text)
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python dashboards/build.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
