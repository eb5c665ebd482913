"""Short appends run whole on the decode replica that retains the conversation (fakes for the
deployments: the real flow and its oracle are in tests/integration/test_pipeline.py)."""

import asyncio
import time

from app.conversations.records import BreakCause, RenderDiagnostics, RenderMode
from app.protocol import (
    Action,
    Membership,
    PrefillResult,
    PrefixLookup,
    Reason,
    ReplyChunk,
    RetainedMatch,
    Role,
    SamplingSettings,
)
from app.turn.decision import PullPolicy, decide_prefill_on_decode
from app.turn.spec import Turn
from tests.factories import BLOCK, handoff, retained
from tests.fakes import ONE_OF_EACH, DecodeGroup, Index, run_turn, turn_loop

HISTORY = list(range(300))
POLICY = PullPolicy(block_size=BLOCK, threshold_tokens=32, expiry_margin_s=5.0, max_decode_prefill_tokens=64)
NOW = 1000.0


def _lookup(expiry: float) -> PrefixLookup:
    return PrefixLookup(prefill_cached_tokens={"p0": 0},
                        retained=RetainedMatch(retained(HISTORY, expiry), len(HISTORY) // BLOCK))


def test_a_short_append_to_what_decode_retains_runs_on_decode():
    decision = decide_prefill_on_decode(HISTORY + [7] * 20, _lookup(NOW + 60), POLICY, NOW)
    assert decision.action == Action.PREFILL_ON_DECODE and decision.reason == Reason.SHORT_APPEND
    assert decision.tokens_local == 288 and decision.pull is None and decision.pulled_tokens == 0
    assert decision.retained.replica_id == "d0"


def test_long_appends_expiring_blocks_and_switched_off_policies_go_through_prefill():
    short = HISTORY + [7] * 20
    assert decide_prefill_on_decode(HISTORY + [7] * 60, _lookup(NOW + 60), POLICY, NOW) is None, "76 new > 64"
    assert decide_prefill_on_decode(short, _lookup(NOW + 2), POLICY, NOW) is None
    assert decide_prefill_on_decode(short, PrefixLookup(), POLICY, NOW) is None
    for off in ({"enabled": False}, {"max_decode_prefill_tokens": 0}):
        assert decide_prefill_on_decode(short, _lookup(NOW + 60), PullPolicy(BLOCK, 32, 5.0, **off), NOW) is None


PROMPT = tuple(HISTORY + [7] * 20)
# Built at import: the expiry must outlast the rest of the suite (the integration tests run first).
REPLY = [ReplyChunk(token_ids=(8,), text=" b", num_cached_tokens=288),
         ReplyChunk(token_ids=(9,), text=" c", finish_reason="length",
                    retained=retained(list(PROMPT) + [8], time.time() + 3600, request_id="r2"))]
THROUGH_PREFILL = PrefillResult(replica_id="p0", handoff=handoff(len(PROMPT) + 1, 0.0, name="prefill-0"),
                                num_prompt_tokens=len(PROMPT), num_cached_tokens=0,
                                first_chunk=ReplyChunk(token_ids=(8,), text=" b"))


def _serve(decode: DecodeGroup, **turn):
    loop = turn_loop(THROUGH_PREFILL, decode, _lookup(time.time() + 60))
    return (*_turn(loop, PROMPT, **turn), loop)


def _turn(loop, prompt: tuple[int, ...], **turn):
    return asyncio.run(run_turn(loop, Turn("t", prompt, "salt", SamplingSettings(max_tokens=2), **turn)))


def test_the_turn_loop_sends_a_short_append_to_the_retaining_replica_and_frees_the_old_sequence():
    decode = DecodeGroup(REPLY)
    chunks, prepared, loop = _serve(decode)
    assert chunks == REPLY and loop.groups[Role.PREFILL].prefill.calls == []
    request = decode.generate.calls[0]
    assert request.handoff is None and request.target_replica_id == "d0" and request.prompt_token_ids == PROMPT
    assert prepared.cached_tokens == 288 and prepared.log_entry["first_token_from"] == "decode"
    assert loop.index.take.calls == [("d0", "r1")], "the turn owns the sequence it extends"
    assert loop.groups[Role.PREFILL].release.calls == [prepared.decision.retained.handoff], "the extended sequence"
    [records] = loop.index.record_turn.calls
    assert records.retained == REPLY[-1].retained and records.cache_salt == "salt"
    assert records.retained_hashes == tuple(loop.own_retained.retained_hashes("salt", records.retained))
    assert records.prefill_hashes == (), "no prefill replica computed anything"


def test_a_request_may_keep_its_prompt_on_prefill():
    decode = DecodeGroup(REPLY)
    _, prepared, loop = _serve(decode, prefill_on_decode=False)
    assert prepared.decision.action == Action.PULL and len(loop.groups[Role.PREFILL].prefill.calls) == 1


def test_a_failed_decode_replica_falls_back_to_recomputing_through_prefill_for_another_decode():
    decode = DecodeGroup(REPLY, fails_prompts=True)
    loop = turn_loop(THROUGH_PREFILL, decode, _lookup(time.time() + 60), members=Membership(("p0",), ("d0", "d1")))
    chunks, prepared = _turn(loop, PROMPT)
    assert prepared.decision.action == Action.RECOMPUTE and prepared.decision.reason == Reason.DECODE_FAILED
    assert loop.groups[Role.PREFILL].prefill.calls[0].pull is None, "nothing pulled from the failed replica"
    assert [c.token_ids for c in chunks] == [(8,), (8,), (9,)]  # prefill's first token, then the fake's reply
    assert decode.generate.calls[-1].handoff == THROUGH_PREFILL.handoff
    assert decode.generate.calls[-1].target_replica_id == "d1", "routed around the failed replica"


def test_when_the_only_decode_replica_fails_the_whole_turn_runs_on_prefill():
    decode = DecodeGroup(REPLY, fails_prompts=True)
    chunks, prepared, loop = _serve(decode)
    assert prepared.decision.action == Action.RUN_ON_PREFILL and prepared.decision.reason == Reason.NO_DECODE_ALIVE
    assert chunks == REPLY and loop.groups[Role.PREFILL].prefill.calls == []
    request = loop.groups[Role.PREFILL].generate.calls[0]
    assert request.handoff is None and request.retain is False and request.target_replica_id == "p0"
    released = [h.request_id for h in loop.groups[Role.PREFILL].release.calls]
    assert released[0] == "r1", "the claimed sequence nobody extended is released"


def test_a_short_append_to_a_sequence_this_router_recorded_needs_no_index_call():
    _, _, loop = _serve(DecodeGroup(REPLY))
    _, follow_up = _turn(loop, PROMPT + (8,) + (5,) * 10)
    assert len(loop.index.lookup.calls) == 1, "only the first turn asked the index"
    assert follow_up.decision.action == Action.PREFILL_ON_DECODE
    assert follow_up.decision.retained == REPLY[-1].retained
    assert loop.index.record_turn.calls[-1].take_keys == (("d0", "r2"),), "a near-cache claim is taken, then released"
    assert loop.groups[Role.PREFILL].release.calls[-1].request_id == "r2"
    _, other = _turn(loop, (1, 2, 3) * 40)
    assert len(loop.index.lookup.calls) == 2 and other.decision.action != Action.PREFILL_ON_DECODE


def test_a_router_whose_own_record_of_the_conversation_is_stale_asks_the_index():
    """Under two router replicas the other one served the turn before: this router's own record
    (r2, 10 blocks) lacks it, and claiming it would leave the latest sequence held for nobody."""
    _, _, loop = _serve(DecodeGroup(REPLY))
    prompt = PROMPT + (8,) + (5,) * 10
    served_elsewhere = RenderDiagnostics(RenderMode.PRESERVE, len(prompt), len(PROMPT) + 40, len(PROMPT) + 40,
                                         (len(PROMPT) + 39) // BLOCK, BreakCause.NONE)
    _turn(loop, prompt, rendering=served_elsewhere)
    assert len(loop.index.lookup.calls) == 2, "the index was asked"
    latest = RenderDiagnostics(RenderMode.PRESERVE, len(prompt), len(PROMPT) + 1, len(PROMPT) + 1,
                               len(PROMPT) // BLOCK, BreakCause.NONE)
    _turn(loop, prompt, rendering=latest)
    assert len(loop.index.lookup.calls) == 2, "its own record holds the previous turn: no index call"


def test_a_pull_from_a_sequence_this_router_recorded_takes_it_with_its_one_index_call():
    """Kept off decode (too long an append, or as here the request's choice), so prefill pulls: the
    lookup takes the sequence it names (the index's longest match), and no second call claims it."""
    _, _, loop = _serve(DecodeGroup(REPLY))
    latest = REPLY[-1].retained
    loop.index = Index(PrefixLookup(prefill_cached_tokens={"p0": 0},
                                    retained=RetainedMatch(latest, len(latest.token_ids) // BLOCK)), ONE_OF_EACH)
    prompt = PROMPT + (8,) + (5,) * 10
    _, follow_up = _turn(loop, prompt, prefill_on_decode=False)
    assert follow_up.decision.action == Action.PULL and follow_up.decision.retained == latest
    [(_, key)] = loop.index.lookup.calls
    assert key == latest.key and loop.index.take.calls == []
    assert loop.groups[Role.PREFILL].prefill.calls[-1].pull == follow_up.decision.pull
    assert loop.index.record_turn.calls[-1].take_keys == (), "the claim was confirmed by the lookup"
    _turn(loop, PROMPT + (9,) * 100, prefill_on_decode=False)
    assert loop.index.lookup.calls[-1][1] is None, "a prompt that does not extend it takes nothing with its lookup"
