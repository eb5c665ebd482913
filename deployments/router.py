"""The router: OpenAI-compatible HTTP ingress that runs each request through the turn loop.

client ──HTTP──▶ here: render ──▶ TurnLoop(kv_index, prefill, decode) ──▶ SSE/JSON ──▶ client
KV tensors never pass through here: only token ids and block metadata do.
"""

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from app.chat import BadRequest, PromptRenderer
from app.config import TINY_MODEL, AppConfig
from app.metrics import TurnMetrics, kv_bytes_per_token
from app.model.tiny import ensure_tiny_model
from app.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ResponseShape,
    error_body,
    sse,
    usage,
)
from app.routing import NoPrefillReplica
from app.sessions import ChatSessions, RenderedTurn
from app.tenants import Unauthorized, cache_salt, cache_scope
from app.turn import PreparedTurn, Turn, TurnLoop

DEFAULT_MAX_TOKENS = 256
RETRY_WHILE_STARTING = {"Retry-After": "5"}
"""Engines are still starting: clients may retry after this many seconds."""
api = FastAPI(title="kv-loop")


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
    return _error(f"invalid request: {problems}", 400)


@api.exception_handler(BadRequest)
async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return _error(str(exc), 400)


@api.exception_handler(Unauthorized)
async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
    return _error(str(exc), 401)


@api.exception_handler(NoPrefillReplica)
async def _starting(_: Request, exc: NoPrefillReplica) -> JSONResponse:
    return _error(str(exc), 503, headers=RETRY_WHILE_STARTING)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    def __init__(self, config: AppConfig, index, prefill, decode) -> None:
        if config.model == TINY_MODEL:
            ensure_tiny_model(config.model_path())
        # Calls and streamed chunks go straight to the replicas over gRPC (Serve's throughput-optimized
        # transport) rather than through Ray's object store: the payloads are token ids and block
        # metadata, and on this machine each hop to decode took 4 ms instead of 7.
        index, prefill, decode = (h.options(_by_reference=False) for h in (index, prefill, decode))
        self.config, self.index = config, index
        self.renderer = PromptRenderer(config.model_path(), config.max_model_len)
        self.sessions = ChatSessions(self.renderer, config.block_size, config.conversation_ttl_s,
                                     config.max_conversations)
        metrics = TurnMetrics(kv_bytes_per_token(config.model_path()))
        self.loop = TurnLoop(config, index, prefill, decode, metrics)

    @api.get("/health")
    async def health(self):
        """Ready when a prefill and a decode engine have registered (a readiness probe)."""
        if await self.index.ready.remote():
            return {"status": "ok"}
        return JSONResponse({"status": "starting"}, status_code=503, headers=RETRY_WHILE_STARTING)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "owned_by": "kv-loop", "max_model_len": self.config.max_model_len}]}

    @api.get("/admin/decisions")
    async def decisions(self, n: int = 100) -> list[dict[str, Any]]:
        return list(self.loop.decisions)[-n:]

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, authorization: str | None = Header(None),
                               x_session_id: str | None = Header(None)):
        tenant = cache_scope(authorization, body.user, self.config.api_keys, self.config.per_user_salt_tenants)
        mode = body.conversation_mode or self.config.conversation_mode
        rendered = self.sessions.render(body.template_messages(), body.chat_template_kwargs, tenant,
                                        x_session_id or body.user, mode)
        return await self._serve(body, rendered.prompt_ids, tenant, rendered)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, authorization: str | None = Header(None)):
        tenant = cache_scope(authorization, body.user, self.config.api_keys, self.config.per_user_salt_tenants)
        return await self._serve(body, self.renderer.completion(body), tenant, None)

    async def _serve(self, body: GenerationRequest, prompt_ids: list[int], tenant: str,
                     rendered: RenderedTurn | None):
        if body.model and body.model != self.config.model_name:
            return _error(f"the model {body.model!r} does not exist; this server serves "
                          f"{self.config.model_name!r}", 404)
        sampling = body.sampling(DEFAULT_MAX_TOKENS)
        self.renderer.check_fits(prompt_ids, sampling.max_tokens)
        chat = rendered is not None
        turn = Turn(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                    prompt_token_ids=tuple(prompt_ids), cache_salt=cache_salt(tenant), sampling=sampling,
                    reverse_pull=self.config.reverse_pull and body.reverse_pull is not False,
                    rendering=rendered.diagnostics if rendered else None,
                    routing_policy=body.routing_policy or self.config.routing_policy,
                    affinity_key=rendered.affinity_key if rendered else f"{tenant}:{prompt_ids[:64]}",
                    turn_index=rendered.turn_index if rendered else 1,
                    previous_replica=rendered.previous_replica if rendered else "",
                    prefill_on_decode=body.prefill_on_decode is not False)
        prepared = await asyncio.wait_for(self.loop.prepare(turn), self.config.request_timeout_s)
        shape = ResponseShape(turn.request_id, self.config.model_name, chat)
        if body.stream:
            return StreamingResponse(self._stream(prepared, shape, body, rendered), media_type="text/event-stream")
        return await self._complete(prepared, shape, body, rendered)

    async def _complete(self, prepared: PreparedTurn, shape: ResponseShape, body: GenerationRequest,
                        rendered: RenderedTurn | None):
        token_ids: list[int] = []
        text, finish_reason = [], None
        async for chunk in self.loop.decode(prepared):
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            finish_reason = chunk.finish_reason or finish_reason
        if rendered is not None:
            self.sessions.finish(rendered, token_ids, "".join(text), prepared.prefill.replica_id)
        use = usage(len(prepared.turn.prompt_token_ids), len(token_ids), prepared.cached_tokens)
        ids = token_ids if body.return_token_ids else None
        prompt = list(prepared.turn.prompt_token_ids) if body.return_token_ids else None
        return shape.full("".join(text), finish_reason, use, ids, prompt)

    async def _stream(self, prepared: PreparedTurn, shape: ResponseShape, body: GenerationRequest,
                      rendered: RenderedTurn | None):
        generated: list[int] = []
        text: list[str] = []
        prompt = list(prepared.turn.prompt_token_ids) if body.return_token_ids else None
        try:
            async for chunk in self.loop.decode(prepared):
                ids = list(chunk.token_ids) if body.return_token_ids else None
                yield shape.chunk(chunk.text, chunk.finish_reason, ids, None if generated else prompt)
                generated.extend(chunk.token_ids)
                text.append(chunk.text)
        except Exception as exc:  # noqa: BLE001 - headers are sent; report in-band, then end the stream
            yield sse(error_body(f"generation failed: {type(exc).__name__}", 500))
        else:
            if rendered is not None:
                self.sessions.finish(rendered, generated, "".join(text), prepared.prefill.replica_id)
        if body.include_usage:
            yield shape.usage_chunk(usage(len(prepared.turn.prompt_token_ids), len(generated),
                                          prepared.cached_tokens))
        yield sse("[DONE]")
