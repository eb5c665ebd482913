"""The multi-turn benchmark: this project against the systems users would pick instead, same
model, same engine settings, same conversations, one run; rows as Parquet, a Markdown summary,
PNG plots.

Systems:
- `vllm`: one plain vLLM engine, aggregated, prefix caching on (vLLM's OpenAI server): the ideal;
- `serve-llm`: Ray Serve LLM's `build_pd_openai_app`, the standard disaggregated flow;
- `disagg`: this app with reverse pulls off and template rendering (the standard flow, here);
- `preserve`: append-only sessions, reverse pulls off;  `pull`: reverse pull on, template
  rendering;  `pull+preserve`: both, every turn through prefill;
- `on-decode`: pull+preserve, and a short append runs whole on the decode replica that retains
  the conversation (this project's default);
- `kv_aware`, `session_affinity`, `round_robin`, `least_loaded`: pull+preserve under each
  routing policy.

Scenarios (each one app configuration, started in turn; peers run alone on the machine):
- `prefix-off`: prefill's prefix cache off: every turn's history is lost on prefill;
- `small-pool`: prefill's KV pool is `pool_blocks` blocks, so the other conversations' turns
  evict an idle conversation's blocks during its think time;
- `2-prefill`: two prefill replicas (prefix cache on), for the routing policies.

    python -m benchmarks.multi_turn [--preset default|ci] [--scenarios prefix-off small-pool 2-prefill]
                                    [--serve-proxy]
    python -m benchmarks.multi_turn --url http://cluster:8000 [--model NAME --tokenizer HF_ID --api-key KEY]
                                    [--systems disagg pull+preserve] [--set block_size=16]

With --url, the app there runs --systems (its own modes and routing policies, per request); the
peers (`vllm`, `serve-llm`) are started on this machine and so take no part.
"""

import argparse
import sys
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.config import AppConfig, load_config
from app.metrics import kv_bytes_per_token
from app.ops.client import TurnResult
from app.turn.routing import RoutingPolicy
from benchmarks import history
from benchmarks.report import Row, summarize, write_results
from benchmarks.target import NO_KEY, PEERS_ARE_LOCAL, Target, add_target_args, decisions, resolve, resolve_target
from benchmarks.workload import Profile, load_tokenizer, openai_client, plan_conversation, replay

POLICIES = tuple(p.value for p in RoutingPolicy)
THROUGH_PREFILL = {"prefill_on_decode": False}
APP_SYSTEMS = {"disagg": {"reverse_pull": False, "conversation_mode": "template"},
               "preserve": {"reverse_pull": False, "conversation_mode": "preserve"},
               "pull": {"conversation_mode": "template", **THROUGH_PREFILL},
               "pull+preserve": {"conversation_mode": "preserve", **THROUGH_PREFILL},
               "on-decode": {"conversation_mode": "preserve"},
               **{policy: {"conversation_mode": "preserve", "routing_policy": policy, **THROUGH_PREFILL}
                  for policy in POLICIES}}
PEERS = ("vllm", "serve-llm")


@dataclass(frozen=True)
class Preset:
    profile: Profile
    in_flight: int
    think_s: float
    """Mean think time between turns."""
    pool_blocks: int
    """Prefill's KV pool in the small-pool scenario."""
    think_distribution: str = "exponential"
    """exponential (capped at 5x the mean), uniform or constant: see benchmarks.workload.think_time."""
    max_model_len: int = 4096


PRESETS = {"default": Preset(Profile(1500, 150, 64, 10), in_flight=4, think_s=1.0, pool_blocks=160),
           "ci": Preset(Profile(400, 40, 8, 3), in_flight=2, think_s=0.2, pool_blocks=129)}

WARM_UP = Preset(Profile(system_tokens=96, user_tokens=16, reply_tokens=4, turns=2), in_flight=1, think_s=0.0,
                 pool_blocks=0)


