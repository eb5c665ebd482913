"""Fake deployments for the turn loop's unit tests: Serve handles that record their calls."""

from types import SimpleNamespace
from unittest.mock import MagicMock

from app.config import AppConfig
from app.protocol import Membership, PrefillResult, PrefixLookup, ReplyChunk
from app.turn.ledger import TurnLedger
from app.turn.loop import Turn, TurnLoop


class Remote:
    """A Serve handle method: `.remote(*args)` records the args and returns what `answer(first)` gives."""

    def __init__(self, answer=lambda _: None) -> None:
        self.calls, self.answer = [], answer

    def remote(self, *args):
        self.calls.append(args[0] if len(args) == 1 else args)
        result = self.answer(args[0] if args else None)
        return result if hasattr(result, "__anext__") else Response(result)


class Response:
    """Awaitable like a Serve DeploymentResponse; like one, it may be left unawaited."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
        yield  # a generator: awaiting it returns at once


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

    def options(self, stream: bool):
        return self


class Index(SimpleNamespace):
    """The KV index deployment: `lookup` answers `lookup`, `membership` the engines `members`;
    `take` (or `record_turn`'s take_keys) succeeds for any key once."""

    def __init__(self, lookup: PrefixLookup | None, members: Membership) -> None:
        taken = set()

        def take(key):
            if key in taken:
                return None
            taken.add(key)
            return key

        super().__init__(lookup=Remote(lambda _: lookup or PrefixLookup(prefill_cached_tokens={"p0": 0})),
                         take=Remote(take), record_turn=Remote(lambda r: tuple(k for k in r.take_keys if take(k))),
                         membership=Remote(lambda _: members))


ONE_OF_EACH = Membership(("p0",), ("d0",))


def turn_loop(result: PrefillResult, decode: DecodeGroup, lookup: PrefixLookup | None = None,
              members: Membership = ONE_OF_EACH, **config) -> TurnLoop:
    prefill = SimpleNamespace(prefill=Remote(lambda _: result), release=Remote(),
                              generate=DecodeGroup(decode.chunks).generate)  # a whole turn, when no decode lives
    prefill.options = lambda stream: prefill
    loop = TurnLoop(AppConfig(**config), Index(lookup, members), prefill, decode, MagicMock())
    loop.engines.update(members)
    return loop


async def run_turn(loop: TurnLoop, turn: Turn):
    """Prepare, stream and close one turn as the router does; returns (chunks, prepared)."""
    ledger = TurnLedger(turn.request_id)
    try:
        prepared = await loop.prepare(turn, ledger)
        return [chunk async for chunk in loop.reply(prepared)], prepared
    finally:
        loop.close(turn, ledger)
        await loop.drain()
