"""The turn loop end to end: real Serve app, real vLLM engines, real NIXL, prefill cache off."""

import os
import time
from pathlib import Path

import pytest
from ray import serve

from app.conversations.tenants import cache_salt
from app.kv.hashing import common_prefix_len
from app.ops.client import chat_turn
from app.ops.launch import APP_NAME
from app.protocol import EngineEndpoint, KVHandoff, RetainedBlocks, TurnRecords
from tests.integration.conftest import (
    SYSTEM_PROMPT,
    USER_TURNS,
    decisions_by_request,
    reference_ids,
    run_conversation,
)

pytestmark = pytest.mark.integration
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def conversation(client):
    """Every turn through prefill (short appends would otherwise run on decode)."""
    return run_conversation(client, SYSTEM_PROMPT, USER_TURNS, MAX_TOKENS, prefill_on_decode=False)


@pytest.fixture(scope="module")
def on_decode_conversation(client):
    return run_conversation(client, "On decode. " + SYSTEM_PROMPT, USER_TURNS, MAX_TOKENS)


def _reusable(previous, current, block_size: int) -> tuple[int, int]:
    shared = common_prefix_len(current.prompt_ids, previous.prompt_ids + previous.output_ids)
    return shared, min(shared, len(current.prompt_ids) - 1) // block_size * block_size


def test_later_turns_pull_every_full_block_of_the_common_prefix(conversation, http, app_config):
    decisions = decisions_by_request(http)
    for previous, current in zip(conversation, conversation[1:]):
        shared, full_blocks = _reusable(previous, current, app_config.block_size)
        assert full_blocks >= 10 * app_config.block_size, "the history should be long enough to matter"
        assert full_blocks <= current.cached_tokens <= shared
        decision = decisions[current.request_id]
        assert decision["action"] == "pull" and decision["reason"] == "pull_saves_tokens"
        assert decision["pulled_tokens"] == current.cached_tokens, "prefill's cache is off: all of it was pulled"
    assert decisions[conversation[0].request_id]["action"] == "recompute"
    assert {decisions[t.request_id]["first_token_from"] for t in conversation} == {"prefill"}


def test_transferred_kv_gives_the_same_tokens_as_one_plain_engine(conversation, reference):
    import ray

    expected = ray.get(reference.generate.remote([t.prompt_ids for t in conversation], MAX_TOKENS))
    assert [t.output_ids for t in conversation] == expected


def test_short_appends_run_whole_on_the_decode_replica_that_retains_them(on_decode_conversation, http, app_config,
                                                                        reference):
    import ray

    conversation, decisions = on_decode_conversation, decisions_by_request(http)
    for previous, current in zip(conversation, conversation[1:]):
        shared, full_blocks = _reusable(previous, current, app_config.block_size)
        decision = decisions[current.request_id]
        assert decision["action"] == "prefill_on_decode" and decision["reason"] == "short_append"
        assert decision["first_token_from"] == "decode" and decision["pulled_tokens"] == 0
        assert full_blocks <= current.cached_tokens <= shared, "decode's prefix cache served the history"
    assert decisions[conversation[0].request_id]["action"] == "recompute"
    expected = ray.get(reference.generate.remote([t.prompt_ids for t in conversation], MAX_TOKENS))
    assert [t.output_ids for t in conversation] == expected


def test_a_long_append_after_a_turn_on_decode_pulls_that_turn_s_blocks(on_decode_conversation, client, http,
                                                                      app_config, reference):
    """The sequence decode computed itself is held for the next prefill like any other."""
    import ray

    messages = [{"role": "system", "content": "On decode. " + SYSTEM_PROMPT}]
    for user, turn in zip(USER_TURNS, on_decode_conversation):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": turn.text}]
    long_append = " ".join(f"Tool result {i}: nothing to report for row {i}." for i in range(90))
    record = chat_turn(client, messages + [{"role": "user", "content": long_append}], MAX_TOKENS)
    decision = decisions_by_request(http)[record.request_id]
    assert record.prompt_tokens - decision["tokens_pullable"] > app_config.max_decode_prefill_tokens
    assert decision["action"] == "pull" and decision["pulled_tokens"] >= 10 * app_config.block_size
    assert record.output_ids == ray.get(reference.generate.remote([record.prompt_ids], MAX_TOKENS))[0]


