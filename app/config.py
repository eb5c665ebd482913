"""One typed configuration for the whole graph: defaults run the tiny model on this CPU machine.

Sources, later ones winning: the dataclass defaults, a YAML file (`config=path.yaml`), then
`key=value` Serve args (`serve run app:graph prefill.replicas=2 retention_ttl_s=60`).
Validated once, when the graph is built; replicas receive the frozen object.
"""

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.conversations.bounded import RecordBounds
from app.conversations.records import RenderMode
from app.kv.hashing import DEFAULT_HASH_SEED
from app.turn.routing import RoutingPolicy

TINY_MODEL = "tiny-qwen3"


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True)
class EngineGroupConfig:
    """One engine role (prefill or decode): how many replicas and what each one gets."""

    replicas: int = 1
    """Engine replicas in this group; each is a Serve replica holding one vLLM AsyncLLM."""
    cpus_per_replica: float = 1.0
    """Logical CPUs in the replica's placement-group bundle (its GPUs follow from the parallelism:
    AppConfig.gpus_per_engine)."""
    bundle_resources: Mapping[str, float] = field(default_factory=dict)
    """Extra custom resources per bundle, e.g. {"efa": 1} or a node-type label resource."""
    prefix_caching: bool = True
    """vLLM prefix caching; tests switch it off on prefill to emulate cache loss."""
    kv_cache_gib: int = 1
    """KV pool size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE); on GPU use gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory vLLM may take (GPU only)."""
    num_gpu_blocks_override: int = 0
    """Force the KV pool to this many blocks (0: let vLLM size it); small pools create cache loss."""
    max_batched_tokens: int = 512
    """Tokens one engine step computes at most (vLLM's max_num_batched_tokens); longer prompts are
    chunked. Every request in an engine waits for the step in flight (vLLM adds new requests
    between steps, and a later turn goes ahead of waiting first turns but not of a running chunk):
    on decode that is each stream's next token and each short append's first. A quarter of vLLM's
    CPU default (2048): at 64 conversations here an append on decode waited 1,036 ms for its first
    token with 2048, 306 ms with 512 (two runs; docs/measurements.md). The benchmark's peers get it too."""
    long_prefill_tokens: int = 0
    """The most tokens of one prompt an engine step takes while other requests wait or run (vLLM's
    long_prefill_token_threshold; 0: no cap). Uncapped, a running first turn's chunk takes the
    whole step budget and an append arriving behind it waits for that prompt to finish (vLLM's
    priority orders the waiting queue, never a running chunk's budget). Off on purpose: capped at
    256 of 512 on every engine, two first turns' chunks fill a step, and in three full sweeps no
    target moved for the better; an append on decode at 64 conversations took 222 ms in its own
    step against 112-120 uncapped at the same machine speed (docs/measurements.md). The
    benchmark's peers get it too."""


