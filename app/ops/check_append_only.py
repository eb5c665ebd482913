"""Offline append-only checker: does each turn of a recorded conversation extend the previous one?

    python -m app.ops.check_append_only --model PATH transcripts.jsonl

One JSON object per line: {"id": ..., "messages": [...], "chat_template_kwargs": {...},
"generated_token_ids": [[...], ...]} (the last two optional; generated ids are the server's
logged ids of each assistant reply, in order). Per turn it prints the tokens shared with the
previous prompt, the full blocks reusable and their share of the previous prompt, flagging turns
under the threshold (seed 002 recommends 90 %). With generated ids it also compares against the
previous prompt plus what the server generated, which catches stripped reasoning and
re-tokenisation drift that template-only comparison cannot see.
"""

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.kv.hashing import common_prefix_len


@dataclass(frozen=True)
class TurnCheck:
    conversation: str
    turn: int
    prompt_tokens: int
    shared: int
    reusable: int
    share: float
    shared_with_generated: int | None = None
    reusable_with_generated: int | None = None
    share_with_generated: float | None = None

    def flagged(self, threshold: float) -> bool:
        shares = [s for s in (self.share, self.share_with_generated) if s is not None]
        return min(shares) < threshold


def _reuse(prompt: list[int], previous: list[int], block_size: int) -> tuple[int, int, float]:
    shared = common_prefix_len(prompt, previous)
    reusable = shared // block_size * block_size
    return shared, reusable, reusable / len(previous) if previous else 1.0


def check_conversation(tokenizer, transcript: dict[str, Any], block_size: int) -> list[TurnCheck]:
    messages, kwargs = transcript["messages"], transcript.get("chat_template_kwargs", {})
    generated = list(transcript.get("generated_token_ids", []))
    checks, previous, replies_seen = [], None, 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            replies_seen += 1
        if message["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False, add_generation_prompt=True, **kwargs)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        if previous is not None:
            shared, reusable, share = _reuse(prompt, previous, block_size)
            check = TurnCheck(transcript.get("id", "?"), len(checks) + 2, len(prompt), shared, reusable, share)
            if replies_seen - 1 < len(generated):
                shared, reusable, share = _reuse(prompt, previous + list(generated[replies_seen - 1]), block_size)
                check = replace(check, shared_with_generated=shared, reusable_with_generated=reusable,
                                share_with_generated=share)
            checks.append(check)
        previous = prompt
    return checks


def format_check(check: TurnCheck, threshold: float) -> str:
    line = (f"{check.conversation} turn {check.turn}: {check.prompt_tokens} tokens, shared {check.shared}, "
            f"full blocks reusable {check.reusable} ({check.share:.0%} of last prompt)")
    if check.share_with_generated is not None:
        line += (f"; with generated ids: shared {check.shared_with_generated}, reusable "
                 f"{check.reusable_with_generated} ({check.share_with_generated:.0%} of last prompt + reply)")
    return line + ("  << under threshold" if check.flagged(threshold) else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("transcripts", type=Path)
    parser.add_argument("--model", required=True, help="a folder or hub id with a tokenizer and chat template")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    flagged = total = 0
    for line in args.transcripts.read_text().splitlines():
        if not line.strip():
            continue
        for check in check_conversation(tokenizer, json.loads(line), args.block_size):
            print(format_check(check, args.threshold))
            total += 1
            flagged += check.flagged(args.threshold)
    print(f"{flagged} of {total} later turns under {args.threshold:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
