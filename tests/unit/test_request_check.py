"""What vLLM would refuse is refused in the router, by vLLM's own code, before any engine sees it;
and an engine's refusal of a request is the client's error, not a dying engine."""

import pytest

from app.chat import BadRequest, PromptRenderer
from app.model.tiny import ensure_tiny_model
from app.protocol import SamplingSettings
from app.reply import EngineRefused, refusal
from app.request_check import RequestCheck


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    path = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    return RequestCheck(path, 4096, {}, PromptRenderer(path, 4096).tokenizer)


@pytest.mark.parametrize("settings, field", [
    (SamplingSettings(stop=("",)), "stop"),
    (SamplingSettings(temperature=-1.0), "temperature"),
    (SamplingSettings(top_p=0.0), "top_p"),
    (SamplingSettings(top_k=-5), "top_k"),
    (SamplingSettings(seed=2**64), "seed"),
    (SamplingSettings(regex="(["), "structured_outputs.regex"),
    (SamplingSettings(regex="a\x00b"), "structured_outputs.regex"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(check, settings, field):
    with pytest.raises(BadRequest, match=field.replace(".", r"\.")):
        check.check(settings)


def test_what_vllm_runs_passes(check):
    check.check(SamplingSettings(max_tokens=8, temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1, stop=("END",),
                                 regex="[a-z]{1,8}"))


def test_an_engine_s_refusal_is_the_client_s_error_and_its_death_is_not():
    from ray.exceptions import ActorDiedError, RayTaskError
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    assert isinstance(refusal(VLLMValidationError("stop cannot contain an empty string.")), BadRequest)
    wrapped = RayTaskError("generate", "traceback", VLLMValidationError("top_k must be 0"))
    assert "top_k" in str(refusal(wrapped))
    for unclear in (EngineGenerateError(), OverflowError("can't serialize ints"), TypeError("x")):
        assert isinstance(refusal(unclear), EngineRefused)
    for dead in (EngineDeadError(), RuntimeError("the engine process died"), ActorDiedError(), TimeoutError()):
        assert refusal(dead) is None
