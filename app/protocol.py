"""Every message that crosses a deployment boundary, defined once.

frontend ──ClientRequest(validated body, credentials, Resume?)──▶ router ──ReplyStart, ReplyChunk…──▶ frontend
router ──PrefillRequest──▶ prefill ──PrefillResult(KVHandoff, first ReplyChunk)──▶ router
router ──DecodeRequest(KVHandoff)──▶ decode ──ReplyChunk…, last one with RetainedBlocks──▶ router
router ──DecodeRequest(no handoff: a short append)──▶ decode ──ReplyChunk…──▶ router
router ──RetainedBlocks / prefill hashes──▶ kv_index ──PrefixLookup──▶ router
engine replicas ──ReplicaInfo (heartbeat)──▶ kv_index ──Membership──▶ router
prefill ──KVEvents (its engine's KV cache events, block hashes only)──▶ kv_index
No live decode replica: router ──DecodeRequest(no handoff)──▶ prefill, which streams the whole turn.
"""

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


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


@dataclass(frozen=True)
class KVHandoff:
    """KV blocks one engine holds for another to read: prefill→decode, or decode→next prefill."""

    source: EngineEndpoint
    block_ids: tuple[tuple[int, ...], ...]
    """One tuple of block ids per KV-cache group, as vLLM lays them out."""
    num_tokens: int
    request_id: str
    """The engine's id of the request that owns the blocks; the reader's notification frees them."""
    expiry_time: float = 0.0
    """Unix time after which the owner may free the blocks (0: until read)."""
    engine_expiry: float | None = None
    """The same deadline on the owner's monotonic clock, as the engine reads it."""

    def prefix(self, num_tokens: int, block_size: int) -> "KVHandoff":
        """The same blocks cut to those holding the first `num_tokens` tokens."""
        num_blocks = -(-num_tokens // block_size)
        return replace(self, block_ids=tuple(group[:num_blocks] for group in self.block_ids),
                       num_tokens=min(num_tokens, self.num_tokens))


TokenLogprobs = tuple[tuple[int, float, int, str | None], ...]
"""One generated token's candidates as vLLM returns them, the sampled token first: (token id,
logprob, rank, decoded text)."""


@dataclass(frozen=True)
class SamplingSettings:
    """A reply's vLLM SamplingParams as they cross deployments (app/engine/adapter.py sampling_params builds
    them); vLLM's defaults, and its names, for what the client did not set."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1): every token is a candidate."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    regex: str | None = None
    """Structured output: the reply must match this regular expression."""
    json_schema: str | None = None
    """Structured output: the reply is JSON of this schema (JSON text; response_format json_schema)."""
    json_object: bool = False
    """Structured output: the reply is a JSON object (response_format json_object)."""
    structural_tag: str | None = None
    """Structured output: vLLM's structural tag (JSON text), as its tool parser builds it for a
    `required` or named tool choice."""
    min_tokens: int = 0
    """Like max_tokens, counts the whole reply: `after` takes off what an earlier engine generated."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Over prompt and reply alike: the same wherever the reply's first tokens were generated."""
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[str, float], ...] = ()
    """(token id as the client wrote it, bias): vLLM converts and clamps them."""
    allowed_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    """Candidates returned with each generated token besides the sampled one (-1: the whole
    vocabulary); None: no log probabilities."""

    @property
    def reads_reply(self) -> bool:
        """Whether sampling depends on the reply's tokens so far, not just on their number: a
        grammar's state; presence and frequency penalties, which vLLM counts over generated tokens
        only; bad words, matched against the last generated ones. Such a reply is generated by one
        engine from its first token: decode continuing after prefill's first token, or an engine
        taking over a reply after another's death, would see the earlier tokens as prompt."""
        return bool(self.grammar or self.presence_penalty or self.frequency_penalty or self.bad_words)

    @property
    def grammar(self) -> bool:
        return bool(self.regex or self.json_schema or self.json_object or self.structural_tag)

    def after(self, generated: int) -> "SamplingSettings":
        """The settings for the rest of a reply of which `generated` tokens exist elsewhere."""
        return replace(self, max_tokens=self.max_tokens - generated,
                       min_tokens=max(self.min_tokens - generated, 0))


@dataclass(frozen=True)
class RetainedBlocks:
    """Block metadata of a finished sequence that a decode replica keeps for the next turn."""

    replica_id: str
    handoff: KVHandoff
    token_ids: tuple[int, ...]
    """The tokens the retained blocks hold: prompt plus generated, minus the last sampled one."""
    num_prompt_tokens: int
    tenant: str = ""
    """Whose share of decode's retained KV the blocks count against."""
    paused_until: float = 0.0
    """Unix time until which the sequence waits out a tool's run: decode's trimming takes it last."""


@dataclass(frozen=True)
class TurnRecords:
    """What a finished turn tells the KV index, in one call after the reply: the sequence decode
    retains (with the block hashes the router already computed), the blocks prefill computed, the
    conversation record, and the retained sequences to take before the router releases them. One
    call instead of four: each Serve call cost both ends CPU."""

    cache_salt: str
    retained: RetainedBlocks | None = None
    retained_hashes: tuple[bytes, ...] = ()
    prefill_replica_id: str = ""
    prefill_hashes: tuple[bytes, ...] = ()
    conversation: Any = None
    """The turn's app.conversations.records.ConversationRecord, for a chat turn."""
    session_key: str | None = None
    take_keys: tuple[tuple[str, str], ...] = ()
    """(replica id, request id) of sequences this turn claimed without taking them (a near-cache
    claim, a superseded one): the index takes each after recording, and the router releases only
    those it took."""

    def __bool__(self) -> bool:
        return (self.retained is not None or bool(self.prefill_hashes) or self.conversation is not None
                or bool(self.take_keys))


