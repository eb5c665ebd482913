"""Conversation workloads for the benchmarks: seed 002's profile, every size a parameter.

A long fixed system prompt with a unique nonce in its first block, short user turns, longer
replies; text drawn from the embedded model's corpus so token counts are predictable.
"""

from dataclasses import dataclass

from openai import OpenAI

from app.client import TurnResult, chat_turn
from app.model.tiny import corpus_lines


@dataclass(frozen=True)
class Profile:
    system_tokens: int = 1500
    user_tokens: int = 150
    reply_tokens: int = 350
    turns: int = 10


def text_of_tokens(tokenizer, num_tokens: int, seed: str = "") -> str:
    """Corpus text of about `num_tokens` tokens, starting with `seed` (a nonce makes it unique)."""
    lines, text = corpus_lines(), seed
    i = len(seed)
    while len(tokenizer.encode(text)) < num_tokens:
        text += lines[i % len(lines)] + " "
        i += 1
    ids = tokenizer.encode(text)[:num_tokens]
    return tokenizer.decode(ids)


def run_conversation(client: OpenAI, tokenizer, profile: Profile, nonce: str, model: str = "tiny-qwen3",
                     **extra) -> list[TurnResult]:
    """One conversation replayed faithfully, streaming, greedy, fixed reply length."""
    messages = [{"role": "system", "content": text_of_tokens(tokenizer, profile.system_tokens, f"[{nonce}] ")}]
    results = []
    for k in range(profile.turns):
        messages.append({"role": "user", "content": text_of_tokens(tokenizer, profile.user_tokens, f"Q{k}: ")})
        result = chat_turn(client, messages, profile.reply_tokens, model=model, **extra)
        messages.append({"role": "assistant", "content": result.text})
        results.append(result)
    return results
