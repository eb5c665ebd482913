"""The concurrency sweep: every system at each level of concurrent conversations, in one run.

Systems (all up for the whole run, each driven alone while the others idle):
- `app`: this project's default, `serve run app:graph` as shipped; `app-fixed`: the same
  deployment with the fixed placement rule per request (load-aware placement off);
- `ideal`: one plain vLLM engine fed exactly the app's prompt token ids of the same level through
  `/v1/completions` with the app's per-turn priorities (same reuse and scheduling, no rendering, no
  disaggregation): the single-engine ideal;
- `vllm`: the same plain vLLM engine through its chat API, as users run it today;
- `serve-llm`: Ray Serve LLM's `build_pd_openai_app` (one prefill, one decode, NIXL).
Every engine gets the app's engine settings (block size, pool, stream interval, prefix caching,
scheduler limits and policy, process priority);
the plain engine has both cores, each disaggregated engine one.

With `--repeats N` each level runs N times, the systems in turn each time (app, ideal, app,
ideal, ...), and the summary pools the repeats: on a shared machine a slow minute then falls on
both systems' halves rather than on one system's whole level. The summary also gives, per repeat,
the benchmark client's CPU per reply: a system's client does the same work per reply in every run
(the ideal's, which sends token ids, more than the app's), so it reads how fast the machine ran.

Workload (issue 14): three-turn conversations through the official `openai` client, streaming,
32-token replies with `ignore_eos`, ~1k-token system prompts, exponential think time (1 s mean).

    python -m benchmarks.sweep [--concurrency 1,4,16,32,64] [--systems app ideal vllm serve-llm]
                               [--repeats 2] [--set later_turns_first=false ...]
    python -m benchmarks.sweep --url http://HEAD:8000 [--model NAME --tokenizer HF_ID --api-key KEY]
                               [--set block_size=16]

With --url the sweep measures only the app at that URL (`app`, `app-fixed`): the peers are started
on this machine and cannot be started on someone else's cluster, so their rows are absent and no
ratio against them is computed. --set then tells the summary what the endpoint does not (the app's
block size: 16 in serve.yaml).
"""

import argparse
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

from app.config import AppConfig, load_config
from app.metrics import kv_bytes_per_token
from app.ops.client import TurnResult, chat_turn, completion_turn
from app.turn.spec import turn_priority
from benchmarks import history
from benchmarks.cpu_profile import snapshot, spent_since
from benchmarks.multi_turn import app_decisions, key_value, rows_of
from benchmarks.report import Row
from benchmarks.sweep_summary import APP_EXTRA, CpuUse, cpu_lines, machine_lines, plot, summarize
from benchmarks.target import NO_KEY, PEERS_ARE_LOCAL, Target, add_target_args, resolve_target
from benchmarks.workload import ConversationPlan, Profile, load_tokenizer, openai_client, plan_conversation

SYSTEMS = ("app", "app-fixed", "ideal", "vllm", "serve-llm")
PEERS_ABSENT = (f"{PEERS_ARE_LOCAL} ({', '.join(APP_EXTRA)}); rows for the peers "
                f"({', '.join(s for s in SYSTEMS if s not in APP_EXTRA)}) are absent and no ratio against them "
                "is computed")
"""What --url leaves out, in the help and in the output."""
PROFILE = Profile(system_tokens=1000, user_tokens=100, reply_tokens=32, turns=3)
THINK_S = 1.0


@dataclass
class Conversation:
    """One conversation as the client saw it: (sent at, result) per turn until the first failure."""

    turns: list[tuple[float, TurnResult]]
    error: str = ""
    failed_at: float = 0.0