@dataclass(frozen=True)
class Scenario:
    name: str
    app_args: Mapping[str, str]
    """AppConfig overrides (Serve args) for this scenario's engines; peers get the same settings."""
    systems: tuple[str, ...]
    """Peers first: they run before this scenario's app starts."""


def scenarios(preset: Preset) -> dict[str, Scenario]:
    return {s.name: s for s in (
        Scenario("prefix-off", {"prefill.prefix_caching": "false"},
                 ("vllm", "serve-llm", "disagg", "preserve", "pull", "pull+preserve", "on-decode")),
        Scenario("small-pool", {"prefill.engine_kwargs": f"{{num_gpu_blocks_override: {preset.pool_blocks}}}"},
                 ("disagg", "preserve", "pull", "pull+preserve", "on-decode")),
        Scenario("2-prefill", {"prefill.replicas": "2", "prefill.cpus_per_replica": "0.5",
                               "decode.cpus_per_replica": "0.5"}, POLICIES))}


@dataclass
class SystemRun:
    """One system's conversations, as the client saw them."""

    system: str
    began: float = field(default_factory=time.perf_counter)
    turns: list[list[tuple[float, TurnResult]]] = field(default_factory=list)


def converse(client, tokenizer, run: SystemRun, index: int, preset: Preset, extra: dict) -> list:
    plan = plan_conversation(tokenizer, preset.profile, f"{run.system} {index} {uuid.uuid4().hex}", preset.think_s,
                             preset.think_distribution, seed=index)
    return replay(client, plan, preset.profile.reply_tokens, run.began, **extra)


def drive(url: str, system: str, tokenizer, preset: Preset, extra: dict, api_key: str = NO_KEY) -> SystemRun:
    """`preset.in_flight` conversations at once through the official OpenAI client, streaming."""
    client = openai_client(url, api_key)
    run = SystemRun(system)
    with ThreadPoolExecutor(preset.in_flight) as pool:
        futures = [pool.submit(converse, client, tokenizer, run, i, preset, extra) for i in range(preset.in_flight)]
        run.turns = [f.result() for f in futures]
    return run


def warm_up(url: str, tokenizer, extra: dict, api_key: str = NO_KEY) -> None:
    """A short unmeasured conversation takes first-request costs (NIXL handshakes, lazy
    initialisation) out of the first measured turns."""
    drive(url, "warm-up", tokenizer, WARM_UP, extra, api_key)


def rows_of(scenario: str, run: SystemRun, decisions: dict[str, dict], prefill_hits: dict[str, int],
            bytes_per_token: int = 0) -> list[Row]:
    """`prefill_hits` overrides the response's cached tokens where prefill's own count differs
    (Serve LLM reports decode's, which include every transferred token)."""
    rows = []
    for i, turns in enumerate(run.turns):
        for turn, (started, r) in enumerate(turns, 1):
            d = decisions.get(r.request_id, {})
            cached = prefill_hits.get(r.request_id, r.cached_tokens)
            stages = [d.get(k, 0.0) / 1e3 for k in ("plan_ms", "prefill_ms", "decode_first_token_ms")]
            if d.get("first_token_from") == "prefill":  # decode's first token is the reply's second
                stages[2] = 0.0
            rows.append(Row(scenario, run.system, i, turn, started, r.prompt_tokens, len(r.output_ids), cached,
                            r.prompt_tokens - cached, r.ttft_s, r.itl_s, r.e2e_s, d.get("action", ""),
                            d.get("pulled_tokens", 0), d.get("pulled_tokens", 0) * bytes_per_token, *stages,
                            render_s=(d.get("render_ms") or 0.0) / 1e3, **_engine_stages(d.get("engine_ms"))))
    return rows


def _engine_stages(engine_ms: dict | None) -> dict[str, float]:
    if not engine_ms:
        return {}
    return {"engine_wait_s": (engine_ms["admit_ms"] + engine_ms["queued_ms"]) / 1e3,
            "engine_step_s": engine_ms["step_ms"] / 1e3}


