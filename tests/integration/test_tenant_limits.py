"""One tenant cannot take the others' places: past its share of a frontend replica's admission
places a tenant's requests get 429 + Retry-After while another tenant's are served, and a client
that drops its streams gives its places back. Replaces the session's app with one of small limits
(own_app: after every test on it)."""

from dataclasses import replace

import httpx
import pytest

from app.config import Limits
from app.ops import faults
from tests.integration.conftest import make_client, run_own_app

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
LIMITS = {"router_max_ongoing_requests": 8, "router_max_queued_requests": 8, "tenant_share": 0.25}
"""16 places per frontend replica, 4 of them per tenant."""
LONG = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def small_limits(base_url, app_config):
    limits = replace(app_config.limits, **LIMITS)
    run_own_app(base_url, replace(app_config, limits=limits, engine_max_num_seqs=8))
    return limits


def _stream(client: httpx.Client, key: str) -> httpx.Response:
    return client.send(client.build_request("POST", "/v1/chat/completions", json=LONG,
                                            headers={"Authorization": f"Bearer {key}"}), stream=True)


def test_a_tenant_past_its_share_gets_429_while_another_is_served(small_limits: Limits, base_url):
    share = int(small_limits.router_holds * small_limits.tenant_share)
    with httpx.Client(base_url=base_url, timeout=120) as client:
        held = [_stream(client, "key-a") for _ in range(share)]  # headers only: each holds its place
        assert [r.status_code for r in held] == [200] * share
        refused = _stream(client, "key-a")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == str(small_limits.retry_after_s)
        refused.read()
        assert refused.json()["error"]["code"] == 429 and "share" in refused.json()["error"]["message"]
        other = make_client(base_url, "key-b").chat.completions.create(
            model="tiny-qwen3", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert other.choices[0].finish_reason == "length"
        for response in held:  # the client drops its streams
            response.close()
    # The places come back as the server sees the disconnects.
    faults.wait_until(lambda: _short_turn(base_url, "key-a").status_code == 200, timeout_s=30)


def _short_turn(base_url: str, key: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={**LONG, "max_tokens": 4, "stream": False})
