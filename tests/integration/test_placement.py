"""Load-aware placement through the real app: each turn's prompt goes to the side estimated to
answer sooner, from the engines' measured costs and the live load, and the tokens stay right."""

from concurrent.futures import ThreadPoolExecutor

from tests.integration.conftest import SYSTEM_PROMPT, USER_TURNS, decisions_by_request, reference_ids, run_conversation

CONVERSATIONS = 8
MAX_TOKENS = 16


def test_conversations_at_once_are_placed_by_estimates_from_measured_costs(client, http, reference):
    """Eight conversations arrive together. Every placed decision names both sides' estimates, from
    costs the engines measured and with the load the router saw (queued tokens, decode's running
    streams and its step time), and went to the smaller one; the tokens match the oracle wherever they were computed.
    Which side wins depends on this machine's load at the time (unit tests pin the spreading down:
    tests/unit/test_placement.py)."""

    def converse(i: int):
        return run_conversation(client, f"[placed {i}] {SYSTEM_PROMPT} {SYSTEM_PROMPT}", USER_TURNS[:2],
                                MAX_TOKENS, load_aware_placement=True)

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        conversations = list(pool.map(converse, range(CONVERSATIONS)))
    decisions = decisions_by_request(http)
    placed = [decisions[t.request_id] for turns in conversations for t in turns]
    for d in placed:
        sides = d["placement"]
        assert sides is not None, d
        assert sides["prefill_compute_us_per_token"] > 0 and sides["decode_compute_us_per_token"] > 0
        assert (d["action"] == "prefill_on_decode") == (
            sides["on_decode_ms"] + sides["decode_stall_ms"] < sides["on_prefill_ms"]), d
    seen_load = [d["placement"]["prefill_queued_tokens"] + d["placement"]["decode_queued_tokens"]
                 + d["placement"]["decode_running"] for d in placed]
    assert max(seen_load) > 0, "eight conversations at once, and no estimate saw another one's load"
    assert max(d["placement"]["decode_step_ms"] for d in placed) > 0, "no estimate saw decode's steps"
    for turns in conversations:
        assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
