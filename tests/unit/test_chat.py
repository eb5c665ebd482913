"""The router's rendering: only the model's own template variables from a request, no prompt
tokenized that cannot fit the context, and a time budget that starts with each request's own work."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.conversations.rendering import BadRequest, PromptRenderer, within_budget
from app.model.tiny import ensure_tiny_model

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    return PromptRenderer(ensure_tiny_model(tmp_path_factory.mktemp("tiny")), 4096)


def test_chat_template_kwargs_take_only_the_template_s_own_variables(renderer):
    renderer.check_template_kwargs({"enable_thinking": False})
    renderer.check_template_kwargs({})
    for smuggled in ("chat_template", "tools", "tokenize", "add_generation_prompt", "eos_token", "documents",
                     "no_such_variable"):
        with pytest.raises(BadRequest, match=f"chat_template_kwargs: .*{smuggled}"):
            renderer.check_template_kwargs({smuggled: "{{ 'injected' }}"})


def test_a_prompt_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(renderer, monkeypatch):
    fits = renderer.chat(MESSAGES, {})
    assert 0 < len(fits) < 4096
    calls = []
    monkeypatch.setattr(renderer.tokenizer, "encode", lambda *args, **kwargs: calls.append(args) or [])
    too_long = [{"role": "user", "content": "x" * (4096 * renderer.max_token_bytes)}]
    with pytest.raises(BadRequest, match="context length of 4096 tokens"):
        renderer.chat(too_long, {})
    assert calls == [], "the tokenizer never saw it"


def test_the_render_budget_counts_from_the_request_s_own_work_not_its_wait():
    async def scenario(thread):
        slow = asyncio.ensure_future(within_budget(thread, 0.05, time.sleep, 0.3))
        queued = asyncio.ensure_future(within_budget(thread, 0.05, lambda: "rendered"))
        with pytest.raises(BadRequest, match="longer than this server's limit of 0.05 s"):
            await slow
        assert await queued == "rendered", "waiting behind the slow one did not count against it"

    with ThreadPoolExecutor(max_workers=1) as thread:
        asyncio.run(scenario(thread))


def test_a_turn_after_a_tool_result_is_a_later_turn(renderer):
    """An agent loop asks once and then sends tool results: each of its turns after the first follows
    a reply, so it takes a later turn's priority and placement fit."""
    from app.conversations.bounded import RecordBounds
    from app.conversations.records import RenderMode
    from app.conversations.sessions import ChatSessions

    bounds = RecordBounds(ttl_s=60, max_records=8, max_bytes=1 << 20, tenant_bytes=1 << 20)
    sessions = ChatSessions(renderer, 32, bounds)
    call = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    loop = [{"role": "system", "content": "Agent."}, *MESSAGES]
    for expected in (1, 2, 3):
        query = sessions.query(loop, "tenant", "tenant", None)
        turn = sessions.render(loop, {}, query, sessions.match(query), RenderMode.PRESERVE)
        assert turn.turn_index == expected
        loop += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c0", "content": "sunny"}]
