"""The router: OpenAI-compatible HTTP ingress that runs each request through the turn loop.

client ──HTTP──▶ here: render (a worker thread) ──▶ TurnLoop(kv_index, prefill, decode) ──▶ SSE/JSON
KV tensors never pass through here: only token ids and block metadata do. Every failure answers
in the OpenAI error shape: 400/401/403/413 for the client's mistakes, 503 + Retry-After while no
engine can serve, 504 when a stage times out, 500 otherwise (in-band once a stream has started).
"""

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from app.chat import BadRequest, PromptRenderer
from app.config import TINY_MODEL, AppConfig
from app.ledger import TurnLedger
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
from app.protocol import Role
from app.reply import NoEngineAlive, StageTimeout
from app.routing import NoPrefillReplica
from app.sessions import ChatSessions, HistoryQuery, RenderedTurn
from app.tenants import Forbidden, Unauthorized, cache_salt, cache_scope, open_api_warning, require_admin
from app.turn import PreparedTurn, Turn, TurnLoop
from deployments.http_guard import HttpGuard, error_response

logger = logging.getLogger("ray.serve")
DEFAULT_MAX_TOKENS = 256
api = FastAPI(title="kv-loop")
api.add_middleware(HttpGuard)


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
    return error_response(f"invalid request: {problems}", 400)


@api.exception_handler(BadRequest)
async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
    return error_response(str(exc), 400)


@api.exception_handler(Unauthorized)
async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
    return error_response(str(exc), 401)


@api.exception_handler(Forbidden)
async def _forbidden(_: Request, exc: Forbidden) -> JSONResponse:
    return error_response(str(exc), 403)


@api.exception_handler(NoPrefillReplica)
@api.exception_handler(NoEngineAlive)
async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    return error_response(str(exc), 503, retry_after_s=request.app.state.retry_after_s)


