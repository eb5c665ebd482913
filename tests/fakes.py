"""Fakes for the turn loop's unit tests: in-memory implementations of the turn's seams
(app/turn/seams.py) whose methods record their calls."""

from dataclasses import replace
from types import SimpleNamespace
from unittest.mock import MagicMock

from app.config import AppConfig
from app.protocol import Membership, PrefillResult, PrefixLookup, ReplyChunk
from app.turn.loop import TurnLoop
from app.turn.spec import Turn


class Remote:
    """A seam's method: calling it records the arguments and returns what `answer(*arguments)` gives, as an
    awaitable Response, or as a Stream when `answer` is an async generator function. `.remote` is
    the same call, for the deployments' own Serve handles."""

    def __init__(self, answer=lambda _: None) -> None:
        self.calls, self.answer, self.streams = [], answer, []

    def __call__(self, *args):
        self.calls.append(args[0] if len(args) == 1 else args)
        result = self.answer(*(args or (None,)))
        if hasattr(result, "__anext__"):
            self.streams.append(Stream(result))
            return self.streams[-1]
        return Response(result)

    remote = __call__


class Response:
    """Awaitable like a Serve DeploymentResponse; like one, it may be left unawaited."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
        yield  # a generator: awaiting it returns at once


class Stream:
    """An EngineStream over an async generator; `cancelled` once the turn aborted it."""

    def __init__(self, chunks) -> None:
        self._chunks, self.cancelled = chunks, False

    def __anext__(self):
        return self._chunks.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class DecodeGroup:
    """Streams `chunks` for every request; with `fails_prompts`, a request that asks decode to
    compute the prompt itself (no handoff) fails before its first chunk; with `fails_after`, the
    first stream fails after that many chunks (its engine died; the next engine lives)."""

    def __init__(self, chunks: list[ReplyChunk], fails_prompts: bool = False, fails_after: int | None = None) -> None:
        streams = []

        async def stream(request):
            streams.append(request)
            if fails_prompts and request.handoff is None:
                raise RuntimeError("decode replica is gone")
            for i, chunk in enumerate(chunks):
                if fails_after is not None and i == fails_after and len(streams) == 1:
                    raise RuntimeError("engine died")
                yield chunk
        self.chunks = chunks
        self.generate, self.release = Remote(stream), Remote()


class Index(SimpleNamespace):
    """The KV index: `lookup` answers `lookup`, `membership` the engines `members`;
    `take` (or `record_turn`'s take_keys) succeeds for any key once."""

    def __init__(self, lookup: PrefixLookup | None, members: Membership) -> None:
        taken = set()

        def take(key):
            if key in taken:
                return None
            taken.add(key)
            return key

        def answer(hashes, key=None):
            found = lookup or PrefixLookup(prefill_cached_tokens={"p0": 0})
            if key is None or found.retained is None or found.retained.retained.key != key:
                return found
            return replace(found, taken=take(key) is not None)

        super().__init__(lookup=Remote(answer),
                         take=Remote(take), record_turn=Remote(lambda r: tuple(k for k in r.take_keys if take(k))),
                         membership=Remote(lambda _: members), match_conversation=Remote(),
                         store_response=Remote(lambda _: True), load_response=Remote())


ONE_OF_EACH = Membership(("p0",), ("d0",))


def turn_loop(result: PrefillResult, decode: DecodeGroup, lookup: PrefixLookup | None = None,
              members: Membership = ONE_OF_EACH, **config) -> TurnLoop:
    prefill = SimpleNamespace(prefill=Remote(lambda _: result), release=Remote(),
                              generate=DecodeGroup(decode.chunks).generate)  # a whole turn, when no decode lives
    loop = TurnLoop(AppConfig(**config), Index(lookup, members), prefill, decode, MagicMock())
    loop.engines.update(members)
    return loop


async def run_turn(loop: TurnLoop, turn: Turn):
    """One turn as the router runs it; returns (chunks, the turn run)."""
    try:
        async with loop.turn(turn) as run:
            await run.prepare()
            return [chunk async for chunk in run.reply()], run
    finally:
        await loop.drain()
