"""The four routing policies side by side, at each prefill replica count, in one run.

For each replica count the embedded default is started with that many prefill replicas (prefix
caching on) and one decode replica; each policy then serves the same number of concurrent
multi-turn conversations (unique nonces), with reverse pulls off so that reuse depends on the
prefill replica chosen. Printed per policy: hit rate of later turns (every full block of the
previous prompt cached), share of later turns on the previous turn's replica, TTFT p50/p95 by turn
index, and tokens prefilled against the ideal.

    python -m benchmarks.routing_policies [--replicas 1 2 --conversations 8 --turns 3]
    python -m benchmarks.routing_policies --url http://HEAD:8000 [--model NAME --tokenizer HF_ID --api-key KEY]

With --url the policies run on the app there, at the prefill replica count it was deployed with.
"""

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from app.config import EngineGroupConfig, load_config
from app.turn.routing import RoutingPolicy
from benchmarks.report import ideal_prefill, later_turn_hit, percentile
from benchmarks.target import Target, add_target_args, decisions, resolve_target
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


def run_policies(client, tokenizer, target: Target, profile: Profile, conversations: int, label: str,
                 block_size: int) -> None:
    """Each policy in turn on `conversations` concurrent conversations; prints a summary line each."""
    for policy in (p.value for p in RoutingPolicy):
        with ThreadPoolExecutor(conversations) as pool:
            one = partial(run_conversation, client, tokenizer, profile, model=target.model, routing_policy=policy,
                          reverse_pull=False)
            done = list(pool.map(one, [f"{policy}-{label}-{i}" for i in range(conversations)]))
        by_request = {d["request_id"]: d for d in decisions(target.url, target.api_key, 1000)}
        row = summarize(done, by_request, block_size)
        print(f"  {policy:>16}: " + ", ".join(f"{k} {v}" for k, v in row.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--reply-tokens", type=int, default=16)
    add_target_args(parser, url_note="the policies run there, as deployed (--replicas is not used)")
    args = parser.parse_args()
    profile = Profile(system_tokens=args.system_tokens, user_tokens=30, reply_tokens=args.reply_tokens,
                      turns=args.turns)
    target = resolve_target(args, load_config({}))
    if target.url:
        config = target.app_config(load_config({}))
        client, tokenizer, target = open_target(target, config)
        print(f"\nthe app at {target.url} as deployed, {args.conversations} concurrent conversations x "
              f"{args.turns} turns, reverse pull off")
        run_policies(client, tokenizer, target, profile, args.conversations, "deployed", config.block_size)
        return
    for count in args.replicas:
        config = replace(load_config({}), prefill=EngineGroupConfig(replicas=count, cpus_per_replica=0.5),
                         decode=EngineGroupConfig(replicas=1, cpus_per_replica=0.5))
        if target.url is None:
            client, tokenizer, target = open_target(target, config)
        else:
            from app.ops.launch import replace_app

            replace_app(config)
        print(f"\n{count} prefill replica(s), 1 decode, {args.conversations} concurrent conversations x "
              f"{args.turns} turns, reverse pull off")
        run_policies(client, tokenizer, target, profile, args.conversations, str(count), config.block_size)


if __name__ == "__main__":
    main()
