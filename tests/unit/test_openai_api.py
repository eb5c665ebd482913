import pytest
from pydantic import ValidationError

from app.openai_api import ChatCompletionRequest


def test_unknown_role_and_empty_messages_are_rejected():
    with pytest.raises(ValidationError, match="unknown role"):
        ChatCompletionRequest(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


def test_client_transfer_params_are_dropped():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                    kv_transfer_params={"remote_host": "10.0.0.9"})
    assert "kv_transfer_params" not in request.model_dump()


def test_sampling_settings_from_the_request():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=7,
                                    temperature=0, stop="END", stream=True)
    sampling = request.sampling(default_max_tokens=256)
    assert sampling.max_tokens == 7 and sampling.temperature == 0 and sampling.stop == ("END",)
    assert request.include_usage is False


@pytest.mark.parametrize("extra, named", [
    ({"n": 2}, "n"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"logprobs": True}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template": "{{ messages }}"}, "chat_template"), ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_fields_the_server_does_not_implement_are_refused_by_name(extra, named):
    with pytest.raises(ValidationError, match=f"not supported by this server: {named}"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **extra)


def test_no_op_values_of_unimplemented_fields_are_accepted():
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=1, tools=[], logprobs=False,
                          response_format={"type": "text"}, presence_penalty=0)


def test_image_parts_are_refused_and_sampling_values_are_left_to_vllm_s_checks():
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(ValidationError, match="image_url are not supported"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [image]}])
    # Typed here, checked by vLLM's own code in the router (app/request_check.py): no compile on the frontend's loop.
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], structured_outputs={"regex": "(["},
                                 temperature=-1, top_k=-5, stop=[""])
    sampling = body.sampling(16)
    assert (sampling.regex, sampling.temperature, sampling.top_k, sampling.stop) == ("([", -1, -5, ("",))


def test_a_seed_beyond_int64_is_refused_as_vllm_s_server_refuses_it():
    for seed in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(ValidationError, match="seed"):
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], seed=seed)
    largest = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], seed=2**63 - 1)
    assert largest.sampling(1).seed == 2**63 - 1
