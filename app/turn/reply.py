"""A turn's engine calls: each bounded in time, its reply streamed, and what a stage does when it fails.

    EngineCalls: prefill(PrefillRequest), stream(role, DecodeRequest), continue_reply(…) ──▶ the engine groups
    ReplyStream: DecodeRequest ──engine replica──▶ ReplyChunk…   (counted as load while open)
    migrated():  a reply whose engine died ──▶ the same request from the prompt + tokens already sent
    refusal():   a call the engine refused, alive ──▶ the client's error (400/500): no other engine tried
"""

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

from app.config import Limits
from app.conversations.rendering import BadRequest
from app.metrics import TurnMetrics
from app.protocol import DecodeRequest, PrefillRequest, PrefillResult, ReplyChunk, Role
from app.turn.membership import LiveEngines
from app.turn.seams import EngineGroup

logger = logging.getLogger("ray.serve")


class NoEngineAlive(RuntimeError):
    """No engine of either group can take the turn: the router answers 503 with Retry-After."""


class StageTimeout(TimeoutError):
    """A stage of the turn did not answer within its configured timeout: the router answers 504."""


class EngineGone(RuntimeError):
    """The replica a call waits on left the live set (its heartbeats stopped, or a call to it failed)."""


class EngineRefused(RuntimeError):
    """An engine could not run the request and lives on: the client gets 500 with the reason."""


def refusal(exc: BaseException) -> Exception | None:
    """The client's error when an engine call failed through the request itself, or None when the
    engine or its replica failed. vLLM raises its client errors (VLLMClientError: 400) and
    ValueError, TypeError, OverflowError or EngineGenerateError (500: not clearly the client's)
    for a request it cannot take, and its engine lives on; the other engines would fail the same
    request the same way. Marking each suspect would take every engine from every tenant for
    `suspect_replica_s`, so only a dead engine, a dead replica or a timeout moves a turn."""
    from ray.exceptions import RayTaskError
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    # Ray raises the replica's exception as itself, or wrapped when it cannot subclass it.
    for error in (exc, exc.cause) if isinstance(exc, RayTaskError) else (exc,):
        if isinstance(error, VLLMClientError):
            return BadRequest(f"the engine refused the request: {error}")
        if isinstance(error, ValueError | TypeError | OverflowError | EngineGenerateError):
            return EngineRefused(f"the engine could not run the request: {type(error).__name__}: {error}")
    return None


async def unless_gone(awaitable: Awaitable, gone: Callable[[], bool], poll_s: float):
    """`awaitable`'s result, or EngineGone once `gone()`: a call to a replica that died can wait
    in Serve's queue for a replacement replica (tens of seconds) instead of failing."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not (await asyncio.wait({task}, timeout=poll_s))[0]:
            if gone():
                raise EngineGone("the replica left the live set while the call waited")
        return task.result()
    finally:
        if not task.done():
            task.cancel()


class ReplyStream:
    """One engine call's streamed chunks, counted as load on its replica until closed. Until its
    first chunk arrives the call is abandoned if its replica is `gone`."""

    def __init__(self, group: EngineGroup, streams: Counter[str], role: Role, request: DecodeRequest,
                 gone: Callable[[], bool], gone_poll_s: float) -> None:
        """`streams`: open streams per replica (the router's view)."""
        self.role, self.request, self.replica_id = role, request, request.target_replica_id
        self._streams, self._gone, self._gone_poll_s = streams, gone, gone_poll_s
        self._streams[self.replica_id] += 1
        self._chunks = group.generate(request)
        self._open, self.started, self.finished = True, False, False

    async def next(self, timeout_s: float, stage: str) -> ReplyChunk:
        waiting = self._chunks.__anext__()
        try:
            if not self.started:
                waiting = unless_gone(waiting, self._gone, self._gone_poll_s)
            chunk = await timed(waiting, timeout_s, stage)
        except StopAsyncIteration:
            self.finished = True
            raise
        self.started, self.finished = True, chunk.finish_reason is not None
        return chunk

    def close(self) -> None:
        """Idempotent; cancelling an unfinished call aborts its engine request, which frees its blocks."""
        if self._open:
            self._open = False
            self._streams[self.replica_id] -= 1
            if not self.finished:
                self._chunks.cancel()


async def timed(awaitable: Awaitable, timeout_s: float, stage: str):
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise StageTimeout(f"{stage} did not answer within {timeout_s:g} s") from None


def migrated(request: DecodeRequest, sent: list[int]) -> DecodeRequest | None:
    """The rest of a reply whose engine failed after sending `sent`: the prompt plus those tokens,
    computed afresh (greedy decoding then gives the tokens the failed engine would have); None
    when nothing is left to generate."""
    remaining = request.sampling.max_tokens - len(sent)
    if remaining <= 0:
        return None
    return replace(request, request_id=f"{request.request_id}-m", handoff=None,
                   prompt_token_ids=request.prompt_token_ids + tuple(sent),
                   sampling=request.sampling.after(len(sent)))


class EngineCalls:
    """The calls a turn makes to the engine groups, each bounded in time and abandoned when its replica
    leaves the live set; a failure suspects the replica unless the engine refused the request itself."""

    def __init__(self, groups: dict[Role, EngineGroup], engines: LiveEngines, limits: Limits,
                 metrics: TurnMetrics) -> None:
        self.groups, self.engines, self.limits, self.metrics = groups, engines, limits, metrics

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        gone = partial(self.engines.gone, Role.PREFILL, request.target_replica_id)
        call = unless_gone(self.groups[Role.PREFILL].prefill(request), gone, self.limits.replica_gone_poll_s)
        return await timed(call, self.limits.prefill_timeout_s, "prefill")

    def stream(self, role: Role, request: DecodeRequest) -> ReplyStream:
        return ReplyStream(self.groups[role], self.engines.streams, role, request,
                           gone=partial(self.engines.gone, role, request.target_replica_id),
                           gone_poll_s=self.limits.replica_gone_poll_s)

    def continue_reply(self, request: DecodeRequest) -> ReplyStream:
        """Stream `request` on a live decode replica (its preferred one if live), else compute it
        whole on a prefill replica."""
        if target := self.engines.pick(Role.DECODE, request.target_replica_id):
            return self.stream(Role.DECODE, replace(request, target_replica_id=target))
        if target := self.engines.pick(Role.PREFILL):
            return self.stream(Role.PREFILL, replace(request, target_replica_id=target, handoff=None, retain=False))
        raise NoEngineAlive("no engine is ready; retry shortly")

    @staticmethod
    def unless_refused(exc: BaseException, stage: str, request_id: str) -> None:
        """Raise the client's error if the engine refused the request itself (app/turn/reply.py
        refusal): no engine is suspected and none is tried next."""
        if (refused := refusal(exc)) is not None:
            logger.warning(json.dumps({"event": "engine_refused_request", "stage": stage, "request_id": request_id,
                                       "error": f"{type(exc).__name__}: {exc}"[:500]}))
            raise refused from None

    def failed(self, replica_id: str, stage: str, request_id: str, exc: BaseException) -> None:
        self.engines.suspect(replica_id)
        self.metrics.record_engine_failure(stage)
        logger.warning(json.dumps({"event": "engine_call_failed", "stage": stage, "replica": replica_id,
                                   "request_id": request_id, "error": f"{type(exc).__name__}: {exc}"[:500]}))
