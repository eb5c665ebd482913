"""The multi-turn benchmark: this project against the plain engine and the standard disaggregated
flow, same model, same conversations, one run; rows as Parquet, a Markdown summary, PNG plots.

Systems (`--systems`):
- `vllm`: one plain vLLM engine, aggregated, prefix caching on (vLLM's OpenAI server): the ideal;
- `disagg`: this app with reverse pulls off and template rendering: the standard disaggregated
  flow (prefill recomputes history unless its own cache still has it);
- `pull`: reverse pull on, template rendering;  `pull+preserve`: reverse pull and append-only
  sessions (this project's default).
The app runs with prefill's prefix cache off: the cache-loss scenario of vLLM's experiment.

    python -m benchmarks.multi_turn [--preset default|ci] [--systems vllm disagg pull pull+preserve]
"""

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from app.client import TurnResult, chat_turn
from app.config import AppConfig, load_config
from app.metrics import kv_bytes_per_token
from benchmarks.workload import Profile, text_of_tokens

PRESETS = {"default": (Profile(1500, 150, 64, 10), 4, 1.0), "ci": (Profile(400, 40, 8, 3), 2, 0.2)}
APP_SYSTEMS = {"disagg": {"reverse_pull": False, "conversation_mode": "template"},
               "pull": {"conversation_mode": "template"},
               "pull+preserve": {"conversation_mode": "preserve"}}


@dataclass(frozen=True)
class Row:
    system: str
    conversation: int
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    ttft_s: float
    itl_s: float
    e2e_s: float
    decision: str
    pulled_tokens: int


def conversation_rows(client, tokenizer, system: str, index: int, profile: Profile, think_s: float,
                      extra: dict, rng: random.Random) -> list[tuple[int, TurnResult]]:
    messages = [{"role": "system", "content": text_of_tokens(tokenizer, profile.system_tokens,
                                                             f"[{system} {index} {uuid.uuid4().hex}] ")}]
    results = []
    for k in range(profile.turns):
        if k:
            time.sleep(min(rng.expovariate(1 / think_s), 5 * think_s) if think_s else 0)
        messages.append({"role": "user", "content": text_of_tokens(tokenizer, profile.user_tokens, f"Q{k}: ")})
        result = chat_turn(client, messages, profile.reply_tokens, **extra)
        messages.append({"role": "assistant", "content": result.text})
        results.append((k + 1, result))
    return results


def run_system(url: str, system: str, tokenizer, profile: Profile, in_flight: int, think_s: float,
               extra: dict, progress) -> list[Row]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    with ThreadPoolExecutor(in_flight) as pool:
        futures = [pool.submit(conversation_rows, client, tokenizer, system, i, profile, think_s, extra,
                               random.Random(i)) for i in range(in_flight)]
        conversations = [f.result() for f in futures]
    progress.update(1)
    decisions = _decisions(url) if system in APP_SYSTEMS else {}
    rows = []
    for i, turns in enumerate(conversations):
        for turn, r in turns:
            d = decisions.get(r.request_id, {})
            itl = (r.e2e_s - r.ttft_s) / max(len(r.output_ids) - 1, 1)
            rows.append(Row(system, i, turn, r.prompt_tokens, len(r.output_ids), r.cached_tokens,
                            r.prompt_tokens - r.cached_tokens, r.ttft_s, itl, r.e2e_s, d.get("action", ""),
                            d.get("pulled_tokens", 0)))
    return rows


def _decisions(url: str) -> dict[str, dict]:
    body = httpx.get(f"{url}/admin/decisions", params={"n": 1000}, headers={"Authorization": "Bearer unused"}).json()
    return {d["request_id"]: d for d in body}


def start_plain_vllm(config: AppConfig) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(config.model_path()),
               "--served-model-name", config.model_name, "--dtype", config.engine_dtype, "--block-size",
               str(config.block_size), "--max-model-len", str(config.max_model_len), "--enforce-eager",
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("the plain vLLM server did not start")


