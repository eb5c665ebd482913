"""The router's view of which engine replicas can take work.

kv_index.membership (engine heartbeats) ──update──▶ LiveEngines ◀──suspect── a failed call
LiveEngines.live(role), .load(replica) ──▶ the turn loop's choices (placement, degraded modes)
The last membership is kept while the index is unreachable, and merged into a restarted index's
answers until every live engine has renewed with it: engines outlive an index restart.
"""

import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from app.config.limits import Limits
from app.protocol import LoadReport, Membership, Role


class LiveEngines:
    def __init__(self, suspect_s: float) -> None:
        self.suspect_s = suspect_s
        self.members = Membership()
        self.known = False
        """A membership has been received at least once (before that the engines are starting)."""
        self._suspects: dict[str, float] = {}
        self.streams: Counter[str] = Counter()
        """Streams this router has open on each replica: its load, as this router sees it."""

    def update(self, members: Membership) -> None:
        """A dead engine in the merged view still fails its first call and is routed around."""
        self.members = members if members.settled or not self.known else members.union(self.members)
        self.known = True

    def load(self, replica_id: str) -> LoadReport:
        """The replica's load and costs as of its last heartbeat the index passed on, running at
        least the streams this router has open on it: a burst of turns placed between two
        heartbeats would otherwise all see the load from before the burst, pile onto the side that
        looks idle and queue there."""
        load = self.members.loads.get(replica_id) or LoadReport()
        streams = self.streams[replica_id]
        return load if streams <= load.num_running_reqs else replace(load, num_running_reqs=streams)

    def suspect(self, replica_id: str, now: float | None = None) -> None:
        """A call to the replica failed: route around it for a while (its heartbeat may lag)."""
        if replica_id:
            self._suspects[replica_id] = (time.monotonic() if now is None else now) + self.suspect_s

    def live(self, role: Role, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [r for r in self.members.of(role) if self._suspects.get(r, 0.0) <= now]

    def gone(self, role: Role, replica_id: str) -> bool:
        """A named replica is no longer live: a call waiting on it should be abandoned."""
        return bool(replica_id) and replica_id not in self.live(role)

    def pick(self, role: Role, preferred: str = "") -> str | None:
        """The preferred replica if live, else the live one with the fewest open streams."""
        live = self.live(role)
        if preferred in live:
            return preferred
        return min(live, key=lambda r: self.streams[r], default=None)


@dataclass
class QuietPoll:
    """The wait before asking again for an answer that mostly repeats: `busy_s` after one that
    changed, `quiet_s` after one that repeated (an idle app's loads and health repeat)."""

    busy_s: float
    quiet_s: float
    last: Any = None

    def wait_after(self, answer: Any) -> float:
        changed, self.last = answer != self.last, answer
        return self.busy_s if changed else self.quiet_s

    @classmethod
    def of(cls, limits: Limits) -> "QuietPoll":
        return cls(limits.heartbeat_interval_s, limits.quiet_poll_interval_s)
