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