def app_decisions(url: str, api_key: str = NO_KEY) -> dict[str, dict]:
    return {d["request_id"]: d for d in decisions(url, api_key, 1000)}


def run_serve_llm(scenario: Scenario, config: AppConfig, proxy_url: str, tokenizer, preset: Preset,
                  model: str) -> list[Row]:
    """Serve LLM reports decode's cached tokens, which count every transferred token; prefill's
    come from its engine's counters, in total only. With prefill's prefix cache off they are zero
    for every request: the counters must show no hit and every prompt token computed (at least:
    they also hold the warm-up, and Ray exports them with a lag)."""
    from benchmarks.peers import prompt_tokens_by_source, prompt_tokens_since, serve_llm_pd, serve_llm_prefill_replica

    if config.prefill.prefix_caching:
        raise ValueError("serve-llm reports prefill cache hits only in total: run it where prefill's prefix "
                         "cache is off (scenario prefix-off)")
    with serve_llm_pd(config, proxy_url) as url:
        replica = serve_llm_prefill_replica()
        before = prompt_tokens_by_source(replica)
        warm_up(url, tokenizer, {"model": model})
        run = drive(url, "serve-llm", tokenizer, preset, {"model": model})
        rows = rows_of(scenario.name, run, {}, {r.request_id: 0 for turns in run.turns for _, r in turns})
        counted = prompt_tokens_since(replica, before, sum(r.prompt_tokens for r in rows))
    if counted.get("local_cache_hit", 0) or counted.get("local_compute", 0) < sum(r.prompt_tokens for r in rows):
        raise RuntimeError(f"serve-llm prefill counters {counted} do not match the prompts sent")
    return rows


def run_scenario(scenario: Scenario, preset: Preset, config: AppConfig, tokenizer, proxy_url: str | None,
                 app_url: str | None, model: str, progress, api_key: str = NO_KEY) -> list[Row]:
    """The scenario's systems in order. `app_url`: a running app, which `api_key` opens (else the
    app is started on the local Serve at `proxy_url` with `config` when the first app system needs it)."""
    from benchmarks.peers import plain_vllm

    rows: list[Row] = []
    for system in scenario.systems:
        if system == "vllm":
            with plain_vllm(config) as url:
                warm_up(url, tokenizer, {"model": model})
                rows += rows_of(scenario.name, drive(url, system, tokenizer, preset, {"model": model}), {}, {})
        elif system == "serve-llm":
            if proxy_url is None:
                raise ValueError("serve-llm runs on the local Ray started by this benchmark (no --url)")
            rows += run_serve_llm(scenario, config, proxy_url, tokenizer, preset, model)
        else:
            if app_url is None:
                from app.ops.launch import replace_app

                replace_app(config)
                app_url = proxy_url
            warm_up(app_url, tokenizer, {**APP_SYSTEMS[system], "model": model}, api_key)
            run = drive(app_url, system, tokenizer, preset, {**APP_SYSTEMS[system], "model": model}, api_key)
            rows += rows_of(scenario.name, run, app_decisions(app_url, api_key), {},
                            kv_bytes_per_token(config.model_path()))
        progress.update(1)
    return rows


def run(target: Target | str | None, systems: list[str], preset: str | Preset, config: AppConfig) -> list[Row]:
    """`systems` against one app: the target's URL (a running app, a cluster's endpoint; a bare URL
    takes the target flags' defaults) or the embedded default started here with `config`. Rows are
    labelled scenario "app"."""
    from tqdm import tqdm

    from app.ops.launch import start_serve

    target = target if isinstance(target, Target) else resolve(target, config)
    if target.url is not None and set(systems) & set(PEERS):
        raise ValueError(PEERS_ARE_LOCAL)
    proxy_url = start_serve() if target.url is None else None
    config = target.app_config(config)
    tokenizer = load_tokenizer(config)
    progress = tqdm(total=len(systems), desc="systems", file=sys.stderr)
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    return run_scenario(Scenario("app", {}, tuple(systems)), preset, config, tokenizer, proxy_url, target.url,
                        target.model, progress, target.api_key)


