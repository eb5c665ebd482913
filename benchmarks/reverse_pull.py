"""Later-turn TTFT with the reverse pull against recomputing the history, in one run.

Two copies of the same conversation (a unique nonce in each first block) run interleaved turn by
turn on one app whose prefill cache is off (cache loss): one with reverse pulls, one with
`reverse_pull: false` per request. Prints TTFT per turn and the recompute/pull ratio.

    python -m benchmarks.reverse_pull                  # starts the embedded default itself
    python -m benchmarks.reverse_pull --url http://host:8000 [--model NAME --tokenizer HF_ID --api-key KEY]
    python -m benchmarks.reverse_pull --sweep 32 128 512 2048 7500   # transfer vs recompute by size

The sweep runs two-turn conversations with histories from one block to the model's limit and
prints turn 2's TTFT and prefill stage with the pull and recomputing: where the lines cross is
where `recompute_threshold_tokens` should sit on this machine.
"""

import argparse
import statistics
import uuid

from openai import OpenAI

from app.config import load_config
from app.ops.client import TurnResult, chat_turn
from benchmarks.target import Target, add_target_args, decisions, resolve_target
from benchmarks.workload import open_target, text_of_tokens


def run_pair(client: OpenAI, model: str, prompt: str, turns: int, reply_tokens: int) -> dict[str, list[TurnResult]]:
    results: dict[str, list[TurnResult]] = {"pull": [], "recompute": []}
    histories = {mode: [{"role": "system", "content": f"{mode}:{prompt}"}] for mode in results}
    for k in range(turns):
        for mode, messages in histories.items():
            messages.append({"role": "user", "content": f"Question {k}: explain the trade off of step {k}."})
            result = chat_turn(client, messages, reply_tokens, model=model, reverse_pull=mode == "pull",
                               prefill_on_decode=False)
            messages.append({"role": "assistant", "content": result.text})
            results[mode].append(result)
    return results


def report(runs: list[dict[str, list[TurnResult]]], turns: int, prefill_ms: dict[str, float]) -> None:
    """TTFT as the client sees it, and the prefill stage alone (from the router's decision log)."""
    def median_ms(mode: str, k: int, stage: bool = False) -> float:
        return statistics.median(prefill_ms[r[mode][k].request_id] if stage else r[mode][k].ttft_s * 1e3
                                 for r in runs)

    print(f"{'turn':>4} {'prompt':>7} {'pulled':>7} | {'TTFT ms: pull':>13} {'recompute':>9} {'ratio':>6} | "
          f"{'prefill ms: pull':>16} {'recompute':>9} {'ratio':>6}")
    ratios = []
    for k in range(turns):
        first = runs[0]["pull"][k]
        ttft = median_ms("pull", k), median_ms("recompute", k)
        stage = median_ms("pull", k, True), median_ms("recompute", k, True)
        print(f"{k + 1:>4} {first.prompt_tokens:>7} {first.cached_tokens:>7} | {ttft[0]:>13.1f} {ttft[1]:>9.1f} "
              f"{ttft[1] / ttft[0]:>5.2f}x | {stage[0]:>16.1f} {stage[1]:>9.1f} {stage[1] / stage[0]:>5.2f}x")
        if k:
            ratios.append((ttft[1] / ttft[0], stage[1] / stage[0]))
    print(f"later turns, median ratio recompute/pull: TTFT {statistics.median(r[0] for r in ratios):.2f}x, "
          f"prefill stage {statistics.median(r[1] for r in ratios):.2f}x")


def sweep(client: OpenAI, target: Target, tokenizer, sizes: list[int], repeats: int) -> None:
    runs = {n: [run_pair(client, target.model, text_of_tokens(tokenizer, n, f"[{uuid.uuid4().hex}] "), 2, 8)
                for _ in range(repeats)] for n in sizes}
    prefill_ms = _prefill_ms(target)
    print(f"{'history':>8} | {'TTFT ms: pull':>13} {'recompute':>9} | {'prefill ms: pull':>16} {'recompute':>9} "
          f"| {'recompute/pull':>14}")
    for n, pairs in runs.items():
        ttft = [statistics.median(p[mode][1].ttft_s * 1e3 for p in pairs) for mode in ("pull", "recompute")]
        stage = [statistics.median(prefill_ms[p[mode][1].request_id] for p in pairs) for mode in ("pull", "recompute")]
        print(f"{n:>8} | {ttft[0]:>13.1f} {ttft[1]:>9.1f} | {stage[0]:>16.1f} {stage[1]:>9.1f} "
              f"| {ttft[1] / ttft[0]:>6.2f}x TTFT {stage[1] / stage[0]:>5.2f}x prefill")


def _prefill_ms(target: Target) -> dict[str, float]:
    return {d["request_id"]: d["prefill_ms"] for d in decisions(target.url, target.api_key, 10_000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(parser, url_note="it needs prefill's prefix cache off there (prefill.prefix_caching: false), "
                                     "and for --sweep recompute_threshold_tokens: 0")
    parser.add_argument("--system-tokens", type=int, default=1400)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", type=int, nargs="+", help="history sizes in tokens: transfer vs recompute")
    args = parser.parse_args()

    overrides = {"prefill.prefix_caching": "false"}
    if args.sweep:  # pull even one block, to see where pulling stops paying
        overrides["recompute_threshold_tokens"] = "0"
    config = load_config(overrides)
    client, tokenizer, target = open_target(resolve_target(args, config), config)
    chat_turn(client, [{"role": "user", "content": "warm up"}], 4, model=target.model)
    if args.sweep:
        sweep(client, target, tokenizer, args.sweep, args.repeats)
        return
    runs = [run_pair(client, target.model, text_of_tokens(tokenizer, args.system_tokens, f"[{uuid.uuid4().hex}] "),
                     args.turns, args.reply_tokens) for _ in range(args.repeats)]
    report(runs, args.turns, _prefill_ms(target))
    later = [d for d in decisions(target.url, target.api_key, 10_000) if d["action"] == "pull"]
    if later:
        print("pull turns, median ms: plan {:.1f}, prefill {:.1f}, decode first token {:.1f}".format(
            *(statistics.median(d.get(k, 0.0) for d in later) for k in ("plan_ms", "prefill_ms",
                                                                      "decode_first_token_ms"))))


if __name__ == "__main__":
    main()
