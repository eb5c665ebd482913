"""What vLLM would refuse is refused in the router, by vLLM's own code, before any engine sees it;
and an engine's refusal of a request is the client's error, not a dying engine."""

import re

import pytest

from app.conversations.openai_api import IGNORED, REFUSED_BECAUSE, ChatCompletionRequest, CompletionRequest
from app.conversations.rendering import BadRequest, PromptRenderer
from app.conversations.request_check import RequestCheck, vllm_request_defaults
from app.model.tiny import ensure_tiny_model
from app.protocol import SamplingSettings
from app.turn.reply import EngineRefused, refusal


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    path = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    return RequestCheck(path, 4096, 20, {}, PromptRenderer(path, 4096).tokenizer, 4)


@pytest.mark.parametrize("settings, field", [
    (SamplingSettings(stop=("",)), "stop"),
    (SamplingSettings(temperature=-1.0), "temperature"),
    (SamplingSettings(top_p=0.0), "top_p"),
    (SamplingSettings(top_k=-5), "top_k"),
    (SamplingSettings(seed=2**64), "seed"),
    (SamplingSettings(regex="(["), "structured_outputs.regex"),
    (SamplingSettings(regex="a\x00b"), "structured_outputs.regex"),
    (SamplingSettings(max_tokens=8, min_tokens=9), "min_tokens"),
    (SamplingSettings(min_tokens=-1), "min_tokens"),
    (SamplingSettings(min_p=1.5), "min_p"),
    (SamplingSettings(presence_penalty=2.5), "presence_penalty"),
    (SamplingSettings(frequency_penalty=-3.0), "frequency_penalty"),
    (SamplingSettings(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingSettings(stop_token_ids=(10**6,)), "stop_token_ids"),
    (SamplingSettings(stop_token_ids=(2**64,)), "stop_token_ids"),
    (SamplingSettings(logit_bias=(("x", 1.0),)), "logit_bias"),
    (SamplingSettings(logit_bias=(("999999", 1.0),)), "logit_bias"),
    (SamplingSettings(allowed_token_ids=()), "allowed_token_ids"),
    (SamplingSettings(allowed_token_ids=(1, 10**6)), "allowed_token_ids"),
    (SamplingSettings(bad_words=("",)), "bad_words"),
    (SamplingSettings(bad_words=tuple(f"w{i}" for i in range(200))), "bad_words"),
    (SamplingSettings(regex="a+", stop_token_ids=(10**6,)), "stop_token_ids"),
    (SamplingSettings(logprobs=21), "logprobs"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(check, settings, field):
    with pytest.raises(BadRequest, match=field.replace(".", r"\.")):
        check.check(settings)


def test_a_grammar_vllm_passed_is_checked_once_and_the_rest_of_each_request_every_time(tmp_path):
    path = ensure_tiny_model(tmp_path)
    check = RequestCheck(path, 4096, 20, {}, PromptRenderer(path, 4096).tokenizer, 4)
    grammar = SamplingSettings(regex="[ab]+")
    assert check.needs_tokenizer(grammar)
    check.check(grammar)
    assert not check.needs_tokenizer(grammar), "checked before: at once, not in the render thread"
    with pytest.raises(BadRequest, match="logprobs"):
        check.check(SamplingSettings(regex="[ab]+", logprobs=99))
    for _ in range(2):  # a refused grammar is never remembered
        with pytest.raises(BadRequest, match="structured_outputs.regex"):
            check.check(SamplingSettings(regex="(["))
    assert check.needs_tokenizer(SamplingSettings(regex="(["))


def test_what_vllm_runs_passes(check):
    check.check(SamplingSettings(max_tokens=8, temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1, stop=("END",),
                                 regex="[a-z]{1,8}"))
    check.check(SamplingSettings(max_tokens=8, min_tokens=8, min_p=0.05, presence_penalty=2.0, frequency_penalty=-2.0,
                                 repetition_penalty=1.3, stop_token_ids=(5,), bad_words=("router", "index"),
                                 include_stop_str_in_output=True, logit_bias=(("7", -100.0),),
                                 allowed_token_ids=(1, 2, 3), skip_special_tokens=False,
                                 spaces_between_special_tokens=False))


def _body(chat: bool = True, **fields):
    if chat:
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    return CompletionRequest(prompt="x", **fields)


@pytest.mark.parametrize("fields, message", [
    ({"best_of": 2}, "best_of (choices are sampled as n turns"),
    ({"prompt_logprobs": 2}, "prompt_logprobs (a prompt's history is mostly not computed at all"),
    ({"chat_template": "{{ messages }}"}, "chat_template (a client's template is not run)"),
    ({"use_beam_search": True, "length_penalty": 0.5}, "length_penalty (it applies to beam search only), "
     "use_beam_search (beam search is not implemented)"),
    ({"add_generation_prompt": False}, "add_generation_prompt (conversations are rendered append-only"),
    ({"priority": -5}, "priority (this server sets priorities itself"),
    ({"cache_salt": "mine"}, "cache_salt (this server salts the prefix cache per tenant)"),
    ({"request_id": "abc"}, "request_id (this server names its requests)"),
    ({"functions": [{"name": "f"}]}, "functions (deprecated by OpenAI: use tools)"),
])
def test_vllm_s_fields_the_server_does_not_honour_are_refused_by_name_with_why(check, fields, message):
    with pytest.raises(BadRequest, match=re.escape(f"not supported by this server: {message}")):
        check.check_fields(_body(**fields))


def test_completions_are_checked_against_vllm_s_completion_request(check):
    with pytest.raises(BadRequest, match=re.escape("echo (the prompt is not echoed), suffix (not implemented)")):
        check.check_fields(_body(chat=False, echo=True, suffix="end"))
    with pytest.raises(BadRequest, match="prompt_logprobs"):
        check.check_fields(_body(chat=False, prompt_logprobs=0))
    check.check_fields(_body(chat=False, add_special_tokens=True, logprobs=None))  # vLLM's defaults
    check.check_fields(_body(suffix="end"))  # not a field of vLLM's chat model: ignored, as vLLM does


def test_values_that_ask_for_nothing_and_fields_vllm_does_not_know_are_accepted(check):
    check.check_fields(_body(n=1, tools=[], tool_choice="none", logprobs=False, top_logprobs=0, echo=False,
                             response_format={"type": "text"}, length_penalty=1, add_generation_prompt=True,
                             priority=0, request_id=None, prompt_logprobs=None, mm_payload="tensors"))
    check.check_fields(_body(metadata={"a": "b"}, store=False, some_client_field=[1]))  # logged, as vLLM does
    assert "kv_transfer_params" not in _body(kv_transfer_params={"do_remote_decode": True}).model_extra


def test_every_field_of_vllm_s_request_models_is_honoured_or_refused_with_a_reason():
    """A field a vLLM upgrade adds is refused ("not implemented") until it is honoured here or
    given its reason."""
    declared = ChatCompletionRequest.model_fields.keys() | CompletionRequest.model_fields.keys()
    for defaults in vllm_request_defaults().values():
        unexplained = defaults.keys() - declared - REFUSED_BECAUSE.keys() - set(IGNORED)
        assert not unexplained, f"vLLM fields neither honoured nor explained: {sorted(unexplained)}"


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
