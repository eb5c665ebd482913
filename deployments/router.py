"""The router: renders each request append-only and runs it through the turn loop.

frontend ──ClientRequest──▶ here: authenticate, render (a worker thread) ──▶ TurnLoop(kv_index,
prefill, decode) ──ReplyStart(first chunk), ReplyChunk…──▶ frontend
KV tensors never pass through here: only token ids and block metadata do. A client's mistake
raises BadRequest/Unauthorized/Forbidden, no engine NoEngineAlive, a slow stage StageTimeout: the
frontend turns each into its HTTP answer. A ClientRequest with `resume` continues a reply whose
router replica died (prompt plus the tokens already sent) and records the whole reply.
"""

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.config import TINY_MODEL, AppConfig, Device
from app.conversations.openai_api import ChatCompletionRequest, GenerationRequest
from app.conversations.rendering import PromptRenderer, within_budget
from app.conversations.reply_parsing import ReplyParsing
from app.conversations.request_check import RequestCheck
from app.conversations.sessions import ChatSessions, HistoryQuery, RenderedTurn
from app.conversations.tenants import KeyRing, cache_salt, cache_scope, open_api_warning
from app.kv.hashing import block_hashes
from app.metrics import TurnMetrics, kv_bytes_per_token
from app.model.tiny import ensure_tiny_model
from app.protocol import ClientRequest, ReplyChunk, ReplyStart, Resume, Role, SamplingSettings, StoredResponse
from app.turn.loop import TurnLoop
from app.turn.spec import Turn
from app.turn.turn import TurnRun
from deployments.handles import ServeEngineGroup, ServeIndex
from deployments.targeted_router import ConversationRequestRouter

