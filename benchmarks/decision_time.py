"""Router decision time with the KV index alone: lookup + routing + pull decision per turn, with
10,000 live conversations retained in the index (target: under 1 ms p99).

    python -m benchmarks.decision_time [--conversations 10000 --prompt-tokens 4000]
"""

import argparse
import random
import statistics
import time

from app.kv.hashing import block_hashes
from app.kv.index import KVIndex
from app.protocol import EngineEndpoint, KVHandoff, ReplicaInfo, RetainedBlocks, Role
from app.turn.decision import PullPolicy
from app.turn.routing import CostWeights, PrefillChooser, RoutingPolicy

BLOCK = 32


def build_index(conversations: int, prompt_tokens: int, prefill_replicas: int, rng: random.Random):
    index = KVIndex(block_size=BLOCK)
    for r in range(prefill_replicas):
        index.register(ReplicaInfo(f"p{r}", Role.PREFILL, EngineEndpoint(f"p{r}", "h", 1), True, BLOCK))
    index.register(ReplicaInfo("d0", Role.DECODE, EngineEndpoint("d0", "h", 2), True, BLOCK))
    sequences = []
    for c in range(conversations):
        tokens = [c, *(rng.randrange(2048) for _ in range(prompt_tokens - 1))]
        handoff = KVHandoff(EngineEndpoint("d0", "h", 2), (tuple(range(prompt_tokens // BLOCK)),), prompt_tokens,
                            f"r{c}", expiry_time=time.time() + 3600)
        index.record_retained("salt", RetainedBlocks("d0", handoff, tuple(tokens), prompt_tokens))
        index.record_prefill(f"p{c % prefill_replicas}", block_hashes(tokens[:prompt_tokens // 2], BLOCK, "salt"))
        sequences.append(tokens)
    return index, sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--prefill-replicas", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    index, sequences = build_index(args.conversations, args.prompt_tokens, args.prefill_replicas, rng)
    chooser = PrefillChooser(RoutingPolicy.KV_AWARE, PullPolicy(BLOCK, 32, 5.0), CostWeights())
    hashing, deciding = [], []
    for _ in range(args.turns):
        prompt = rng.choice(sequences) + [rng.randrange(2048) for _ in range(150)]
        t0 = time.perf_counter()
        hashes = block_hashes(prompt, BLOCK, "salt")
        t1 = time.perf_counter()
        chooser.choose(prompt, index.lookup(hashes), {}, "k", time.time())
        t2 = time.perf_counter()
        hashing.append(t1 - t0)
        deciding.append(t2 - t1)

    def p(values, q):
        return statistics.quantiles(values, n=100)[q - 1] * 1e3

    print(f"{args.conversations} live conversations, {args.prompt_tokens}+150-token prompts, "
          f"{args.prefill_replicas} prefill replicas, index stats {index.stats()}")
    print(f"lookup + routing + decision: p50 {p(deciding, 50):.3f} ms, p99 {p(deciding, 99):.3f} ms "
          f"(target < 1 ms p99)")
    print(f"block hashing of the prompt (router side): p50 {p(hashing, 50):.3f} ms, p99 {p(hashing, 99):.3f} ms")


if __name__ == "__main__":
    main()
