"""Eviction-horizon probe (seed 002): two-turn conversations with a unique first block, a
controlled pause between the turns, under background load. Turn-2 TTFT stays at the cached floor
while the pause is inside the horizon and jumps to the full prefill cost once it is not.

Scaled to finish in minutes here: a prefill pool of `--pool-blocks` blocks, reverse pulls off (so
turn 2 can only hit prefill's own prefix cache), one background client sending fresh prompts.

    python -m benchmarks.eviction_horizon [--pauses 0 2 4 8 16 --pool-blocks 256 --load-interval-s 0.5]
                                          [--url URL --model NAME --tokenizer HF_ID --api-key KEY]

With --url the app there runs with its own prefill pool (--pool-blocks sizes only the local one):
the pauses must then reach its own horizon, which the router's estimate printed last tells.
"""

import argparse
import statistics
import threading
import time
import uuid

from app.config import load_config
from app.ops.client import chat_turn
from benchmarks.target import add_target_args, decisions, resolve_target
from benchmarks.workload import open_target, text_of_tokens


def background_load(client, model: str, tokenizer, stop: threading.Event, prompt_tokens: int,
                    interval_s: float) -> None:
    """Fresh prompts, one at a time, `interval_s` apart: the rate of newly computed tokens."""
    while not stop.wait(interval_s):
        prompt = text_of_tokens(tokenizer, prompt_tokens, f"[load {uuid.uuid4().hex}] ")
        chat_turn(client, [{"role": "user", "content": prompt}], 1, model=model, reverse_pull=False)


def probe(client, model: str, tokenizer, pause_s: float, system_tokens: int) -> tuple[float, int, int]:
    messages = [{"role": "system", "content": text_of_tokens(tokenizer, system_tokens, f"[{uuid.uuid4().hex}] ")},
                {"role": "user", "content": "Summarise section two."}]
    first = chat_turn(client, messages, 8, model=model, reverse_pull=False)
    time.sleep(pause_s)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now list the risks."}]
    second = chat_turn(client, messages, 8, model=model, reverse_pull=False)
    return second.ttft_s, second.cached_tokens, second.prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(parser)
    parser.add_argument("--pauses", type=float, nargs="+", default=[0, 2, 4, 8, 16])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--pool-blocks", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=1200)
    parser.add_argument("--load-tokens", type=int, default=600)
    parser.add_argument("--load-interval-s", type=float, default=0.5)
    args = parser.parse_args()
    config = load_config({"prefill.engine_kwargs": f"{{num_gpu_blocks_override: {args.pool_blocks}}}",
                          "max_model_len": "2048"})
    client, tokenizer, target = open_target(resolve_target(args, config), config)
    stop = threading.Event()
    loader = threading.Thread(target=background_load, daemon=True,
                              args=(client, target.model, tokenizer, stop, args.load_tokens, args.load_interval_s))
    loader.start()
    local_pool = f"prefill pool {args.pool_blocks} blocks x {config.block_size} tokens"
    pool = f"the prefill pool at {target.url}" if args.url else local_pool
    print(f"{pool}; background prompts of "
          f"{args.load_tokens} tokens every {args.load_interval_s} s; turn 1 of {args.system_tokens}+ tokens")
    print(f"{'pause s':>7} {'turn-2 TTFT ms (median)':>24} {'cached/prompt (median)':>23}")
    try:
        for pause in args.pauses:
            samples = [probe(client, target.model, tokenizer, pause, args.system_tokens) for _ in range(args.trials)]
            ttft = statistics.median(s[0] for s in samples) * 1e3
            cached = statistics.median(s[1] for s in samples)
            print(f"{pause:>7.1f} {ttft:>24.1f} {cached:>12.0f}/{samples[0][2]}")
    finally:
        stop.set()
    estimates = [d["eviction_horizon_s"] for d in decisions(target.url, target.api_key, 200)
                 if d.get("eviction_horizon_s")]
    if estimates:
        print(f"router's estimate (pool - pinned) / rate, median of the last {len(estimates)} turns: "
              f"{statistics.median(estimates):.1f} s")


if __name__ == "__main__":
    main()
