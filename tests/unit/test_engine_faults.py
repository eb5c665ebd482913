"""Engines that fail: the turn loop routes around them, degrades, and moves a reply mid-stream
(fakes for the deployments; the real faults are in tests/integration/test_faults.py)."""

import asyncio
import time
from collections import OrderedDict
from dataclasses import replace
from types import SimpleNamespace

import pytest

from app.config import AppConfig
from app.protocol import Action, LoadReport, Membership, PrefillResult, Reason, ReplyChunk, Role, SamplingSettings
from app.turn.membership import LiveEngines
from app.turn.reply import NoEngineAlive
from app.turn.spec import Turn
from deployments.decode import DecodeServer
from tests.factories import BLOCK, handoff, retained
from tests.fakes import ONE_OF_EACH, DecodeGroup, Remote, run_turn, turn_loop

PROMPT = tuple(range(100))
REPLY = [ReplyChunk(token_ids=(i,), text=f" {i}") for i in (8, 9, 10)] + [
    ReplyChunk(token_ids=(11,), text=" 11", finish_reason="length")]
PREFILLED = PrefillResult(replica_id="p0", handoff=handoff(len(PROMPT) + 1, 0.0, name="prefill-0"),
                          num_prompt_tokens=len(PROMPT), num_cached_tokens=0,
                          first_chunk=ReplyChunk(token_ids=(7,), text=" 7"))


def _turn(max_tokens: int = 5, **sampling) -> Turn:
    return Turn("t", PROMPT, "salt", SamplingSettings(max_tokens=max_tokens, temperature=0.0, **sampling))


def test_a_decode_that_dies_mid_reply_hands_the_rest_to_another_engine():
    decode = DecodeGroup(REPLY, fails_after=2)
    loop = turn_loop(PREFILLED, decode, members=Membership(("p0",), ("d0", "d1")))
    chunks, prepared = asyncio.run(run_turn(loop, _turn()))
    first, moved = decode.generate.calls
    assert moved.prompt_token_ids == first.prompt_token_ids + (8, 9), "prompt plus the tokens already sent"
    assert moved.sampling.max_tokens == first.sampling.max_tokens - 2 and moved.handoff is None
    assert moved.target_replica_id != first.target_replica_id
    assert [c.token_ids for c in chunks][:3] == [(7,), (8,), (9,)]
    assert loop.metrics.record_engine_failure.call_args.args == ("reply",)


def test_with_no_decode_left_the_reply_continues_on_prefill():
    decode = DecodeGroup(REPLY, fails_after=1)
    loop = turn_loop(PREFILLED, decode, members=Membership(("p0",), ("d0",)))
    chunks, _ = asyncio.run(run_turn(loop, _turn()))
    moved = loop.groups[Role.PREFILL].generate.calls[0]
    assert moved.retain is False and moved.target_replica_id == "p0"
    assert chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("sampling", [{"regex": "[0-9 ]+"}, {"presence_penalty": 0.5}, {"bad_words": ("x",)}])
def test_a_turn_whose_sampling_reads_the_reply_is_not_moved(sampling):
    """A grammar's state, or penalties over generated tokens: another engine would read the sent
    tokens as prompt."""
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY, fails_after=1), members=Membership(("p0",), ("d0", "d1")))
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(run_turn(loop, _turn(**sampling)))


def test_a_moved_reply_still_counts_min_tokens_over_the_whole_reply():
    decode = DecodeGroup(REPLY, fails_after=2)
    loop = turn_loop(PREFILLED, decode, members=Membership(("p0",), ("d0", "d1")))
    asyncio.run(run_turn(loop, _turn(max_tokens=30, min_tokens=20)))
    first, moved = decode.generate.calls
    assert (first.sampling.min_tokens, moved.sampling.min_tokens) == (19, 17)


def _refusing(exc: Exception) -> Remote:
    """An engine's generate that refuses every request (vLLM raised before the first output)."""
    async def stream(_request):
        raise exc
        yield  # an async generator, as the replica's generate is

    return Remote(stream)


