"""Fake deployments for the turn loop's unit tests: Serve handles that record their calls."""

from types import SimpleNamespace
from unittest.mock import MagicMock

from app.config import AppConfig
from app.protocol import PrefillResult, PrefixLookup, ReplyChunk
from app.turn import TurnLoop


class Remote:
    """A Serve handle method: `.remote(*args)` records the args and returns what `answer(first)` gives."""

    def __init__(self, answer=lambda _: None) -> None:
        self.calls, self.answer = [], answer

    def remote(self, *args):
        self.calls.append(args[0] if len(args) == 1 else args)
        result = self.answer(args[0])
        return result if hasattr(result, "__anext__") else Response(result)


class Response:
    """Awaitable like a Serve DeploymentResponse; like one, it may be left unawaited."""

    def __init__(self, value) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator: awaiting it returns at once


class DecodeGroup:
    """Streams `chunks` for every request; with `fails_prompts`, a request that asks decode to
    compute the prompt itself (no handoff) fails before its first chunk."""

    def __init__(self, chunks: list[ReplyChunk], fails_prompts: bool = False) -> None:
        async def stream(request):
            if fails_prompts and request.handoff is None:
                raise RuntimeError("decode replica is gone")
            for chunk in chunks:
                yield chunk
        self.decode, self.release = Remote(stream), Remote()

    def options(self, stream: bool):
        return self


def turn_loop(result: PrefillResult, decode: DecodeGroup, lookup: PrefixLookup | None = None,
              **config) -> TurnLoop:
    index = SimpleNamespace(lookup=Remote(lambda _: lookup or PrefixLookup(prefill_cached_tokens={"p0": 0})),
                            record_prefill=Remote(), record_retained=Remote(), forget_retained=Remote())
    prefill = SimpleNamespace(prefill=Remote(lambda _: result), release=Remote())
    return TurnLoop(AppConfig(**config), index, prefill, decode, MagicMock())