@dataclass(frozen=True)
class Limits:
    """Every concurrency cap, queue bound, timeout and TTL of the serving path, set on purpose.

    Serve's defaults (5 ongoing requests per replica, unbounded queues) would queue a busy
    service silently; these bound it and answer overload with 503 + Retry-After instead."""

    router_max_ongoing_requests: int = 256
    """Requests one router replica serves at once. A stream holds its slot until [DONE], so this is
    the number of conversations in flight per router replica (Serve's default of 5 queued 32
    conversations behind five slots: later-turn TTFT 5-10x)."""
    router_max_queued_requests: int = 512
    """Requests one frontend replica holds waiting for a router slot; past ongoing plus queued it
    answers new ones 503 with Retry-After (the OpenAI error shape)."""
    engine_max_ongoing_requests: int = 128
    """Calls one engine replica takes at once (prefill calls, decode streams); vLLM queues inside."""
    engine_max_queued_requests: int = 512
    """Calls waiting for an engine replica slot before the router's call is refused (then retried elsewhere)."""
    index_max_ongoing_requests: int = 1024
    """Concurrent calls to the KV index actor: each is a short in-memory lookup or record."""
    index_max_queued_requests: int = 2048
    """Calls waiting for the KV index before new ones are refused; every caller goes on without the
    answer (a recompute instead of a pull, a record the router still holds), as when it is slow."""
    retry_after_s: int = 2
    """Retry-After on 503s (overload, engines starting, no engine alive)."""
    bookkeeping_timeout_s: float = 2.0
    """A KV index call or block release that takes longer is abandoned: the turn goes on without it
    (recompute instead of pull; the owner's TTL frees the blocks). A dead index answers at once
    (Serve knows it is unavailable); this bounds a slow one: on 2 cores with engines starting, the
    index's calls took over 1 s."""
    index_wait_at_start_s: float = 30.0
    """A new router replica waits up to this long for the KV index's first answer before it takes
    requests (see TurnLoop.refresh_membership); past it, it starts without (the index may be restarting)."""
    prefill_timeout_s: float = 120.0
    """Prefill (or a pull plus prefill) of one turn; past it the client gets 504."""
    first_chunk_timeout_s: float = 120.0
    """From the decode request to its first chunk; past it the client gets 504 (in-band once streaming)."""
    stream_idle_timeout_s: float = 60.0
    """The longest gap between two chunks of a reply before the stream is ended with an error."""
    max_request_bytes: int = 4 * 1024 * 1024
    """Request bodies above this get 413 before they are parsed."""
    max_messages: int = 2048
    """Chat messages per request above this get 400."""
    max_regex_bytes: int = 8192
    """A `structured_outputs.regex` longer than this gets 400 at the frontend. An engine's grammar
    compile grows faster than the pattern: here 5 KB took 0.12 s, 15 KB 1.1 s, 32 KB 5.4 s and
    65 KB 54 s of an engine core (xgrammar, the embedded model's 2,048-token vocabulary)."""
    max_stop_strings: int = 16
    """`stop` strings per request above this get 400: vLLM checks each against every new token's text."""
    max_stop_chars: int = 256
    """A `stop` string longer than this gets 400."""
    max_token_rules: int = 256
    """Entries of `stop_token_ids`, `bad_words` or `logit_bias` (each) above this get 400: vLLM applies
    each at every step of the reply, bad words one by one."""
    max_logprobs: int = 20
    """Candidates per token a request may ask for (`top_logprobs`, completions' `logprobs`): vLLM's
    max_logprobs of every engine, checked in the router. Each costs a sort over the vocabulary."""
    tenant_share: float = 0.5
    """With api_keys set, the share one tenant may hold of a frontend replica's admission places
    (router_holds; past it: 429 + Retry-After), and its share of the conversation records' bytes
    and of each decode replica's retained KV: when those are full, a tenant past its share loses its
    own oldest first, so that one tenant cannot starve the others (while there is room, any tenant
    may use it). Without keys every request is one tenant and only the whole bounds apply."""
    client_write_timeout_s: float = 30.0
    """A reply the client has not taken for this long (it stopped reading) is ended, and its
    admission place and engine slots released."""
    render_timeout_s: float = 2.0
    """Rendering and checking one request in the router (chat template, tokenizer, vLLM's checks of
    its sampling parameters), counted from when its own work starts; past it: 400. Prompts too long
    for the context are refused before they are tokenized (a 4 MB one took 2 s to tokenize here)."""
    heartbeat_interval_s: float = 1.0
    """How often each engine replica renews its registration in the KV index."""
    registration_ttl_s: float = 5.0
    """A registration not renewed for this long is dropped: the replica's engine is dead or gone."""
    health_check_period_s: float = 2.0
    """Serve's health check of every replica (a dead engine also stops heartbeating at once, and the
    router routes around it from its first failed call)."""
    health_check_timeout_s: float = 30.0
    """Serve's limit for one health check before the replica counts as unhealthy."""
    drain_timeout_s: float = 60.0
    """A replica being removed (scale-in, redeploy) waits this long for its open streams before it
    stops (Serve's graceful_shutdown_timeout_s); a reply still running then moves (a router's to
    another router replica, an engine's to another engine), so this bounds how long an old replica
    holds its resources, not whether replies finish."""
    retained_trim_interval_s: float = 0.5
    """How often decode checks what it retains against its pool share and the requests waiting."""
    suspect_replica_s: float = 10.0
    """After a call to a replica fails, the router routes around it for this long."""
    retained_pool_share: float = 0.5
    """Decode keeps finished sequences for the next turn in at most this share of its KV pool; past
    it, or when requests wait for blocks, the oldest are released (they are a cache, not a reservation)."""
    retained_yield_usage: float = 0.9
    """Requests waiting count as waiting for blocks when vLLM's KV usage is at least this: decode then
    releases one retained sequence per trim tick. Below it they wait for the step's token budget,
    and releasing would only cost later turns their KV."""

    @property
    def router_holds(self) -> int:
        """Requests one router replica holds, ongoing plus queued: what one frontend replica admits."""
        return self.router_max_ongoing_requests + self.router_max_queued_requests

    def __post_init__(self) -> None:
        positive = {name: getattr(self, name) for name in (
            "router_max_ongoing_requests", "engine_max_ongoing_requests", "index_max_ongoing_requests",
            "router_max_queued_requests", "engine_max_queued_requests", "index_max_queued_requests",
            "bookkeeping_timeout_s", "index_wait_at_start_s", "prefill_timeout_s", "first_chunk_timeout_s",
            "stream_idle_timeout_s", "max_request_bytes", "max_messages", "max_regex_bytes", "render_timeout_s",
            "max_stop_strings", "max_stop_chars", "max_token_rules", "max_logprobs", "client_write_timeout_s",
            "heartbeat_interval_s", "health_check_period_s", "drain_timeout_s", "retained_trim_interval_s")}
        failed = [f"limits.{name} must be > 0" for name, value in positive.items() if value <= 0]
        if self.registration_ttl_s < 2 * self.heartbeat_interval_s:
            failed.append("limits.registration_ttl_s must be at least twice limits.heartbeat_interval_s")
        shares = ("retained_pool_share", "retained_yield_usage", "tenant_share")
        failed += [f"limits.{name} must lie in (0, 1]" for name in shares if not 0 < getattr(self, name) <= 1]
        if failed:
            raise ValueError("invalid config: " + "; ".join(failed))


