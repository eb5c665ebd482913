"""Append-only conversations through the real app: preserve vs template rendering, edited history,
tenant isolation. The tiny model's template drops the empty think block from history, as Qwen3's does."""

import httpx
import pytest

from app.kv.hashing import common_prefix_len
from app.ops.client import chat_turn
from tests.integration.conftest import (
    SYSTEM_PROMPT,
    USER_TURNS,
    decisions_by_request,
    make_client,
    reference_ids,
    run_conversation,
)

pytestmark = pytest.mark.integration
MAX_TOKENS = 24
NON_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _rendering(http, turn) -> dict:
    return decisions_by_request(http)[turn.request_id]["rendering"]


@pytest.fixture(scope="module")
def preserved(client):
    return run_conversation(client, "Preserve. " + SYSTEM_PROMPT, USER_TURNS, MAX_TOKENS,
                            conversation_mode="preserve", **NON_THINKING)


@pytest.fixture(scope="module")
def templated(client):
    return run_conversation(client, "Template. " + SYSTEM_PROMPT, USER_TURNS, MAX_TOKENS,
                            conversation_mode="template", **NON_THINKING)


def test_preserve_reuses_every_full_block_of_the_previous_sequence(preserved, http, app_config):
    block = app_config.block_size
    for previous, current in zip(preserved, preserved[1:]):
        sequence = previous.prompt_ids + previous.output_ids
        assert current.prompt_ids[:len(sequence)] == sequence, "the new prompt appends to the old tokens"
        assert current.cached_tokens >= len(sequence) // block * block
        rendering = _rendering(http, current)
        assert rendering["cause"] == "none" and rendering["shared_tokens"] == len(sequence)


def test_template_mode_stops_at_the_dropped_think_block(templated, http, app_config):
    for previous, current in zip(templated, templated[1:]):
        sequence = previous.prompt_ids + previous.output_ids
        shared = common_prefix_len(current.prompt_ids, sequence)
        assert shared < len(previous.prompt_ids), "history lost the generation prompt's think block"
        rendering = _rendering(http, current)
        assert rendering["cause"] == "template_rewrite" and rendering["shared_tokens"] == shared
        assert rendering["reusable_blocks"] == shared // app_config.block_size
        assert current.cached_tokens <= shared


def test_both_modes_generate_what_a_plain_engine_generates(preserved, templated, reference):
    for turns in (preserved, templated):
        assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)


REASONING = r"<think>\n[a-z ]{8,24}\n</think>\n\n[a-z ]{8,24}"
THINKING_WITH_REASONING = {"structured_outputs": {"regex": REASONING}, "ignore_eos": False}


@pytest.mark.parametrize("mode, cause", [("preserve", "none"), ("template", "reasoning_stripped")])
def test_thinking_mode_with_reasoning_in_the_replies(client, http, reference, mode, cause):
    turns = run_conversation(client, f"Thinking {mode}. " + SYSTEM_PROMPT, USER_TURNS[:3], 64,
                             conversation_mode=mode, **THINKING_WITH_REASONING)
    assert all(t.text.startswith("<think>\n") and "</think>" in t.text for t in turns), [t.text for t in turns]
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, 64, REASONING)
    for previous, current in zip(turns, turns[1:]):
        sequence = previous.prompt_ids + previous.output_ids
        rendering = _rendering(http, current)
        assert rendering["cause"] == cause
        if mode == "preserve":
            assert current.prompt_ids[:len(sequence)] == sequence, "the reasoning stays in the prompt"
        else:
            assert rendering["shared_tokens"] == len(previous.prompt_ids), "reuse ends where the reasoning began"


def test_edited_history_is_correct_and_the_break_is_reported(client, http, reference, app_config):
    def edit_first_question(k, messages):
        if k < 2:
            return messages
        return [messages[0], {"role": "user", "content": "An edited first question?"}, *messages[2:]]

    turns = run_conversation(client, "Edited. " + SYSTEM_PROMPT, USER_TURNS[:3], MAX_TOKENS,
                             edit=edit_first_question, **NON_THINKING)
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
    previous, edited = turns[1], turns[2]
    shared = common_prefix_len(edited.prompt_ids, previous.prompt_ids + previous.output_ids)
    rendering = _rendering(http, edited)
    assert rendering["cause"] == "edited_history"
    assert rendering["shared_tokens"] == shared and rendering["reusable_blocks"] == shared // app_config.block_size
    assert edited.cached_tokens <= shared


def test_records_of_one_tenant_never_serve_another(base_url, http):
    tenant_a, tenant_b = make_client(base_url, "key-a"), make_client(base_url, "key-b")
    messages = [{"role": "system", "content": "Shared prompt. " + SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}]
    first = chat_turn(tenant_a, messages, MAX_TOKENS, stream=False, **NON_THINKING)
    replay = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More"}]
    a_next = chat_turn(tenant_a, replay, MAX_TOKENS, stream=False, **NON_THINKING)
    b_same = chat_turn(tenant_b, replay, MAX_TOKENS, stream=False, **NON_THINKING)
    assert _rendering(http, a_next)["cause"] == "none" and a_next.cached_tokens > 0
    b_rendering = _rendering(http, b_same)
    assert b_rendering["cause"] == "no_record" and b_same.cached_tokens == 0
    assert decisions_by_request(http)[b_same.request_id]["action"] == "recompute"
    assert b_same.prompt_ids != a_next.prompt_ids, "B renders from the template, A appends to its record"


def test_missing_or_unknown_api_key_gets_401(base_url):
    body = {"messages": [{"role": "user", "content": "x"}]}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
