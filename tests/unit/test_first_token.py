"""Prefill's first token goes to the client at once; decode continues after it (fakes for the
deployments: the real flow and its oracle are in tests/integration/test_pipeline.py)."""

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from app.protocol import PrefillRequest, PrefillResult, ReplyChunk, Role, SamplingSettings
from app.turn.loop import TurnLoop
from app.turn.spec import CONTINUATION_PRIORITY, Turn
from deployments.prefill import engine_settings, first_chunk
from tests.factories import BLOCK, handoff
from tests.fakes import DecodeGroup, run_turn, turn_loop

PROMPT = tuple(range(64))


def _loop(result: PrefillResult, decode_chunks: list[ReplyChunk], **config) -> tuple[TurnLoop, DecodeGroup]:
    decode = DecodeGroup(decode_chunks)
    return turn_loop(result, decode, **config), decode


def _result(first: ReplyChunk | None) -> PrefillResult:
    return PrefillResult(replica_id="p0", handoff=handoff(len(PROMPT) + 1, 0.0), num_prompt_tokens=len(PROMPT),
                         num_cached_tokens=0, first_chunk=first)


def _serve(loop: TurnLoop, sampling: SamplingSettings) -> list[ReplyChunk]:
    return asyncio.run(run_turn(loop, Turn("t", PROMPT, "salt", sampling)))


def test_the_first_token_comes_from_prefill_and_decode_continues_after_it():
    first = ReplyChunk(token_ids=(7,), text=" a")
    loop, decode = _loop(_result(first), [ReplyChunk(token_ids=(8, 9), text=" b c", finish_reason="length")])
    chunks, prepared = _serve(loop, SamplingSettings(max_tokens=3, temperature=0.0))
    assert [c.token_ids for c in chunks] == [(7,), (8, 9)]
    assert loop.groups[Role.PREFILL].prefill.calls[0].first_token == SamplingSettings(max_tokens=3, temperature=0.0)
    request = decode.generate.calls[0]
    assert request.prompt_token_ids == PROMPT + (7,) and request.sampling.max_tokens == 2
    # The user has the first token: decode starts the rest ahead of every prompt waiting there.
    assert request.priority == CONTINUATION_PRIORITY < loop.groups[Role.PREFILL].prefill.calls[0].priority
    assert prepared.log_entry["first_token_from"] == "prefill" and "ttft_ms" in prepared.log_entry


def test_the_decision_is_logged_once_its_first_token_is_out_with_its_ttft(caplog):
    first = ReplyChunk(token_ids=(7,), text=" a")
    loop, _ = _loop(_result(first), [ReplyChunk(token_ids=(8,), text=" b", finish_reason="length")])

    async def first_chunk_then_rest():
        async with loop.turn(Turn("t", PROMPT, "salt", SamplingSettings(max_tokens=2, temperature=0.0))) as run:
            await run.prepare()
            chunks = run.reply()
            await anext(chunks)
            logged_with_the_first_chunk = len(loop.decisions)
            rest = [chunk async for chunk in chunks]
        await loop.drain()
        return logged_with_the_first_chunk, rest

    with caplog.at_level("INFO", logger="ray.serve"):
        logged_with_the_first_chunk, _ = asyncio.run(first_chunk_then_rest())
    lines = [json.loads(r.message) for r in caplog.records if r.message.startswith('{"event": "kv_decision"')]
    assert logged_with_the_first_chunk == 0 and len(loop.decisions) == 1
    assert len(lines) == 1 and lines[0]["ttft_ms"] == loop.decisions[0]["ttft_ms"]


def test_min_tokens_counts_the_whole_reply_across_prefill_and_decode():
    first = ReplyChunk(token_ids=(7,), text=" a")
    loop, decode = _loop(_result(first), [ReplyChunk(token_ids=(8, 9), text=" b c", finish_reason="length")])
    sampling = SamplingSettings(max_tokens=30, min_tokens=20, temperature=0.0, stop_token_ids=(8,),
                                repetition_penalty=1.3)
    _serve(loop, sampling)
    assert loop.groups[Role.PREFILL].prefill.calls[0].first_token == sampling, "repetition_penalty reads prompt too"
    continued = decode.generate.calls[0].sampling
    assert (continued.max_tokens, continued.min_tokens) == (29, 19)
    on_prefill = engine_settings(loop.groups[Role.PREFILL].prefill.calls[0], BLOCK)
    assert (on_prefill.max_tokens, on_prefill.min_tokens) == (2, 2), "vLLM refuses min_tokens above max_tokens"


