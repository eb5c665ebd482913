"""The four routing policies side by side, at each prefill replica count, in one run.

For each replica count the embedded default is started with that many prefill replicas (prefix
caching on) and one decode replica; each policy then serves the same number of concurrent
multi-turn conversations (unique nonces), with reverse pulls off so that reuse depends on the
prefill replica chosen. Printed per policy: hit rate of later turns (every full block of the
previous prompt cached), share of later turns on the previous turn's replica, TTFT p50/p95 by turn
index, and tokens prefilled against the ideal.

    python -m benchmarks.routing_policies [--replicas 1 2 --conversations 8 --turns 3]
"""

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import httpx

from app.config import EngineGroupConfig, load_config
from app.routing import RoutingPolicy
from benchmarks.report import ideal_prefill, later_turn_hit, percentile
from benchmarks.workload import Profile, open_target, run_conversation


def summarize(conversations, decisions: dict[str, dict], block_size: int) -> dict[str, str]:
    later = [(p, c) for turns in conversations for p, c in zip(turns, turns[1:])]
    hits = sum(later_turn_hit(c.cached_tokens, p.prompt_tokens, block_size) for p, c in later)
    same = sum(decisions[c.request_id]["prefill_replica"] == decisions[p.request_id]["prefill_replica"]
               for p, c in later)
    prefilled = sum(t.prompt_tokens - t.cached_tokens for turns in conversations for t in turns)
    ideal = sum(sum(ideal_prefill([t.prompt_tokens for t in turns], [len(t.output_ids) for t in turns]))
                for turns in conversations)
    ttft = {}
    for k in range(len(conversations[0])):
        values = [turns[k].ttft_s * 1e3 for turns in conversations]
        ttft[k + 1] = f"{statistics.median(values):.0f}/{percentile(values, 95):.0f}"
    return {"hit rate": f"{hits / len(later):.2f}", "same replica": f"{same / len(later):.2f}",
            "prefilled/ideal": f"{prefilled / ideal:.2f}x",
            "TTFT p50/p95 ms by turn": " ".join(f"t{k}:{v}" for k, v in ttft.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--reply-tokens", type=int, default=16)
    args = parser.parse_args()
    profile = Profile(system_tokens=args.system_tokens, user_tokens=30, reply_tokens=args.reply_tokens,
                      turns=args.turns)
    url = None
    for count in args.replicas:
        config = replace(load_config({}), prefill=EngineGroupConfig(replicas=count, cpus_per_replica=0.5),
                         decode=EngineGroupConfig(replicas=1, cpus_per_replica=0.5))
        if url is None:
            client, tokenizer, url = open_target(None, config)
        else:
            from app.launch import replace_app

            replace_app(config)
        print(f"\n{count} prefill replica(s), 1 decode, {args.conversations} concurrent conversations x "
              f"{args.turns} turns, reverse pull off")
        for policy in (p.value for p in RoutingPolicy):
            with ThreadPoolExecutor(args.conversations) as pool:
                one = partial(run_conversation, client, tokenizer, profile, routing_policy=policy, reverse_pull=False)
                conversations = list(pool.map(one, [f"{policy}-{count}-{i}" for i in range(args.conversations)]))
            decisions = {d["request_id"]: d for d in httpx.get(
                f"{url}/admin/decisions", params={"n": 1000}, headers={"Authorization": "Bearer unused"}).json()}
            row = summarize(conversations, decisions, config.block_size)
            print(f"  {policy:>16}: " + ", ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
