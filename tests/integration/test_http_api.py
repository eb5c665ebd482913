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
])
def test_malformed_requests_get_a_clear_4xx(http, body, status, words):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
        else {"json": body}
    response = http.post("/v1/chat/completions", **kwargs)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_service_endpoints_and_completions_after_bad_input(http, client):
    assert http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3"]
    completion = client.completions.create(model="tiny-qwen3", prompt="The router keeps", max_tokens=5,
                                           temperature=0)
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text is not None