def _error_of(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    return str(status) if status else type(exc).__name__


def converse(plan: ConversationPlan, send, began: float) -> Conversation:
    """The plan's turns through `send(k) -> TurnResult`, with its think times; stops at a failure."""
    done = Conversation([])
    for k, think_s in enumerate((0.0, *plan.think_s)):
        time.sleep(think_s)
        sent = time.perf_counter() - began
        try:
            done.turns.append((sent, send(k)))
        except openai.OpenAIError as exc:
            done.error, done.failed_at = _error_of(exc), sent
            break
    return done


def chat_sender(client, plan: ConversationPlan, reply_tokens: int, extra: dict):
    messages = [{"role": "system", "content": plan.system}]

    def send(k: int) -> TurnResult:
        messages.append({"role": "user", "content": plan.user_turns[k]})
        result = chat_turn(client, messages, reply_tokens, **extra)
        messages.append({"role": "assistant", "content": result.text})
        return result

    return send


def plans(tokenizer, level: int, tag: str) -> list[ConversationPlan]:
    return [plan_conversation(tokenizer, PROFILE, f"{tag} {i} {uuid.uuid4().hex}", THINK_S, seed=i)
            for i in range(level)]


def drive_chat(url: str, conversations: list[ConversationPlan], extra: dict,
               api_key: str = NO_KEY) -> list[Conversation]:
    client = openai_client(url, api_key)
    began = time.perf_counter()
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda p: converse(p, chat_sender(client, p, PROFILE.reply_tokens, extra), began),
                             conversations))


def drive_prompts(url: str, conversations: list[ConversationPlan], prompts: list[list[list[int]]],
                  config: AppConfig) -> list[Conversation]:
    """The same conversations as token ids: `prompts[i][k]` is conversation i's turn k prompt, as
    the app rendered it (a conversation the app failed ends where it failed), with the priority the
    app gives that turn."""
    client, model = openai_client(url), config.model_name
    began = time.perf_counter()

    def priority(k: int) -> dict:
        return {"priority": turn_priority(later=k > 0)} if config.later_turns_first else {}

    def run(i: int) -> Conversation:
        plan = conversations[i]
        plan = ConversationPlan(plan.system, plan.user_turns[:len(prompts[i])], plan.think_s)
        return converse(plan, lambda k: completion_turn(client, prompts[i][k], PROFILE.reply_tokens, model=model,
                                                        **priority(k)), began)

    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(run, range(len(conversations))))


def rows_for(system: str, level: int, repeat: int, conversations: list[Conversation], decisions: dict,
             bytes_per_token: int) -> list[Row]:
    from benchmarks.multi_turn import SystemRun

    run = SystemRun(system, turns=[c.turns for c in conversations])
    rows = [Row(**{**asdict(r), "concurrency": level, "repeat": repeat})
            for r in rows_of(f"c{level}", run, decisions, {}, bytes_per_token)]
    failed = [Row(f"c{level}", system, i, len(c.turns) + 1, c.failed_at, 0, 0, 0, 0, 0.0, 0.0, 0.0, "", 0, 0,
                  0.0, 0.0, 0.0, concurrency=level, repeat=repeat, error=c.error)
              for i, c in enumerate(conversations) if c.error]
    return rows + failed


def write(rows: list[Row], cpu: list[CpuUse], summary: str, config: AppConfig, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([asdict(r) for r in rows]), out / "rows.parquet")
    pq.write_table(pa.Table.from_pylist([{"system": c.system, "concurrency": c.concurrency, "repeat": c.repeat,
                                          "replies": c.replies, "role": role, "cpu_s": seconds}
                                         for c in cpu for role, seconds in c.seconds_by_role.items()]),
                   out / "cpu.parquet")
    (out / "summary.md").write_text(summary + "\n")
    plot(rows, config.block_size, out)


def sweep(levels: list[int], repeats: int, systems: list[str], config: AppConfig, peer_config: AppConfig,
          target: Target) -> tuple[list[Row], list[CpuUse]]:
    """Start every system once (the peers' engines from `peer_config`), then at each level drive
    each in turn (the app first: the ideal replays its prompts), `repeats` times. With the target's
    URL only the app's systems run, on the app there; `config` then describes it (Target.app_config)."""
    from benchmarks.multi_turn import warm_up

    tokenizer = load_tokenizer(config)
    with ExitStack() as running:
        if target.url:
            urls = dict.fromkeys(APP_EXTRA, target.url)
        else:
            urls = start_systems(systems, config, peer_config, running)
        for url in dict.fromkeys(urls[s] for s in systems):
            warm_up(url, tokenizer, {"model": config.model_name}, target.api_key)
        rows: list[Row] = []
        cpu: list[CpuUse] = []
        for level in levels:
            for repeat in range(repeats):
                rows += run_level(level, repeat, systems, urls, tokenizer, config, cpu, target.api_key)
            print(f"{level} conversations done", file=sys.stderr)
    return rows, cpu


