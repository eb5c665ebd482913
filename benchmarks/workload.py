"""Conversation workloads for the benchmarks: seed 002's profile, every size a parameter.

A long fixed system prompt with a unique nonce in its first block, short user turns, longer
replies; text drawn from the embedded model's corpus so token counts are predictable.
"""

import random
import time
from dataclasses import dataclass, replace

from openai import OpenAI

from app.config import TINY_MODEL, AppConfig
from app.model.tiny import corpus_lines, ensure_tiny_model
from app.ops.client import TurnResult, chat_turn, timed_client
from benchmarks.target import NO_KEY, Target


def open_target(target: Target, config: AppConfig) -> tuple[OpenAI, object, Target]:
    """A client for the target, once the embedded default is started here with `config` if the
    target has no URL; a tokenizer (the target model's, for sizing prompts); the target with its URL."""
    if target.url is None:
        from app.ops.launch import start_local

        target = replace(target, url=start_local(config))
    return openai_client(target.url, target.api_key), load_tokenizer(target.app_config(config)), target


def openai_client(url: str, api_key: str = NO_KEY) -> OpenAI:
    """The official client against `url`: no retries (a failure is a result), long timeouts, each
    turn timed from when its request leaves (app/ops/client.py timed_client)."""
    return timed_client(url, api_key, timeout_s=600)


def load_tokenizer(config: AppConfig):
    """The model's tokenizer (sizes the prompts); builds the embedded model first if needed."""
    from transformers import AutoTokenizer

    if config.model == TINY_MODEL:
        ensure_tiny_model(config.model_path())
    try:
        return AutoTokenizer.from_pretrained(str(config.model_path()))
    except OSError as exc:  # a served name such as Qwen3-32B is not a hub id
        raise ValueError(f"no tokenizer at {config.model!r}: name the model's Hugging Face id or local path "
                         "with --tokenizer") from exc


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


def replay(client: OpenAI, plan: ConversationPlan, reply_tokens: int, began: float | None = None,
           **extra) -> list[tuple[float, TurnResult]]:
    """One conversation replayed faithfully (each reply appended as the client received it),
    streaming, greedy, fixed reply length, with the plan's think time before each later turn; each
    turn comes with when it was sent, in seconds after `began`."""
    began = time.perf_counter() if began is None else began
    messages = [{"role": "system", "content": plan.system}]
    turns = []
    for user, think_s in zip(plan.user_turns, (0.0, *plan.think_s)):
        time.sleep(think_s)
        messages.append({"role": "user", "content": user})
        sent = time.perf_counter() - began
        result = chat_turn(client, messages, reply_tokens, **extra)
        messages.append({"role": "assistant", "content": result.text})
        turns.append((sent, result))
    return turns


def run_conversation(client: OpenAI, tokenizer, profile: Profile, nonce: str, model: str,
                     **extra) -> list[TurnResult]:
    """One conversation without think time (see `replay`)."""
    plan = plan_conversation(tokenizer, profile, nonce)
    return [result for _, result in replay(client, plan, profile.reply_tokens, model=model, **extra)]