logger = logging.getLogger("ray.serve")


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=ConversationRequestRouter))
class Router:
    async def __init__(self, config: AppConfig, index, prefill, decode) -> None:
        if config.model == TINY_MODEL:
            ensure_tiny_model(config.model_path())
        if warning := open_api_warning(config.api_keys):
            logger.warning(warning)
        if config.device == Device.CPU and (nice := os.getpriority(os.PRIO_PROCESS, 0)) > 0:
            logger.warning("this replica runs at nice %d: on shared cores the serving path then waits behind the "
                           "engines' compute; start Ray with RAY_worker_niceness=0 (README)", nice)
        self.config, self.limits = config, config.limits
        self.keys = KeyRing.of(config.api_keys, config.admin_api_keys)
        self.renderer = PromptRenderer(config.model_path(), config.max_model_len)
        self.request_check = RequestCheck(config.model_path(), config.max_model_len, config.limits.max_logprobs,
                                          dict(config.engine_kwargs), self.renderer.tokenizer,
                                          config.limits.remembered_grammars)
        # One thread: tokenizers are not safe to share across threads, and rendering a large body
        # must not stall other streams on the event loop.
        self.render_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
        self.sessions = ChatSessions(self.renderer, config.block_size, config.record_bounds)
        self.reply_parsing = ReplyParsing.of(config, self.renderer.tokenizer)
        self.generation_defaults = self.request_check.model.get_diff_sampling_param()
        """The model's generation config (vLLM applies it to what a request leaves unset)."""
        metrics = TurnMetrics(kv_bytes_per_token(config.model_path()))
        self.loop = TurnLoop(config, ServeIndex(index), ServeEngineGroup(prefill), ServeEngineGroup(decode), metrics,
                             serve.get_replica_context().replica_id.unique_id)
        # Take requests once the index answered (or the wait ran out: the index may be restarting).
        await self.loop.refresh_membership(config.limits.index_wait_at_start_s)
        self.loop.spawn(self.loop.follow_membership(), "membership")

    async def health(self) -> dict[str, Any]:
        """Live engines, from the heartbeats the router already follows: never waits on a stream or
        the index. ok: both groups live; degraded: one group serves whole turns; starting: none. The NIXL
        backends a group's live engines loaded show which transport its KV moves over (UCX where
        LIBFABRIC was asked for is a fallback: KV over TCP; the engine's log names the replica)."""
        engines = self.loop.engines
        live = {role.value: engines.live(role) for role in Role}
        counts = {role: len(replicas) for role, replicas in live.items()}
        return {"status": "ok" if all(counts.values()) else "degraded" if any(counts.values()) else "starting",
                "live_engines": counts,
                "nixl_backends": {role: sorted({b for r in replicas for b in engines.load(r).nixl_backends})
                                  for role, replicas in live.items()}}

    async def store_response(self, stored: StoredResponse) -> bool:
        """Keep a /v1/responses conversation in the KV index (False: the index did not answer)."""
        return bool(await self.loop.bookkeep(self.loop.index.store_response(stored), "index.store_response"))

    async def load_response(self, authorization: str | None, response_id: str) -> StoredResponse | None:
        tenant = self.keys.tenant_of(authorization)
        return await self.loop.bookkeep(self.loop.index.load_response(tenant, response_id), "index.load_response")

    async def decisions(self, n: int) -> list[dict[str, Any]]:
        return list(self.loop.decisions)[-n:]

    async def generate(self, request: ClientRequest) -> AsyncIterator[ReplyStart | ReplyChunk]:
        """One request's reply: a ReplyStart with its first chunk, then the other chunks (without
        block metadata, which stays here)."""
        received, body = time.perf_counter(), request.body
        tenant = self.keys.tenant_of(request.authorization)
        scope = cache_scope(tenant, body.user, self.config.per_user_salt_tenants)
        self.request_check.check_fields(body)
        # max_tokens is resolved once the prompt's length is known (_turn); until then the context bounds it
        sampling = body.sampling(body.requested_max_tokens or self.config.max_model_len, self.generation_defaults)
        if isinstance(body, ChatCompletionRequest):
            sampling = self.reply_parsing.constrain(body, sampling)
        # vLLM's check, before any engine sees the request: at once, or, when it needs the tokenizer,
        # in the render thread with the prompt (one hop for both)
        check = partial(self.request_check.check, sampling) if self.request_check.needs_tokenizer(sampling) else None
        if check is None:
            self.request_check.check(sampling)
        salt = cache_salt(scope, self.config.salt_secret)
        if isinstance(body, ChatCompletionRequest):
            rendered, hashes = await self._rendered(body, scope, tenant, body.session_id or request.session_id,
                                                    salt, check)
            prompt_ids = rendered.prompt_ids
        else:
            rendered = None
            prompt_ids, hashes = await self._in_render_thread(self._hashed, salt, check, self.renderer.completion, body)
        if request.resume is not None:  # the reply continues what the client already has
            prompt_ids, hashes = list(request.resume.prompt_token_ids), ()
            rendered = replace(rendered, prompt_ids=prompt_ids) if rendered else None
        turn = self._turn(body, sampling, prompt_ids, scope, salt, hashes, tenant, rendered, request.resume, received)
        async with self.loop.turn(turn) as run:
            await run.prepare()
            resume = request.resume or Resume((), (), "", run.cached_tokens)
            async with aclosing(self._replied(run, body, rendered, resume)) as chunks:
                first = await anext(chunks, None)
                yield ReplyStart(turn.request_id, tuple(prompt_ids), resume.cached_tokens,
                                 max_tokens=turn.sampling.max_tokens + len(resume.sent_token_ids),
                                 movable=not turn.sampling.reads_reply, first=first)
                async for chunk in chunks:
                    yield chunk

    async def _replied(self, run: TurnRun, body: GenerationRequest, rendered: RenderedTurn | None,
                       resume: Resume) -> AsyncIterator[ReplyChunk]:
        """The reply's chunks as the client gets them; a chat turn is recorded with its settlement."""
        generated, text = list(resume.sent_token_ids), [resume.sent_text]
        async for chunk in run.reply():
            generated.extend(chunk.token_ids)
            text.append(chunk.text)
            yield ReplyChunk(chunk.token_ids, chunk.text, chunk.finish_reason, logprobs=chunk.logprobs)
        if rendered is not None:
            reply = self.reply_parsing.replayed(body, "".join(text), generated)
            run.record(self.sessions.finish(rendered, generated, reply, run.prefill.replica_id), rendered.session_key)

    def _turn(self, body: GenerationRequest, sampling: SamplingSettings, prompt_ids: list[int], scope: str,
              salt: str, hashes: tuple[bytes, ...], tenant: str, rendered: RenderedTurn | None, resume: Resume | None,
              received_at: float) -> Turn:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

        self.renderer.check_fits(prompt_ids, body.requested_max_tokens or 1)
        # vLLM's own rule: the request's max_tokens, else the generation config's, within the context
        max_tokens = get_max_tokens(self.config.max_model_len, body.requested_max_tokens, len(prompt_ids),
                                    self.generation_defaults)
        sampling = replace(sampling, max_tokens=max_tokens)
        if sampling.min_tokens > max_tokens:  # vLLM's own check, now that the bound is known
            self.request_check.check(sampling)
        sent = resume.sent_token_ids if resume else ()
        chat = rendered is not None
        return Turn(request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                    prompt_token_ids=(*prompt_ids, *sent), cache_salt=salt, block_hashes=hashes,
                    sampling=sampling.after(len(sent)), tenant=tenant,
                    tool_pause_s=self.config.tool_pause_s if body.may_call_tools else 0.0,
                    reverse_pull=self.config.reverse_pull and body.reverse_pull is not False,
                    rendering=rendered.diagnostics if rendered else None,
                    routing_policy=body.routing_policy or self.config.routing_policy,
                    affinity_key=rendered.affinity_key if rendered else f"{scope}:{prompt_ids[:64]}",
                    turn_index=rendered.turn_index if rendered else 1,
                    previous_replica=rendered.previous_replica if rendered else "",
                    prefill_on_decode=body.prefill_on_decode is not False,
                    load_aware=self.config.placement.load_aware if body.load_aware_placement is None
                    else body.load_aware_placement, received_at=received_at)

    async def _rendered(self, body: ChatCompletionRequest, scope: str, tenant: str, session_id: str | None,
                        salt: str, check: Callable[[], None] | None) -> tuple[RenderedTurn, tuple[bytes, ...]]:
        self.renderer.check_template_kwargs(body.chat_template_kwargs)
        messages = body.template_messages()
        query = self.sessions.query(messages, scope, tenant, session_id or body.user, body.tools)
        match = await self._history(query)
        mode = body.conversation_mode or self.config.conversation_mode
        template_kwargs = body.chat_template_kwargs | ({"tools": body.tools} if body.tools else {})
        return await self._in_render_thread(self._hashed, salt, check, self.sessions.render, messages, template_kwargs,
                                            query, match, mode)

    def _hashed(self, salt: str, check: Callable[[], None] | None, prompt_of, *args) -> tuple[Any, tuple[bytes, ...]]:
        """In the render thread: the request's check (if it needs the tokenizer), its prompt (a
        RenderedTurn or token ids) and the prompt's block hashes, in one hop: each hop to a thread
        and back waits twice for this event loop, behind every stream it serves, in a turn's TTFT."""
        if check is not None:
            check()
        prompt = prompt_of(*args)
        ids = prompt.prompt_ids if isinstance(prompt, RenderedTurn) else prompt
        hash_seed, hash_algo = self.config.prefix_hash_seed, self.config.prefix_hash_algo
        return prompt, tuple(block_hashes(ids, self.config.block_size, salt, hash_seed, hash_algo))

    async def _in_render_thread(self, fn, *args):
        return await within_budget(self.render_thread, self.limits.render_timeout_s, fn, *args)

    async def _history(self, query: HistoryQuery):
        """The recorded turn these messages continue: this replica's copy, else the shared one."""
        match = self.sessions.match(query)
        if match.exact or query.last_assistant < 0:
            return match
        shared = await self.loop.bookkeep(self.loop.index.match_conversation(
            list(query.chain), query.last_assistant, query.session_key), "index.match_conversation")
        return shared if shared is not None and (shared.exact or match.record is None) else match
