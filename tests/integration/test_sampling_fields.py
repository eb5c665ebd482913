"""vLLM's sampling fields through the real app, against one plain vLLM engine given the same prompt
ids and sampling parameters: min_tokens counts the whole reply when prefill sampled its first
token, penalties give the plain engine's tokens, and bad values are a 400 naming the field."""

import pytest
import ray

from app.ops.client import chat_turn
from tests.integration.conftest import SYSTEM_PROMPT, decisions_by_request

pytestmark = pytest.mark.integration
MAX_TOKENS = 24


def _messages(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"{tag}. {SYSTEM_PROMPT}"}, {"role": "user", "content": "Hello"}]


def _oracle(reference, prompt_ids: list[int], **sampling) -> list[int]:
    return ray.get(reference.generate.remote([prompt_ids], MAX_TOKENS, None, sampling))[0]


def test_min_tokens_holds_off_an_early_stop_token_over_the_whole_reply(client, http, reference):
    messages = _messages("Min tokens")
    plain = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False)
    stop = {"ignore_eos": False, "stop_token_ids": [plain.output_ids[1]]}
    early = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False, **stop)
    assert len(early.output_ids) <= 2, "the stop token ends the reply where it first comes"
    assert early.output_ids == _oracle(reference, early.prompt_ids, **stop)

    held = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False, min_tokens=20, **stop)
    assert decisions_by_request(http)[held.request_id]["first_token_from"] == "prefill", "the split path"
    assert len(held.output_ids) >= 20
    assert held.output_ids == _oracle(reference, held.prompt_ids, min_tokens=20, **stop)


def test_min_tokens_without_max_tokens_counts_against_the_context_s_room(client, http, reference):
    """max_tokens left unset is the context's room (vLLM's rule), so min_tokens is checked against
    that, not against a placeholder; min_tokens past the room is vLLM's own 400."""
    messages = _messages("Min tokens, no max")
    plain = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False)
    stop_at = next(t for t in plain.output_ids[2:] if t not in plain.output_ids[:2])
    body = {"messages": messages, "temperature": 0, "min_tokens": 2, "stop_token_ids": [stop_at],
            "return_token_ids": True}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    ids = response.json()["choices"][0]["token_ids"]
    assert ids == plain.output_ids[:plain.output_ids.index(stop_at) + 1]
    refused = http.post("/v1/chat/completions", json={**body, "min_tokens": 10**6})
    assert refused.status_code == 400 and "min_tokens" in refused.json()["error"]["message"], refused.text


def test_penalties_give_the_plain_engine_s_tokens(client, http, reference):
    """Presence and frequency penalties count generated tokens only: decode samples the whole reply.
    The repetition penalty counts prompt and reply alike: prefill's first token may stay."""
    messages = _messages("Penalties")
    plain = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    penalised = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False, **penalties)
    assert decisions_by_request(http)[penalised.request_id]["first_token_from"] == "decode"
    assert penalised.output_ids == _oracle(reference, penalised.prompt_ids, **penalties)
    assert penalised.output_ids != plain.output_ids, "the penalties changed the reply"

    repeated = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False, repetition_penalty=1.3)
    assert decisions_by_request(http)[repeated.request_id]["first_token_from"] == "prefill"
    assert repeated.output_ids == _oracle(reference, repeated.prompt_ids, repetition_penalty=1.3)


def test_per_token_constraints_give_the_plain_engine_s_tokens(client, reference):
    messages = _messages("Constraints")
    plain = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False)
    allowed = sorted(set(plain.output_ids[:6]))
    fields = {"allowed_token_ids": allowed, "logit_bias": {str(allowed[-1]): 5.0}, "min_p": 0.2}
    constrained = chat_turn(client, messages, MAX_TOKENS, prefill_on_decode=False, stream=False, **fields)
    assert set(constrained.output_ids) <= set(allowed)
    assert constrained.output_ids == _oracle(reference, constrained.prompt_ids, **fields)


@pytest.mark.parametrize("fields, words", [
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be less than or equal to max_tokens"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"use_beam_search": True}, "not supported by this server: use_beam_search (beam search is not implemented)"),
])
def test_bad_sampling_fields_are_a_400_naming_the_field(http, fields, words):
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **fields})
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]



@pytest.mark.parametrize("length", [1, 3])
def test_a_reply_ending_inside_a_utf8_character_has_the_plain_engine_s_text(client, reference, app_config, length):
    """The reply's tokens are UTF-8 lead bytes (allowed_token_ids): its text ends inside a character.
    Whole and streamed, the text is what vLLM's own detokenizer makes of the same tokens (vLLM
    holds back a trailing incomplete character, it does not write U+FFFD for it), so the next
    turn's history matches a plain vLLM server's."""
    from transformers import AutoTokenizer

    # byte-level BPE names the byte 0xE2, which opens a three-byte character, 'â'
    lead = AutoTokenizer.from_pretrained(str(app_config.model_path())).convert_tokens_to_ids("â")
    fields = {"allowed_token_ids": [lead]}
    messages = _messages(f"UTF-8 {length}")
    whole = chat_turn(client, messages, length, stream=False, prefill_on_decode=False, **fields)
    streamed = chat_turn(client, messages, length, prefill_on_decode=False, **fields)
    ids, text = ray.get(reference.replies.remote([whole.prompt_ids], length, None, fields))[0]
    assert whole.output_ids == streamed.output_ids == ids == [lead] * length
    assert whole.text == streamed.text == text


def test_n_choices_are_vllm_s_choices_and_each_one_continues(client, http, reference):
    """`n` as vLLM's server answers it: seeded choices equal one plain engine's n choices of the same
    seed (each a turn sampled whole in one engine), streamed or not; the client's next turn continues
    whichever choice it kept, reusing its history."""
    messages = _messages("Choices")
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
            "n": 2, "seed": 11, "temperature": 1.0}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    prompt, choices = reply["prompt_token_ids"], reply["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    expected = ray.get(reference.choices.remote(prompt, MAX_TOKENS, {"n": 2, "seed": 11, "temperature": 1.0}))
    assert [c["token_ids"] for c in choices] == expected and expected[0] != expected[1]
    assert reply["usage"]["completion_tokens"] == 2 * MAX_TOKENS and reply["usage"]["prompt_tokens"] == len(prompt)

    streamed = client.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=MAX_TOKENS, n=2,
                                              seed=11, temperature=1.0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    ids, usage = {0: [], 1: []}, []
    for chunk in streamed:
        for choice in chunk.choices:
            ids[choice.index] += choice.model_dump().get("token_ids") or []
        usage += [chunk.usage] if chunk.usage else []
    assert [ids[0], ids[1]] == expected
    assert len(usage) == 1 and usage[0].completion_tokens == 2 * MAX_TOKENS

    kept = choices[1]["message"]["content"]
    after = chat_turn(client, [*messages, {"role": "assistant", "content": kept}, {"role": "user", "content": "More"}],
                      MAX_TOKENS)
    decision = decisions_by_request(http)[after.request_id]
    assert decision["rendering"]["cause"] == "none" and after.output_ids == _oracle(reference, after.prompt_ids)


def test_n_past_the_server_s_limit_is_a_400(http):
    response = http.post("/v1/chat/completions", json={"messages": _messages("Too many"), "n": 99})
    assert response.status_code == 400 and "n: 99 choices" in response.json()["error"]["message"], response.text
