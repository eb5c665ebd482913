"""Tokens prefilled per turn and over a conversation, per rendering mode, against the ideal.

Seed 002's profile (1,500-token system prompt, 150-token user turns, 350-token replies, ten
turns) on one app with prefill's prefix cache off, so prefill computes whatever was not pulled:
- preserve: append-only rendering + reverse pull (this project's default);
- template: the model's template every turn + reverse pull;
- no reuse: template rendering, no reverse pull.
Ideal: turn 1's prompt, then only the tokens each later turn appends.

    python -m benchmarks.prefill_tokens [--turns 10 --system-tokens 1500 ...]
                                        [--url URL --model NAME --tokenizer HF_ID --api-key KEY]

With --url, the app there runs as deployed: with prefill's prefix cache on, what prefill found in
its own cache is not prefilled either.
"""

import argparse
import uuid

from app.config import load_config
from benchmarks.report import ideal_prefill
from benchmarks.target import add_target_args, resolve_target
from benchmarks.workload import Profile, open_target, run_conversation

MODES = {"preserve": {"conversation_mode": "preserve"},
         "template": {"conversation_mode": "template"},
         "no reuse": {"conversation_mode": "template", "reverse_pull": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(parser)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--reply-tokens", type=int, default=350)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    profile = Profile(args.system_tokens, args.user_tokens, args.reply_tokens, args.turns)
    config = load_config({"prefill.prefix_caching": "false"})
    client, tokenizer, target = open_target(resolve_target(args, config), config)
    runs = {mode: run_conversation(client, tokenizer, profile, uuid.uuid4().hex, target.model, **extra,
                                   ignore_eos=True)
            for mode, extra in MODES.items()}
    ideal = ideal_prefill([t.prompt_tokens for t in runs["preserve"]], [len(t.output_ids) for t in runs["preserve"]])
    prefilled = {mode: [t.prompt_tokens - t.cached_tokens for t in turns] for mode, turns in runs.items()}
    print(f"{'turn':>4} {'prompt':>7} {'ideal':>6} " + " ".join(f"{m:>9}" for m in MODES))
    for k in range(profile.turns):
        print(f"{k + 1:>4} {runs['preserve'][k].prompt_tokens:>7} {ideal[k]:>6} "
              + " ".join(f"{prefilled[m][k]:>9}" for m in MODES))
    print(f"total {'':>7} {sum(ideal):>6} " + " ".join(f"{sum(prefilled[m]):>9}" for m in MODES))
    for mode in MODES:
        print(f"{mode}: {sum(prefilled[mode])} tokens prefilled over {profile.turns} turns = "
              f"{sum(prefilled[mode]) / sum(ideal):.2f}x the ideal ({sum(ideal)})")


if __name__ == "__main__":
    main()
