"""A small OpenAI-client driver for conversations against the router: tests, benchmarks, notebooks.

Greedy turns with token ids (vLLM's return_token_ids extension) and client-side timings, counted
from when the request leaves the client (`timed_client`).
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from openai import DefaultHttpx2Client, OpenAI

_sent = threading.local()
"""When this thread's last request left its timed client (time.perf_counter())."""


def timed_client(url: str, api_key: str, timeout_s: float) -> OpenAI:
    """The official client, no retries, noting when each request is handed to HTTP. A turn's
    timings count from there: before it, the client's own type transform walks every message, the
    longer the conversation the longer, work of the client that a body of prompt ids sent as is
    (the ideal) never does and no server spends."""
    http = DefaultHttpx2Client(timeout=timeout_s, event_hooks={"request": [_note_sent]})
    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s, http_client=http)


def _note_sent(_request) -> None:
    _sent.at = time.perf_counter()


def _sent_since(start: float) -> float:
    """When the request made since `start` left a timed client; `start` from any other client."""
    at = getattr(_sent, "at", 0.0)
    return at if at >= start else start


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
    second_chunk_s: float = 0.0
    """When the second content chunk arrived (0: one chunk, or not streamed): decode's first, where
    prefill sent the first token."""
    tool_calls: list[dict] = field(default_factory=list)
    """The reply's tool calls as a chat message carries them (streamed deltas joined)."""

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
    if stream:
        return _streamed(client.chat.completions.create, kwargs, lambda choice: choice["delta"]["content"])
    start = time.perf_counter()
    response = client.chat.completions.create(**kwargs).model_dump()
    elapsed = time.perf_counter() - _sent_since(start)
    choice = response["choices"][0]
    return TurnResult(response["id"], response.get("prompt_token_ids") or [], choice.get("token_ids") or [],
                      choice["message"]["content"] or "", _cached(response["usage"]), ttft_s=elapsed, e2e_s=elapsed,
                      prompt_tokens=response["usage"]["prompt_tokens"],
                      tool_calls=choice["message"].get("tool_calls") or [])


def completion_turn(client: OpenAI, prompt_ids: list[int], max_tokens: int, model: str = "tiny-qwen3",
                    **extra: Any) -> TurnResult:
    """A streamed, greedy completion of exactly these prompt token ids (no chat template).

    The ids go in the request body as they are: the client's own `prompt` argument walks a token
    list element by element (openai-python's type transform), client work that grows with the prompt."""
    body = {"return_token_ids": True, "ignore_eos": True, **extra, "prompt": prompt_ids}
    kwargs = dict(model=model, prompt="", max_tokens=max_tokens, temperature=0, extra_body=body)
    return _streamed(client.completions.create, kwargs, lambda choice: choice["text"])


def _streamed(create, kwargs: dict[str, Any], content_of) -> TurnResult:
    """Timings from the client's side: the first and the last chunk that carries tokens (a token
    whose text is an incomplete character arrives with empty text: it counts too)."""
    chunks, arrivals = [], []
    start = time.perf_counter()
    stream = create(**kwargs, stream=True, stream_options={"include_usage": True})
    start = _sent_since(start)
    for chunk in stream:
        dumped = chunk.model_dump()
        if dumped["choices"] and (dumped["choices"][0].get("token_ids") or content_of(dumped["choices"][0])):
            arrivals.append(time.perf_counter() - start)
        chunks.append(dumped)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    # chat carries the prompt's ids on a chunk, completions on a choice
    prompt_ids = next((ids for c in chunks for ids in (c.get("prompt_token_ids"), *(ch.get("prompt_token_ids")
                                                                                 for ch in c["choices"])) if ids), [])
    return TurnResult(chunks[0]["id"], prompt_ids, [t for ch in choices for t in ch.get("token_ids") or []],
                      "".join(content_of(ch) or "" for ch in choices), _cached(usage),
                      ttft_s=arrivals[0] if arrivals else time.perf_counter() - start,
                      e2e_s=time.perf_counter() - start, prompt_tokens=usage["prompt_tokens"],
                      last_token_s=arrivals[-1] if arrivals else 0.0,
                      second_chunk_s=arrivals[1] if len(arrivals) > 1 else 0.0,
                      tool_calls=_joined_tool_calls(choices))


def _joined_tool_calls(choices: list[dict]) -> list[dict]:
    """Streamed tool-call deltas joined by index: id, type and name from the first, arguments appended."""
    calls: dict[int, dict] = {}
    for choice in choices:
        for delta in (choice.get("delta") or {}).get("tool_calls") or ():
            call = calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            call["id"] = delta.get("id") or call["id"]
            function = delta.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
