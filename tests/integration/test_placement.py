"""Load-aware placement through the real app: each turn's prompt goes to the side estimated to
answer sooner, from the engines' measured costs and the live load, and the tokens stay right."""

from concurrent.futures import ThreadPoolExecutor

from tests.integration.conftest import SYSTEM_PROMPT, USER_TURNS, decisions_by_request, reference_ids, run_conversation

CONVERSATIONS = 8
MAX_TOKENS = 16


def test_conversations_at_once_are_spread_over_both_groups_by_estimate(client, http, reference):
    """Eight first turns arrive together: as the router's queued tokens on one side grow, the other
    side's estimate wins, so both groups compute prompts. Every placed decision names both sides'
    estimates from costs the engines measured, and went to the smaller one."""

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
        assert (d["action"] == "prefill_on_decode") == (sides["on_decode_ms"] < sides["on_prefill_ms"]), d
    first_actions = {decisions[turns[0].request_id]["action"] for turns in conversations}
    assert first_actions == {"recompute", "prefill_on_decode"}, first_actions
    for turns in conversations:
        assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
