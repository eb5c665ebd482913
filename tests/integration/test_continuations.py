"""Decode's continuation of a prompt computed on prefill goes ahead of the prompts waiting on decode
(app/turn/loop.py, CONTINUATION_PRIORITY), on the session's app: real engines, real NIXL."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from app.ops.client import TurnResult, chat_turn
from tests.integration.conftest import SYSTEM_PROMPT, decisions_by_request, reference_ids

pytestmark = pytest.mark.integration
APPENDS = 8
APPEND_TEXT = " ".join(f"clause {i} of the appendix." for i in range(130))
"""About 1,700 tokens: a short append (computed on decode, under the 2,048-token threshold) that
takes four of decode's 512-token steps."""
MAX_TOKENS = 8


def _timed(client: OpenAI, messages: list[dict]) -> tuple[float, TurnResult]:
    """The reply, and when it was sent (perf_counter): its chunks' times are from then."""
    sent_at = time.perf_counter()
    return sent_at, chat_turn(client, messages, MAX_TOKENS)


def test_a_continuation_starts_ahead_of_the_appends_waiting_on_decode(client, http, reference):
    """Eight conversations' long appends queue on decode (about 0.7 s of its steps here). A first
    turn sent just after them is computed on prefill, whose first token the client gets at once;
    decode's continuation then starts when the append in its step is done, not after every append:
    at its turn's priority (first turns behind later turns) its second chunk came 12-30 ms after
    the last append's first token, now 0.35 s before it."""
    histories, firsts = [], []
    for i in range(APPENDS):
        messages = [{"role": "system", "content": f"Conversation {i}. " + SYSTEM_PROMPT},
                    {"role": "user", "content": "Read the appendix."}]
        firsts.append(chat_turn(client, messages, MAX_TOKENS))
        histories.append([*messages, {"role": "assistant", "content": firsts[-1].text},
                          {"role": "user", "content": APPEND_TEXT}])
    # Also waits for the reference engine to be up: its start-up must not share the cores with what is timed.
    assert [t.output_ids for t in firsts] == reference_ids(reference, firsts, MAX_TOKENS)
    newcomer = [{"role": "system", "content": "A newcomer. " + SYSTEM_PROMPT}, {"role": "user", "content": "Hi."}]
    with ThreadPoolExecutor(APPENDS + 1) as pool:
        appends = [pool.submit(_timed, client, messages) for messages in histories]
        time.sleep(0.2)  # the appends are rendered and queued on decode
        continuation = pool.submit(_timed, client, newcomer)
        appended = [a.result() for a in appends]
        sent_at, turn = continuation.result()
    decisions = decisions_by_request(http)
    assert {decisions[t.request_id]["action"] for _, t in appended} == {"prefill_on_decode"}
    assert decisions[turn.request_id]["first_token_from"] == "prefill"
    last_append_first_at = max(at + t.ttft_s for at, t in appended)
    second_at, first_at = sent_at + turn.second_chunk_s, sent_at + turn.ttft_s
    assert turn.second_chunk_s and second_at < last_append_first_at, (
        f"the continuation's second chunk came {second_at - last_append_first_at:+.3f} s after the last append's "
        f"first token (its first token {first_at - last_append_first_at:+.3f} s)")
    turns = [turn] + [t for _, t in appended]
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
