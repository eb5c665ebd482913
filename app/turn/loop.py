"""The turn loop: what a router's turns share. It makes each turn (`async with loop.turn(spec)`,
app/turn/turn.py), keeps the live view of engines and the near cache of retained sequences, holds the
engine calls (app/turn/reply.py EngineCalls), and settles each turn when it exits.

    TurnRun exit ──settle()──▶ ledger ──▶ Settlement ──▶ kv_index.record_turn, releases   (off the reply's path)
Degraded, never down: no live decode replica ──▶ the whole turn on a prefill engine; no live prefill
replica ──▶ on a decode engine; an engine that dies mid-reply ──▶ the reply continues on another engine
from the prompt plus the tokens already sent (greedy replies stay token-exact). A request an engine
refuses itself (vLLM's checks; the engine lives on) is the client's error: no engine is suspected and
none is tried next (app/turn/reply.py refusal).
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from typing import Any

from app.config import AppConfig
from app.kv.index import KVIndex
from app.metrics import TurnMetrics
from app.protocol import Membership, RetainedBlocks, Role, TurnRecords
from app.turn.journal import TurnJournal
from app.turn.ledger import Release, Settlement, TurnState, settle
from app.turn.membership import LiveEngines, QuietPoll
from app.turn.planner import Planner
from app.turn.reply import EngineCalls
from app.turn.seams import EngineGroup, KVIndexClient, PrefillGroup
from app.turn.spec import Turn
from app.turn.turn import TurnRun

logger = logging.getLogger("ray.serve")


class TurnLoop:
    def __init__(self, config: AppConfig, index: KVIndexClient, prefill: PrefillGroup, decode: EngineGroup,
                 metrics: TurnMetrics, replica_id: str = "") -> None:
        """`replica_id`: the router replica this loop runs in, named in its decision log."""
        self.config, self.limits = config, config.limits
        self.index = index
        self.metrics = metrics
        self.journal = TurnJournal(config.block_size, metrics, self.limits.decision_log_entries, replica_id)
        self.engines = LiveEngines(self.limits.suspect_replica_s)
        self.calls = EngineCalls({Role.PREFILL: prefill, Role.DECODE: decode}, self.engines, self.limits, metrics)
        self.groups = self.calls.groups
        self.planner = Planner(config, self.engines, self.journal)
        self.own_retained = KVIndex.of(config)
        """The retained sequences this router recorded in the index, as a near cache: a short append
        to one of them goes to decode without an index call. Stale entries cost speed, never
        correctness: decode's prefix cache checks every block by hash."""
        self._own_expired_at = 0.0
        self._tasks: set[asyncio.Task] = set()

    def turn(self, turn: Turn) -> TurnRun:
        return TurnRun(self, turn)

    @property
    def decisions(self):
        return self.journal.decisions

    # ---- the KV index: bounded calls, never fatal to a turn ----------------------------------------
    async def bookkeep(self, call: Awaitable, what: str, timeout_s: float | None = None) -> Any:
        """The call's answer, or None when the index (or a release's engine) is unreachable or slow."""
        try:
            return await asyncio.wait_for(call, timeout_s or self.limits.bookkeeping_timeout_s)
        except Exception as exc:  # noqa: BLE001 - bookkeeping never decides whether the user gets a reply
            logger.warning(json.dumps({"event": "bookkeeping_failed", "call": what,
                                       "error": f"{type(exc).__name__}: {exc}"[:300]}))
            self.metrics.record_bookkeeping_failure(what)
            return None

    async def follow_membership(self) -> None:
        """Keep the live view of engines current (the index's heartbeats) and hand the turn metrics
        to Ray; runs for the router's life."""
        poll = QuietPoll.of(self.limits)
        while True:
            members = await self.refresh_membership()
            self.metrics.flush()
            await asyncio.sleep(poll.wait_after(members))

    async def refresh_membership(self, timeout_s: float | None = None) -> Membership | None:
        """`timeout_s`: longer than a bookkeeping call's for a new router replica's first ask, whose
        call also resolves where the index runs: a turn planned before the answer finds neither its
        conversation's record nor its retained KV, so it recomputes."""
        if (members := await self.bookkeep(self.index.membership(), "index.membership", timeout_s)) is not None:
            self.engines.update(members)
        return members

    async def live(self) -> tuple[list[str], list[str]]:
        """The live prefill and decode replicas; a group with none is asked about again first (its
        engines may have just started)."""
        if not self.engines.live(Role.PREFILL) or not self.engines.live(Role.DECODE):
            await self.refresh_membership()
        return self.planner.live()

    def spawn(self, coro: Awaitable, what: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the bookkeeping still running (tests; a router shutting down)."""
        await asyncio.gather(*[t for t in self._tasks if t.get_name() != "membership"])

    # ---- settlement: the one way out of a turn -------------------------------------------------------
    def settle(self, run: TurnRun) -> None:
        """Settle what the turn's ledger holds, and record its conversation with it, before the client
        sees the end of the reply. The near cache learns the retained sequence at once and the index
        call leaves now, so the client's next turn finds them; a failed release or record is logged
        and counted, never the user's error."""
        ledger, turn = run.ledger, run.turn
        ledger.advance(TurnState.ABORTED)
        if ledger.open_stream is not None:
            ledger.open_stream.close()
        settlement = settle(ledger, turn.reverse_pull)
        retained, hashes = settlement.record_retained, ()
        if retained is not None:
            hashes = self._remember(turn.cache_salt, retained)
        records = TurnRecords(turn.cache_salt, retained, hashes, ledger.prefill_replica_id,
                              tuple(ledger.hashes) if settlement.record_prefill else (), run.conversation,
                              run.session_key,
                              tuple(r.confirm_key for r in settlement.releases if r.confirm_key is not None))
        self.spawn(self._apply(records, settlement), "settle")

    async def _apply(self, records: TurnRecords, settlement: Settlement) -> None:
        taken = (await self.bookkeep(self.index.record_turn(records), "index.record_turn") or ()) if records else ()
        for release in settlement.releases:
            # A claim the index did not hand over belongs to another turn (it may be pulling it now).
            if release.confirm_key is None or release.confirm_key in taken:
                await self._release(release)

    async def _release(self, release: Release) -> None:
        sender = Role.PREFILL if release.owner == Role.DECODE else Role.DECODE
        if not self.engines.live(sender):  # nobody to send the notification: the owner's TTL frees it
            self.metrics.record_bookkeeping_failure("release.no_sender")
            return
        await self.bookkeep(self.groups[sender].release(release.handoff), "release")

    def _remember(self, salt: str, retained: RetainedBlocks) -> tuple[bytes, ...]:
        """Put `retained` in the near cache; its block hashes."""
        now = time.time()
        if now - self._own_expired_at > self.limits.own_retained_sweep_s:  # lookups skip expired ones meanwhile
            self.own_retained.expire(now)
            self._own_expired_at = now
        hashes = self.own_retained.retained_hashes(salt, retained)
        self.own_retained.record_retained(salt, retained, hashes)
        return tuple(hashes)