@dataclass(frozen=True)
class Placement:
    """Where each turn's prompt is computed: a prefill replica or the decode replica that streams
    the reply, whichever is estimated to give the first token sooner (app/turn/placement.py)."""

    load_aware: bool = True
    """Off: only a short append to a sequence decode retains runs on decode (the fixed rule)."""
    itl_weight: float = 0.05
    """A prompt computed on decode stalls each of its running streams for as long as it takes;
    one stream's stall counts this much against the new turn's wait (0.05: 20 streams stalled
    for x weigh as much as the turn waiting x longer)."""
    kv_high_watermark: float = 0.9
    """No prompt is computed on a decode replica whose KV pool is fuller than this (vLLM's usage)."""
    prior_pull_share: float = 0.05
    """Until an engine has measured a transfer, a pulled token costs this share of a computed one."""
    probe_tokens: int = 256
    """Each engine times a prefill of this many tokens at start: its first measured compute cost.
    Sized for the device: the prefill must be long enough that compute, not the step's fixed cost,
    sets its time (256 on this CPU; an H200 needs thousands, serve.yaml sets 4096)."""
    cost_refresh_s: float = 10.0
    """An engine whose compute cost is older than this re-times it with one probe once it has been
    idle for `cost_refresh_quiet_s` (real turns that ran alone count as measurements): a side that
    gets no turns would otherwise keep a stale cost, and so keep getting none."""
    cost_refresh_quiet_s: float = 1.0
    """How long an engine must have had no request before it re-times its compute cost."""
    probe_window: int = 60
    """The least of an engine's last this many probes is its compute cost (60: ten minutes of an
    idle engine's probes): a probe timed while other processes loaded the machine reads high."""
    calibration_ttl_s: float = 10.0
    """A side's calibration (app/turn/placement.py) that no turn has refreshed for this long is
    forgotten, and the side's turns are estimated by the formula alone until one comes back: a fit
    learned under one load otherwise stands through the next and keeps turns off its side."""

    def __post_init__(self) -> None:
        failed = [f"placement.{name} must be >= 0" for name in ("itl_weight", "prior_pull_share",
                                                                 "cost_refresh_quiet_s", "calibration_ttl_s")
                  if getattr(self, name) < 0]
        if not 0 < self.kv_high_watermark <= 1:
            failed.append("placement.kv_high_watermark must lie in (0, 1]")
        if self.probe_tokens < 32:
            failed.append("placement.probe_tokens must be >= 32 (shorter prefills are not measured)")
        if self.cost_refresh_s <= 0:
            failed.append("placement.cost_refresh_s must be > 0")
        if self.probe_window < 1:
            failed.append("placement.probe_window must be >= 1")
        if failed:
            raise ValueError("invalid config: " + "; ".join(failed))


@dataclass(frozen=True)
class ScalingBounds:
    """Ray Serve autoscaling of one group (deployments/autoscaling.py); off, the group keeps its fixed count."""

    enabled: bool = False
    """On: Serve starts the group's configured replica count and scales it within these bounds."""
    min_replicas: int = 1
    max_replicas: int = 2
    upscale_delay_s: float = 30.0
    """How long the load must ask for more replicas before one starts. An engine takes 40-70 s to
    start on 2 cores: a burst shorter than that is better queued than answered with a replica."""
    downscale_delay_s: float = 300.0
    """How long the load must ask for fewer before a replica stops; a stopped engine replica takes
    its prefix cache and the sequences it retains with it (reuse lost, not correctness)."""
    metrics_interval_s: float = 10.0
    """How often each replica sends its metrics to Serve's controller (Serve's default)."""
    look_back_period_s: float = 30.0
    """Serve averages each replica's metrics over this window before the policy reads them."""

    def problems(self) -> list[str]:
        failed = [] if 1 <= self.min_replicas <= self.max_replicas else ["1 <= min_replicas <= max_replicas"]
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            failed.append("upscale_delay_s and downscale_delay_s must be >= 0")
        if not 0 < self.metrics_interval_s < self.look_back_period_s:
            failed.append("0 < metrics_interval_s < look_back_period_s")
        return failed


@dataclass(frozen=True)
class PrefillScaling(ScalingBounds):
    target_queued_tokens: int = 4096
    """Queued prefill tokens per replica (prompt tokens in calls not yet prefilled, less pulled
    ones). A new prompt waits about queued tokens / the replica's prefill rate: four 1,000-token
    prompts here; set it from the TTFT budget and a measured prefill rate."""

    def problems(self) -> list[str]:
        return super().problems() + ([] if self.target_queued_tokens > 0 else ["target_queued_tokens must be > 0"])


