"""A turn is one object: however its `async with` ends, it settles what it holds, once; the seams it is
written against are the ones the Serve adapters and the fakes implement."""

import asyncio
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from app.config import AppConfig
from app.kv.hashing import block_hashes
from app.protocol import Membership, Role, SamplingSettings
from app.turn.ledger import TurnState
from app.turn.seams import EngineGroup, KVIndexClient, PrefillGroup
from app.turn.spec import Turn
from app.turn.turn import TurnRun
from deployments.router import Router
from tests.fakes import DecodeGroup, Index, Remote, turn_loop
from tests.unit.test_engine_faults import PREFILLED, PROMPT, REPLY


def _turn() -> Turn:
    return Turn("t", PROMPT, "salt", SamplingSettings(max_tokens=5, temperature=0.0))


def test_a_client_gone_mid_reply_aborts_the_engine_request_and_keeps_nothing():
    decode = DecodeGroup(REPLY)
    loop = turn_loop(PREFILLED, decode)

    async def scenario():
        async with loop.turn(_turn()) as run:
            await run.prepare()
            async for chunk in run.reply():
                if chunk.token_ids == REPLY[0].token_ids:
                    break  # the client went away after decode's first token
        await loop.drain()
        return run

    run = asyncio.run(scenario())
    [stream] = decode.generate.streams
    assert stream.cancelled, "the engine request is aborted, which frees its blocks"
    assert run.ledger.state == TurnState.ABORTED
    assert all(records.retained is None for records in loop.index.record_turn.calls)


def test_a_turn_that_fails_inside_its_block_still_settles_its_handoff():
    """The turn raised after prefill, before decode read the handoff: prefill's blocks are released."""
    decode = DecodeGroup(REPLY)
    loop = turn_loop(PREFILLED, decode)

    async def scenario():
        with pytest.raises(RuntimeError, match="the router failed"):
            async with loop.turn(_turn()) as run:
                await run.prepare()
                raise RuntimeError("the router failed")
        await loop.drain()

    asyncio.run(scenario())
    released = [call for group in loop.groups.values() for call in group.release.calls]
    assert released == [PREFILLED.handoff]


def test_a_turn_looks_up_the_block_hashes_computed_with_its_prompt(monkeypatch):
    """The router hashes the prompt in its render thread; the turn does not hash it again."""
    monkeypatch.setattr("app.turn.turn.block_hashes", lambda *args: pytest.fail("hashed twice"))
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY))
    hashes = (b"h0", b"h1")

    async def scenario():
        async with loop.turn(replace(_turn(), block_hashes=hashes)) as run:
            await run.prepare()
        await loop.drain()

    asyncio.run(scenario())
    assert loop.index.lookup.calls == [(list(hashes), None)]


def test_the_router_s_hashes_are_the_turn_s_own():
    """The router's one render-thread job gives the hashes the turn would compute itself."""
    config = AppConfig()
    router = SimpleNamespace(config=config)
    prompt, hashes = Router.func_or_class._hashed(router, "salt", None, lambda ids: ids, list(PROMPT))
    assert prompt == list(PROMPT)
    assert list(hashes) == block_hashes(list(PROMPT), config.block_size, "salt", config.prefix_hash_seed,
                                        config.prefix_hash_algo)


@pytest.mark.parametrize("first_from_prefill", [True, False])
def test_placement_is_fitted_to_the_turn_s_first_token(first_from_prefill):
    """Prefill's answer is the first token only when prefill sampled it; otherwise decode's first
    chunk is, and the estimate (which counts decode's read and step then) is fitted to that."""
    decode_s = 0.2

    async def slow_decode(_request):
        await asyncio.sleep(decode_s)
        for chunk in REPLY:
            yield chunk

    decode = DecodeGroup(REPLY)
    decode.generate = Remote(slow_decode)
    result = PREFILLED if first_from_prefill else replace(PREFILLED, first_chunk=None)
    loop = turn_loop(result, decode)
    observed = []
    loop.planner.observe = lambda turn, decision, fallback, ms: observed.append(ms)

    async def scenario():
        async with loop.turn(_turn()) as run:
            await run.prepare()
            async for _ in run.reply():
                pass
        await loop.drain()

    asyncio.run(scenario())
    [measured_ms] = observed
    assert (measured_ms < decode_s * 1e3) if first_from_prefill else (measured_ms >= decode_s * 1e3)


def test_fakes_and_serve_adapters_implement_the_turn_s_seams():
    from deployments.handles import ServeEngineGroup, ServeIndex

    loop = turn_loop(PREFILLED, DecodeGroup(REPLY))
    assert isinstance(Index(None, Membership()), KVIndexClient) and isinstance(ServeIndex(MagicMock()), KVIndexClient)
    assert isinstance(loop.groups[Role.PREFILL], PrefillGroup)
    assert isinstance(ServeEngineGroup(MagicMock()), PrefillGroup) and isinstance(DecodeGroup(REPLY), EngineGroup)
    assert isinstance(loop.turn(_turn()), TurnRun)


def test_the_engine_plugins_import_without_ray_serve_or_the_app_s_config():
    """vLLM imports them in every engine process: they must not drag in the graph."""
    code = ("import sys, app.engine.idle_poll, app.engine.process, app.engine.nixl_worker, app.engine.scheduler\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'deployments') or m == 'app.config'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
