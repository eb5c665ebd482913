"""What vLLM would refuse, refused in the router before any engine sees it.

    request fields vLLM's own request models declare, that this server does not honour
        (vLLM's ChatCompletionRequest / CompletionRequest, read here) ──▶ BadRequest naming them
    SamplingSettings ──sampling_params() (the engines' own function)──▶ vLLM SamplingParams
        constructor:  vLLM's argument checks (stop, temperature, top_k, penalties, min_tokens, ...)
        verify():     vLLM's request-time checks against the model (token ids within the
                      vocabulary); for a regex, the grammar backend the engines run validates it
                      (vLLM's own compile timeout applies)
        tokenizer:    bad_words tokenized as the engines' input processor does
        encode:       vLLM's msgpack encoder, which carries the params to the engine core
    ──▶ ok, or BadRequest naming the field (400)
An engine given such a request failed it, and the router took that for a dying engine: it marked
the replica suspect and moved the turn to the next engine, which failed the same way, so one
request made every engine unavailable for `suspect_replica_s`.
"""

import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from app.conversations.memo import Memo
from app.conversations.openai_api import ChatCompletionRequest, GenerationRequest, refused_fields
from app.conversations.rendering import BadRequest
from app.engine.adapter import sampling_params
from app.protocol import SamplingSettings

logger = logging.getLogger("ray.serve")

ENGINE_INT_RANGE = range(-(2**63), 2**64)
"""The integers vLLM's msgpack transport carries (signed or unsigned 64-bit)."""


def vllm_request_defaults() -> dict[bool, dict[str, Any]]:
    """The fields of vLLM's own request models with their defaults: chat (True) and completions."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VLLMChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VLLMCompletion

    return {chat: {name: info.get_default(call_default_factory=True) for name, info in model.model_fields.items()}
            for chat, model in ((True, VLLMChat), (False, VLLMCompletion))}


def vllm_responses_defaults() -> dict[str, Any]:
    """The fields of vLLM's ResponsesRequest with their defaults (app/conversations/responses.py honours some)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as VLLMResponses

    return {name: info.get_default(call_default_factory=True) for name, info in VLLMResponses.model_fields.items()}


class RequestCheck:
    """vLLM's own checks of a request's sampling parameters, with the model and structured-output
    backend the engines use."""

    def __init__(self, model_path: Path, max_model_len: int, max_logprobs: int, engine_kwargs: dict[str, Any],
                 tokenizer: Any, remembered: int) -> None:
        from vllm.config import ModelConfig, StructuredOutputsConfig
        from vllm.tokenizers.hf import get_cached_tokenizer
        from vllm.v1.serial_utils import MsgpackEncoder

        self.model = ModelConfig(model=str(model_path), tokenizer=str(model_path), max_model_len=max_model_len,
                                 max_logprobs=max_logprobs)
        self.structured = StructuredOutputsConfig(**dict(engine_kwargs.get("structured_outputs_config") or {}))
        # vLLM's view of the tokenizer (its max_token_id bounds bad words), as the engines hold it
        self.tokenizer, self.encoder = get_cached_tokenizer(tokenizer), MsgpackEncoder()
        self.vllm_defaults = vllm_request_defaults()
        self.grammars: Memo[bool] = Memo(remembered)
        """The grammars vLLM's check passed: its verdict on one depends on nothing else."""

    def check_fields(self, body: GenerationRequest) -> None:
        """Refuse the fields of vLLM's request model this server does not honour (the body's
        undeclared ones) when set to anything but a value that asks for nothing. A field vLLM does
        not know either is logged and ignored, as vLLM's server does with it."""
        extra = body.model_extra
        if not extra:
            return
        defaults = self.vllm_defaults[isinstance(body, ChatCompletionRequest)]
        if message := refused_fields(extra, defaults):
            raise BadRequest(message)
        if unknown := sorted(extra.keys() - defaults.keys()):
            logger.debug(json.dumps({"event": "request_fields_ignored", "fields": unknown[:20]}))

    def needs_tokenizer(self, settings: SamplingSettings) -> bool:
        """Whether `check` compiles a grammar not checked before or tokenizes bad words: then it runs
        in the router's render thread (the tokenizer is not safe to share, a compile takes time).
        Without them it takes microseconds, less than a hop to that thread."""
        return bool(settings.bad_words or (settings.grammar and not self._passed_before(settings)))

    def _passed_before(self, settings: SamplingSettings) -> bool:
        return bool(self.grammars.get(json.dumps(settings.grammar_spec)))

    def check(self, settings: SamplingSettings) -> None:
        from vllm import envs
        from vllm.exceptions import VLLMClientError

        try:
            params = sampling_params(settings, {})
        except VLLMClientError as exc:
            raise BadRequest(f"invalid sampling parameters: {exc}") from None
        known = settings.grammar and self._passed_before(settings)
        if known:  # the rest of vLLM's check still runs
            params.structured_outputs = None
        try:
            params.verify(self.model, None, self.structured, self.tokenizer)
        except (VLLMClientError, ValueError) as exc:  # vLLM's name the field (parameter=); a grammar's do not
            grammar = settings.grammar and getattr(exc, "parameter", None) is None
            what = ("structured_outputs.regex: invalid regex" if settings.regex else "response_format: invalid schema"
                    ) if grammar else "invalid sampling parameters"
            raise BadRequest(f"{what}: {exc}") from None
        if settings.grammar and not known:
            self.grammars.put(json.dumps(settings.grammar_spec), True)
        try:
            params.update_from_tokenizer(self.tokenizer)
        except VLLMClientError as exc:
            raise BadRequest(f"invalid sampling parameters: {exc}") from None
        # The engines' model runner (V2) refuses more in its worker, where a refusal is no 400.
        bad_word_tokens = sum(map(len, params.bad_words_token_ids or ()))
        if bad_word_tokens > envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS:
            raise BadRequest(f"bad_words: {bad_word_tokens} tokens exceed vLLM's limit of "
                             f"{envs.VLLM_MAX_BAD_WORDS_TOTAL_TOKENS}")
        try:
            self.encoder.encode(params)
        except OverflowError as exc:
            raise BadRequest(f"{', '.join(out_of_range(settings)) or 'sampling parameters'}: cannot be sent to "
                             f"the engine ({exc})") from None


def out_of_range(settings: SamplingSettings) -> list[str]:
    """The integer fields vLLM's transport cannot carry."""
    return [f.name for f in fields(settings)
            if any(isinstance(v, int) and v not in ENGINE_INT_RANGE for v in _values(getattr(settings, f.name)))]


def _values(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)