@dataclass(frozen=True)
class DecodeScaling(ScalingBounds):
    target_sequences: int = 64
    """Sequences (running and waiting) per decode engine: the batch whose inter-token latency you
    accept; measure it."""
    target_kv_cache_usage: float = 0.8
    """KV pool usage per decode engine (vLLM's); above limits.retained_pool_share, so sequences kept
    for next turns alone never hold a replica up."""

    def problems(self) -> list[str]:
        failed = [] if self.target_sequences > 0 else ["target_sequences must be > 0"]
        if not 0 < self.target_kv_cache_usage <= 1:
            failed.append("target_kv_cache_usage must lie in (0, 1]")
        return super().problems() + failed


@dataclass(frozen=True)
class RouterScaling(ScalingBounds):
    target_ongoing_requests: int = 128
    """Requests per router replica (Serve's built-in policy); a stream holds its request until
    [DONE]. Half of limits.router_max_ongoing_requests: the next replica starts before the queue."""

    def problems(self) -> list[str]:
        failed = [] if self.target_ongoing_requests > 0 else ["target_ongoing_requests must be > 0"]
        return super().problems() + failed


@dataclass(frozen=True)
class Autoscaling:
    """Each group on its own signal: prefill on queued prefill tokens, decode on sequences and KV
    usage, the router on ongoing requests. All off by default (fixed replica counts)."""

    prefill: PrefillScaling = PrefillScaling()
    decode: DecodeScaling = DecodeScaling()
    router: RouterScaling = RouterScaling()

    def __post_init__(self) -> None:
        failed = [f"autoscaling.{group}: {problem}" for group in ("prefill", "decode", "router")
                  for problem in getattr(self, group).problems()]
        if failed:
            raise ValueError("invalid config: " + "; ".join(failed))


@dataclass(frozen=True)
class ReplicaRuntime:
    """How Serve runs every replica's Python, set on each deployment (Ray's throughput-optimized
    settings, without the cluster-wide flag). At 64 conversations here the four Serve roles took
    14 % less CPU per reply with the first three on (docs/measurements.md)."""

    user_code_on_main_loop: bool = True
    """Run handlers on the replica's own event loop, not a second thread's (no thread hop per
    request and per streamed chunk). Handlers then must not block: rendering and hashing run in
    worker threads."""
    handle_router_on_main_loop: bool = True
    """Run each outgoing handle's request routing on that same loop, not a router thread's."""
    log_to_stderr: bool = False
    """Also write every replica log line to stderr (the log files and the dashboard have them)."""
    access_log: bool = False
    """Serve's access line per request and replica; the router's decision log covers turns."""

    def env_vars(self) -> dict[str, str]:
        flag = lambda on: "1" if on else "0"  # noqa: E731
        return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": flag(not self.user_code_on_main_loop),
                "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": flag(not self.handle_router_on_main_loop),
                "RAY_SERVE_LOG_TO_STDERR": flag(self.log_to_stderr)}


