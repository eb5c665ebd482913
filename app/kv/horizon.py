"""The eviction horizon: how long an idle block survives in a replica's prefix cache under load.

Seed 002's estimate: (P - A) / R, with P the pool's tokens, A the tokens pinned by running
requests and R the rate of newly computed tokens. If it is shorter than users' think time,
later turns miss however good the routing. Fed by the turn loop after each prefill.
"""

from collections import deque


class EvictionHorizon:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._computed: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, replica_id: str, computed_tokens: int, now: float) -> None:
        samples = self._computed.setdefault(replica_id, deque())
        samples.append((now, computed_tokens))
        while samples and samples[0][0] < now - self.window_s:
            samples.popleft()

    def rate(self, replica_id: str, now: float) -> float:
        """Newly computed tokens per second over the window."""
        samples = [n for t, n in self._computed.get(replica_id, ()) if t >= now - self.window_s]
        return sum(samples) / self.window_s

    def estimate_s(self, replica_id: str, pool_tokens: int, pinned_tokens: int, now: float) -> float | None:
        """Seconds an idle block survives; None while nothing is being computed (no eviction)."""
        rate = self.rate(replica_id, now)
        return max(pool_tokens - pinned_tokens, 0) / rate if rate > 0 else None
