"""What vLLM would refuse, refused in the router before any engine sees it.

    SamplingSettings ──sampling_params() (the engines' own function)──▶ vLLM SamplingParams
        constructor:  vLLM's argument checks (stop, temperature, top_k, ...)
        verify():     vLLM's request-time checks against the model; for a regex, the grammar
                      backend the engines run validates it (vLLM's own compile timeout applies)
        encode:       vLLM's msgpack encoder, which carries the params to the engine core
    ──▶ ok, or BadRequest naming the field (400)
An engine given such a request failed it, and the router took that for a dying engine: it marked
the replica suspect and moved the turn to the next engine, which failed the same way, so one
request made every engine unavailable for `suspect_replica_s`.
"""

from dataclasses import fields
from pathlib import Path
from typing import Any

from app.chat import BadRequest
from app.engine import sampling_params
from app.protocol import SamplingSettings

ENGINE_INT_RANGE = range(-(2**63), 2**64)
"""The integers vLLM's msgpack transport carries (signed or unsigned 64-bit)."""


class RequestCheck:
    """vLLM's own checks of a request's sampling parameters, with the model and structured-output
    backend the engines use. Runs in the router's render thread: a regex is compiled there."""

    def __init__(self, model_path: Path, max_model_len: int, engine_kwargs: dict[str, Any], tokenizer: Any) -> None:
        from vllm.config import ModelConfig, StructuredOutputsConfig
        from vllm.v1.serial_utils import MsgpackEncoder

        self.model = ModelConfig(model=str(model_path), tokenizer=str(model_path), max_model_len=max_model_len)
        self.structured = StructuredOutputsConfig(**dict(engine_kwargs.get("structured_outputs_config") or {}))
        self.tokenizer, self.encoder = tokenizer, MsgpackEncoder()

    def check(self, settings: SamplingSettings) -> None:
        from vllm.exceptions import VLLMClientError

        try:
            params = sampling_params(settings, {})
        except VLLMClientError as exc:
            raise BadRequest(f"invalid sampling parameters: {exc}") from None
        try:
            params.verify(self.model, None, self.structured, self.tokenizer)
        except (VLLMClientError, ValueError) as exc:  # with this server's fields, only a grammar fails here
            what = "structured_outputs.regex: invalid regex" if settings.regex else "invalid request"
            raise BadRequest(f"{what}: {exc}") from None
        try:
            self.encoder.encode(params)
        except OverflowError as exc:
            raise BadRequest(f"{', '.join(out_of_range(settings)) or 'sampling parameters'}: cannot be sent to "
                             f"the engine ({exc})") from None


def out_of_range(settings: SamplingSettings) -> list[str]:
    """The integer fields vLLM's transport cannot carry."""
    return [f.name for f in fields(settings)
            if isinstance(value := getattr(settings, f.name), int) and value not in ENGINE_INT_RANGE]