@api.exception_handler(StageTimeout)
async def _timed_out(_: Request, exc: StageTimeout) -> JSONResponse:
    return error_response(str(exc), 504)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    def __init__(self, config: AppConfig, index, prefill, decode) -> None:
        if config.model == TINY_MODEL:
            ensure_tiny_model(config.model_path())
        if warning := open_api_warning(config.api_keys):
            logger.warning(warning)
        # Calls and streamed chunks go straight to the replicas over gRPC (Serve's throughput-optimized
        # transport) rather than through Ray's object store: the payloads are token ids and block
        # metadata, and on this machine each hop to decode took 4 ms instead of 7.
        index, prefill, decode = (h.options(_by_reference=False) for h in (index, prefill, decode))
        self.config, self.limits = config, config.limits
        api.state.max_request_bytes, api.state.retry_after_s = self.limits.max_request_bytes, self.limits.retry_after_s
        self.renderer = PromptRenderer(config.model_path(), config.max_model_len)
        # One thread: tokenizers are not safe to share across threads, and rendering a large body
        # must not stall other streams on the event loop.
        self.render_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        self.sessions = ChatSessions(self.renderer, config.block_size, config.conversation_ttl_s,
                                     config.max_conversations)
        metrics = TurnMetrics(kv_bytes_per_token(config.model_path()))
        self.loop = TurnLoop(config, index, prefill, decode, metrics)
        self.loop.spawn(self.loop.follow_membership(), "membership")

    @api.get("/health")
    async def health(self):
        """Live engines, from the heartbeats the router already follows: never waits on a stream or
        the index. ok: both groups live; degraded: one group serves whole turns; 503: none."""
        engines = self.loop.engines
        live = {role.value: len(engines.live(role)) for role in Role}
        status = "ok" if all(live.values()) else "degraded" if any(live.values()) else "starting"
        body = {"status": status, "live_engines": live}
        if status == "starting":
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.limits.retry_after_s)})
        return body

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "owned_by": "kv-loop", "max_model_len": self.config.max_model_len}]}

    @api.get("/admin/decisions")
    async def decisions(self, n: int = 100, authorization: str | None = Header(None)) -> list[dict[str, Any]]:
        require_admin(authorization, self.config.api_keys, self.config.admin_api_keys)
        return list(self.loop.decisions)[-n:]

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, authorization: str | None = Header(None),
                               x_session_id: str | None = Header(None)):
        tenant = cache_scope(authorization, body.user, self.config.api_keys, self.config.per_user_salt_tenants)
        if len(body.messages) > self.limits.max_messages:
            raise BadRequest(f"{len(body.messages)} messages exceed this server's limit of {self.limits.max_messages}")
        messages = body.template_messages()
        query = self.sessions.query(messages, tenant, x_session_id or body.user)
        match = await self._history(query)
        mode = body.conversation_mode or self.config.conversation_mode
        rendered = await self._in_render_thread(self.sessions.render, messages, body.chat_template_kwargs, query,
                                                match, mode)
        return await self._serve(body, rendered.prompt_ids, tenant, rendered)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, authorization: str | None = Header(None)):
        tenant = cache_scope(authorization, body.user, self.config.api_keys, self.config.per_user_salt_tenants)
        return await self._serve(body, await self._in_render_thread(self.renderer.completion, body), tenant, None)

    async def _in_render_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.render_thread, fn, *args)

    async def _history(self, query: HistoryQuery):
        """The recorded turn these messages continue: this replica's copy, else the shared one."""
        match = self.sessions.match(query)
        if match.exact or query.last_assistant < 0:
            return match
        shared = await self.loop.ask_index("match_conversation", list(query.chain), query.last_assistant,
                                           query.session_key)
        return shared if shared is not None and (shared.exact or match.record is None) else match

    async def _serve(self, body: GenerationRequest, prompt_ids: list[int], tenant: str,
                     rendered: RenderedTurn | None):
        if body.model and body.model != self.config.model_name:
            return error_response(f"the model {body.model!r} does not exist; this server serves "
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
                    prefill_on_decode=body.prefill_on_decode is not False,
                    load_aware=self.config.placement.load_aware if body.load_aware_placement is None
                    else body.load_aware_placement)
        ledger = TurnLedger(turn.request_id)
        try:
            prepared = await self.loop.prepare(turn, ledger)
        except BaseException:
            self.loop.close(turn, ledger)
            raise
        shape = ResponseShape(turn.request_id, self.config.model_name, chat)
        if body.stream:
            return StreamingResponse(self._stream(prepared, shape, body, rendered), media_type="text/event-stream")
        try:
            return await self._complete(prepared, shape, body, rendered)
        finally:
            self.loop.close(turn, ledger)

    async def _complete(self, prepared: PreparedTurn, shape: ResponseShape, body: GenerationRequest,
                        rendered: RenderedTurn | None):
        token_ids: list[int] = []
        text, finish_reason = [], None
        async with aclosing(self.loop.reply(prepared)) as reply:
            async for chunk in reply:
                token_ids.extend(chunk.token_ids)
                text.append(chunk.text)
                finish_reason = chunk.finish_reason or finish_reason
        self._finished(prepared, rendered, token_ids, "".join(text))
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
            async with aclosing(self.loop.reply(prepared)) as reply:
                async for chunk in reply:
                    ids = list(chunk.token_ids) if body.return_token_ids else None
                    yield shape.chunk(chunk.text, chunk.finish_reason, ids, None if generated else prompt)
                    generated.extend(chunk.token_ids)
                    text.append(chunk.text)
            self._finished(prepared, rendered, generated, "".join(text))
        except StageTimeout as exc:  # headers are sent: report in-band, then end the stream
            yield sse(error_body(str(exc), 504))
        except Exception as exc:  # noqa: BLE001
            logger.exception("stream of %s failed", prepared.turn.request_id)
            yield sse(error_body(f"generation failed: {type(exc).__name__}", 500))
        finally:
            self.loop.close(prepared.turn, prepared.ledger)
        if body.include_usage:
            yield shape.usage_chunk(usage(len(prepared.turn.prompt_token_ids), len(generated),
                                          prepared.cached_tokens))
        yield sse("[DONE]")

    def _finished(self, prepared: PreparedTurn, rendered: RenderedTurn | None, generated: list[int],
                  text: str) -> None:
        if rendered is None:
            return
        record = self.sessions.finish(rendered, generated, text, prepared.prefill.replica_id)
        self.loop.spawn(self.loop.ask_index("record_conversation", record, rendered.session_key), "conversation")