@dataclass(frozen=True)
class AppConfig:
    model: str = TINY_MODEL
    """Model path or hub id; "tiny-qwen3" builds the embedded random-weight model on first start."""
    served_model_name: str = ""
    """Name clients pass as `model`; defaults to `model` as given (a hub id such as Qwen/Qwen3-32B,
    or a path), as vLLM's server names it."""
    model_cache_dir: str = "~/.cache/kv-loop"
    """Where the embedded model is built."""
    tool_call_parser: str = "hermes"
    """vLLM's tool parser for the model family (`--tool-call-parser` with `--enable-auto-tool-choice`):
    Qwen3's JSON calls are "hermes", as the embedded model's. Empty: requests offering `tools` get
    400 unless their tool_choice is "none"."""
    reasoning_parser: str = ""
    """vLLM's reasoning parser (`--reasoning-parser`; "qwen3" for Qwen3): replies carry their
    reasoning in `reasoning`, apart from `content`, and a grammar starts where the reasoning ends.
    Empty, as vLLM's default: the reasoning stays in `content`, as the model wrote it."""
    device: Device = Device.CPU
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    """Pipeline stages per engine. An engine's ranks (tensor x pipeline) run as processes of vLLM's
    multiprocessing executor inside its Serve replica, on the replica's node: one engine spans one
    node at most (docs/design.md, "Engine placement")."""
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """vLLM engine arguments passed through unchanged (quantization, kv_cache_dtype, ...), as Ray
    Serve LLM's `LLMConfig.engine_kwargs`: names are checked against vLLM's `EngineArgs` when the
    config loads, values by vLLM when the engine builds its config. The arguments the app sets
    itself (APP_ENGINE_ARGS) are refused here: set them through the app's own keys."""
    cpu_tuning_on_gpu: bool = False
    """The engine tuning for CPU cores shared with the serving path (engine_nice, engine_busy_poll_s,
    engine_queue_recheck_ms, bind_engine_cores, engine_idle_poll_s, nixl_poll_delay_us and the NIXL
    worker extension) applies on device cpu only; on cuda vLLM's and NIXL's own behaviour stands
    unless this turns it on."""
    block_size: int = 32
    """Tokens per KV block; the CPU attention backend needs a multiple of 32."""
    max_model_len: int = 8192
    enforce_eager: bool = True
    """Skip graph capture: engine start on 2 CPU cores drops from about 70 s to 40 s."""
    dtype: str = "auto"
    """Weights and KV dtype; "auto" is float32 for the embedded model (vLLM's CPU default would be bf16)."""
    prefill: EngineGroupConfig = EngineGroupConfig(prefix_caching=True)
    decode: EngineGroupConfig = EngineGroupConfig(prefix_caching=True)
    reverse_pull: bool = True
    """Pull the previous turn's KV back from decode; off means prefill always recomputes history."""
    recompute_threshold_tokens: int = 256
    """Pull only when it saves at least this many tokens of prefill over the local cache. On 2 CPU
    cores with the embedded model pulling and recomputing break even near 128-512 tokens
    (`benchmarks/reverse_pull.py --sweep`); measure yours."""
    retention_ttl_s: float = 120.0
    """How long decode keeps a finished sequence's blocks for the next turn (think time)."""
    tool_pause_s: float = 30.0
    """A reply to a request that offers tools (tool_choice not "none") may end in tool calls, and its
    next turn comes when the tool has run: decode's trimming for its pool share and tenant shares
    takes such a retained sequence after every other for this long. Requests waiting for blocks
    still take it, and vLLM frees it at retention_ttl_s, which bounds this (vLLM's TTL is one per
    engine, not per request). 0: no pause kept."""
    handoff_lease_s: int = 120
    """How long prefill holds a turn's blocks for decode to read before freeing them (vLLM's
    kv_lease_duration on prefill). Each heartbeat of a reading decode extends it by 2/3 of this,
    and decode heartbeats every retention_ttl_s / 6 (vLLM's rule), so a decode that starts reading
    late keeps its blocks; a turn that ends unread releases them at once, so this is a backstop."""
    expiry_margin_s: float = 5.0
    """Decline retained blocks that expire sooner than this: the pull must finish first."""
    min_local_horizon_s: float = 30.0
    """Count a prefill replica's cached blocks against a pull only where its eviction horizon (how
    long an idle block survives its pool under the current load) is at least this long. Under a
    shorter horizon they may be evicted before the turn runs, so decode's retained sequence is
    pulled whenever it covers them (vLLM's prefill then reads only the blocks it lacks)."""
    max_decode_prefill_tokens: int = 2048
    """The most prompt tokens a decode replica computes for one turn: each of its streams stalls
    while it does. A later turn adding at most this many tokens to what decode retains of the
    conversation may run whole there (its prefix cache holds the history: no prefill hop, no KV
    transfer); with load-aware placement a first turn this short may too, when decode is estimated
    to answer sooner. Under the fixed rule (placement.load_aware off) such an append always runs on
    decode. 0: every turn goes through prefill. 2048: four engine steps on CPU; on 2 cores
    900-token appends gained under the fixed rule (docs/measurements.md)."""
    placement: Placement = Placement()
    kv_events: bool = True
    """Prefill engines publish vLLM KV cache events; the KV index subscribes (what each prefill
    replica caches). Decode engines publish none: the index learns what decode retains from each
    turn's records, and decode's events, read by nobody, cost its engine and replica CPU each step."""
    prefix_hash_seed: int = DEFAULT_HASH_SEED
    """PYTHONHASHSEED of every engine: vLLM's root block hash, which the router's hashes must share."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """NIXL transfer backends: UCX here; LIBFABRIC on EFA nodes. An engine replica checks at start
    that each one loads, and stops with the missing library's name if one does not."""
    nixl_fallback_to_ucx: bool = False
    """A requested backend that does not load is replaced by UCX, with a warning, instead of
    stopping the replica. Off on purpose: on EFA nodes UCX without libefa moves KV over TCP, an
    order of magnitude slower, and placement then avoids pulls (a slow service, not a dead one)."""
    nixl_poll_delay_us: int = 100
    """NIXL progress-thread sleep between polls; NIXL's own 0 spins a core per engine."""
    stream_interval_tokens: int = 4
    """Decode streams its first token at once, then every this many tokens (vLLM's stream_interval):
    each streamed chunk is two Serve hops, which on a small machine cost the engines CPU time."""
    engine_max_num_seqs: int = 128
    """Sequences one engine's scheduler runs at once (vLLM's max_num_seqs); the rest wait in its
    queue. Every conversation's reply streams from decode: this bounds the streams per decode
    engine, so at least the conversations in flight per decode replica. vLLM's CPU default, set here."""
    later_turns_first: bool = True
    """Engines schedule by priority (vLLM's "priority" policy): a later turn's prompt, a short
    append whose user waits, goes ahead of first turns waiting in the same engine, and decode's
    continuation of a prompt computed on prefill ahead of both (app/turn/loop.py); off: FCFS."""
    later_turns_before_chunks: bool = True
    """With `later_turns_first`: in a step where a later turn waits to start, the running chunks of
    first turns' prompts sit that step out and the later turn takes their place (app/engine/scheduler.py);
    off, vLLM schedules every running chunk before any waiting request."""
    first_token_from_prefill: bool = True
    """Send the client the first token prefill samples, and let decode continue after it: TTFT
    then excludes decode's KV read and first step. Off, or for requests with stop strings, a regex,
    presence or frequency penalties or bad words, decode samples the first token (vLLM's standard
    disaggregated flow)."""
    engine_idle_poll_s: float = 5.0
    """An engine that only holds finished turns for remote readers waits this long for new work
    between connector polls instead of stepping (app/engine/idle_poll.py); 0 keeps vLLM's busy loop.
    Above 1 s so the worker's shared-memory reader goes idle too."""
    bind_engine_cores: bool = True
    """Pin each CPU engine's OpenMP threads to its own core (VLLM_CPU_OMP_THREADS_BIND)."""
    engine_nice: int = 19
    """CPU only: each engine's processes run at this nice value (app/engine/process.py), so that the
    serving path's Python, which needs little CPU but must not wait, runs ahead of a prefill's
    compute on the cores it shares with the engines. The engines inherit their replica's nice
    value: Ray's worker niceness, 15 by default (RAY_worker_niceness), 0 where this app starts Ray
    and in the README's command (app/ops/launch.py). Only a value above the replicas' puts the engines
    behind the serving path (at 10 against 15 they ran ahead of it and later-turn TTFT tripled).
    0: keep the inherited value. The benchmarks give their peers the same two values."""
    engine_busy_poll_s: float = 0.001
    """CPU only: how long an engine's worker and EngineCore spin on their shared-memory queue after
    each message before they block until the writer's notification (app/engine/process.py).
    vLLM's 1 s spins one process for the whole of every step of the other. Must be above 0: at 0
    the engines tried stalled on their first request. The benchmarks give their peers the same."""
    engine_queue_recheck_ms: int = 2
    """CPU only: how often a blocked reader of those queues rechecks it, which bounds what a lost
    notification costs (vLLM's 5 s: at a 1 ms spin, turns waited 5 s); an idle engine's worker
    wakes this often. The benchmarks give their peers the same."""
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    """kv_aware, session_affinity, round_robin or least_loaded (see app/turn/routing.py)."""
    cost_per_token: float = 1.0
    """kv_aware: cost of one prompt token prefill must compute."""
    load_weight: float = 0.5
    """kv_aware: cost of one prefill token already queued on the replica."""
    transfer_cost_per_token: float = 0.05
    """kv_aware: cost of one token pulled from decode instead of computed."""
    conversation_mode: RenderMode = RenderMode.PRESERVE
    """preserve: append each turn to the previous turn's exact tokens; template: re-render history."""
    conversation_ttl_s: float = 1800.0
    """How long a finished turn's record can serve the next turn."""
    max_conversations: int = 100_000
    """Records kept per router replica and in the KV index's shared copy (the oldest go first)."""
    conversation_store_mib: int = 512
    """Bytes of records (tokens at 4 bytes each) kept per router replica and in the KV index's shared
    copy: about 16 M tokens of history. With api_keys set, when it is full, a tenant past
    `limits.tenant_share` of it loses its own oldest first."""
    router_replicas: int = 1
    """Router replicas (they share conversation records through the KV index), and as many frontend
    replicas: the HTTP ingress, which moves a reply to another router replica if its replica dies."""
    autoscaling: Autoscaling = Autoscaling()
    """Per group, off by default; on, a group starts at its replica count (`prefill.replicas`,
    `decode.replicas`, `router_replicas`) and Serve scales it within the group's bounds."""
    limits: Limits = Limits()
    replica_runtime: ReplicaRuntime = ReplicaRuntime()
    api_keys: Mapping[str, str] = field(default_factory=dict)
    """API key -> tenant. Empty: every request is tenant "default". Set: unknown keys get 401, before
    the body is read. A key may be given as `sha256:<hex digest>` so that the config holds no key;
    the app keeps digests only."""
    openapi_docs: bool = False
    """Serve /docs, /redoc and /openapi.json (open, without a key). Off: they describe every endpoint
    and extension to anyone who can reach the server."""
    admin_api_keys: tuple[str, ...] = ()
    """Keys that may read /admin/*; once api_keys or these are set, /admin answers no one else."""
    secrets_env: str = ""
    """An environment variable holding the app's secrets as a JSON object (`api_keys`,
    `admin_api_keys`, `salt_secret`), read where the graph is built, so that no key sits in a Serve
    config. Serve builds the graph on any node: set it on every node before `ray start`."""
    salt_secret: str = ""
    """The server secret each tenant's cache salt is derived from (HMAC-SHA256 of the tenant).
    Empty: drawn at random when the graph is built."""
    allow_open_api: bool = False
    """Serve without api_keys on an HTTP host other than loopback (a development server). Off: the
    frontend refuses to start then. Serve's HAProxy ingress listens on every interface."""
    per_user_salt_tenants: tuple[str, ...] = ()
    """Tenants whose cache salt is per user (the request's `user` field), for sensitive tenants."""

    def __post_init__(self) -> None:
        checks = {
            "block_size must be a positive multiple of 32 on CPU":
                self.block_size > 0 and (self.device != Device.CPU or self.block_size % 32 == 0),
            "max_model_len must hold at least two blocks": self.max_model_len >= 2 * self.block_size,
            "placement.probe_tokens must be below max_model_len": self.placement.probe_tokens < self.max_model_len,
            "tensor_parallel_size and pipeline_parallel_size must be >= 1":
                min(self.tensor_parallel_size, self.pipeline_parallel_size) >= 1,
            # Each stream holds an engine replica's slot until its last token: a replica admitting
            # fewer than its engine runs leaves the rest of the batch empty.
            "limits.engine_max_ongoing_requests must be >= engine_max_num_seqs":
                self.limits.engine_max_ongoing_requests >= self.engine_max_num_seqs,
            # Every reply streams through a router replica: routers admitting fewer than the decode
            # group runs cap the service below what its engines hold.
            "router_replicas * limits.router_max_ongoing_requests must be >= "
            "decode.replicas * engine_max_num_seqs":
                self.router_replicas * self.limits.router_max_ongoing_requests
                >= self.decode.replicas * self.engine_max_num_seqs,
            "prefill.replicas and decode.replicas must be >= 1":
                self.prefill.replicas >= 1 and self.decode.replicas >= 1,
            "recompute_threshold_tokens must be >= 0": self.recompute_threshold_tokens >= 0,
            "max_conversations and conversation_store_mib must be >= 1":
                min(self.max_conversations, self.conversation_store_mib) >= 1,
            "stream_interval_tokens must be >= 1": self.stream_interval_tokens >= 1,
            "engine_nice must lie in [0, 19]": 0 <= self.engine_nice <= 19,
            "engine_busy_poll_s must be > 0": self.engine_busy_poll_s > 0,
            "engine_queue_recheck_ms must be >= 1": self.engine_queue_recheck_ms >= 1,
            "each group's long_prefill_tokens must lie in [0, max_batched_tokens]":
                all(0 <= g.long_prefill_tokens <= g.max_batched_tokens for g in (self.prefill, self.decode)),
            "each group's max_batched_tokens must be >= engine_max_num_seqs >= 1 (vLLM's own check)":
                min(self.prefill.max_batched_tokens, self.decode.max_batched_tokens) >= self.engine_max_num_seqs >= 1,
            "retention_ttl_s must exceed expiry_margin_s": self.retention_ttl_s > self.expiry_margin_s,
            "tool_pause_s must lie in [0, retention_ttl_s]": 0 <= self.tool_pause_s <= self.retention_ttl_s,
            "min_local_horizon_s must be >= 0": self.min_local_horizon_s >= 0,
            # At least three of decode's heartbeats inside each lease extension on prefill.
            "decode's lease heartbeat (retention_ttl_s / 6) must come 3x inside prefill's lease extension "
            "(handoff_lease_s * 2 / 3)": int(self.retention_ttl_s) // 6 * 3 <= self.handoff_lease_s * 2 // 3,
            "max_decode_prefill_tokens must be >= 0": self.max_decode_prefill_tokens >= 0,
            # vLLM keeps one block of the pool as its null block.
            "a num_gpu_blocks_override pool must hold max_model_len tokens plus one block": all(
                g.num_gpu_blocks_override == 0 or g.num_gpu_blocks_override * self.block_size > self.max_model_len
                for g in (self.prefill, self.decode)),
            "an autoscaled group's replica count (where it starts) must lie within its min and max replicas": all(
                not s.enabled or s.min_replicas <= n <= s.max_replicas for s, n in (
                    (self.autoscaling.prefill, self.prefill.replicas), (self.autoscaling.decode, self.decode.replicas),
                    (self.autoscaling.router, self.router_replicas))),
            "autoscaling.decode.target_kv_cache_usage must exceed limits.retained_pool_share":
                not self.autoscaling.decode.enabled
                or self.autoscaling.decode.target_kv_cache_usage > self.limits.retained_pool_share,
            "autoscaling.router.target_ongoing_requests must not exceed limits.router_max_ongoing_requests":
                not self.autoscaling.router.enabled
                or self.autoscaling.router.target_ongoing_requests <= self.limits.router_max_ongoing_requests,
        }
        failed = [msg for msg, ok in checks.items() if not ok] + engine_kwargs_problems(self.engine_kwargs)
        if failed:
            raise ValueError("invalid config: " + "; ".join(failed))

    @property
    def engine_world_size(self) -> int:
        """Ranks per engine: vLLM's world size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def gpus_per_engine(self) -> int:
        """GPUs each engine replica holds on cuda, one per rank: its multiprocessing workers inherit
        the replica's CUDA_VISIBLE_DEVICES."""
        return self.engine_world_size if self.device == Device.CUDA else 0

    @property
    def executor_backend(self) -> str:
        """vLLM's distributed executor, always set: left unset inside a Serve replica, vLLM sees the
        replica's placement group and picks its Ray executor, which refuses a bundle of more than one
        GPU (vllm/v1/executor/ray_utils.py::initialize_ray_cluster)."""
        return "mp" if self.engine_world_size > 1 else "uni"

    @property
    def prefix_hash_algo(self) -> str:
        """vLLM's prefix-cache hash, which the router's hashes match: sha256 once tenants share the
        engines (vLLM's advice for multi-tenant serving: a collision would hand one tenant another's
        KV), the faster xxhash for a single tenant."""
        return "sha256_cbor" if self.api_keys else "xxhash_cbor"

    @property
    def tenant_quotas(self) -> bool:
        """Whether each tenant is held to its `limits.tenant_share` (with api_keys set)."""
        return bool(self.api_keys)

    @property
    def record_bounds(self) -> RecordBounds:
        max_bytes = self.conversation_store_mib << 20
        share = self.limits.tenant_share if self.tenant_quotas else 1.0
        return RecordBounds(self.conversation_ttl_s, self.max_conversations, max_bytes, int(max_bytes * share))

    @property
    def tunes_shared_cpu(self) -> bool:
        """Whether the engines get the tuning for cores shared with the serving path."""
        return self.device == Device.CPU or self.cpu_tuning_on_gpu

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def engine_dtype(self) -> str:
        return "float32" if self.dtype == "auto" and self.model == TINY_MODEL else self.dtype

    def model_path(self) -> Path:
        """The folder engines and the tokenizer load (the embedded model's build folder)."""
        if self.model == TINY_MODEL:
            return Path(os.path.expanduser(self.model_cache_dir)) / TINY_MODEL
        return Path(self.model)


