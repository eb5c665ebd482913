"""The frontend's relay moves a reply whose router replica dies to another replica, from the prompt
plus the tokens already sent (fakes for the router: the real kill is in tests/integration/test_faults.py)."""

import asyncio
from dataclasses import replace

import pytest
from ray.exceptions import ActorDiedError

from app.protocol import ClientRequest, ReplyChunk, ReplyStart
from app.turn.relay import NoRouterAlive, Relay

START = ReplyStart("chatcmpl-1", (1, 2, 3), cached_tokens=2, max_tokens=5)


class Stream:
    def __init__(self, items: list) -> None:
        self.items, self.cancelled = list(items), False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Router:
    """Each call streams the next script; the requests it got are kept."""

    def __init__(self, *scripts: list) -> None:
        self.scripts, self.requests, self.streams = list(scripts), [], []

    def open(self, request: ClientRequest, choice: int | None) -> Stream:
        self.requests.append(request)
        self.streams.append(Stream(self.scripts.pop(0)))
        return self.streams[-1]


def _relay(router: Router) -> tuple[Relay, list[ReplyChunk]]:
    relay = Relay(router, ClientRequest(body=None), attempts=3)

    async def run():
        await relay.begin()
        return [chunk async for chunk in relay.chunks()]

    return relay, asyncio.run(run())


def test_a_reply_whose_router_dies_continues_on_another_from_what_was_sent():
    router = Router([START, ReplyChunk((7,), " a"), ReplyChunk((8,), " b"), ActorDiedError()],
                    [START, ReplyChunk((9, 10), " c d"), ReplyChunk((11,), " e", "length")])
    relay, chunks = _relay(router)
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10, 11] and relay.text[-1] == " e"
    resume = router.requests[1].resume
    assert resume.prompt_token_ids == START.prompt_token_ids and resume.sent_token_ids == (7, 8)
    assert resume.sent_text == " a b" and resume.cached_tokens == 2
    assert router.streams[0].cancelled


def test_each_start_s_first_chunk_is_the_reply_s_next_and_counts_as_sent_when_the_reply_moves():
    router = Router([replace(START, first=ReplyChunk((7,), " a")), ReplyChunk((8,), " b"), ActorDiedError()],
                    [replace(START, first=ReplyChunk((9,), " c")), ReplyChunk((10,), " d", "stop")])
    relay, chunks = _relay(router)
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10] and "".join(relay.text) == " a b c d"
    assert router.requests[1].resume.sent_token_ids == (7, 8)


def test_a_reply_finished_in_its_start_s_chunk_ends_with_the_router_s_stream():
    router = Router([replace(START, first=ReplyChunk((7,), " a", "stop"))])
    _, chunks = _relay(router)
    assert [c.finish_reason for c in chunks] == ["stop"] and len(router.requests) == 1


def test_a_router_that_dies_before_the_reply_starts_is_retried_from_scratch():
    router = Router([ActorDiedError()], [START, ReplyChunk((7,), " a", "stop")])
    _, chunks = _relay(router)
    assert [c.token_ids for c in chunks] == [(7,)] and router.requests[1].resume is None


def test_a_finished_reply_is_not_extended_when_its_router_dies_afterwards():
    router = Router([START, ReplyChunk((7,), " a", "stop"), ActorDiedError()])
    _, chunks = _relay(router)
    assert [c.finish_reason for c in chunks] == ["stop"] and len(router.requests) == 1


def test_a_grammar_reply_does_not_move_and_a_router_that_keeps_dying_gives_up():
    with pytest.raises(NoRouterAlive):
        _relay(Router([replace(START, movable=False), ReplyChunk((7,), " a"), ActorDiedError()]))
    with pytest.raises(NoRouterAlive):
        _relay(Router(*[[START, ActorDiedError()]] * 3))


def test_admission_holds_a_place_per_reply_until_it_ends_or_its_relay_is_dropped():
    import gc

    from app.turn.relay import Admission

    admission = Admission(capacity=2, tenant_capacity=2)
    first, second = (Relay(None, None, 3) for _ in range(2))
    assert admission.admit(first, "t") and admission.admit(second, "u")
    assert not admission.admit(Relay(None, None, 3), "v") and admission.full  # full: refused
    first.close()
    first.close()  # a reply's end may be reported twice (stream and caller): counted once
    assert admission.held == 1
    del second  # never streamed: the client left before its stream started
    gc.collect()
    assert admission.held == 0 and not admission.held_by


def test_one_tenant_holds_at_most_its_share_of_the_places():
    from app.turn.relay import Admission

    admission = Admission(capacity=4, tenant_capacity=2)
    relays = [Relay(None, None, 3) for _ in range(4)]
    assert admission.admit(relays[0], "greedy") and admission.admit(relays[1], "greedy")
    assert not admission.admit(relays[2], "greedy") and not admission.full  # its share: 429, not 503
    assert admission.admit(relays[3], "polite")  # another tenant still gets in
    relays[0].close()
    assert admission.admit(relays[2], "greedy")
