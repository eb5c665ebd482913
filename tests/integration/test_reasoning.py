"""vLLM's reasoning parser (qwen3) through the real app: a reply's reasoning in `reasoning`, apart from
`content`, streamed or not, as vLLM's parser reads the plain engine's reply; a client that replays
the reasoning in its own field, or drops it, continues the record of the exact tokens (own_app:
after every test on the session's app)."""

from dataclasses import replace

import pytest
import ray

from tests.integration.conftest import SYSTEM_PROMPT, decisions_by_request, run_own_app

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reasoning_app(base_url, app_config):
    return run_own_app(base_url, replace(app_config, reasoning_parser="qwen3"))


def _turn(client, messages: list[dict], stream: bool, **body) -> dict:
    kwargs = dict(model="tiny-qwen3", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                  extra_body={"return_token_ids": True, "ignore_eos": True, **body})
    if not stream:
        response = client.chat.completions.create(**kwargs).model_dump()
        choice = response["choices"][0]
        return {"id": response["id"], "reasoning": choice["message"].get("reasoning"),
                "content": choice["message"]["content"], "prompt_ids": response["prompt_token_ids"],
                "output_ids": choice["token_ids"]}
    chunks = [c.model_dump() for c in client.chat.completions.create(**kwargs, stream=True)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    joined = {key: "".join(d.get(key) or "" for d in deltas) or None for key in ("reasoning", "content")}
    return {"id": chunks[0]["id"], **joined,
            "prompt_ids": next(c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")),
            "output_ids": [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or ()]}


def _vllm_reads(app_config, ids: list[int], text: str, thinking: bool) -> tuple[str | None, str | None]:
    """What vLLM's qwen3 reasoning parser reads in the plain engine's reply: (reasoning, content)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tokenizer = AutoTokenizer.from_pretrained(str(app_config.model_path()))
    kwargs = {} if thinking else {"enable_thinking": False}
    request = ChatCompletionRequest(model="tiny-qwen3", messages=[{"role": "user", "content": "x"}],
                                    chat_template_kwargs=kwargs)
    parser = ParserManager.get_parser(reasoning_parser_name="qwen3", tokenizer=tokenizer)(
        tokenizer, None, chat_template_kwargs=kwargs, model_config=None)
    reasoning, content, _ = parser.parse(text, request, model_output_token_ids=ids)
    return reasoning or None, content or None


def test_reasoning_comes_apart_from_content_and_replayed_histories_continue_the_record(
        reasoning_app, client, http, reference):
    messages = [{"role": "system", "content": f"Reasoning. {SYSTEM_PROMPT}"}, {"role": "user", "content": "Hi"}]
    turns = []
    for k, (thinking, stream, replay) in enumerate([(True, False, "field"), (True, True, "drop"),
                                                    (False, False, None)]):
        body = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
        turn = _turn(client, messages, stream, **body)
        ids, text = ray.get(reference.replies.remote([turn["prompt_ids"]], MAX_TOKENS))[0]
        assert turn["output_ids"] == ids, f"turn {k}"
        assert (turn["reasoning"], turn["content"]) == _vllm_reads(reasoning_app, ids, text, thinking), f"turn {k}"
        assert turn["reasoning"] if thinking else turn["content"] and not turn["reasoning"], turn
        turns.append(turn)
        reply = {"role": "assistant", "content": turn["content"] or ""}
        if replay == "field":
            reply["reasoning"] = turn["reasoning"]
        messages = [*messages, reply, {"role": "user", "content": f"And then {k}?"}]
    decisions = decisions_by_request(http)
    for previous, current in zip(turns, turns[1:]):
        sequence = previous["prompt_ids"] + previous["output_ids"]
        assert current["prompt_ids"][:len(sequence)] == sequence, "the reasoning the model produced stays"
        assert decisions[current["id"]]["rendering"]["cause"] == "none"