def run_all(names: list[str], preset: Preset, base_args: dict[str, str],
            haproxy: bool = True) -> tuple[list[Row], AppConfig]:
    """Every scenario on a local Ray and Serve, one after another; returns rows and the base config."""
    from tqdm import tqdm

    from app.ops.launch import delete_app, start_serve

    plan = [scenarios(preset)[n] for n in names]
    base = load_config({"max_model_len": str(preset.max_model_len), **base_args})
    tokenizer = load_tokenizer(base)
    proxy_url = start_serve(haproxy=haproxy)
    progress = tqdm(total=sum(len(s.systems) for s in plan), desc="systems", file=sys.stderr)
    rows: list[Row] = []
    for scenario in plan:
        delete_app()
        config = load_config({"max_model_len": str(preset.max_model_len), **base_args, **scenario.app_args})
        rows += run_scenario(scenario, preset, config, tokenizer, proxy_url, None, base.model_name, progress)
    return rows, base


def preset_from_args(args: argparse.Namespace) -> Preset:
    """The named preset with any size given on the command line."""
    preset = PRESETS[args.preset]
    sizes = {k: v for k, v in vars(args).items() if v is not None}
    profile = replace(preset.profile, **{k: sizes[k] for k in PROFILE_FIELDS if k in sizes})
    return replace(preset, profile=profile, **{k: sizes[k] for k in PRESET_FIELDS if k in sizes})


PROFILE_FIELDS = {"system_tokens": int, "user_tokens": int, "reply_tokens": int, "turns": int}
PRESET_FIELDS = {"in_flight": int, "think_s": float, "think_distribution": str, "pool_blocks": int}


def key_value(text: str) -> tuple[str, str]:
    """A KEY=VALUE command-line argument: a config value, dotted keys as in Serve args."""
    key, sep, value = text.partition("=")
    if not (key and sep):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_serve_proxy_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serve-proxy", action="store_true",
                        help="the local Serve ingress is Serve's Python proxy actor instead of HAProxy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    for name, kind in {**PROFILE_FIELDS, **PRESET_FIELDS}.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, help="overrides the preset's value")
    parser.add_argument("--scenarios", nargs="+", default=["prefix-off", "small-pool", "2-prefill"],
                        choices=["prefix-off", "small-pool", "2-prefill"])
    parser.add_argument("--systems", nargs="+", default=["disagg", "pull", "pull+preserve", "on-decode"],
                        choices=[*PEERS, *APP_SYSTEMS], help="with --url: the systems to run there (not the peers)")
    add_target_args(parser, url_note="run --systems against it instead of the scenarios")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="a config value for every scenario's app and peers (dotted keys, as Serve args); "
                             "repeatable. With --url: what the summary reads about the app there (block_size=16 "
                             "for serve.yaml)")
    add_serve_proxy_flag(parser)
    history.add_flag(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    preset = preset_from_args(args)
    if args.url and set(args.systems) & set(PEERS):
        parser.error(PEERS_ARE_LOCAL)
    config = load_config({"max_model_len": str(preset.max_model_len), **dict(args.set)})
    target = resolve_target(args, config)
    if target.url:
        config = target.app_config(config)
        rows = run(target, args.systems, preset, config)
    else:
        rows, config = run_all(args.scenarios, preset, dict(args.set), haproxy=not args.serve_proxy)
    ingress = target.url or ("Serve's proxy actor" if args.serve_proxy else "Serve's HAProxy ingress")
    summary = f"ingress: {ingress}\n\n" + summarize(rows, config)
    write_results(rows, summary, args.out)
    history.record(args, "multi_turn", history.multi_turn_rows(rows, config.block_size, preset.in_flight))
    print(summary)
    print(f"rows, summary and plot in {args.out}")


if __name__ == "__main__":
    main()
