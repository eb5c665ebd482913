"""A turn's one way out: what `settle` frees and records for every way a turn can end."""

import pytest

from app.protocol import Role
from app.turn.ledger import Release, TurnLedger, TurnState, settle
from tests.factories import handoff, retained

CLAIMED = retained(list(range(96)), 2000.0, request_id="old")
NEXT = retained(list(range(140)), 2000.0, request_id="new")
HANDOFF = handoff(120, 0.0, name="prefill-0", request_id="p")


def _ledger(state: TurnState, **held) -> TurnLedger:
    ledger = TurnLedger("t", **held)
    ledger.state = state
    return ledger


def test_a_recorded_turn_keeps_decode_s_sequence_and_frees_what_nobody_reads():
    ledger = _ledger(TurnState.RECORDED, claimed=CLAIMED, pulled=True, handoff=HANDOFF, handoff_read=True,
                     retained=NEXT)
    assert settle(ledger, keep_for_next_turn=True).releases == ()
    assert settle(ledger, keep_for_next_turn=True).record_retained == NEXT
    assert settle(ledger, keep_for_next_turn=True).record_prefill


def test_a_superseded_sequence_is_released_at_once():
    ledger = _ledger(TurnState.RECORDED, claimed=CLAIMED, pulled=False, retained=NEXT)
    assert settle(ledger, True).releases == (Release(Role.DECODE, CLAIMED.handoff),)


def test_a_near_cache_claim_is_confirmed_in_the_index_before_its_release():
    ledger = _ledger(TurnState.RECORDED, claimed=CLAIMED, claim_confirmed=False, retained=NEXT)
    assert settle(ledger, True).releases[0].confirm_key == ("d0", "old")


@pytest.mark.parametrize("state", [TurnState.PLANNED, TurnState.PREFILLED, TurnState.DECODING, TurnState.ABORTED])
def test_an_aborted_turn_releases_everything_it_held_and_records_nothing(state):
    ledger = _ledger(state, claimed=CLAIMED, handoff=HANDOFF, retained=NEXT)
    ledger.advance(TurnState.ABORTED)
    settlement = settle(ledger, True)
    assert settlement.releases == (Release(Role.DECODE, CLAIMED.handoff), Release(Role.PREFILL, HANDOFF),
                                   Release(Role.DECODE, NEXT.handoff))
    assert settlement.record_retained is None and not settlement.record_prefill


def test_without_reverse_pulls_decode_s_sequence_is_released_not_kept():
    ledger = _ledger(TurnState.RECORDED, retained=NEXT, handoff=HANDOFF, handoff_read=True)
    settlement = settle(ledger, keep_for_next_turn=False)
    assert settlement.releases == (Release(Role.DECODE, NEXT.handoff),) and settlement.record_retained is None


def test_an_ended_turn_does_not_change_state_again():
    ledger = _ledger(TurnState.RECORDED)
    ledger.advance(TurnState.ABORTED)
    assert ledger.state == TurnState.RECORDED
