"""Engine replicas, as the KV index and the router see them: identity, endpoint, heartbeat and load."""

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class EngineEndpoint:
    """Where an engine's KV can be read over NIXL: its identity and side channel."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1


@dataclass(frozen=True)
class LoadReport:
    """An engine's load and measured costs, as its last heartbeat carried them (vLLM's own stats)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    compute_s_per_token: float = 0.0
    """Seconds per prompt token computed: a probe at start-up, then prefills that ran alone (0: unknown)."""
    pull_s_per_token: float = 0.0
    """Seconds per token of KV read over NIXL by this engine, from its transfers (0: none yet)."""
    step_s: float = 0.0
    """Wall time of the engine's recent steps while it had requests running (smoothed; 0: none yet)."""
    nixl_backends: tuple[str, ...] = ()
    """The NIXL backends the engine moves KV over, those its pull cost is measured on. Here because the
    load is what the index passes on to routers from each heartbeat: /health lists it per engine."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What an engine replica tells the KV index when it starts, and with each heartbeat."""

    replica_id: str
    role: Role
    endpoint: EngineEndpoint
    prefix_caching: bool
    block_size: int
    load: LoadReport = LoadReport()


@dataclass(frozen=True)
class KVEvents:
    """A prefill replica's KV cache events, reduced to block hashes (app/kv/events.py): vLLM's own
    carry the prompt's token ids and the tenant's cache salt, which never leave the replica's node."""

    STORED: ClassVar[str] = "stored"
    REMOVED: ClassVar[str] = "removed"
    CLEARED: ClassVar[str] = "cleared"

    replica_id: str
    events: tuple[tuple[str, tuple[bytes, ...]], ...] = ()
    """(kind, block hashes) in the engine's order, which decides what is held: a batch can store a
    block and remove it again, or remove it and store it again. CLEARED carries no hashes."""


@dataclass(frozen=True)
class Membership:
    """The engine replicas whose heartbeats are current, by role."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    loads: Mapping[str, LoadReport] = field(default_factory=dict)
    settled: bool = True
    """False from an index younger than one registration TTL: a live engine may not have renewed
    with it yet, so a replica missing from this answer is not known to be gone."""

    def of(self, role: Role) -> tuple[str, ...]:
        return self.prefill if role == Role.PREFILL else self.decode

    def union(self, older: "Membership") -> "Membership":
        """This answer plus the replicas only `older` knew (with their last load)."""
        return Membership(prefill=tuple(dict.fromkeys(self.prefill + older.prefill)),
                          decode=tuple(dict.fromkeys(self.decode + older.decode)),
                          loads={**older.loads, **self.loads}, settled=self.settled)


@dataclass(frozen=True)
class EngineStatus:
    """One engine replica as it reports itself (fault tooling, tests, benchmarks)."""

    replica_id: str
    role: Role
    alive: bool
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    """vLLM's own share of the KV pool in use, from its last step."""
    pool_blocks: int
    kept_blocks: int
    """Blocks held for next turns (decode's retained sequences that no later turn took)."""
    kept_released: int
    """Sequences held for next turns that decode released before their TTL, under pool pressure."""
    engine_pids: tuple[int, ...]
    """The vLLM engine-core processes (what a SIGKILL fault kills)."""
