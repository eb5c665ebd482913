"""Conversation workloads for the benchmarks: seed 002's profile, every size a parameter.

A long fixed system prompt with a unique nonce in its first block, short user turns, longer
replies; text drawn from the embedded model's corpus so token counts are predictable.
"""

import random
from dataclasses import dataclass

from openai import OpenAI

from app.client import TurnResult, chat_turn
from app.config import AppConfig
from app.model.tiny import corpus_lines


def open_target(url: str | None, config: AppConfig) -> tuple[OpenAI, object, str]:
    """A client for `url`, or for the embedded default started here with `config`; and a tokenizer
    (the embedded model's, for sizing prompts)."""
    if url is None:
        from app.launch import start_local

        url = start_local(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(config.model_path()))
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600), tokenizer, url


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


THINK_DISTRIBUTIONS = ("exponential", "uniform", "constant")


@dataclass(frozen=True)
class ConversationPlan:
    """What the client will send: the system prompt (nonce first), each user turn, and the think
    time before each turn after the first."""

    system: str
    user_turns: tuple[str, ...]
    think_s: tuple[float, ...]


def think_time(rng: random.Random, mean_s: float, distribution: str = "exponential") -> float:
    """Exponential capped at 5x the mean (a long tail without stalling a run), uniform on
    [0, 2 x mean], or the mean itself."""
    if distribution == "exponential":
        return min(rng.expovariate(1 / mean_s), 5 * mean_s) if mean_s else 0.0
    if distribution == "uniform":
        return rng.uniform(0, 2 * mean_s)
    if distribution == "constant":
        return mean_s
    raise ValueError(f"think-time distribution must be one of {THINK_DISTRIBUTIONS}, not {distribution!r}")


def plan_conversation(tokenizer, profile: Profile, nonce: str, think_mean_s: float = 0.0,
                      distribution: str = "exponential", seed: int = 0) -> ConversationPlan:
    rng = random.Random(seed)
    return ConversationPlan(
        system=text_of_tokens(tokenizer, profile.system_tokens, f"[{nonce}] "),
        user_turns=tuple(text_of_tokens(tokenizer, profile.user_tokens, f"Q{k}: ") for k in range(profile.turns)),
        think_s=tuple(think_time(rng, think_mean_s, distribution) for _ in range(profile.turns - 1)))


def run_conversation(client: OpenAI, tokenizer, profile: Profile, nonce: str, model: str = "tiny-qwen3",
                     **extra) -> list[TurnResult]:
    """One conversation replayed faithfully, streaming, greedy, fixed reply length, no think time."""
    plan = plan_conversation(tokenizer, profile, nonce)
    messages = [{"role": "system", "content": plan.system}]
    results = []
    for user in plan.user_turns:
        messages.append({"role": "user", "content": user})
        result = chat_turn(client, messages, profile.reply_tokens, model=model, **extra)
        messages.append({"role": "assistant", "content": result.text})
        results.append(result)
    return results
