"""The frontend: the OpenAI-compatible HTTP ingress, thin on purpose.

client ──HTTP──▶ here: key, validate ──ClientRequest──▶ router ──ReplyStart(first chunk), ReplyChunk…──▶ here
──▶ SSE/JSON
The API key is checked first, before the body is read (deployments/http_guard.py); /docs, /redoc
and /openapi.json are served only with `openapi_docs`. It holds no conversation state, so nothing
is lost with it but its open connections; a router replica that dies mid-reply is replaced under
the reply (app/turn/relay.py). Every failure answers in
the OpenAI error shape: 400/401/403/404/413 for the client's mistakes, 503 + Retry-After past its
admission bound or while no engine or router can serve, 504 when a stage times out, 500 otherwise
(in-band once a stream has started).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.serve.context import _get_global_client
from ray.serve.exceptions import BackPressureError

from app.config import AppConfig
from app.conversations.openai_api import ChatCompletionRequest, CompletionRequest, GenerationRequest, refused_fields
from app.conversations.openai_replies import ResponseShape, error_body, logprobs_body, merged_choices, sse, usage
from app.conversations.rendering import BadRequest
from app.conversations.reply_parsing import ReplyParsing
from app.conversations.request_check import vllm_responses_defaults
from app.conversations.responses import ResponsesRequest, ResponseStream
from app.conversations.tenants import KeyRing, Unauthorized, open_api_refusal
from app.protocol import ClientRequest
from app.turn.membership import QuietPoll
from app.turn.relay import Admission, NoRouterAlive, Relay
from app.turn.reply import EngineRefused, NoEngineAlive, StageTimeout
from app.turn.routing import NoPrefillReplica
from deployments.handles import ServeRouterStreams
from deployments.http_guard import HttpGuard, error_response, open_paths, serve_docs

logger = logging.getLogger("ray.serve")
api = FastAPI(title="kv-loop", docs_url=None, redoc_url=None, openapi_url=None)
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


@api.exception_handler(EngineRefused)
async def _refused(_: Request, exc: EngineRefused) -> JSONResponse:
    return error_response(str(exc), 500)


@api.exception_handler(NoPrefillReplica)
@api.exception_handler(NoEngineAlive)
@api.exception_handler(NoRouterAlive)
@api.exception_handler(BackPressureError)
async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    message = "the server is at its request limit; retry shortly" if isinstance(exc, BackPressureError) else str(exc)
    return error_response(message, 503, retry_after_s=request.app.state.retry_after_s)


@api.exception_handler(StageTimeout)
async def _timed_out(_: Request, exc: StageTimeout) -> JSONResponse:
    return error_response(str(exc), 504)


def in_band_status(exc: Exception) -> int:
    """The status of an error reported inside a stream whose headers (200) are sent."""
    return 400 if isinstance(exc, BadRequest) else 504 if isinstance(exc, StageTimeout) else 500


def _http(reply: Any) -> Any:
    """A streamed reply's chunk bodies as the chat API's SSE, ended by [DONE]; anything else as is."""
    return StreamingResponse(_sse(reply), media_type="text/event-stream") if hasattr(reply, "__anext__") else reply


async def _sse(bodies: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    async with aclosing(bodies):  # a client gone mid-reply ends the reply now, releasing its place
        async for body in bodies:
            yield sse(body)
    yield sse("[DONE]")


@serve.deployment
@serve.ingress(api)
class Frontend:
    def __init__(self, config: AppConfig, router) -> None:
        self.config, self.limits = config, config.limits
        self.parsing = ReplyParsing.of(config)
        self.responses_defaults = vllm_responses_defaults()
        self.router = router.options(_by_reference=False)
        self.streams = ServeRouterStreams(router)
        api.state.max_request_bytes, api.state.retry_after_s = self.limits.max_request_bytes, self.limits.retry_after_s
        if config.openapi_docs:
            serve_docs(api)
        if refusal := open_api_refusal(config, _get_global_client().http_config.host):
            raise RuntimeError(refusal)
        api.state.keys, api.state.open_paths = KeyRing.of(config.api_keys, config.admin_api_keys), open_paths(api)
        api.state.write_timeout_s = self.limits.client_write_timeout_s
        # Admission is counted here, not left to Serve's caller-side queue bound: under a burst
        # Serve sends requests on past its places (a replica's refusals re-enter its queue
        # unchecked). One frontend replica holds what one router replica does; one tenant, its share.
        holds = self.limits.router_holds
        self.admission = Admission(holds, max(1, int(holds * self.limits.tenant_share)) if config.api_keys else holds)
        self.health_body: dict[str, Any] = {"status": "starting", "live_engines": {}}
        self.health_at = 0.0
        asyncio.get_event_loop().create_task(self._follow_health())
        self.moves = metrics.Counter("kv_loop_router_moves", "Replies whose router replica died under them, moved "
                                     "to another replica (start: before the reply began).", tag_keys=("stage",))

    async def _follow_health(self) -> None:
        """The router's view of live engines, asked once a heartbeat, so that /health answers from
        here at once and never waits behind streams for a router slot."""
        poll = QuietPoll.of(self.limits)
        while True:
            await self._refresh_health()
            await asyncio.sleep(poll.wait_after(self.health_body))

    async def _refresh_health(self) -> None:
        try:
            body = await asyncio.wait_for(self.router.health.remote(), self.limits.bookkeeping_timeout_s)
            self.health_body, self.health_at = body, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - a router replica is being replaced: ask again
            logger.warning("router health: %s", f"{type(exc).__name__}: {exc}"[:300])

    @api.get("/health")
    async def health(self):
        """ok: both engine groups live; degraded: one group serves whole turns; 503: none, or no
        router answered for a registration TTL. Only an answer short of ok is asked again at once
        (engines may have just come up)."""
        if self.health_body["status"] != "ok":
            await self._refresh_health()
        fresh = time.monotonic() - self.health_at <= self.limits.registration_ttl_s
        body = self.health_body if fresh else {**self.health_body, "status": "starting"}
        if body["status"] == "starting":
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.limits.retry_after_s)})
        return body

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "owned_by": "kv-loop", "max_model_len": self.config.max_model_len}]}

    @api.get("/admin/decisions")
    async def decisions(self, n: int = 100) -> list[dict[str, Any]]:
        """Admin keys only (the guard checked the key)."""
        return await self.router.decisions.remote(n)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, authorization: str | None = Header(None),
                               x_session_id: str | None = Header(None)):
        if len(body.messages) > self.limits.max_messages:
            raise BadRequest(f"{len(body.messages)} messages exceed this server's limit of {self.limits.max_messages}")
        return _http(await self._serve(body, ClientRequest(body, authorization, x_session_id), chat=True))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, authorization: str | None = Header(None)):
        return _http(await self._serve(body, ClientRequest(body, authorization), chat=False))

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, authorization: str | None = Header(None),
                        x_session_id: str | None = Header(None)):
        if message := refused_fields(body.model_extra or {}, self.responses_defaults):
            raise BadRequest(message)
        previous = None
        if body.previous_response_id:
            previous = await self.router.load_response.remote(authorization, body.previous_response_id)
            if previous is None:
                return error_response(f"previous_response_id: no stored response {body.previous_response_id!r} "
                                      "(unknown, expired, or not this API key's)", 404)
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body(previous))
        except ValidationError as exc:
            raise BadRequest(f"invalid request: {exc.errors()[0]['msg']}") from None
        completion = await self._serve(chat, ClientRequest(chat, authorization, x_session_id), chat=True)
        if isinstance(completion, JSONResponse):
            return completion
        tenant = api.state.keys.tenant_of(authorization)
        if body.stream:
            events = self._response_events(body, chat, completion, tenant)
            return StreamingResponse(events, media_type="text/event-stream")
        response, stored = body.response(completion, chat.template_messages(), tenant)
        return await self._stored(body, response, stored)

    async def _stored(self, body: ResponsesRequest, response: dict[str, Any], stored) -> dict[str, Any]:
        if body.store and not await self.router.store_response.remote(stored):
            response["store"] = False  # the index did not answer: this id continues nothing
        return response

    async def _response_events(self, body: ResponsesRequest, chat: ChatCompletionRequest, chunks, tenant: str):
        """The chat stream's chunks as Responses events; the response is stored before
        `response.completed` goes out, so the client's next request finds it."""
        stream = ResponseStream(body)
        for event in stream.opening(self.config.model_name):
            yield event
        async with aclosing(chunks):  # a client gone mid-reply ends the chat stream now, releasing its place
            async for chunk in chunks:
                if "error" in chunk:
                    yield stream.event("error", code=str(chunk["error"]["code"]), message=chunk["error"]["message"])
                    return
                for event in stream.chunk(chunk):
                    yield event
        response, stored = body.response(stream.completion(), chat.template_messages(), tenant, stream.response_id,
                                         stream.ids)
        for event in stream.closing(await self._stored(body, response, stored)):
            yield event

    async def _serve(self, body: GenerationRequest, request: ClientRequest, chat: bool):
        """The reply's body, or with `stream` its chunks' bodies (the chat API sends them as SSE,
        /v1/responses as its own events), or an error response."""
        if body.model and body.model != self.config.model_name:
            return error_response(f"the model {body.model!r} does not exist; this server serves "
                                  f"{self.config.model_name!r}", 404)
        if problem := body.over_limits(self.limits):
            raise BadRequest(problem)
        parsed = self.parsing.vllm_request(body) if chat and self.parsing.applies(body) else None
        choices = body.choices() if body.n > 1 else [body]
        relays = await self._begin([replace(request, body=choice) for choice in choices])
        if isinstance(relays, JSONResponse):
            return relays
        request_id = relays[0].start.request_id
        shapes = [ResponseShape(request_id, self.config.model_name, chat, index) for index in range(len(relays))]
        if body.stream:
            if len(relays) == 1:
                return self._chunk_bodies(relays[0], shapes[0], body, parsed)
            return self._merged_bodies(relays, shapes, choices, body.include_usage, parsed)
        try:
            return merged_choices(await asyncio.gather(*(self._complete(relay, shape, choice, parsed) for
                                                         relay, shape, choice in zip(relays, shapes, choices))))
        finally:
            for relay in relays:
                relay.close()

    async def _begin(self, requests: list[ClientRequest]) -> list[Relay] | JSONResponse:
        """A started relay per request (a choice each), each holding an admission place; or the refusal."""
        relays: list[Relay] = []
        for index, request in enumerate(requests):
            relays.append(Relay(self.streams, request, self.limits.router_attempts,
                                on_move=lambda stage: self.moves.inc(1, {"stage": stage}),
                                choice=index if len(requests) > 1 else None))
            if not self.admission.admit(relays[-1], api.state.keys.tenant_of(request.authorization)):
                for relay in relays:
                    relay.close()
                if self.admission.full:
                    return error_response("the server is at its request limit; retry shortly", 503,
                                          retry_after_s=self.limits.retry_after_s)
                return error_response("this API key holds its share of the server's requests in flight; retry "
                                      "when one ends", 429, retry_after_s=self.limits.retry_after_s)
        starts = [asyncio.ensure_future(relay.begin()) for relay in relays]
        try:
            await asyncio.gather(*starts)
        except BaseException:
            for start, relay in zip(starts, relays):
                start.cancel()
                relay.close()
            raise
        return relays

    async def _merged_bodies(self, relays: list[Relay], shapes: list[ResponseShape],
                             choices: list[GenerationRequest], include_usage: bool, parsed_request):
        """The choices' chunk bodies as they come, then one usage for them all (vLLM's `n` > 1 stream)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(bodies) -> None:
            try:
                async for body in bodies:
                    await queue.put(body)
            finally:
                queue.put_nowait(None)

        pumps = [asyncio.ensure_future(pump(self._chunk_bodies(*args, parsed_request)))
                 for args in zip(relays, shapes, choices)]
        try:
            for _ in pumps:
                while (body := await queue.get()) is not None:
                    yield body
        finally:
            for task in pumps:
                task.cancel()
        if include_usage:
            start = relays[0].start
            yield shapes[0].usage_chunk(usage(len(start.prompt_token_ids), sum(len(r.sent) for r in relays),
                                              start.cached_tokens))

    async def _complete(self, relay: Relay, shape: ResponseShape, body: GenerationRequest, parsed_request):
        """`parsed_request`: vLLM's request model when vLLM's parsers read the reply, else None."""
        finish_reason, steps = None, []
        async with aclosing(relay.chunks()) as chunks:
            async for chunk in chunks:
                finish_reason = chunk.finish_reason or finish_reason
                steps.extend(chunk.logprobs or ())
        start, text, message = relay.start, "".join(relay.text), None
        top = body.sample_logprobs
        logprobs = None if top is None else logprobs_body(shape.chat, relay.sent, steps, top)
        if parsed_request is not None:
            message, called_tools = self.parsing.message(parsed_request, text, relay.sent)
            finish_reason = "tool_calls" if called_tools else finish_reason
        use = usage(len(start.prompt_token_ids), len(relay.sent), start.cached_tokens)
        ids, prompt = (relay.sent, list(start.prompt_token_ids)) if body.return_token_ids else (None, None)
        return shape.full(text, finish_reason, use, ids, prompt, message, logprobs)

    async def _chunk_bodies(self, relay: Relay, shape: ResponseShape, body: GenerationRequest, parsed_request):
        start = relay.start
        prompt = list(start.prompt_token_ids) if body.return_token_ids else None
        parser = self.parsing.stream(parsed_request) if parsed_request is not None else None
        top, text_offset = body.sample_logprobs, 0
        try:
            if shape.chat:  # the start came with the reply's first output
                yield shape.role_chunk(prompt)
                prompt = None
            async with aclosing(relay.chunks()) as chunks:
                async for chunk in chunks:
                    ids = list(chunk.token_ids) if body.return_token_ids else None
                    logprobs = None if top is None else logprobs_body(shape.chat, list(chunk.token_ids),
                                                                      list(chunk.logprobs or ()), top, text_offset)
                    text_offset += len(chunk.text)
                    delta, finish_reason = None, chunk.finish_reason
                    if parser is not None:
                        delta = parser.delta(chunk.text, list(chunk.token_ids), list(start.prompt_token_ids),
                                             finished=finish_reason is not None)
                        if delta is None and finish_reason is None and ids is None and logprobs is None:
                            continue  # nothing the client sees yet (a tool call's markup), as vLLM streams it
                        delta, finish_reason = delta or {}, parser.finish_reason(finish_reason)
                    yield shape.chunk(chunk.text, finish_reason, ids, prompt, delta, logprobs)
                    prompt = None
        except (BadRequest, EngineRefused, StageTimeout) as exc:  # headers are sent: report in-band, then end
            yield error_body(str(exc), in_band_status(exc))
        except Exception as exc:  # noqa: BLE001
            logger.exception("stream of %s failed", start.request_id)
            yield error_body(f"generation failed: {type(exc).__name__}", 500)
        finally:
            relay.close()
        if body.include_usage:
            yield shape.usage_chunk(usage(len(start.prompt_token_ids), len(relay.sent), start.cached_tokens))
