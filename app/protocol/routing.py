"""A turn's plan: what the index knows about its prompt, and the decision the router takes from it."""

import enum
from dataclasses import dataclass, field

from app.protocol.kv import KVHandoff, RetainedBlocks


@dataclass(frozen=True)
class Estimate:
    """Both sides' estimated time to the first token, what decode's streams would pay, and the
    inputs (the decision log's record)."""

    on_prefill_ms: float
    on_decode_ms: float
    prefill_queued_tokens: int
    decode_queued_tokens: int
    decode_running: int
    decode_kv_usage: float
    prefill_compute_us_per_token: float
    decode_compute_us_per_token: float
    pull_us_per_token: float
    prefill_residual_ms: float = 0.0
    """What calibration against measured turns added to the formula's estimate (app/turn/placement.py)."""
    decode_residual_ms: float = 0.0
    decode_stall_ms: float = 0.0
    """The stall computing the prompt on decode puts on its running streams, weighted (itl_weight).
    A cost, not a time to the first token: it is charged after calibration, which would otherwise
    fit it away as error (app/turn/placement.py)."""
    prefill_step_ms: float = 0.0
    decode_step_ms: float = 0.0
    """Each side's recent step time, if it has requests running (0: idle): what the estimate charges
    for the step in flight and the batch the prompt joins."""
    decode_read_ms: float = 0.0
    """On the prefill side, for a reply whose first token decode samples (its sampling reads the
    reply: a tool call's grammar, penalties): decode's read of the prompt's KV and its step."""

    @property
    def decode_cost_ms(self) -> float:
        return self.on_decode_ms + self.decode_stall_ms

    @property
    def decode_wins(self) -> bool:
        return self.decode_cost_ms < self.on_prefill_ms


class Action(str, enum.Enum):
    PULL = "pull"
    RECOMPUTE = "recompute"
    PREFILL_ON_DECODE = "prefill_on_decode"
    """The whole turn runs on a decode replica: the one that retains the conversation (no prefill
    hop), or any live one when no prefill replica is."""
    RUN_ON_PREFILL = "run_on_prefill"
    """No decode replica is live: the whole turn runs on a prefill engine (a full vLLM engine)."""


class Reason(str, enum.Enum):
    PULL_SAVES_TOKENS = "pull_saves_tokens"
    LOCAL_AT_RISK = "local_at_risk"
    """Pulled although prefill should hold most of it: its pool evicts faster than the horizon."""
    PULL_DISABLED = "pull_disabled"
    NOTHING_RETAINED = "nothing_retained"
    INDEX_UNREACHABLE = "index_unreachable"
    """The KV index did not answer the lookup in time: nothing retained is known, so the turn recomputes."""
    BELOW_THRESHOLD = "below_threshold"
    EXPIRES_TOO_SOON = "expires_too_soon"
    PULL_FAILED = "pull_failed"
    SHORT_APPEND = "short_append"
    """Decode retains the conversation and gives the first token sooner than prefill would."""
    DECODE_SOONER = "decode_sooner"
    """Nothing retained (a first turn): a decode replica gives the first token sooner than prefill."""
    DECODE_FAILED = "prefill_on_decode_failed"
    ENGINE_FAILED = "engine_failed"
    """The planned engine failed; another replica recomputes the turn."""
    NO_PREFILL_ALIVE = "no_prefill_alive"
    NO_DECODE_ALIVE = "no_decode_alive"


@dataclass(frozen=True)
class RetainedMatch:
    """A retained sequence whose leading blocks match the prompt's block hashes."""

    retained: RetainedBlocks
    matched_blocks: int


@dataclass(frozen=True)
class PrefixLookup:
    """The index's answer for one prompt: cached leading tokens per prefill replica, and the
    retained decode sequence sharing the longest prefix, if any."""

    prefill_cached_tokens: dict[str, int] = field(default_factory=dict)
    """Leading tokens each registered prefill replica is believed to hold (0 for most)."""
    retained: RetainedMatch | None = None
    taken: bool = False
    """The index took `retained` for the caller, who named it (KVIndex.lookup's `take`)."""


@dataclass(frozen=True)
class RoutingDecision:
    prefill_replica_id: str
    action: Action
    reason: Reason
    tokens_local: int
    tokens_pullable: int
    threshold: int
    expires_in_s: float | None = None
    pull: KVHandoff | None = None
    """The decode blocks to read, cut to the full blocks inside the common prefix."""
    retained: RetainedBlocks | None = None
    """The retained sequence considered, pulled or not (so the router can release it)."""
    decode_replica_id: str = ""
    """For a prompt computed on decode with nothing retained: the decode replica placement chose."""
    placement: Estimate | None = None
    """Both sides' estimated time to first token, when placement weighed them."""

    @property
    def pulled_tokens(self) -> int:
        """Tokens this decision reads from decode instead of computing (0 when it recomputes)."""
        return self.tokens_pullable - self.tokens_local if self.action == Action.PULL else 0