@pytest.mark.parametrize("prompt_len, max_tokens", [(BLOCK - 1, 1), (BLOCK, 2), (BLOCK + 1, 1)])
def test_prefill_samples_a_second_token_only_when_the_prompt_fills_its_last_block(prompt_len, max_tokens):
    request = PrefillRequest("r", tuple(range(prompt_len)), "salt", "p0", first_token=SamplingSettings(max_tokens=8))
    assert engine_settings(request, BLOCK).max_tokens == max_tokens
    assert engine_settings(replace(request, first_token=SamplingSettings(max_tokens=1)), BLOCK).max_tokens == 1
    assert engine_settings(replace(request, first_token=None), BLOCK).temperature == 0.0


def test_a_turn_that_ends_with_its_first_token_frees_prefill_blocks_without_decoding():
    loop, decode = _loop(_result(ReplyChunk(token_ids=(7,), text=" a", finish_reason="length")), [])
    chunks, prepared = _serve(loop, SamplingSettings(max_tokens=1, temperature=0.0))
    assert [c.finish_reason for c in chunks] == ["length"]
    assert decode.generate.calls == [] and decode.release.calls == [prepared.prefill.handoff]
    [records] = loop.index.record_turn.calls
    assert (records.prefill_replica_id, records.prefill_hashes) == ("p0", tuple(prepared.ledger.hashes))


@pytest.mark.parametrize("sampling, config", [
    (SamplingSettings(stop=("\n",)), {}),
    (SamplingSettings(regex="[a-z]+"), {}),
    (SamplingSettings(presence_penalty=0.5), {}),
    (SamplingSettings(frequency_penalty=0.5), {}),
    (SamplingSettings(bad_words=("router",)), {}),
    (SamplingSettings(), {"first_token_from_prefill": False}),
])
def test_stop_strings_grammars_or_the_switch_leave_the_first_token_to_decode(sampling, config):
    """And penalties over generated tokens and bad words: decode would read prefill's token as prompt."""
    loop, decode = _loop(_result(None), [ReplyChunk(token_ids=(8,), text=" b", finish_reason="length")], **config)
    chunks, prepared = _serve(loop, sampling)
    assert loop.groups[Role.PREFILL].prefill.calls[0].first_token is None
    assert decode.generate.calls[0].prompt_token_ids == PROMPT
    assert decode.generate.calls[0].sampling == sampling
    assert prepared.log_entry["first_token_from"] == "decode"


def _delta(token_ids: list[int], text: str, finish_reason: str | None = None):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, text=text, finish_reason=finish_reason,
                                                   logprobs=None)])


def test_a_first_token_without_text_yet_is_left_to_decode():
    assert first_chunk([_delta([7], " a"), _delta([8], " b", "length")], 8) == ReplyChunk((7,), " a")
    assert first_chunk([_delta([7], "", "stop")], 8) is None, "a partial UTF-8 character or a hidden token"
    assert first_chunk([_delta([7, 8], " a b", "length")], 8) is None


def test_the_first_token_ends_the_turn_at_its_end_of_sequence_or_its_limit_not_at_prefill_s():
    assert first_chunk([_delta([7], " a", "length")], 8).finish_reason is None
    assert first_chunk([_delta([7], " a", "length")], 1).finish_reason == "length"
    assert first_chunk([_delta([7], " a", "stop")], 8).finish_reason == "stop"


def test_a_handoff_cut_to_a_prefix_keeps_the_blocks_of_those_tokens():
    full = handoff(2 * BLOCK + 1, 0.0)
    assert full.prefix(2 * BLOCK, BLOCK).block_ids == (full.block_ids[0][:2],)
    assert full.prefix(2 * BLOCK, BLOCK).num_tokens == 2 * BLOCK
    assert full.prefix(2 * BLOCK + 1, BLOCK) == full
