"""The agent benchmark: concurrent agent tasks, each a loop of tool calls whose results are appended
to a growing history, with a pause while each tool runs; every system in one run.

A task: a system prompt (nonce first) and a question; then `calls` turns, each answered with a
call of the `lookup` tool (a named tool choice, which vLLM constrains to the tool's schema, so the
random-weight model makes real, parseable calls), followed by the tool's result (`result_tokens`
of text) after the tool's latency; then an answer without tools. Every turn after the first is an
append to the history, which is where keeping the KV across turns pays.

Systems, as in `benchmarks.sweep` (all up for the whole run, each driven alone): `app` (the
embedded default); `ideal`: one plain vLLM engine fed the app's prompt token ids through
`/v1/completions`, with the same constraint on each call (equal replies, greedy); `vllm`: that
engine through its chat API with vLLM's own tool parser (`--tool-call-parser`), as users run it;
`serve-llm`: Ray Serve LLM's P/D app. The peers get the app's engine settings.

Presets: `issue` is issue 36's workload (5-30 calls, results of 50-5,000 tokens, tools of
0.1-10 s), which needs a model context of about 160k tokens (a GPU layout, `--url`); `cpu` scales the
calls and results to the embedded model's 8,192-token context (the handicap is in the output).

    python -m benchmarks.agent [--preset cpu|issue] [--concurrency 1,4,16,32,64] [--repeats 1]
                               [--systems app ideal vllm serve-llm]
    python -m benchmarks.agent --url http://HEAD:8000 --preset issue [--model ... --tokenizer ... --api-key ...]
"""

import argparse
import math
import random
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from app.config import AppConfig, load_config
from app.metrics import kv_bytes_per_token
from app.ops.client import TurnResult, chat_turn, completion_turn
from app.turn.spec import turn_priority
from benchmarks import history
from benchmarks.multi_turn import app_decisions, key_value, warm_up
from benchmarks.report import Row, percentile
from benchmarks.sweep import Conversation, converse, rows_for
from benchmarks.sweep_summary import APP_EXTRA, LevelSummary, core_handicap
from benchmarks.target import NO_KEY, PEERS_ARE_LOCAL, Target, add_target_args, resolve_target
from benchmarks.workload import load_tokenizer, openai_client, text_of_tokens

SYSTEMS = ("app", "ideal", "vllm", "serve-llm")
TOPICS = ("weather", "time", "stock", "flight", "news", "recipe", "traffic", "score")
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a topic up.", "strict": True,
    "parameters": {"type": "object", "properties": {"topic": {"type": "string", "enum": list(TOPICS)}},
                   "required": ["topic"], "additionalProperties": False}}}
CALL = {"type": "function", "function": {"name": "lookup"}}
CALL_TOKENS = 128
"""A bound on a call's length: the call ends the reply well before it (the random weights spell the
tool-call markup out character by character: about 60 tokens)."""
ANSWER_TOKENS = 32


@dataclass(frozen=True)
class Preset:
    calls: tuple[int, int]
    result_tokens: tuple[int, int]
    tool_s: tuple[float, float]
    """Ranges, drawn log-uniformly (calls uniformly)."""
    system_tokens: int = 1000
    task_tokens: int = 100
    max_model_len: int = 8192


PRESETS = {"issue": Preset(calls=(5, 30), result_tokens=(50, 5000), tool_s=(0.1, 10.0), max_model_len=163840),
           "cpu": Preset(calls=(3, 8), result_tokens=(20, 600), tool_s=(0.1, 2.0))}


