"""One engine call's reply stream, and what a stage does when it fails or runs late.

    ReplyStream: DecodeRequest ──engine replica──▶ ReplyChunk…   (counted as load while open)
    migrated():  a reply whose engine died ──▶ the same request from the prompt + tokens already sent
    refusal():   a call the engine refused, alive ──▶ the client's error (400/500): no other engine tried
"""

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace

from app.conversations.rendering import BadRequest
from app.protocol import DecodeRequest, ReplyChunk, Role
from app.turn.seams import EngineGroup


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
    request the same way. Marking each suspect took every engine from every tenant for
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


GONE_POLL_S = 0.5
"""How often a call that has not answered yet checks that its replica is still live."""


async def unless_gone(awaitable: Awaitable, gone: Callable[[], bool], poll_s: float = GONE_POLL_S):
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
                 gone: Callable[[], bool]) -> None:
        """`streams`: open streams per replica (the router's view)."""
        self.role, self.request, self.replica_id = role, request, request.target_replica_id
        self._streams, self._gone = streams, gone
        self._streams[self.replica_id] += 1
        self._chunks = group.generate(request)
        self._open, self.started, self.finished = True, False, False

    async def next(self, timeout_s: float, stage: str) -> ReplyChunk:
        waiting = self._chunks.__anext__()
        try:
            chunk = await timed(waiting if self.started else unless_gone(waiting, self._gone), timeout_s, stage)
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