@pytest.mark.parametrize("prefill_refuses", [True, False])
def test_a_request_the_engine_refuses_is_the_client_s_error_tried_once_and_suspects_no_engine(prefill_refuses):
    """vLLM refused it (it refuses it on every engine): today's 503 for every tenant came from
    suspecting each engine in turn. Prefill refusing it, or decode refusing the continuation."""
    from vllm.exceptions import VLLMValidationError

    from app.config import Placement
    from app.conversations.rendering import BadRequest

    refused = VLLMValidationError("stop cannot contain an empty string.")
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), members=Membership(("p0", "p1"), ("d0", "d1")),
                     placement=Placement(load_aware=False))
    prefill, decode = loop.groups[Role.PREFILL], loop.groups[Role.DECODE]
    if prefill_refuses:
        prefill.prefill, prefill.generate = Remote(lambda _: refused), _refusing(refused)
    decode.generate = _refusing(refused)
    with pytest.raises(BadRequest, match="stop cannot contain an empty string"):
        asyncio.run(run_turn(loop, _turn()))
    calls = [*prefill.prefill.calls, *prefill.generate.calls, *decode.generate.calls]
    assert len(calls) == (1 if prefill_refuses else 2), "tried once: prefill, then decode's continuation"
    assert loop.engines.live(Role.PREFILL) == ["p0", "p1"] and loop.engines.live(Role.DECODE) == ["d0", "d1"]
    loop.metrics.record_engine_failure.assert_not_called()


def test_no_live_decode_runs_the_whole_turn_on_prefill_and_no_engine_at_all_is_a_503():
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), members=Membership(("p0",), ()))
    chunks, prepared = asyncio.run(run_turn(loop, _turn()))
    assert prepared.decision.action == Action.RUN_ON_PREFILL and prepared.decision.reason == Reason.NO_DECODE_ALIVE
    assert loop.groups[Role.PREFILL].prefill.calls == [] and chunks == REPLY
    down = turn_loop(PREFILLED, DecodeGroup(REPLY), members=Membership())
    with pytest.raises(NoEngineAlive):
        asyncio.run(run_turn(down, _turn()))


def test_no_live_prefill_runs_the_whole_turn_on_decode():
    decode = DecodeGroup(REPLY)
    loop = turn_loop(PREFILLED, decode, members=Membership((), ("d0",)))
    _, prepared = asyncio.run(run_turn(loop, _turn()))
    assert prepared.decision.action == Action.PREFILL_ON_DECODE
    assert prepared.decision.reason == Reason.NO_PREFILL_ALIVE and decode.generate.calls[0].handoff is None


def test_a_suspected_replica_is_routed_around_until_its_time_is_up():
    engines = LiveEngines(suspect_s=10.0)
    engines.update(Membership(("p0", "p1"), ("d0",)))
    engines.suspect("p0", now=100.0)
    assert engines.live(Role.PREFILL, now=105.0) == ["p1"]
    assert engines.live(Role.PREFILL, now=111.0) == ["p0", "p1"]
    engines.streams["d0"] = 3
    assert engines.pick(Role.DECODE, preferred="gone") == "d0"


def test_a_restarted_index_adds_to_the_known_engines_until_every_engine_has_renewed():
    """Right after an index restart only the engines that already heartbeated are in its answer:
    the others stay live until the index has been up one registration TTL; then its word holds."""
    engines = LiveEngines(suspect_s=10.0)
    engines.update(Membership(("p0",), ("d0",)))
    engines.update(Membership((), ("d0",), settled=False))
    assert engines.live(Role.PREFILL) == ["p0"] and engines.live(Role.DECODE) == ["d0"]
    engines.update(Membership((), (), settled=False))
    assert engines.live(Role.PREFILL) == ["p0"]
    engines.update(Membership((), ("d0",)))
    assert engines.live(Role.PREFILL) == [] and engines.live(Role.DECODE) == ["d0"]