APP_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "served_model_name", "dtype", "block_size", "max_model_len", "enforce_eager",
    "enable_prefix_caching", "prefix_caching_hash_algo", "tensor_parallel_size", "pipeline_parallel_size",
    "distributed_executor_backend", "gpu_memory_utilization", "num_gpu_blocks_override", "stream_interval",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "scheduling_policy",
    "scheduler_cls", "kv_transfer_config", "worker_extension_cls", "kv_events_config", "disable_log_stats",
    "reasoning_parser", "max_logprobs"})
"""The vLLM engine arguments app/engine/adapter.py sets from the app's own keys (a test keeps them equal)."""


def engine_kwargs_problems(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """Names in `engine_kwargs` that vLLM's EngineArgs lacks or that the app sets itself. vLLM is
    imported only when there are any: the default config loads without it."""
    if not engine_kwargs:
        return []
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_kwargs) - known)
    owned = sorted(set(engine_kwargs) & APP_ENGINE_ARGS)
    return ([f"engine_kwargs: vLLM's EngineArgs has no {unknown}"] if unknown else []) + (
        [f"engine_kwargs: {owned} are set by the app from its own keys (docs/configuration.md)"] if owned else [])


def load_config(args: Mapping[str, Any] | None = None) -> AppConfig:
    """Build the config from Serve args: an optional `config` YAML path plus dotted key=value pairs."""
    args = dict(args or {})
    values: dict[str, Any] = {}
    if "config" in args:
        values = yaml.safe_load(Path(args.pop("config")).read_text()) or {}
    for key, value in args.items():
        _set_dotted(values, key.split("."), value)
    return _build(AppConfig, values)


