"""One engine call's reply stream, and what a stage does when it fails or runs late.

    ReplyStream: DecodeRequest ──engine replica──▶ ReplyChunk…   (counted as load while open)
    migrated():  a reply whose engine died ──▶ the same request from the prompt + tokens already sent
"""

import asyncio
from collections import Counter
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from app.protocol import DecodeRequest, ReplyChunk, Role


class NoEngineAlive(RuntimeError):
    """No engine of either group can take the turn: the router answers 503 with Retry-After."""


class StageTimeout(TimeoutError):
    """A stage of the turn did not answer within its configured timeout: the router answers 504."""


class ReplyStream:
    """One engine call's streamed chunks, counted as load on its replica until closed."""

    def __init__(self, group: Any, streams: Counter[str], role: Role, request: DecodeRequest) -> None:
        """`group`: the role's deployment handle; `streams`: open streams per replica (the router's view)."""
        self.role, self.request, self.replica_id = role, request, request.target_replica_id
        self._streams = streams
        self._streams[self.replica_id] += 1
        self._chunks = group.options(stream=True).generate.remote(request)
        self._open, self.finished = True, False

    async def next(self, timeout_s: float, stage: str) -> ReplyChunk:
        try:
            chunk = await timed(self._chunks.__anext__(), timeout_s, stage)
        except StopAsyncIteration:
            self.finished = True
            raise
        self.finished = chunk.finish_reason is not None
        return chunk

    def close(self) -> None:
        """Idempotent; cancelling an unfinished call aborts its engine request, which frees its blocks."""
        if self._open:
            self._open = False
            self._streams[self.replica_id] -= 1
            if not self.finished and (cancel := getattr(self._chunks, "cancel", None)):
                cancel()


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
                   sampling=replace(request.sampling, max_tokens=remaining))