def start_systems(systems: list[str], config: AppConfig, peer_config: AppConfig, running: ExitStack) -> dict[str, str]:
    """A local Serve with the app and the peers `systems` need (they stop with `running`); each system's URL."""
    from app.ops.launch import replace_app, start_serve
    from benchmarks.peers import plain_vllm, serve_llm_pd

    proxy_url = start_serve()
    urls = {}
    if set(APP_EXTRA) & set(systems):
        replace_app(config)
        urls.update(dict.fromkeys(APP_EXTRA, proxy_url))
    if {"ideal", "vllm"} & set(systems):
        urls["ideal"] = urls["vllm"] = running.enter_context(plain_vllm(peer_config))
    if "serve-llm" in systems:
        urls["serve-llm"] = running.enter_context(serve_llm_pd(peer_config, proxy_url))
    return urls


def run_level(level: int, repeat: int, systems: list[str], urls: dict[str, str], tokenizer, config: AppConfig,
              cpu: list[CpuUse], api_key: str = NO_KEY) -> list[Row]:
    """Every system in turn on new conversations (the ideal on the app's); `api_key` on every request."""
    rows: list[Row] = []
    app_plans: list[ConversationPlan] = []
    prompts: list[list[list[int]]] | None = None
    bytes_per_token = kv_bytes_per_token(config.model_path())
    for system in systems:
        before = snapshot()
        if system == "ideal":
            if prompts is None:
                raise ValueError("the ideal replays the app's prompts: run `app` before `ideal`")
            done = drive_prompts(urls[system], app_plans, prompts, config)
        else:
            conversations = plans(tokenizer, level, system)
            done = drive_chat(urls[system], conversations, {"model": config.model_name, **APP_EXTRA.get(system, {})},
                              api_key)
        cpu.append(CpuUse(system, level, repeat, sum(len(c.turns) for c in done), spent_since(before)))
        decisions = app_decisions(urls[system], api_key) if system in APP_EXTRA else {}
        rows += rows_for(system, level, repeat, done, decisions, bytes_per_token if system in APP_EXTRA else 0)
        if system == "app":
            app_plans, prompts = conversations, [[r.prompt_ids for _, r in c.turns] for c in done]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated conversation counts")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        help=f"default: every system; with --url: {' '.join(APP_EXTRA)}")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each level, the systems in turn each time, pooled in the summary")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="a config value for the app and every peer (dotted keys, as Serve args), e.g. "
                             "later_turns_first=false; repeatable. With --url: what the summary reads about the "
                             "app there (block_size=16 for serve.yaml)")
    parser.add_argument("--peer-set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="a config value for the peers' engines only, after --set (an engine setting the "
                             "app's groups have apart, e.g. 'prefill.engine_kwargs={max_num_batched_tokens: 2048}' "
                             "for the plain engine)")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    add_target_args(parser, url_note=PEERS_ABSENT)
    history.add_flag(parser)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    systems = args.systems or list(APP_EXTRA if args.url else SYSTEMS)
    if args.url and set(systems) - set(APP_EXTRA):
        parser.error(PEERS_ABSENT)
    config = load_config({"max_model_len": "4096", **dict(args.set)})
    peer_config = load_config({"max_model_len": "4096", **dict(args.set), **dict(args.peer_set)})
    target = resolve_target(args, config)
    config = target.app_config(config)
    rows, cpu = sweep([int(n) for n in args.concurrency.split(",")], args.repeats, systems, config, peer_config,
                      target)
    heading = [f"target: {target.url}, model {target.model}; {PEERS_ABSENT}"] if target.url else []
    summary = "\n\n".join((*heading, summarize(rows, config), machine_lines(rows, cpu, config), cpu_lines(cpu)))
    print(summary, flush=True)
    write(rows, cpu, summary, config, args.out)
    history.record(args, "sweep", history.sweep_rows(rows, config.block_size))
    print(f"rows, summary and plot in {args.out}")


if __name__ == "__main__":
    main()