def _set_dotted(tree: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _build(cls, values: Mapping[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"unknown config keys for {cls.__name__}: {sorted(unknown)}")
    defaults = cls()
    kwargs = {}
    for name, value in values.items():
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default):
            merged = {**dataclasses.asdict(default), **value}
            kwargs[name] = _build(type(default), merged)
        else:
            kwargs[name] = _coerce(value, default, name)
    return cls(**kwargs)


def _coerce(value: Any, default: Any, name: str) -> Any:
    """Serve CLI args arrive as strings; convert them to the type of the field's default."""
    try:
        if isinstance(default, enum.Enum):
            return type(default)(value)
        if isinstance(default, tuple) and isinstance(value, list):
            return tuple(value)
        if not isinstance(value, str) or isinstance(default, str):
            return value
        if isinstance(default, bool):
            if value.lower() not in _BOOLEANS:
                raise ValueError(f"expected a boolean, got {value!r}")
            return _BOOLEANS[value.lower()]
        if isinstance(default, Mapping):
            return yaml.safe_load(value)
        if isinstance(default, tuple):  # an empty value is no item: `admin_api_keys=` sets none
            return tuple(item for item in value.split(",") if item)
        return type(default)(value)
    except ValueError as exc:
        raise ValueError(f"config key {name}: {exc}") from None


_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
