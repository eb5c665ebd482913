"""An agent framework people use, the OpenAI Agents SDK, runs a tool loop against the real app through
its chat-completions model and its default, the Responses API: several tool calls, each result fed
back, streamed and not, and every model call after the first appends to the exact tokens of the one
before (the decision log says so)."""

import asyncio
import time
from typing import Literal

import pytest

from tests.integration.conftest import SYSTEM_PROMPT
from tests.integration.test_tool_calls import no_blank_json  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration
TOOL_CALLS = 3


def _agent(base_url: str, bias: dict[str, float], api: str):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool
    from agents.agent import ToolsToFinalOutputResult
    from openai import AsyncOpenAI

    # A closed set of cities: the random-weight model would fill an open string until max_tokens.
    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        return f"{city}: 21 C and sunny"

    @function_tool
    def get_time(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The local time in a city."""
        return f"{city}: 14:05"

    def stop_after_calls(context, results):
        context.context["calls"] += len(results)
        done = context.context["calls"] >= TOOL_CALLS
        return ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output if done else None)

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    if api == "responses":
        model, extra = OpenAIResponsesModel(model="tiny-qwen3", openai_client=client), {}
    else:
        model = OpenAIChatCompletionsModel(model="tiny-qwen3", openai_client=client)
        extra = {"chat_template_kwargs": {"enable_thinking": False}}
    settings = ModelSettings(temperature=0, max_tokens=128, tool_choice="required",
                             extra_body={"logit_bias": bias, **extra})
    return Agent(name="weather", instructions=f"Agent. {SYSTEM_PROMPT}", model=model, model_settings=settings,
                 tools=[get_weather, get_time], tool_use_behavior=stop_after_calls, reset_tool_choice=False)


async def _run(agent, streamed: bool) -> None:
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no hub access: the SDK's traces would go to OpenAI
    context = {"calls": 0}
    if streamed:
        run = Runner.run_streamed(agent, "Weather and time in Paris?", context=context, max_turns=TOOL_CALLS + 2)
        async for _ in run.stream_events():
            pass
    else:
        run = await Runner.run(agent, "Weather and time in Paris?", context=context, max_turns=TOOL_CALLS + 2)
    assert context["calls"] >= TOOL_CALLS and run.final_output


@pytest.mark.parametrize("api, streamed", [("chat", False), ("chat", True), ("responses", False), ("responses", True)])
def test_an_agents_sdk_tool_loop_reuses_its_history_every_call(base_url, http, no_blank_json, api,  # noqa: F811
                                                               streamed):
    started = time.time()
    asyncio.run(_run(_agent(base_url, no_blank_json, api), streamed))
    calls = [d for d in http.get("/admin/decisions", params={"n": 100}).json() if d["time"] >= started]
    assert len(calls) >= TOOL_CALLS, calls
    for current in calls[1:]:
        rendering = current["rendering"]
        assert rendering["cause"] == "none", rendering
        assert rendering["shared_tokens"] == rendering["previous_tokens"] > 0, "the whole previous call is reused"
