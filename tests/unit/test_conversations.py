from app.conversations.bounded import RecordBounds
from app.conversations.records import (
    BreakCause,
    ConversationRecord,
    ConversationStore,
    HistoryMatch,
    RenderMode,
    compact,
    diagnose,
    message_chain,
)

SYSTEM = {"role": "system", "content": "s"}
USER1, REPLY1, USER2 = ({"role": "user", "content": "u1"}, {"role": "assistant", "content": "r1"},
                        {"role": "user", "content": "u2"})


def _record(messages, tokens=tuple(range(100)), num_prompt=80, created_at=0.0, tenant="t"):
    return ConversationRecord(token_ids=compact(tokens), num_prompt_tokens=num_prompt,
                              message_keys=tuple(message_chain(tenant, messages)), created_at=created_at, tenant=tenant)


def _bounds(max_records=10, max_bytes=1 << 30, tenant_bytes=None):
    return RecordBounds(ttl_s=60, max_records=max_records, max_bytes=max_bytes,
                        tenant_bytes=max_bytes if tenant_bytes is None else tenant_bytes)


def test_chain_keys_are_scoped_by_tenant_and_extendable():
    chain = message_chain("t", [SYSTEM, USER1, REPLY1])
    assert message_chain("t", [SYSTEM, USER1]) == chain[:2]
    assert message_chain(chain[1], [REPLY1]) == chain[2:]
    assert message_chain("other", [SYSTEM]) != chain[:1]


def test_exact_match_inexact_match_and_expiry():
    store = ConversationStore(_bounds())
    store.put(_record([SYSTEM, USER1, REPLY1]))
    chain = message_chain("t", [SYSTEM, USER1, REPLY1, USER2])
    assert store.match(chain, last_assistant=2, now=1.0).exact
    edited = message_chain("t", [SYSTEM, {"role": "user", "content": "edited"}, REPLY1, USER2])
    match = store.match(edited, last_assistant=2, now=1.0)
    assert not match.exact and match.diverged_at_message == 1
    assert store.match(chain, last_assistant=2, now=61.0).record is None
    assert len(store) == 0


def test_store_is_bounded_and_sessions_find_rewritten_histories():
    store = ConversationStore(_bounds(max_records=2))
    for i in range(3):
        store.put(_record([SYSTEM, {"role": "user", "content": str(i)}, REPLY1]), session_key=f"s{i}")
    assert len(store) == 2
    volatile = message_chain("t", [{"role": "system", "content": "now 12:01"}, {"role": "user", "content": "2"},
                                   REPLY1, USER2])
    match = store.match(volatile, last_assistant=2, session_key="s2", now=1.0)
    assert match.record is not None and match.diverged_at_message == 0


def test_records_cost_four_bytes_a_token_and_the_store_is_bounded_in_bytes():
    record = _record([SYSTEM, USER1, REPLY1], tokens=tuple(range(100_000, 110_000)))
    assert record.nbytes < 4 * 10_000 + 1024
    store = ConversationStore(_bounds(max_bytes=3 * record.nbytes))
    for i in range(5):
        store.put(_record([SYSTEM, {"role": "user", "content": str(i)}, REPLY1], tokens=tuple(range(10_000))))
    assert len(store) == 3 and store.nbytes <= 3 * record.nbytes
    assert store.match(message_chain("t", [SYSTEM, {"role": "user", "content": "4"}, REPLY1, USER2]), 2, now=1.0).exact
    assert not store.match(message_chain("t", [SYSTEM, {"role": "user", "content": "0"}, REPLY1, USER2]), 2,
                           now=1.0).exact, "the oldest went"


def test_a_tenant_past_its_share_of_a_full_store_loses_its_own_oldest_records():
    size = _record([SYSTEM, USER1, REPLY1]).nbytes
    store = ConversationStore(_bounds(max_bytes=10 * size, tenant_bytes=4 * size))
    quiet = _record([SYSTEM, USER1, REPLY1], tenant="quiet")
    store.put(quiet)
    for i in range(20):
        store.put(_record([SYSTEM, {"role": "user", "content": str(i)}, REPLY1], tenant="loud"))
    assert store.match(list(quiet.message_keys) + ["next"], 2, now=1.0).exact, "the other tenant's record stays"
    assert len(store) == 10 and store.nbytes == 10 * size, "while there is room, a tenant may use it"


def test_diagnose_names_the_cause():
    record = _record([SYSTEM, USER1, REPLY1])
    exact = HistoryMatch(record=record, exact=True)
    full = list(range(100)) + [7, 7]
    assert diagnose(full, exact, RenderMode.PRESERVE, 32, 3, False).cause == BreakCause.NONE
    rewrite = diagnose(list(range(70)) + [5] * 40, exact, RenderMode.TEMPLATE, 32, 3, False)
    assert (rewrite.cause, rewrite.shared_tokens, rewrite.reusable_blocks) == (BreakCause.TEMPLATE_REWRITE, 70, 2)
    assert diagnose(list(range(90)) + [5], exact, RenderMode.TEMPLATE, 32, 3, False).cause == \
        BreakCause.RETOKENIZATION_DRIFT
    assert diagnose(list(range(90)) + [5], exact, RenderMode.TEMPLATE, 32, 3, True).cause == \
        BreakCause.REASONING_STRIPPED
    edited = HistoryMatch(record=record, exact=False, diverged_at_message=1)
    assert diagnose(list(range(10)), edited, RenderMode.PRESERVE, 32, 3, False).cause == BreakCause.EDITED_HISTORY
    assert diagnose(list(range(10)), edited, RenderMode.PRESERVE, 32, 1, False).cause == BreakCause.TRUNCATION
    none = diagnose([1, 2], HistoryMatch(record=None, exact=False), RenderMode.PRESERVE, 32, 0, False)
    assert none.cause == BreakCause.NO_RECORD and none.previous_tokens == 0
