"""The frontend's side of one reply: the router's stream, moved to another router replica when its
replica dies, as the turn loop moves a reply whose engine dies.

    frontend ──ClientRequest──▶ router replica ──ReplyStart(first chunk), ReplyChunk…──▶ Relay ──▶ SSE / JSON
    the replica died mid-reply ──ClientRequest(resume=Resume(prompt, tokens sent))──▶ another replica
Greedy replies stay token-exact across the move; the client sees one uninterrupted reply.
`Admission` counts the replies a frontend replica holds, and refuses past its bound.
"""

import logging
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Protocol

from ray.exceptions import RayActorError, RayTaskError

from app.protocol import ClientRequest, ReplyChunk, ReplyStart, Resume

logger = logging.getLogger("ray.serve")


class NoRouterAlive(RuntimeError):
    """Every router replica tried died under the request: the frontend answers 503."""


class RouterStreams(Protocol):
    def open(self, request: ClientRequest, choice: int | None) -> Any:
        """The router's stream for `request` (ReplyStart with the first chunk, ReplyChunk…; cancellable). `choice`: its
        index among the choices of one `n` > 1 request, which are open at once, else None."""


class Relay:
    def __init__(self, router: RouterStreams, request: ClientRequest, attempts: int,
                 on_move: Callable[[str], None] = lambda stage: None, choice: int | None = None) -> None:
        """`on_move(stage)`: counts each move. A reply whose state cannot move (ReplyStart.movable: a
        grammar's, penalties over the reply so far) fails with its replica."""
        self.router, self.request, self.choice = router, request, choice
        self.attempts, self.on_move = attempts, on_move
        self.start: ReplyStart | None = None
        self.sent: list[int] = []
        self.text: list[str] = []
        self._stream: Any = None
        self.place: Callable[[], Any] = lambda: None
        """The frontend's admission place this reply holds (Admission.admit), released once by close()."""

    async def begin(self) -> ReplyStart:
        """The reply's start, with its first chunk; a router replica that dies before it is simply
        retried. The router's own errors (bad request, no engine, timeout) are raised as themselves:
        up to the first token, they are the HTTP answer."""
        for _ in range(self.attempts):
            try:
                self.start = await self._open(self.request)
                return self.start
            except RayActorError as exc:
                self._moved(exc, "start")
        raise NoRouterAlive("no router replica could take the request; retry shortly")

    async def chunks(self) -> AsyncIterator[ReplyChunk]:
        """The start's first chunk, then the stream's; after a move, the new start's first, then its stream's."""
        moves, finished, first = 0, False, self.start.first
        while True:
            try:
                if self._stream is None:
                    first = (await self._open(replace(self.request, resume=self._resume()))).first
                while True:
                    chunk = first if first is not None else await self._next()
                    first = None
                    self.sent.extend(chunk.token_ids)
                    self.text.append(chunk.text)
                    finished = chunk.finish_reason is not None
                    yield chunk
            except StopAsyncIteration:
                return
            except RayActorError as exc:
                if finished:  # it died recording a finished reply: the client has it all
                    return
                moves += 1
                if not self.start.movable or moves >= self.attempts:
                    raise NoRouterAlive("the reply's router replica died and it could not move") from exc
                self._moved(exc, "reply")
                self._cancel()
                if len(self.sent) >= self.start.max_tokens:  # it died after the last token, before saying so
                    yield ReplyChunk((), "", "length")
                    return

    def _resume(self) -> Resume:
        return Resume(self.start.prompt_token_ids, tuple(self.sent), "".join(self.text), self.start.cached_tokens)

    def close(self) -> None:
        """The one end of a reply, however it ends (idempotent): cancelling an unfinished stream ends
        the router's turn, which aborts its engine requests, and the admission place is released."""
        self._cancel()
        self.place()

    def _cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def _open(self, request: ClientRequest) -> ReplyStart:
        self._cancel()
        self._stream = self.router.open(request, self.choice)
        return await self._next()

    async def _next(self) -> Any:
        try:
            return await self._stream.__anext__()
        except RayTaskError as exc:  # the router raised it: the frontend answers its cause
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None

    def _moved(self, exc: BaseException, stage: str) -> None:
        self.on_move(stage)
        logger.warning("router replica died (stage %s, %d tokens sent): moving the reply: %s", stage,
                       len(self.sent), f"{type(exc).__name__}: {exc}"[:300])


class Admission:
    """The replies one frontend replica holds, each from its request until its reply ends; past
    `capacity` a request is refused (503 + Retry-After), past `tenant_capacity` a tenant's (429)."""

    def __init__(self, capacity: int, tenant_capacity: int) -> None:
        self.capacity, self.tenant_capacity = capacity, tenant_capacity
        self.held, self.held_by = 0, Counter[str]()

    @property
    def full(self) -> bool:
        return self.held >= self.capacity

    def admit(self, relay: Relay, tenant: str) -> bool:
        """Give `relay` a place (released once, by its close()), or False when every place, or the
        tenant's share, is held. The place is also released when the relay is dropped unread: a
        client gone before its stream started never runs the stream's own cleanup."""
        if self.full or self.held_by[tenant] >= self.tenant_capacity:
            return False
        self.held += 1
        self.held_by[tenant] += 1
        relay.place = weakref.finalize(relay, self._release, tenant)
        return True

    def _release(self, tenant: str) -> None:
        self.held -= 1
        self.held_by[tenant] -= 1
        if not self.held_by[tenant]:
            del self.held_by[tenant]
