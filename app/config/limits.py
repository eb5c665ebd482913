"""Every concurrency cap, queue bound, timeout, TTL and retry count of the serving path.

Serve's defaults (5 ongoing requests per replica, unbounded queues) would queue a busy service
silently; these bound it and answer overload with 503 + Retry-After instead. A limit that follows
from others is a property (`router_holds`, `index_sweep_interval_s`) or a checked relation.
"""

from pydantic import model_validator

from app.config.types import Count, Delay, Natural, Seconds, Share, refuse, section


@section
class Limits:
    # ---- admission: how much each deployment takes at once, and how much waits ----
    router_max_ongoing_requests: Count = 256
    """Requests one router replica serves at once. A stream holds its slot until [DONE], so this is
    the conversations in flight per router replica: higher admits more, each waiting on the engines."""
    router_max_queued_requests: Count = 512
    """Requests one frontend replica holds waiting for a router slot; past ongoing plus queued it
    answers 503 + Retry-After. Higher absorbs longer bursts, as added time to first token."""
    engine_max_ongoing_requests: Count = 128
    """Calls one engine replica takes at once (prefill calls, decode streams); vLLM queues inside.
    At least engine_max_num_seqs, or the engine's batch is never full."""
    engine_max_queued_requests: Count = 512
    """Calls waiting for an engine replica slot before the router's call is refused and retried
    elsewhere: higher waits longer on one replica before trying another."""
    index_max_ongoing_requests: Count = 1024
    """Concurrent calls to the KV index actor, each a short in-memory lookup or record."""
    index_max_queued_requests: Count = 2048
    """Calls waiting for the KV index before new ones are refused; a refused caller goes on without
    the answer (a recompute instead of a pull), as when the index is slow."""
    retry_after_s: Natural = 2
    """Retry-After (s) on 503s: lower brings clients back sooner, into the same overload."""
    # ---- deadlines of a turn ----
    bookkeeping_timeout_s: Seconds = 2.0
    """A KV index call or block release slower than this is abandoned and the turn goes on without it
    (recompute instead of pull; the owner's TTL frees the blocks): lower costs reuse, higher latency."""
    index_wait_at_start_s: Seconds = 30.0
    """How long a new router replica waits for the KV index's first answer before taking requests
    without it (its first turns then recompute). At least bookkeeping_timeout_s."""
    prefill_timeout_s: Seconds = 120.0
    """Prefill (or a pull plus prefill) of one turn; past it the client gets 504."""
    first_chunk_timeout_s: Seconds = 120.0
    """From the decode request to its first chunk; past it the client gets 504 (in-band once streaming)."""
    stream_idle_timeout_s: Seconds = 60.0
    """The longest gap between two chunks of a reply before the stream ends with an error."""
    client_write_timeout_s: Seconds = 30.0
    """A reply the client has not read for this long ends, and its admission place and engine slots
    are released: lower frees them sooner from stalled clients, and cuts slow readers off."""
    render_timeout_s: Seconds = 2.0
    """Rendering and checking one request in the router (chat template, tokenizer, vLLM's checks),
    counted from when its own work starts; past it: 400."""
    # ---- request size: what one request may ask of the engines ----
    max_request_bytes: Count = 4 * 1024 * 1024
    """Request bodies above this get 413 before they are parsed."""
    max_messages: Count = 2048
    """Chat messages per request above this get 400."""
    max_regex_bytes: Count = 8192
    """A `structured_outputs.regex` longer than this gets 400: an engine's grammar compile grows
    faster than the pattern and holds an engine core meanwhile."""
    max_stop_strings: Count = 16
    """`stop` strings per request above this get 400: vLLM checks each against every new token's text."""
    max_stop_chars: Count = 256
    """A `stop` string longer than this gets 400."""
    max_token_rules: Count = 256
    """Entries of `stop_token_ids`, `bad_words` or `logit_bias` (each) above this get 400: vLLM
    applies each at every step of the reply."""
    max_choices: Count = 8
    """Choices (`n`) one request may ask for: each is a turn of its own on the engines, and decode
    keeps each reply's KV for whichever choice the client continues; more costs that much more
    engine work and retained KV per request."""
    max_logprobs: Count = 20
    """Candidates per token a request may ask for (vLLM's max_logprobs of every engine, checked in
    the router); each costs a sort over the vocabulary."""
    tenant_share: Share = 0.5
    """With api_keys: the share of a frontend replica's admission places one tenant may hold (past
    it: 429), and of the records' bytes and each decode replica's retained KV once those are full
    (its own oldest go first). Lower protects the other tenants, and caps a lone busy one."""
    # ---- liveness: how soon a dead part is noticed ----
    heartbeat_interval_s: Seconds = 1.0
    """How often each engine replica renews its registration in the KV index when its load changed
    (and the router and frontend re-read it while the answers change; an unchanged load and repeating
    answers wait quiet_poll_interval_s): lower notices changes sooner, for more calls to the index."""
    registration_ttl_s: Seconds = 5.0
    """A registration not renewed for this long is dropped (the engine is dead or gone). At least
    twice heartbeat_interval_s: lower drops dead engines sooner, and live ones that miss a beat."""
    suspect_replica_s: Seconds = 10.0
    """After a call to a replica fails, the router routes around it for this long. At least
    registration_ttl_s + heartbeat_interval_s, so a dead replica is not tried again while the index
    still lists it; longer keeps a replica that recovered idle."""
    health_check_period_s: Seconds = 2.0
    """Serve's health check of every replica (a dead engine also stops heartbeating)."""
    health_check_timeout_s: Seconds = 30.0
    """Serve's limit for one health check before the replica counts as unhealthy."""
    drain_timeout_s: Seconds = 60.0
    """A replica being removed waits this long for its open streams (Serve's
    graceful_shutdown_timeout_s); a reply still running then moves to another replica. Bounds how
    long an old replica holds its resources, not whether replies finish."""
    replica_gone_poll_s: Seconds = 0.5
    """How often a call that has not answered checks that its replica is still live: lower abandons
    a dead replica's call sooner, for a wake-up per waiting call."""
    engine_dead_poll_s: Seconds = 0.1
    """How often a request waiting on its engine checks that the engine process lives."""
    # ---- retries ----
    engine_attempts: Count = 3
    """Engines one stage of a turn tries (the planned one, then others or the other group): more
    survives more failures, and the client waits longer for the error when all fail."""
    router_attempts: Count = 3
    """Router replicas one reply may use (the first, then others if one dies under it)."""
    # ---- retained KV and bookkeeping ----
    retained_pool_share: Share = 0.5
    """Decode keeps finished sequences for the next turn in at most this share of its KV pool (a
    cache, not a reservation): higher keeps more later turns' KV, leaving less room for new ones."""
    retained_yield_usage: Share = 0.9
    """Requests waiting count as waiting for blocks when vLLM's KV usage is at least this; decode
    then releases one retained sequence per trim tick. Lower releases retained KV sooner."""
    retained_trim_interval_s: Seconds = 0.5
    """How often decode checks what it retains against its pool share and the requests waiting."""
    retained_trim_idle_interval_s: Seconds = 5.0
    """Once its engine has had no request for this long, decode checks this often instead, and a new
    request wakes the check at once: nothing kept can grow or be wanted meanwhile; only the count of
    kept sequences later turns took lags this much. Each check asks the index about every kept one."""
    own_retained_sweep_s: Seconds = 5.0
    """How often the router drops expired entries from its own record of retained sequences."""
    kv_events_push_interval_s: Delay = 0.1
    """The least time between two pushes of a prefill replica's KV events to the index: lower makes
    the index current sooner, for more index CPU per prefill replica."""
    kv_events_retry_pause_s: Delay = 1.0
    """The least time before a failed push is retried: a full or restarting index is not asked again at once."""
    index_blocks_per_replica: Count = 100_000
    """Prefill blocks the KV index tracks per replica (the oldest go first): bounds its memory."""
    decision_log_entries: Count = 1000
    """Routing decisions each router replica keeps for /admin/decisions."""
    remembered_grammars: Count = 256
    """Tool constraints and grammars each router replica remembers as built by vLLM's parser and
    passed by vLLM's check (least recently used out first): an agent loop's, the same every turn,
    are then built and checked once, not at about a millisecond of every turn's time to first token."""

    @property
    def router_holds(self) -> int:
        """Requests one router replica holds, ongoing plus queued: what one frontend replica admits."""
        return self.router_max_ongoing_requests + self.router_max_queued_requests

    @property
    def index_sweep_interval_s(self) -> float:
        """How often the KV index drops expired registrations and entries: a registration's own
        granularity, so a dead engine leaves within registration_ttl_s plus one heartbeat."""
        return self.heartbeat_interval_s

    @property
    def quiet_poll_interval_s(self) -> float:
        """How often a repeating answer is asked for again, and an unchanged heartbeat renewed: an
        idle app's loads and health repeat. A third of registration_ttl_s, so that a registration
        survives one lost renewal; never more often than a heartbeat."""
        return max(self.heartbeat_interval_s, self.registration_ttl_s / 3)

    @model_validator(mode="after")
    def _relations(self) -> "Limits":
        refuse([message for message, holds in {
            "registration_ttl_s must be >= 2 x heartbeat_interval_s":
                self.registration_ttl_s >= 2 * self.heartbeat_interval_s,
            "suspect_replica_s must be >= registration_ttl_s + heartbeat_interval_s":
                self.suspect_replica_s >= self.registration_ttl_s + self.heartbeat_interval_s,
            "index_wait_at_start_s must be >= bookkeeping_timeout_s":
                self.index_wait_at_start_s >= self.bookkeeping_timeout_s,
        }.items() if not holds])
        return self