def summarize(rows: list[Row], config: AppConfig) -> str:
    systems = list(dict.fromkeys(r.system for r in rows))
    turns = sorted({r.turn for r in rows})
    ideal = _ideal_tokens(rows)
    lines = [f"model {config.model_name} ({config.engine_dtype}), block size {config.block_size}, "
             f"KV {kv_bytes_per_token(config.model_path())} bytes/token, machine {os.cpu_count()} CPU cores", "",
             "| system | turn-1 TTFT p50 ms | later TTFT p50 ms | later TTFT p95 ms | prefilled / ideal "
             "| later-turn hits |",
             "|---|---|---|---|---|---|"]
    later_p50 = {}
    for s in systems:
        mine = [r for r in rows if r.system == s]
        first = [r.ttft_s for r in mine if r.turn == 1]
        later = [r for r in mine if r.turn > 1]
        later_p50[s] = statistics.median(r.ttft_s for r in later)
        hits = sum(r.cached_tokens > 0 for r in later) / len(later)
        lines.append(f"| {s} | {statistics.median(first) * 1e3:.0f} | {later_p50[s] * 1e3:.0f} | "
                     f"{_p95([r.ttft_s for r in later]) * 1e3:.0f} | "
                     f"{sum(r.prefilled_tokens for r in mine) / ideal[s]:.2f}x | {hits:.2f} |")
    lines += ["", "TTFT p50 ms by turn: " + "; ".join(
        f"{s}: " + " ".join(f"{statistics.median(r.ttft_s for r in rows if r.system == s and r.turn == t) * 1e3:.0f}"
                            for t in turns) for s in systems)]
    if "pull+preserve" in later_p50:
        for peer in ("disagg", "vllm"):
            if peer in later_p50:
                lines.append(f"later-turn TTFT p50, pull+preserve / {peer}: "
                             f"{later_p50['pull+preserve'] / later_p50[peer]:.2f}x")
    return "\n".join(lines)


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def _ideal_tokens(rows: list[Row]) -> dict[str, int]:
    """Turn 1's prompt, then only each later turn's new tokens: the reply was computed in decode."""
    ideal: dict[str, int] = {}
    for s in {r.system for r in rows}:
        for c in {r.conversation for r in rows if r.system == s}:
            turns = sorted((r for r in rows if r.system == s and r.conversation == c), key=lambda r: r.turn)
            ideal[s] = ideal.get(s, 0) + turns[0].prompt_tokens + sum(
                max(b.prompt_tokens - a.prompt_tokens - a.completion_tokens, 0) for a, b in zip(turns, turns[1:]))
    return ideal


def write_results(rows: list[Row], summary: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([asdict(r) for r in rows]), out / "rows.parquet")
    (out / "summary.md").write_text(summary + "\n")
    systems = list(dict.fromkeys(r.system for r in rows))
    turns = sorted({r.turn for r in rows})
    figure, (ttft_axis, tokens_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in systems:
        ttft_axis.plot(turns, [statistics.median(r.ttft_s for r in rows if r.system == s and r.turn == t) * 1e3
                               for t in turns], marker="o", label=s)
        per_turn = [sum(r.prefilled_tokens for r in rows if r.system == s and r.turn == t) for t in turns]
        tokens_axis.plot(turns, [sum(per_turn[:i + 1]) for i in range(len(turns))], marker="o", label=s)
    ttft_axis.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="Time to first token by turn")
    tokens_axis.set(xlabel="turn", ylabel="tokens prefilled (cumulative)", title="Prefill work")
    for axis in (ttft_axis, tokens_axis):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "multi_turn.png", dpi=100)


def run(url: str | None, systems: list[str], preset: str, config: AppConfig, progress=None,
        model: str = "tiny-qwen3") -> list[Row]:
    """Run the systems in order; `url` is a running app for the app systems (else one is started)."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    profile, in_flight, think_s = PRESETS[preset]
    tokenizer = AutoTokenizer.from_pretrained(str(config.model_path()))
    progress = progress or tqdm(total=len(systems), desc="systems", file=sys.stderr)
    rows: list[Row] = []
    for system in systems:
        if system == "vllm":
            server, plain_url = start_plain_vllm(config)
            try:
                rows += run_system(plain_url, system, tokenizer, profile, in_flight, think_s, {"model": model},
                                   progress)
            finally:
                server.terminate()
                server.wait(timeout=60)
            continue
        if url is None:
            from app.launch import start_local

            url = start_local(config)
        rows += run_system(url, system, tokenizer, profile, in_flight, think_s, {**APP_SYSTEMS[system], "model": model},
                           progress)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running app (prefill cache off for the cache-loss scenario)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--systems", nargs="+", default=["vllm", "disagg", "pull", "pull+preserve"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    config = load_config({"prefill.prefix_caching": "false"})
    rows = run(args.url, args.systems, args.preset, config)
    summary = summarize(rows, config)
    write_results(rows, summary, args.out)
    print(summary)
    print(f"rows, summary and plot in {args.out}")


if __name__ == "__main__":
    main()