def test_a_stage_that_does_not_answer_in_time_is_a_timeout_not_a_hang():
    from app.config import Limits
    from app.turn.reply import StageTimeout

    class Hangs:
        def __call__(self, _):
            return asyncio.sleep(3600)

    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), limits=Limits(prefill_timeout_s=0.05))
    loop.groups[Role.PREFILL].prefill = Hangs()
    with pytest.raises(StageTimeout, match="prefill did not answer within 0.05 s"):
        asyncio.run(run_turn(loop, _turn()))


def test_a_turn_on_decode_moved_mid_reply_keeps_the_tokens_it_already_sent():
    """The whole turn ran on decode: its first chunk came from the same stream, so the moved
    request's prompt must include it too (or the client would get it twice)."""
    from app.protocol import PrefixLookup, RetainedMatch
    from tests.factories import retained

    history = list(range(96))
    prompt = tuple(history + [7] * 4)
    lookup = PrefixLookup(prefill_cached_tokens={"p0": 0},
                          retained=RetainedMatch(retained(history, time.time() + 60), len(history) // 32))
    decode = DecodeGroup(REPLY, fails_after=2)
    loop = turn_loop(PREFILLED, decode, lookup, members=Membership(("p0",), ("d0", "d1")))
    chunks, prepared = asyncio.run(run_turn(loop, Turn("t", prompt, "salt", SamplingSettings(max_tokens=5))))
    assert prepared.decision.action == Action.PREFILL_ON_DECODE
    whole, moved = decode.generate.calls
    assert moved.prompt_token_ids == prompt + (8, 9) and moved.sampling.max_tokens == 3


def test_prefill_s_handoff_is_released_when_the_reply_moved_before_decode_read_it():
    decode = DecodeGroup(REPLY, fails_after=0)
    loop = turn_loop(PREFILLED, decode, members=Membership(("p0",), ("d0", "d1")))
    asyncio.run(run_turn(loop, _turn()))
    assert decode.generate.calls[1].handoff is None, "the moved reply computed its prompt itself"
    assert decode.release.calls == [PREFILLED.handoff], "nobody read prefill's blocks: released at once"


def test_a_call_waiting_on_a_replica_that_leaves_the_live_set_is_abandoned():
    """Serve can hold a call to a dead replica until its replacement starts (tens of seconds):
    the router gives up on it once the replica's heartbeats stop."""
    from app.turn.reply import EngineGone, unless_gone

    async def scenario():
        members = {"d0"}
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, members.clear)
        started = time.perf_counter()
        with pytest.raises(EngineGone):
            await unless_gone(never, lambda: "d0" not in members, poll_s=0.01)
        assert never.cancelled() and time.perf_counter() - started < 1
        assert await unless_gone(asyncio.sleep(0.02, "answer"), lambda: False, poll_s=0.01) == "answer"

    asyncio.run(scenario())


def test_a_turn_planned_without_the_index_s_answer_says_so_in_its_decision():
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY))
    loop.index.lookup = Remote(lambda *_: TimeoutError())
    _, prepared = asyncio.run(run_turn(loop, _turn()))
    assert prepared.decision.action == Action.RECOMPUTE and prepared.decision.reason == Reason.INDEX_UNREACHABLE


def test_a_new_router_takes_requests_once_the_index_answered_or_its_wait_ran_out():
    """A new replica's first index call also resolves where the index runs (up to 4 s on 2 cores):
    turns planned before its answer would find no record and recompute everything."""
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), members=Membership((), ()))
    loop.engines.update(Membership((), ()))
    loop.index.membership = Remote(lambda _: ONE_OF_EACH)
    asyncio.run(loop.refresh_membership(1.0))
    assert loop.engines.live(Role.DECODE) == ["d0"]
    loop.index.membership = lambda: asyncio.sleep(10)
    started = time.perf_counter()
    asyncio.run(loop.refresh_membership(0.05))
    assert time.perf_counter() - started < 1, "an index that does not answer delays the start, never blocks it"


