"""The benchmark client: exactly the given prompt ids reach the server, and a turn is timed from when
its request leaves (the official client's transform of the body before that is the client's work)."""

import json
import time

import httpx2
from openai import OpenAI

from app.ops import client as turn_client


def _stream_of_one_token(request: httpx2.Request) -> httpx2.Response:
    _stream_of_one_token.body = json.loads(request.content)
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "a", "finish_reason": "length", "token_ids": [7],
                          "prompt_token_ids": _stream_of_one_token.body["prompt"]}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    text = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
    return httpx2.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def test_completion_turn_sends_the_prompt_ids_untransformed(monkeypatch):
    walked = []
    monkeypatch.setattr("openai._utils._transform._transform_recursive",
                        lambda data, **kwargs: walked.append(data) or data)
    http = httpx2.Client(transport=httpx2.MockTransport(_stream_of_one_token))
    client = OpenAI(base_url="http://server/v1", api_key="k", http_client=http, max_retries=0)

    result = turn_client.completion_turn(client, [5, 6, 9], 1, model="m")

    assert _stream_of_one_token.body["prompt"] == [5, 6, 9]
    assert result.prompt_ids == [5, 6, 9] and result.output_ids == [7]
    assert walked and all(data.get("prompt") == "" for data in walked if isinstance(data, dict))


def test_a_turn_is_timed_from_when_its_request_leaves(monkeypatch):
    """The client's own preparation of the body (its type transform) is not the server's latency."""
    real = turn_client.DefaultHttpx2Client
    monkeypatch.setattr(turn_client, "DefaultHttpx2Client",
                        lambda **kwargs: real(transport=httpx2.MockTransport(_stream_of_one_token), **kwargs))
    monkeypatch.setattr("openai._utils._transform._transform_recursive",
                        lambda data, **kwargs: time.sleep(0.2) or data)

    started = time.perf_counter()
    result = turn_client.completion_turn(turn_client.timed_client("http://server", "k", 5), [5, 6, 9], 1, model="m")

    assert time.perf_counter() - started >= 0.2 and result.ttft_s < 0.1
