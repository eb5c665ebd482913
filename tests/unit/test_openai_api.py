import pytest
from pydantic import ValidationError
from vllm import SamplingParams

from app.conversations.openai_api import ChatCompletionRequest, CompletionRequest
from app.conversations.openai_replies import logprobs_body


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


def test_vllm_s_sampling_fields_reach_the_engine_s_sampling_params():
    from app.engine.adapter import sampling_params

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=30, min_tokens=20, min_p=0.1,
                                 presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                 stop_token_ids=[5, 6], bad_words=["no"], include_stop_str_in_output=True,
                                 logit_bias={"7": 150.0}, allowed_token_ids=[1, 2, 7], skip_special_tokens=False,
                                 spaces_between_special_tokens=False)
    assert body.model_extra == {}, "each is a field of the server's own"
    params = sampling_params(body.sampling(256), {})
    assert (params.max_tokens, params.min_tokens, params.min_p) == (30, 20, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (params.stop_token_ids, params.bad_words, params.include_stop_str_in_output) == ([5, 6], ["no"], True)
    assert params.logit_bias == {7: 100.0}, "vLLM's own conversion: token ids as integers, the bias clamped"
    assert params.allowed_token_ids == [1, 2, 7]
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)
    unset = sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling(256), {})
    default = SamplingParams(max_tokens=256)
    for name in ("min_tokens", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "stop_token_ids", "bad_words", "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
                 "skip_special_tokens", "spaces_between_special_tokens"):
        assert getattr(unset, name) == getattr(default, name), name


def test_the_rest_of_a_reply_counts_min_tokens_like_max_tokens():
    settings = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=30,
                                     min_tokens=20).sampling(256)
    assert (settings.after(1).max_tokens, settings.after(1).min_tokens) == (29, 19)
    assert (settings.after(25).max_tokens, settings.after(25).min_tokens) == (5, 0)


@pytest.mark.parametrize("fields, reads", [
    ({}, False), ({"min_tokens": 3, "repetition_penalty": 1.3, "logit_bias": {"1": 2.0}, "stop_token_ids": [1]}, False),
    ({"presence_penalty": 0.5}, True), ({"frequency_penalty": 0.1}, True), ({"bad_words": ["x"]}, True),
    ({"structured_outputs": {"regex": "a+"}}, True), ({"presence_penalty": 0.0}, False),
    ({"seed": 3, "temperature": 0.8}, True), ({"seed": 3, "temperature": 0.0}, False),
])
def test_sampling_that_reads_the_reply_so_far_is_known(fields, reads):
    """Penalties over generated tokens, bad words and grammars must see the whole reply in one
    engine; repetition_penalty counts prompt and reply alike, so it need not."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    assert body.sampling(16).reads_reply is reads


def test_fields_the_server_does_not_declare_are_kept_for_the_router_s_check():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], best_of=2, some_client_field=1)
    assert body.model_extra == {"best_of": 2, "some_client_field": 1}


def test_n_choices_are_n_requests_seeded_as_vllm_seeds_its_children():
    from app.config import Limits
    from app.conversations.openai_replies import merged_choices

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=3, seed=7, stream=True,
                                 stream_options={"include_usage": True})
    choices = body.choices()
    assert [(c.n, c.seed, c.include_usage) for c in choices] == [(1, 7, False), (1, 8, False), (1, 9, False)]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=2).choices()[1].seed is None
    assert body.over_limits(Limits(max_choices=2)) == "n: 3 choices exceed this server's limit of 2"
    replies = [{"id": "a", "choices": [{"index": i, "text": str(i)}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2 + i, "total_tokens": 7 + i}} for i in range(2)]
    assert merged_choices(replies) == {"id": "a", "choices": [{"index": 0, "text": "0"}, {"index": 1, "text": "1"}],
                                       "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}


@pytest.mark.parametrize("extra, named", [
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"structured_outputs": {"regex": "a+", "json": {"type": "object"}}}, "structured_outputs.json"),
])
def test_nested_fields_the_server_does_not_implement_are_refused_by_name(extra, named):
    with pytest.raises(ValidationError, match=f"not supported by this server: {named}"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True, **extra)
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True,
                          stream_options={"include_usage": True, "continuous_usage_stats": False})


def test_image_parts_are_refused_and_sampling_values_are_left_to_vllm_s_checks():
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(ValidationError, match="image_url are not supported"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [image]}])
    # Typed here, checked by vLLM's own code in the router (app/conversations/request_check.py): no compile
    # on the frontend's loop.
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


def test_fields_that_ask_an_engine_for_unbounded_work_are_bounded():
    from app.config import Limits
    from app.conversations.openai_api import CompletionRequest

    limits = Limits(max_stop_strings=2, max_stop_chars=8, max_regex_bytes=16)

    def problem(**fields):
        return CompletionRequest(prompt="x", **fields).over_limits(limits)

    assert problem(stop=["a", "b"], structured_outputs={"regex": "[a-z]+"}) is None
    assert "3 strings" in problem(stop=["a", "b", "c"])
    assert "9 characters" in problem(stop="x" * 9)
    assert "17 bytes" in problem(structured_outputs={"regex": "a" * 17})


def test_the_model_s_generation_config_fills_what_the_request_leaves_unset():
    """As vLLM's server applies generation_config.json (get_diff_sampling_param): a value the client
    sets wins, even vLLM's neutral one."""
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    unset = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).sampling(8, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=1.0, top_k=0)
    assert (given.sampling(8, defaults).temperature, given.sampling(8, defaults).top_k) == (1.0, 0)


def test_logprob_fields_map_to_vllm_s_and_its_own_checks_refuse_what_it_refuses():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest(**chat).sampling(4).logprobs is None
    assert ChatCompletionRequest(**chat, logprobs=True).sampling(4).logprobs == 0
    assert ChatCompletionRequest(**chat, logprobs=True, top_logprobs=5).sampling(4).logprobs == 5
    assert CompletionRequest(prompt="x", logprobs=2).sampling(4).logprobs == 2
    with pytest.raises(ValidationError, match="`logprobs` must be set to true"):
        ChatCompletionRequest(**chat, top_logprobs=2)
    with pytest.raises(ValidationError, match="positive value or -1"):
        CompletionRequest(prompt="x", logprobs=-2)


def test_logprobs_take_vllm_s_server_shapes():
    steps = [((5, -0.1, 1, "a"), (7, -2.0, 2, "b")), ((9, -0.5, 1, "c"), (5, -1.0, 2, "a"))]
    chat = logprobs_body(True, [5, 9], steps, 1)["content"]
    assert [(c["token"], c["logprob"], [t["token"] for t in c["top_logprobs"]]) for c in chat] == [
        ("a", -0.1, ["a"]), ("c", -0.5, ["c"])]
    text = logprobs_body(False, [5, 9], steps, 1, text_offset=3)
    assert text == {"text_offset": [3, 4], "token_logprobs": [-0.1, -0.5], "tokens": ["a", "c"],
                    "top_logprobs": [{"a": -0.1, "b": -2.0}, {"c": -0.5, "a": -1.0}]}


def test_a_batch_of_one_prompt_is_that_prompt_and_of_more_a_400():
    assert CompletionRequest(prompt=["ab"]).prompt == "ab"
    assert CompletionRequest(prompt=[[1, 2]]).prompt == [1, 2]
    with pytest.raises(ValidationError, match="send one request per prompt"):
        CompletionRequest(prompt=["a", "b"])