@dataclass(frozen=True)
class AgentTask:
    """What the client sends: the opening messages, each tool result, and each tool's latency
    (`think_s`, as a conversation plan's think times, for `benchmarks.sweep.converse`)."""

    system: str
    question: str
    results: tuple[str, ...]
    think_s: tuple[float, ...]


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def plan_task(tokenizer, preset: Preset, nonce: str, seed: int) -> AgentTask:
    """Results drawn until the calls are made or the next one would not fit the context."""
    rng = random.Random(seed)
    room = preset.max_model_len - preset.system_tokens - preset.task_tokens - 2 * ANSWER_TOKENS
    sizes: list[int] = []
    for _ in range(rng.randint(*preset.calls)):
        size = int(_log_uniform(rng, *preset.result_tokens))
        if sum(sizes) + size + (len(sizes) + 1) * (CALL_TOKENS + 16) > room:
            break
        sizes.append(size)
    return AgentTask(text_of_tokens(tokenizer, preset.system_tokens, f"[{nonce}] "),
                     text_of_tokens(tokenizer, preset.task_tokens, "Task: "),
                     tuple(text_of_tokens(tokenizer, n, f"Result {k}: ") for k, n in enumerate(sizes)),
                     tuple(_log_uniform(rng, *preset.tool_s) for _ in sizes))


def call_bias(config: AppConfig, tokenizer) -> dict:
    """The embedded model's calls need its blank_token_bias to end (every system gets it), whether
    the benchmark started it or reaches it by --url (which names the model by its served name)."""
    from app.config import TINY_MODEL
    from app.model.tiny import blank_token_bias

    return {"logit_bias": blank_token_bias(tokenizer)} if config.model_name == TINY_MODEL else {}


def chat_sender(client, task: AgentTask, extra: dict, bias: dict):
    """Turn k: a call while results remain, then the answer; each call's result appended as a tool message."""
    messages = [{"role": "system", "content": task.system}, {"role": "user", "content": task.question}]
    tools = {"tools": [LOOKUP], **extra}

    def send(k: int) -> TurnResult:
        if k == len(task.results):
            return chat_turn(client, messages, ANSWER_TOKENS, **tools, tool_choice="none")
        result = chat_turn(client, messages, CALL_TOKENS, **tools, **bias, tool_choice=CALL, ignore_eos=False)
        calls = result.tool_calls or [{"id": f"call_{k}", "type": "function",
                                       "function": {"name": "lookup", "arguments": "{}"}}]
        messages.append({"role": "assistant", "content": result.text or None, "tool_calls": calls})
        messages.extend({"role": "tool", "tool_call_id": c["id"], "content": task.results[k]} for c in calls)
        return result

    return send


def drive_chat(url: str, tasks: list[AgentTask], extra: dict, bias: dict, api_key: str = NO_KEY) -> list[Conversation]:
    client = openai_client(url, api_key)
    began = time.perf_counter()
    with ThreadPoolExecutor(len(tasks)) as pool:
        return list(pool.map(lambda t: converse(t, chat_sender(client, t, extra, bias), began), tasks))


def call_constraint(config: AppConfig, bias: dict) -> dict:
    """The sampling the app gives a call (vLLM's parser's constraint for the named choice), as
    completions fields, so the ideal's greedy replies equal the app's."""
    from app.conversations.openai_api import ChatCompletionRequest
    from app.conversations.reply_parsing import ReplyParsing
    from app.protocol import SamplingSettings

    body = ChatCompletionRequest.model_validate({"model": config.model_name, "tools": [LOOKUP], "tool_choice": CALL,
                                                 "messages": [{"role": "user", "content": "x"}]})
    settings = ReplyParsing.of(config).constrain(body, SamplingSettings())
    structured = ({"structural_tag": settings.structural_tag} if settings.structural_tag
                  else {"json": settings.json_schema})
    return {"structured_outputs": structured, "skip_special_tokens": settings.skip_special_tokens, "ignore_eos": False,
            **bias}