@dataclass(frozen=True)
class EngineTiming:
    """Where a request's time to its first token went inside the engine replica (vLLM's request
    stats), in ms. vLLM adds a new request between two steps and runs a later turn ahead of
    waiting first turns but not of a chunk already running, so `admit_ms` is about the rest of
    the step in flight and `step_ms` the step (or chunks) that computed the prompt."""

    admit_ms: float
    """From the replica's call to the engine's scheduler queue."""
    queued_ms: float
    """In the scheduler's queue: behind other requests, or reading its KV over NIXL."""
    step_ms: float
    """From the first step that scheduled it to its first token."""
    deliver_ms: float
    """From the engine's first token to the replica's handler."""


@dataclass(frozen=True)
class ReplyChunk:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    retained: RetainedBlocks | None = None
    """Set on the final chunk only."""
    num_cached_tokens: int | None = None
    """Prompt tokens the engine found in its prefix cache; set when decode computed the prompt."""
    engine_timing: EngineTiming | None = None
    """Set on the first chunk when decode computed the prompt."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """One entry per token, when the request asked for log probabilities."""


@dataclass(frozen=True)
class Resume:
    """A reply whose router replica died mid-stream, as the frontend saw it: the next router
    replica computes the rest from the prompt plus the tokens already sent, and records it whole."""

    prompt_token_ids: tuple[int, ...]
    sent_token_ids: tuple[int, ...]
    sent_text: str
    cached_tokens: int


@dataclass(frozen=True)
class ClientRequest:
    """One HTTP request as the frontend validated it; the router authenticates and renders it."""

    body: Any
    """app.conversations.openai_api.ChatCompletionRequest or CompletionRequest (pydantic, validated)."""
    authorization: str | None = None
    session_id: str | None = None
    resume: Resume | None = None


@dataclass(frozen=True)
class StoredResponse:
    """A stored response of /v1/responses (app/conversations/responses.py): its conversation as chat messages,
    the reply included; the KV index keeps it for `previous_response_id`."""

    response_id: str
    tenant: str
    messages: tuple[dict[str, Any], ...]
    created_at: float
    nbytes: int


@dataclass(frozen=True)
class ReplyStart:
    """The router's first item of a reply, once its prompt is computed: what the response needs
    besides the tokens."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cached_tokens: int
    max_tokens: int = 16
    """The reply's length bound as the router resolved it (the request's, else the context's room)."""
    movable: bool = True
    """False when the reply's sampling reads the reply so far (SamplingSettings.reads_reply): it
    cannot move to another router replica mid-reply."""


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str
    target_replica_id: str
    """The replica the router chose; the Serve request router sends the call there."""
    pull: KVHandoff | None = None
    """Blocks to read from a decode replica instead of computing them (router-chosen, never client)."""
    first_token: SamplingSettings | None = None
    """The turn's sampling settings: prefill samples the turn's first token with them. None:
    prefill samples one greedy token nobody sees and decode samples the first token."""
    priority: int = 0
    """vLLM's scheduling priority (lower first): later turns ahead of first turns (app/turn/loop.py)."""


@dataclass(frozen=True)
class PrefillResult:
    """Where the turn's prompt KV was computed, and its first token. Computed on decode (a short
    append), there is no handoff: the decode replica streams the rest of the reply itself."""

    replica_id: str
    handoff: KVHandoff | None
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens prefill did not compute: local prefix-cache hits plus pulled tokens."""
    pool_tokens: int = 0
    """Tokens the replica's KV pool holds (for the eviction-horizon estimate)."""
    first_chunk: ReplyChunk | None = None
    """The turn's first token, for the client now; decode continues from prompt + this token, whose
    KV the handoff holds. Its finish_reason is set when the turn ends with it. Computed on decode:
    the first chunk of decode's reply, which goes on streaming."""
    engine_timing: EngineTiming | None = None
    """The prompt's way through the engine that computed it (None where vLLM gave no stats)."""


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str
    sampling: SamplingSettings
    handoff: KVHandoff | None
    """Prefill's blocks to read. None: the engine computes the prompt itself (a short append to the
    conversation it retains, whose blocks its prefix cache serves; or a turn moved off a dead engine)."""
    target_replica_id: str = ""
    """The replica the router chose (the one retaining the conversation, else the least busy)."""
    retain: bool = True
    """Hold the finished sequence's blocks for the next turn's pull (False: free them at the end)."""
    priority: int = 0
    """vLLM's scheduling priority (lower first): later turns ahead of first turns (app/turn/loop.py)."""
    tenant: str = ""
    """Whose share of decode's retained KV the finished sequence counts against."""
    tool_pause_s: float = 0.0
    """The reply may end in tool calls (the request offers tools): its retained sequence waits out
    the tool's run this long ahead of others (AppConfig.tool_pause_s)."""


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
