"""What one turn holds, and the one way it lets go: the turn loop fills a TurnLedger as the turn
runs; `settle` turns the ledger into releases and records when the turn ends, however it ends.

    PLANNED ──▶ PREFILLED ──▶ DECODING ──▶ RECORDED
        └───────────┴─────────────┴──────▶ ABORTED     (failure, timeout, client gone)

    holds                            ends RECORDED                 ends ABORTED
    claimed  (retained, taken)       released unless pulled        released unless pulled
    handoff  (prefill's blocks)      released unless decode read   released unless decode read
    retained (decode's new sequence) recorded for the next turn    released
Like vLLM's Scheduler._free_request: every path out of a turn goes through here, and nothing
here decides whether the user gets the reply (the loop runs it after the reply, off its path).
"""

import enum
from dataclasses import dataclass, field
from typing import Any

from app.protocol import KVHandoff, RetainedBlocks, Role


class TurnState(str, enum.Enum):
    PLANNED = "planned"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    RECORDED = "recorded"
    ABORTED = "aborted"


@dataclass
class TurnLedger:
    request_id: str
    state: TurnState = TurnState.PLANNED
    claimed: RetainedBlocks | None = None
    """A retained sequence this turn owns (taken from the index): it extends or supersedes it."""
    claim_confirmed: bool = True
    """False when the claim came from the router's near cache: the index must confirm it (take)
    before a release, so a turn never frees blocks another turn is pulling."""
    pulled: bool = False
    """Prefill read `claimed` (vLLM frees a retained sequence after its read)."""
    handoff: KVHandoff | None = None
    """Prefill's blocks, held for decode."""
    handoff_read: bool = False
    """Decode answered with a first chunk, so it read the handoff (and the owner freed it)."""
    retained: RetainedBlocks | None = None
    """The sequence decode holds for the next turn."""
    prefill_replica_id: str = ""
    hashes: list[bytes] = field(default_factory=list)
    open_stream: Any = None
    """The engine call streaming this turn's reply, if one was started (closing it aborts the request)."""

    def advance(self, state: TurnState) -> None:
        if self.state not in (TurnState.RECORDED, TurnState.ABORTED):
            self.state = state


@dataclass(frozen=True)
class Release:
    """Tell the engine holding `handoff` nobody will read it; `owner` is the role that holds it (any
    replica of the other role can send the notification)."""

    owner: Role
    handoff: KVHandoff
    confirm_key: tuple[str, str] | None = None
    """Take this key from the index first and release only if the take succeeds."""


@dataclass(frozen=True)
class Settlement:
    releases: tuple[Release, ...] = ()
    record_retained: RetainedBlocks | None = None
    record_prefill: bool = False


def settle(ledger: TurnLedger, keep_for_next_turn: bool) -> Settlement:
    """What to free and what to record for a ledger whose turn is over (RECORDED or ABORTED).
    `keep_for_next_turn`: reverse pulls are on for this turn, so decode's sequence is worth keeping."""
    releases = []
    if ledger.claimed is not None and not ledger.pulled:
        key = None if ledger.claim_confirmed else ledger.claimed.key
        releases.append(Release(Role.DECODE, ledger.claimed.handoff, confirm_key=key))
    if ledger.handoff is not None and not ledger.handoff_read:
        releases.append(Release(Role.PREFILL, ledger.handoff))
    recorded = ledger.state == TurnState.RECORDED
    keep = ledger.retained if recorded and keep_for_next_turn else None
    if ledger.retained is not None and keep is None:
        releases.append(Release(Role.DECODE, ledger.retained.handoff))
    return Settlement(releases=tuple(releases), record_retained=keep,
                      record_prefill=recorded and ledger.handoff is not None)