def drive_prompts(url: str, tasks: list[AgentTask], app_done: list[Conversation], config: AppConfig,
                  bias: dict) -> list[Conversation]:
    """The app's prompt ids of each turn, with its reply lengths, priorities and call constraint."""
    client, constraint = openai_client(url), call_constraint(config, bias)
    began = time.perf_counter()

    def run(i: int) -> Conversation:
        turns = [r for _, r in app_done[i].turns]
        task = tasks[i]
        task = AgentTask(task.system, task.question, task.results[:len(turns) - 1], task.think_s[:len(turns) - 1])

        def send(k: int) -> TurnResult:
            priority = {"priority": turn_priority(later=k > 0)} if config.later_turns_first else {}
            answer = k == len(tasks[i].results)
            return completion_turn(client, turns[k].prompt_ids, ANSWER_TOKENS if answer else len(turns[k].output_ids),
                                   model=config.model_name, **priority, **({} if answer else constraint))

        return converse(task, send, began)

    with ThreadPoolExecutor(len(tasks)) as pool:
        return list(pool.map(run, range(len(tasks))))


def history_reused(rows: list[Row]) -> list[float]:
    """Per later turn: the share of its history (the previous turn's prompt and reply) it did not compute."""
    shares = []
    by_task: dict[tuple[int, int], list[Row]] = {}
    for r in rows:
        by_task.setdefault((r.repeat, r.conversation), []).append(r)
    for turns in by_task.values():
        turns.sort(key=lambda r: r.turn)
        shares += [min(b.cached_tokens / (a.prompt_tokens + a.completion_tokens), 1.0)
                   for a, b in zip(turns, turns[1:]) if not b.error]
    return shares


def run_level(level: int, repeat: int, systems: list[str], urls: dict[str, str], tokenizer, preset: Preset,
              config: AppConfig, api_key: str) -> list[Row]:
    rows: list[Row] = []
    bias = call_bias(config, tokenizer)
    tasks = [plan_task(tokenizer, preset, f"agent {level} {repeat} {i} {uuid.uuid4().hex}", seed=i)
             for i in range(level)]
    app_done: list[Conversation] = []
    for system in systems:
        if system == "ideal":
            if not app_done:
                raise ValueError("the ideal replays the app's prompts: run `app` before `ideal`")
            done = drive_prompts(urls[system], tasks, app_done, config, bias)
        else:
            fresh = [AgentTask(f"[{system} {uuid.uuid4().hex}] {t.system}", t.question, t.results, t.think_s)
                     for t in tasks]
            done = drive_chat(urls[system], tasks if system == "app" else fresh,
                              {"model": config.model_name}, bias, api_key)
        decisions = app_decisions(urls[system], api_key) if system in APP_EXTRA else {}
        rows += rows_for(system, level, repeat, done, decisions,
                         kv_bytes_per_token(config.model_path()) if system in APP_EXTRA else 0)
        if system == "app":
            app_done = done
    return rows


TARGETS = (("later_p50", "serve-llm", 0.3), ("later_p50", "ideal", 1.2), ("prefilled_over_ideal", None, 1.05))
"""Issue 36's targets at every level: the app's value over the peer's (None: the value itself)."""


def summarize(rows: list[Row], block_size: int, preset_name: str) -> str:
    lines = [f"preset {preset_name}: {PRESETS[preset_name]}", "",
             "| tasks | system | turns | turn-1 TTFT p50 ms | later TTFT p50 / p99 ms | prefilled / ideal "
             "| history reused p50 / p5 | failed |", "|" + "---|" * 8]
    table = {}
    for level in sorted({r.concurrency for r in rows}):
        for system in dict.fromkeys(r.system for r in rows):
            group = [r for r in rows if r.system == system and r.concurrency == level]
            if not group:
                continue
            table[system, level] = s = LevelSummary.of(group, block_size)
            reused = history_reused(group)
            lines.append(f"| {level} | {system} | {sum(not r.error for r in group)} | {s.first_p50 * 1e3:.0f} | "
                         f"{s.later_p50 * 1e3:.0f} / {s.later_p99 * 1e3:.0f} | {s.prefilled_over_ideal:.2f}x | "
                         f"{statistics.median(reused):.3f} / {percentile(reused, 5):.3f} | {s.failed} |")
    lines += core_handicap({r.system for r in rows})
    lines += ["", "Targets (issue 36), app at each level:"]
    for level in sorted({n for _, n in table}):
        mine = table.get(("app", level))
        if mine is None:
            continue
        parts = []
        for name, peer, limit in TARGETS:
            if peer is None:
                parts.append(f"{name} {getattr(mine, name):.2f} (target <= {limit})")
            elif (peer, level) in table:
                parts.append(f"{name} / {peer} {getattr(mine, name) / getattr(table[peer, level], name):.2f}x "
                             f"(target <= {limit})")
        reused = history_reused([r for r in rows if r.system == "app" and r.concurrency == level])
        parts.append(f"turns reusing >= 95 % of their history {sum(s >= 0.95 for s in reused) / len(reused):.2f}")
        lines.append(f"- {level} tasks: " + "; ".join(parts))
    return "\n".join(lines)