def _decode_replica(kept_ids: list[str], held_ids: set[str], pool_blocks: int = 200,
                    load: LoadReport | None = None, just_kept: tuple[str, ...] = ()) -> SimpleNamespace:
    """DecodeServer's trimming state: sequences of 33 blocks (`held_ids` still in the index), kept
    a minute ago but for `just_kept`."""
    replica = object.__new__(DecodeServer.func_or_class)
    replica.config, replica.replica_id = AppConfig(), "d0"
    replica.engine = SimpleNamespace(load=load or LoadReport(), pool_blocks=pool_blocks, shutdown=lambda: None)
    expiry = {r: time.time() + replica.config.retention_ttl_s - (0 if r in just_kept else 60) for r in kept_ids}
    replica.kept = OrderedDict((r, retained(list(range(33 * BLOCK)), expiry[r], request_id=r)) for r in kept_ids)
    replica.index = SimpleNamespace(**{m: Remote(lambda keys: tuple(k for k in keys if k[1] in held_ids))
                                       for m in ("take_all", "held")})
    replica.prefill = SimpleNamespace(release=Remote())
    replica.released_metric = SimpleNamespace(inc=lambda *_: None)
    return replica


def test_decode_trims_what_it_retains_to_its_pool_share_counting_only_what_nobody_took():
    """Four sequences of 33 blocks against a budget of 100: one is released, the oldest. A sequence
    a turn took already (pulled, or released by the router) leaves the pool anyway: counted, the
    next one lost its KV too."""
    over = _decode_replica(["a", "b", "c", "d"], held_ids={"a", "b", "c", "d"})
    asyncio.run(over._trim())
    assert [h.request_id for h in over.prefill.release.calls] == ["a"] and list(over.kept) == ["b", "c", "d"]
    assert over.kept_released == 1
    taken_first = _decode_replica(["a", "b", "c", "d"], held_ids={"b", "c", "d"})
    asyncio.run(taken_first._trim())
    assert taken_first.prefill.release.calls == [] and list(taken_first.kept) == ["b", "c", "d"]


def test_decode_stops_counting_what_later_turns_took_but_not_a_turn_still_being_recorded():
    """Over its share as counted (132 blocks against 100), decode asks the index which of its kept
    sequences nobody took: a and b were taken, c was kept a moment ago and its record may still be
    on its way. What is left (66 blocks) fits: nothing is released."""
    replica = _decode_replica(["a", "b", "c", "d"], held_ids={"d"}, just_kept=("c",))
    asyncio.run(replica._trim())
    assert replica.index.held.calls == [[("d0", "a"), ("d0", "b"), ("d0", "d")]]
    assert list(replica.kept) == ["c", "d"] and replica.prefill.release.calls == []


def test_decode_releases_for_waiting_requests_only_when_they_wait_for_blocks():
    """Under its pool share, decode releases one sequence a tick while requests wait with the pool
    nearly full; requests waiting for the step's token budget cost no sequence its KV."""
    for usage, released in ((0.2, []), (0.95, ["a"])):
        replica = _decode_replica(["a", "b"], held_ids={"a", "b"}, pool_blocks=1000,
                                  load=LoadReport(num_waiting_reqs=3, kv_cache_usage=usage))
        asyncio.run(replica._trim())
        assert [h.request_id for h in replica.prefill.release.calls] == released, usage


def test_decode_claims_what_it_trims_in_one_index_call_a_tick():
    """Once the pool share binds, a call per kept sequence released was one index call per reply."""
    replica = _decode_replica(["a", "b", "c", "d"], held_ids={"b", "c", "d"}, pool_blocks=2, just_kept=("a",))
    asyncio.run(replica._trim())
    assert len(replica.index.take_all.calls) == 1
    assert [h.request_id for h in replica.prefill.release.calls] == ["b", "c", "d"] and not replica.kept


