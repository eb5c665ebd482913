"""Bad input gets a 4xx with a message, and the app keeps serving."""

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("body, status, words", [
    ("{not json", 400, "invalid request"),
    ({"model": "tiny-qwen3"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "unknown role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x " * 5000}]}, 400, "context length"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2, "prompt_logprobs": 1}, 400, "not supported by "
     "this server: best_of (choices are sampled as n turns"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], },
     400, "image_url are not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "(["}}, 400, "invalid regex"),
    ({"messages": [{"role": "user", "content": "x"}] * 3000}, 400, "exceed this server's limit"),
])
def test_malformed_requests_get_a_clear_4xx(http, body, status, words):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    response = http.post("/v1/chat/completions", **kwargs)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_an_oversized_body_gets_413_before_it_is_read(http, app_config):
    filler = "x" * (app_config.limits.max_request_bytes + 1)
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": filler}]})
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


def test_admin_endpoints_answer_admin_keys_only(http, base_url):
    import httpx

    assert http.get("/admin/decisions", params={"n": 1}).status_code == 200
    tenant = httpx.get(f"{base_url}/admin/decisions", headers={"Authorization": "Bearer key-a"})
    assert tenant.status_code == 403 and "admin" in tenant.json()["error"]["message"]
    assert httpx.get(f"{base_url}/admin/decisions").status_code == 401


def test_service_endpoints_and_completions_after_bad_input(http, client):
    assert http.get("/health").json() == {"status": "ok", "live_engines": {"prefill": 1, "decode": 1},
                                          "nixl_backends": {"prefill": ["UCX"], "decode": ["UCX"]}}
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3"]
    completion = client.completions.create(model="tiny-qwen3", prompt="The router keeps", max_tokens=5,
                                           temperature=0)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text is not None