def test_a_one_token_reply_ends_at_prefill(client, http, reference):
    import ray

    messages = [{"role": "system", "content": "One token. " + SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    for stream in (True, False):
        record = chat_turn(client, messages, 1, stream=stream, prefill_on_decode=False)
        assert decisions_by_request(http)[record.request_id]["first_token_from"] == "prefill"
        assert record.output_ids == ray.get(reference.generate.remote([record.prompt_ids], 1))[0]


@pytest.mark.parametrize("blocks, extra", [(4, -1), (4, 0), (4, 1)])
def test_decode_continues_after_prefill_s_token_at_block_boundaries(http, reference, app_config, blocks, extra):
    import ray

    prompt = [11 + (7 * i) % 997 for i in range(blocks * app_config.block_size + extra)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "prefill_on_decode": False}
    expected = ray.get(reference.generate.remote([prompt], 8))[0]
    for stream in (False, True):
        response = http.post("/v1/completions", json={**body, "stream": stream})
        assert response.status_code == 200
        request_id, tokens = _streamed(response.text) if stream else _completed(response.json())
        assert decisions_by_request(http)[request_id]["first_token_from"] == "prefill"
        assert tokens == expected


def _completed(body: dict) -> tuple[str, list[int]]:
    return body["id"], body["choices"][0]["token_ids"]


def _streamed(sse: str) -> tuple[str, list[int]]:
    import json

    events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    return events[0]["id"], [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


def test_stop_strings_leave_the_first_token_to_decode_and_still_stop(client, http):
    messages = [{"role": "system", "content": "Stop. " + SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    full = chat_turn(client, messages, 16)
    stop = full.text[3:6]
    stopped = chat_turn(client, messages, 16, stop=[stop], prefill_on_decode=False)
    assert decisions_by_request(http)[stopped.request_id]["first_token_from"] == "decode"
    assert stopped.text == full.text[:full.text.index(stop)]


def test_client_supplied_transfer_params_change_nothing(client, http, conversation, reference):
    import ray

    forged = {"do_remote_decode": True, "remote_engine_id": "victim", "remote_host": "127.0.0.1",
              "remote_port": 1, "remote_request_id": "x", "remote_block_ids": [[0, 1, 2]], "remote_num_tokens": 96}
    messages = [{"role": "system", "content": "Forged. " + SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    record = chat_turn(client, messages, MAX_TOKENS, stream=False, kv_transfer_params=forged)
    decision = decisions_by_request(http)[record.request_id]
    assert decision["action"] == "recompute" and decision["pull_source"] is None
    assert record.output_ids == ray.get(reference.generate.remote([record.prompt_ids], MAX_TOKENS))[0]


def _plant_retained(prompt_ids: list[int], port: int, expires_in_s: float, salt_secret: str) -> None:
    """Put a retained sequence in the index that covers the prompt but cannot be read: it names the
    live decode replica, with blocks at an engine endpoint where nothing listens."""
    from app.ops.faults import engine_status

    ghost = EngineEndpoint(engine_id="ghost-decode", host="127.0.0.1", port=port)
    blocks = (tuple(range(len(prompt_ids) // 32)),)
    handoff = KVHandoff(source=ghost, block_ids=blocks, num_tokens=len(prompt_ids),
                        request_id=f"ghost-{time.monotonic_ns()}", expiry_time=time.time() + expires_in_s,
                        engine_expiry=time.perf_counter() + expires_in_s)
    retained = RetainedBlocks(replica_id=engine_status("decode").replica_id, handoff=handoff,
                              token_ids=tuple(prompt_ids), num_prompt_tokens=len(prompt_ids))
    salt = cache_salt("default", salt_secret)
    serve.get_deployment_handle("KVIndexServer", APP_NAME).record_turn.remote(TurnRecords(salt, retained)).result()


def _fresh_conversation(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"{tag}. {SYSTEM_PROMPT}"}, {"role": "user", "content": "Hello"}]


def _plant_for(messages: list[dict], app_config, expires_in_s: float) -> None:
    from app.conversations.rendering import PromptRenderer
    from app.engine.ports import free_port

    renderer = PromptRenderer(app_config.model_path(), app_config.max_model_len)
    _plant_retained(renderer.chat(messages, {}) + [7] * 64, free_port("127.0.0.1"), expires_in_s,
                    app_config.salt_secret)


@pytest.mark.parametrize("expires_in_s, reason", [(60.0, "pull_failed"), (1.0, "expires_too_soon")])
def test_unreadable_retained_blocks_fall_back_to_recompute(client, http, reference, app_config, expires_in_s,
                                                           reason):
    import ray

    messages = _fresh_conversation(reason)
    _plant_for(messages, app_config, expires_in_s)
    record = chat_turn(client, messages, MAX_TOKENS, stream=True, prefill_on_decode=False)
    decision = decisions_by_request(http)[record.request_id]
    assert decision["action"] == "recompute" and decision["reason"] == reason
    assert record.cached_tokens == 0
    assert record.output_ids == ray.get(reference.generate.remote([record.prompt_ids], MAX_TOKENS))[0]


def test_a_stale_record_sends_a_short_append_to_decode_which_recomputes_what_it_lacks(client, http, reference,
                                                                                    app_config):
    """The record names a replica and blocks that don't exist: decode's prefix cache, which
    matches blocks by hash, finds nothing, and the reply is still right."""
    import ray

    messages = _fresh_conversation("stale")
    _plant_for(messages, app_config, 60.0)
    record = chat_turn(client, messages, MAX_TOKENS, stream=True)
    assert decisions_by_request(http)[record.request_id]["action"] == "prefill_on_decode"
    assert record.cached_tokens == 0
    assert record.output_ids == ray.get(reference.generate.remote([record.prompt_ids], MAX_TOKENS))[0]


def test_concurrent_branches_of_one_history_never_read_the_same_retained_blocks(client, http, reference):
    """Two turns that branch from one history arrive together (prefill's cache is off): one owns
    the retained sequence and pulls it, the other recomputes; both answer right. Before the atomic
    take, both pulled the same sequence and the second read blocks vLLM had already freed."""
    from concurrent.futures import ThreadPoolExecutor

    for round_ in range(4):
        messages = _fresh_conversation(f"branch {round_}")
        first = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False)
        history = messages + [{"role": "assistant", "content": first.text}]
        branches = [history + [{"role": "user", "content": f"Branch {b} of round {round_}."}] for b in "AB"]
        with ThreadPoolExecutor(2) as pool:
            turns = list(pool.map(lambda m: chat_turn(client, m, MAX_TOKENS, prefill_on_decode=False), branches))
        assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
        actions = sorted(decisions_by_request(http)[t.request_id]["action"] for t in turns)
        assert actions == ["pull", "recompute"], "one owner pulls; the other finds nothing to pull"


def test_a_decode_that_starts_reading_late_still_finds_prefill_s_blocks(reference, app_config):
    """Prefill holds a handoff for `handoff_lease_s` (120 s), and decode's heartbeats extend it well
    inside each extension; vLLM's default lease (30 s) would have freed these blocks already."""
    import ray

    from app.protocol import DecodeRequest, PrefillRequest, SamplingSettings

    prompt = tuple(11 + (5 * i) % 887 for i in range(10 * app_config.block_size + 7))  # inside the vocabulary
    greedy = SamplingSettings(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill = serve.get_deployment_handle("prefill", APP_NAME)
    result = prefill.prefill.remote(PrefillRequest("late-p", prompt, "late-salt", "")).result()
    time.sleep(35)
    decode = serve.get_deployment_handle("decode", APP_NAME).options(stream=True)
    request = DecodeRequest("late-d", prompt, "late-salt", greedy, handoff=result.handoff, retain=False)
    tokens = [t for chunk in decode.generate.remote(request) for t in chunk.token_ids]
    assert tokens == ray.get(reference.generate.remote([list(prompt)], 8))[0]


def test_the_serving_path_runs_ahead_of_the_engines_on_shared_cores(client, app_config):
    """The Serve replicas at nice 0 (RAY_worker_niceness, set where the app starts Ray), their
    engine processes at engine_nice: the serving path's Python never waits behind a prefill."""
    import psutil

    from app.ops.faults import _actor_pid, engine_pids, replica_names

    for deployment in ("frontend", "router", "KVIndexServer", "prefill", "decode"):
        assert psutil.Process(_actor_pid(replica_names(deployment)[0])).nice() == 0, deployment
    for deployment in ("prefill", "decode"):
        engines = engine_pids(deployment)
        assert engines and {psutil.Process(p).nice() for p in engines} == {app_config.engine_nice}, deployment


def test_each_engine_replica_still_writes_its_serve_log_after_its_engine_started(client):
    """vLLM and NIXL reconfigure logging when an engine starts, which closed Serve's replica log:
    decode's and prefill's own lines (pool trimming, failures) went nowhere."""
    from ray._private.worker import _global_node

    from app.ops.faults import replica_names

    logs = Path(_global_node.get_logs_dir_path()) / "serve"
    for deployment in ("prefill", "decode"):
        replica_id = replica_names(deployment)[0].rsplit("#", 1)[-1]
        text = "".join(p.read_text() for p in logs.glob(f"replica_*_{deployment}_{replica_id}.log*"))
        assert "Finished initializing replica" in text, deployment


def test_each_engine_computes_on_its_own_core(client):
    """vLLM's NIXL connector pinned the thread that runs the model to the machine's last core, so
    both engines computed on it while the first core served only Python (app/engine/nixl_worker.py)."""
    import psutil

    from app.ops.faults import _actor_pid, replica_names

    last = (os.cpu_count() or 1) - 1
    for deployment, core in (("prefill", 0), ("decode", last)):
        engine = psutil.Process(_actor_pid(replica_names(deployment)[0])).children(recursive=True)
        workers = [p.pid for p in engine if p.name() == "VLLM::Worker"]
        assert workers and {frozenset(os.sched_getaffinity(p)) for p in workers} == {frozenset({core})}, deployment
