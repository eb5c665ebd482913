"""One real Ray Serve app (real vLLM engines, real NIXL) and one plain reference engine per session.

The app runs the embedded tiny model with prefill's prefix cache off (cache loss), so every
token prefill does not compute came from a reverse pull. The reference engine is one plain vLLM
engine without disaggregation: the oracle for generated token ids.
"""

import os

import httpx
import pytest
import ray
from openai import OpenAI

from app.config import load_config
from app.ops import faults
from app.ops.client import TurnResult, chat_turn
from app.ops.launch import replace_app, start_local, stop_local
from app.ops.oracle import start_reference

SYSTEM_PROMPT = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: the router keeps an index of which replica holds which blocks, and until when." for i in range(30))
USER_TURNS = ["What is the capital of France?", "Summarise section two.", "List the risks.",
              "Explain the trade off."]
INGRESS_DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def pytest_collection_modifyitems(items):
    """Cluster tests run first, before the shared app starts: they run a multi-node Ray of their own
    and would share 2 cores with it. Then the tests on the session's app, its fault tests after them
    (they kill parts of it, which comes back whole after each), and last the tests that replace it
    with an app of their own (`own_app`), module by module: none has to put the session's app back."""
    def stage(item) -> int:
        return (0 if item.get_closest_marker("cluster") else 3 if item.get_closest_marker("own_app")
                else 2 if item.get_closest_marker("faults") else 1)

    items.sort(key=stage)


@pytest.fixture(scope="session")
def app_config(tmp_path_factory):
    return load_config({"model_cache_dir": str(tmp_path_factory.mktemp("models")),
                        "prefill.prefix_caching": "false", "max_model_len": "4096",
                        "api_keys": '{"unused": "default", "key-a": "tenant-a", "key-b": "tenant-b"}',
                        "admin_api_keys": "unused", "salt_secret": "test-salt-secret",
                        # Each test checks one path; load-aware placement, which picks the path from
                        # the machine's load, has its own tests (per request: load_aware_placement).
                        "placement.load_aware": "false"})


@pytest.fixture(scope="session")
def base_url(app_config):
    # Serve keeps a stopping ingress replica reachable 30 s so that external load balancers can
    # deregister it; the `own_app` tests delete the whole app four times and send nothing to it meanwhile.
    os.environ.setdefault(INGRESS_DRAIN_ENV, "1")
    yield start_local(app_config)
    stop_local()


def run_own_app(base_url: str, config):
    """An `own_app` module's app in place of the session's, whole (every replica up, engines live) on return."""
    replace_app(config)
    faults.wait_whole(base_url)
    return config


def make_client(base_url: str, api_key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def client(base_url) -> OpenAI:
    return make_client(base_url)


@pytest.fixture(scope="session")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": "Bearer unused"}) as session:
        yield session


@pytest.fixture(scope="session")
def reference(app_config, base_url):
    engine = start_reference(app_config)
    yield engine
    ray.kill(engine)


def decisions_by_request(http) -> dict[str, dict]:
    return {d["request_id"]: d for d in http.get("/admin/decisions", params={"n": 1000}).json()}


def run_conversation(client: OpenAI, system_prompt: str, user_turns: list[str], max_tokens: int = 24,
                     edit=None, **extra) -> list[TurnResult]:
    """Replay a conversation faithfully (or through `edit(messages)` before each turn),
    alternating streaming and non-streaming turns."""
    messages = [{"role": "system", "content": system_prompt}]
    records = []
    for k, user in enumerate(user_turns):
        messages.append({"role": "user", "content": user})
        sent = edit(k, messages) if edit else messages
        record = chat_turn(client, sent, max_tokens, stream=k % 2 == 0, **extra)
        messages.append({"role": "assistant", "content": record.text})
        records.append(record)
    return records


def reference_ids(reference, turns: list[TurnResult], max_tokens: int, regex: str | None = None) -> list[list[int]]:
    return ray.get(reference.generate.remote([t.prompt_ids for t in turns], max_tokens, regex))