def start_systems(systems: list[str], config: AppConfig, running: ExitStack) -> dict[str, str]:
    from app.ops.launch import replace_app, start_serve
    from benchmarks.peers import plain_vllm, serve_llm_pd

    proxy_url, urls = start_serve(), {}
    if "app" in systems:
        replace_app(config)
        urls["app"] = proxy_url
    if {"ideal", "vllm"} & set(systems):
        urls["ideal"] = urls["vllm"] = running.enter_context(plain_vllm(config))
    if "serve-llm" in systems:
        urls["serve-llm"] = running.enter_context(serve_llm_pd(config, proxy_url))
    return urls


def write(rows: list[Row], summary: str, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([asdict(r) for r in rows]), out / "rows.parquet")
    (out / "summary.md").write_text(summary + "\n")
    plot(rows, out)


def plot(rows: list[Row], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 5))
    levels = sorted({r.concurrency for r in rows})
    for system in dict.fromkeys(r.system for r in rows):
        points = [(n, [r.ttft_s * 1e3 for r in rows if r.system == system and r.concurrency == n and r.turn > 1
                       and not r.error]) for n in levels]
        points = [(n, statistics.median(v)) for n, v in points if v]
        axis.plot([n for n, _ in points], [v for _, v in points], "o-", label=system)
    axis.set(xscale="log", yscale="log", xlabel="concurrent agent tasks", ylabel="later-turn TTFT p50 ms",
             title="Agent tool turns", xticks=levels, xticklabels=[str(n) for n in levels])
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "agent.png", dpi=100)


def run(levels: list[int], repeats: int, systems: list[str], preset_name: str, config: AppConfig,
        target: Target) -> list[Row]:
    tokenizer = load_tokenizer(config)
    preset = PRESETS[preset_name]
    with ExitStack() as running:
        urls = {"app": target.url} if target.url else start_systems(systems, config, running)
        for url in dict.fromkeys(urls.values()):
            warm_up(url, tokenizer, {"model": config.model_name}, target.api_key)
        rows: list[Row] = []
        for level in levels:
            for repeat in range(repeats):
                rows += run_level(level, repeat, systems, urls, tokenizer, preset, config, target.api_key)
            print(f"{level} tasks done", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated task counts")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: every system; with --url: app")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="a config value for the app and every peer (dotted keys, as Serve args)")
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results") / f"agent-{time.strftime('%Y%m%d-%H%M%S')}")
    add_target_args(parser, url_note=PEERS_ARE_LOCAL)
    history.add_flag(parser)
    args = parser.parse_args()
    systems = args.systems or (["app"] if args.url else list(SYSTEMS))
    if args.url and systems != ["app"]:
        parser.error(PEERS_ARE_LOCAL)
    preset = PRESETS[args.preset]
    config = load_config({"max_model_len": str(preset.max_model_len), **dict(args.set)})
    target = resolve_target(args, config)
    config = target.app_config(config)
    rows = run([int(n) for n in args.concurrency.split(",")], args.repeats, systems, args.preset, config, target)
    summary = summarize(rows, config.block_size, args.preset)
    print(summary, flush=True)
    write(rows, summary, args.out)
    history.record(args, "agent", history.agent_rows(rows, config.block_size, args.preset))
    print(f"rows, summary and plot in {args.out}")


if __name__ == "__main__":
    main()
