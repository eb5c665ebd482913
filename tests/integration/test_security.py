"""Secure by default, through the real app: what vLLM would refuse, a client's template and a body
without a valid key each get a 4xx in the OpenAI error shape naming what was wrong, and a burst of
them costs the other tenants nothing: no 503, the oracle's tokens, every engine live, later turns
as fast as before the burst. Before, one `"stop": [""]` made every engine suspect for 10 s (503
for everyone), a 200 KB regex held the engines 16 s, and a template in `chat_template_kwargs`
replaced the server's."""

import statistics
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import SYSTEM_PROMPT, USER_TURNS, reference_ids, run_conversation

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
BURST = 5
"""Requests of each refused kind, sent at once."""
REFUSED = {  # what the body adds to a valid chat request: (status, words the error message must hold)
    "empty stop string": ({"stop": [""]}, 400, "stop"),
    "seed past int64": ({"seed": 2**64}, 400, "seed"),
    "negative temperature": ({"temperature": -1}, 400, "temperature"),
    "top_k below -1": ({"top_k": -5}, 400, "top_k"),
    "invalid regex": ({"structured_outputs": {"regex": "(["}}, 400, "structured_outputs.regex"),
    "200 KB regex": ({"structured_outputs": {"regex": "(a|b)" * 40_000}}, 400, "structured_outputs.regex"),
    "template in chat_template_kwargs": ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, 400,
                                         "chat_template"),
    "unknown chat_template_kwargs name": ({"chat_template_kwargs": {"no_such_variable": True}}, 400,
                                          "no_such_variable"),
    "17 stop strings": ({"stop": [f"s{n}" for n in range(17)]}, 400, "stop"),
    "a 300-character stop string": ({"stop": ["x" * 300]}, 400, "stop"),
}


def _later_ttft_s(client, opening: str) -> float:
    """Median first-token time of a fresh conversation's later turns."""
    turns = run_conversation(client, f"{opening} {SYSTEM_PROMPT}", USER_TURNS, MAX_TOKENS)
    return statistics.median(t.ttft_s for t in turns[1:])


def _send(base_url: str, body: dict, key: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def _assert_refused(response: httpx.Response, status: int, words: str) -> None:
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (status, status), error
    assert error["type"] == "invalid_request_error" and words in error["message"], error


def test_refused_requests_cost_the_other_tenants_nothing(client, http, base_url, reference, app_config):
    before_s = _later_ttft_s(client, "Before the burst.")
    bodies = [({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **extra}, "unused", status, words)
              for extra, status, words in REFUSED.values() for _ in range(BURST)]
    filler = "x" * (app_config.limits.max_request_bytes - 1024)  # read whole, it would fit the size cap
    bodies += [({"messages": [{"role": "user", "content": filler}]}, "wrong-key", 401, "API key")] * BURST
    # With a valid key the whole body reaches the router (over Serve's replica gRPC), which refuses it untokenized.
    bodies += [({"messages": [{"role": "user", "content": filler}]}, "unused", 400, "context length")] * 2
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda b: _send(base_url, b[0], b[1]), bodies))
    for (_, _, status, words), response in zip(bodies, answers):
        _assert_refused(response, status, words)

    turns = run_conversation(client, f"After the burst. {SYSTEM_PROMPT}", USER_TURNS, MAX_TOKENS)
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["live_engines"] == {"prefill": 1, "decode": 1}
    after_s = statistics.median(t.ttft_s for t in turns[1:])
    # Generous: 2 shared cores are noisy. A suspected engine would leave the turns on one engine
    # (or answer 503); a stalled render thread would add seconds.
    assert after_s <= 3 * before_s + 0.5, (before_s, after_s)


def test_a_wrong_key_is_refused_before_the_body_is_read(base_url, app_config):
    """The body is never read: its size cap is never reached, and no admission place is taken."""
    oversized = {"messages": [{"role": "user", "content": "x" * (app_config.limits.max_request_bytes + 1)}]}
    _assert_refused(_send(base_url, oversized, "wrong-key"), 401, "API key")
    _assert_refused(httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json", timeout=30), 401, "API key")


def test_the_api_docs_are_not_served_unless_configured(http):
    assert [http.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