def test_a_tenant_past_its_share_of_what_decode_retains_loses_its_own_oldest_when_the_pool_share_binds():
    """With tenants, one tenant holds at most `tenant_share` of the retained share (75 of 150 blocks
    here) once the share binds: over it by 15 blocks, decode releases the loud tenant's oldest, not
    the oldest of all (the quiet tenant's). Under the share, nothing goes: room is anyone's."""
    for pool, released in ((300, ["a"]), (400, [])):
        replica = _decode_replica(["e", "a", "b", "c", "d"], held_ids=set("abcde"), pool_blocks=pool)
        replica.config = AppConfig(api_keys={"k1": "loud", "k2": "quiet"})
        replica.kept = OrderedDict((r, replace(k, tenant="quiet" if r == "e" else "loud"))
                                   for r, k in replica.kept.items())
        asyncio.run(replica._trim())
        assert [h.request_id for h in replica.prefill.release.calls] == released, pool


def test_a_sequence_waiting_out_a_tool_s_run_is_trimmed_last_unless_requests_wait_for_blocks():
    """Over the pool share by one sequence: the oldest one not paused for a tool goes. Requests
    waiting for blocks take the oldest, paused or not."""
    waiting = LoadReport(num_waiting_reqs=2, kv_cache_usage=0.95)
    for pool, load, released in ((180, LoadReport(), ["b"]), (1000, waiting, ["a"])):
        replica = _decode_replica(["a", "b", "c"], held_ids={"a", "b", "c"}, pool_blocks=pool, load=load)
        replica.kept["a"] = replace(replica.kept["a"], paused_until=time.time() + 30)
        asyncio.run(replica._trim())
        assert [h.request_id for h in replica.prefill.release.calls][:1] == released, load


def test_decode_counts_every_kept_sequence_while_the_index_does_not_answer():
    replica = _decode_replica(["a", "b"], held_ids=set())
    replica.index.held = SimpleNamespace(remote=lambda keys: asyncio.sleep(10))
    replica.config = AppConfig(limits=replace(AppConfig().limits, bookkeeping_timeout_s=0.05))
    asyncio.run(replica._forget_taken())
    assert list(replica.kept) == ["a", "b"]


def test_an_idle_decode_checks_what_it_keeps_less_often_and_a_request_wakes_the_check():
    replica = _decode_replica(["a"], {"a"})
    limits = replace(replica.config.limits, retained_trim_interval_s=0.01, retained_trim_idle_interval_s=0.5)
    replica.config, replica.request_arrived = replace(replica.config, limits=limits), asyncio.Event()
    replica.engine.llm, replica.engine.in_flight = SimpleNamespace(errored=False), 0
    replica.engine.quiet_since = time.monotonic() - 60  # no request for a minute
    trims = []

    async def trim() -> None:
        trims.append(time.monotonic())

    replica._trim = trim

    async def run() -> tuple[int, int]:
        task = asyncio.ensure_future(replica._trim_forever())
        await asyncio.sleep(0.2)
        idle = len(trims)
        replica.request_arrived.set()  # a request came (and went)
        replica.engine.quiet_since = time.monotonic()
        await asyncio.sleep(0.1)
        task.cancel()
        return idle, len(trims)

    idle, busy = asyncio.run(run())
    assert idle == 0, "idle: no check before the idle interval"
    assert busy >= 3, "a request woke the check, then it ran at the busy interval"


def test_an_idle_app_s_repeating_answers_are_asked_for_less_often():
    from app.turn.membership import QuietPoll

    limits = AppConfig().limits
    poll, busy = QuietPoll.of(limits), Membership(prefill=("p",), decode=("d",), loads={"p": LoadReport(1)})
    assert poll.wait_after(busy) == limits.heartbeat_interval_s, "a first answer is news"
    assert poll.wait_after(busy) == limits.quiet_poll_interval_s > limits.heartbeat_interval_s
    assert poll.wait_after(replace(busy, loads={"p": LoadReport(2)})) == limits.heartbeat_interval_s
