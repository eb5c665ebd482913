"""Log probabilities through the real app, against one plain vLLM engine given the same prompt ids:
a reply's first token may come from prefill and the rest from decode, and a later turn's history
is pulled or reused, yet each token's candidates and log probabilities are the plain engine's,
in vLLM's server's response shape, whole and streamed, chat and completions."""

import json

import pytest
import ray

from tests.integration.conftest import SYSTEM_PROMPT, decisions_by_request

pytestmark = pytest.mark.integration
MAX_TOKENS = 12
TOP = 3
TOLERANCE = 1e-3
"""Two engines run the same float32 model on the same KV: only batching may move the last digits."""
BODY = {"model": "tiny-qwen3", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "prefill_on_decode": False}


def _assert_plain_engine_s(got: list[dict[str, float]], reference, prompt_ids: list[int]) -> None:
    expected = ray.get(reference.logprobs.remote(prompt_ids, MAX_TOKENS, TOP))
    assert len(got) == len(expected) == MAX_TOKENS
    for k, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.keys() == theirs.keys(), f"token {k}: the same candidates"
        assert all(abs(mine[t] - theirs[t]) < TOLERANCE for t in mine), f"token {k}: {mine} != {theirs}"


def _sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_steps(content: list[dict]) -> list[dict[str, float]]:
    steps = []
    for entry in content:
        assert len(entry["top_logprobs"]) == TOP and entry["bytes"] == list(entry["token"].encode())
        steps.append({entry["token"]: entry["logprob"], **{t["token"]: t["logprob"] for t in entry["top_logprobs"]}})
    return steps


def test_chat_logprobs_over_two_turns_are_the_plain_engine_s(http, reference):
    messages = [{"role": "system", "content": f"Logprobs. {SYSTEM_PROMPT}"}, {"role": "user", "content": "Hello"}]
    body = {**BODY, "logprobs": True, "top_logprobs": TOP}
    first = http.post("/v1/chat/completions", json={**body, "messages": messages}).json()
    choice = first["choices"][0]
    assert decisions_by_request(http)[first["id"]]["first_token_from"] == "prefill", "the split path"
    _assert_plain_engine_s(_chat_steps(choice["logprobs"]["content"]), reference, first["prompt_token_ids"])

    messages += [{"role": "assistant", "content": choice["message"]["content"]}, {"role": "user", "content": "More"}]
    chunks = [c for c in _sse(http, "/v1/chat/completions", {**body, "messages": messages}) if c["choices"]]
    content = [e for c in chunks for e in (c["choices"][0].get("logprobs") or {}).get("content", [])]
    prompt = next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids"))
    assert decisions_by_request(http)[chunks[0]["id"]]["rendering"]["cause"] == "none", "the history was reused"
    _assert_plain_engine_s(_chat_steps(content), reference, prompt)


def test_completion_logprobs_streamed_are_the_plain_engine_s(http, reference):
    body = {**BODY, "prompt": f"Completion logprobs. {SYSTEM_PROMPT}", "logprobs": TOP}
    chunks = [c for c in _sse(http, "/v1/completions", body) if c["choices"]]
    prompt = next(ids for c in chunks for ids in (c.get("prompt_token_ids"), c["choices"][0].get("prompt_token_ids"))
                  if ids)
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    steps = [top for lp in logprobs for top in lp["top_logprobs"]]
    assert all(len(step) == TOP for step in steps), "the sampled token among the `logprobs` likeliest"
    _assert_plain_engine_s(steps, reference, prompt)
    offsets = [o for lp in logprobs for o in lp["text_offset"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert offsets == sorted(offsets) and offsets[-1] < len(text), "offsets run over the whole reply"


@pytest.mark.parametrize("fields, named", [
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_logprob_requests_vllm_would_refuse_get_a_400_naming_the_field(http, fields, named):
    response = http.post("/v1/chat/completions", json={**BODY, **fields,
                                                       "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 400 and named in response.json()["error"]["message"], response.text
