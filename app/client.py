"""A small OpenAI-client driver for conversations against the router: tests, benchmarks, notebooks.

Greedy turns with token ids (vLLM's return_token_ids extension) and client-side timings.
"""

import time
from dataclasses import dataclass
from typing import Any

from openai import OpenAI


@dataclass
class TurnResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    last_token_s: float = 0.0
    """When the last content chunk arrived (the stream's usage chunk and end come after it)."""

    @property
    def itl_s(self) -> float:
        """Mean inter-token latency between the first and the last content chunk."""
        return (max(self.last_token_s, self.ttft_s) - self.ttft_s) / max(len(self.output_ids) - 1, 1)


def _cached(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def chat_turn(client: OpenAI, messages: list[dict], max_tokens: int, stream: bool = True,
              model: str = "tiny-qwen3", **extra: Any) -> TurnResult:
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    kwargs = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body)
    start = time.perf_counter()
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        elapsed = time.perf_counter() - start
        choice = response["choices"][0]
        return TurnResult(response["id"], response.get("prompt_token_ids") or [], choice.get("token_ids") or [],
                          choice["message"]["content"], _cached(response["usage"]), ttft_s=elapsed, e2e_s=elapsed,
                          prompt_tokens=response["usage"]["prompt_tokens"])
    chunks, ttft, last = [], None, 0.0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter() - start
            ttft = last if ttft is None else ttft
        chunks.append(chunk.model_dump())
    deltas = [c for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    return TurnResult(chunks[0]["id"], next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), []),
                      [t for c in deltas for t in c["choices"][0].get("token_ids") or []],
                      "".join(c["choices"][0]["delta"]["content"] or "" for c in deltas), _cached(usage),
                      ttft_s=ttft if ttft is not None else time.perf_counter() - start,
                      e2e_s=time.perf_counter() - start, prompt_tokens=usage["prompt_tokens"], last_token_s=last)
