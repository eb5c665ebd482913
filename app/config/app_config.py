"""AppConfig: the whole graph's configuration. Defaults run the embedded model on this CPU machine."""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from app.config.autoscaling import Autoscaling
from app.config.engines import (
    GROUPS,
    SCHEDULER_ARGS,
    TINY_MODEL,
    Device,
    EngineGroupConfig,
    default_engine_kwargs,
    engine_kwargs_problems,
    tool_strict_level_problems,
)
from app.config.limits import Limits
from app.config.placement import Placement, ReplicaRuntime
from app.config.relations import relation_problems
from app.config.types import Bool, Count, Delay, Int, Natural, Seconds, Share, Str, Weight, refuse, section
from app.conversations.bounded import RecordBounds
from app.conversations.records import RenderMode
from app.kv.hashing import DEFAULT_HASH_SEED
from app.turn.routing import RoutingPolicy


@section
class AppConfig:
    # ---- the model and the engines (vLLM arguments the app reads or gives every engine alike) ----
    model: Str = TINY_MODEL
    """Model path or hub id; "tiny-qwen3" builds the embedded random-weight model on first start."""
    served_model_name: Str = ""
    """Name clients pass as `model`; empty: `model` as given, as vLLM's server names it."""
    model_cache_dir: Str = "~/.cache/kv-loop"
    """Where the embedded model is built."""
    tool_call_parser: Str = "hermes"
    """vLLM's tool parser for the model family ("hermes" for Qwen3's JSON calls). Empty: requests
    offering `tools` get 400 unless their tool_choice is "none"."""
    tool_strict_level: Str = "auto"
    """vLLM's server's `--tool-strict-level`, with its meaning: "auto" holds a required or named
    call's arguments to the tool's schema only for tools marked `strict`; "function" constrains every
    request with tools to a well-formed call envelope; "parameter" also holds every tool's arguments
    to its schema, as if each were `strict` (agents that send schemas without `strict` get calls
    their code can parse)."""
    reasoning_parser: Str = ""
    """vLLM's reasoning parser ("qwen3" for Qwen3): replies carry their reasoning apart from
    `content`, and a grammar starts where it ends. Empty: the reasoning stays in `content`."""
    device: Device = Device.CPU
    """cpu or cuda: where the engines run."""
    tensor_parallel_size: Count = 1
    """Tensor-parallel ranks per engine; on cuda each rank holds one GPU of the engine's replica."""
    pipeline_parallel_size: Count = 1
    """Pipeline stages per engine. An engine's ranks (tensor x pipeline) run under its Serve replica,
    on one node: one engine spans one node at most."""
    engine_kwargs: Mapping[Str, Any] = Field(default_factory=dict)
    """vLLM engine arguments for every engine, passed through unchanged (dtype, quantization,
    kv_cache_dtype, enforce_eager, ...) over the app's defaults for the device; a group's own
    `engine_kwargs` go over these. Names are checked against vLLM's EngineArgs when the config loads,
    values by vLLM. The arguments the app sets itself (APP_ENGINE_ARGS) are refused: set its keys."""
    block_size: Count = 32
    """Tokens per KV block (the router hashes the same blocks); on CPU a multiple of 32. Smaller
    blocks reuse more of a shared prefix, for more blocks to track and move."""
    max_model_len: Count = 8192
    """Context length: the longest conversation; longer costs KV pool per sequence."""
    engine_max_num_seqs: Count = 128
    """Sequences one engine runs at once (vLLM's max_num_seqs); every reply streams from decode, so
    this bounds the conversations in flight per decode replica. Larger batches, slower tokens each."""
    prefill: EngineGroupConfig = Field(default_factory=EngineGroupConfig)
    decode: EngineGroupConfig = Field(default_factory=EngineGroupConfig)
    router_replicas: Count = 1
    """Router replicas (they share conversation records through the KV index), and as many frontend
    replicas (the HTTP ingress, which moves a reply to another router replica if its replica dies)."""
    # ---- KV reuse across turns ----
    retention_ttl_s: Seconds = 120.0
    """How long decode keeps a finished sequence's blocks for the next turn (think time): longer
    serves slower users' next turns from KV, holding pool that new turns may need."""
    reverse_pull: Bool = True
    """Pull the previous turn's KV back from decode; off, prefill always recomputes history."""
    recompute_threshold_tokens: Natural = 256
    """Pull only when it saves at least this many tokens of prefill over the local cache: below it a
    transfer's fixed cost exceeds the compute it saves (benchmarks/reverse_pull.py --sweep measures it)."""
    max_recomputed_history: Share = 0.05
    """Pull, whatever the threshold, when recomputing would compute more than this share of the history
    decode retains: the threshold spares a short append a transfer's fixed cost, this bounds the prefill
    a long history costs again each turn (1: the threshold alone decides)."""
    tool_pause_s: Delay = 30.0
    """A reply to a request that offers tools may end in tool calls: decode's trimming takes such a
    retained sequence after every other for this long (0: no pause). At most retention_ttl_s."""
    handoff_lease_s: Count = 120
    """How long prefill holds a turn's blocks for decode to read (vLLM's kv_lease_duration on
    prefill); a turn that ends unread releases them at once, so this is a backstop for a lost
    decode. Decode's heartbeats (every retention_ttl_s / 6) must come 3x inside each extension (2/3 of it)."""
    expiry_margin_s: Delay = 5.0
    """Decline retained blocks that expire sooner than this: the pull must finish first."""
    min_local_horizon_s: Delay = 30.0
    """A prefill replica's cached blocks spare a pull only where its eviction horizon is at least
    this long: higher pulls more often instead of trusting a fast-turning pool."""
    max_decode_prefill_tokens: Natural = 2048
    """The most prompt tokens a decode replica computes for one turn (its streams stall meanwhile):
    a later turn adding at most this many to what decode retains may run whole there, with no prefill
    hop or transfer. 0: every turn goes through prefill."""
    placement: Placement = Field(default_factory=Placement)
    first_token_from_prefill: Bool = True
    """Send the client the first token prefill samples and let decode continue after it, so TTFT
    excludes decode's KV read and first step. Off: decode samples it (vLLM's disaggregated flow)."""
    later_turns_first: Bool = True
    """Engines schedule by priority (vLLM's "priority" policy): a later turn's prompt goes ahead of
    first turns waiting in the same engine; off: first come, first served."""
    later_turns_before_chunks: Bool = True
    """With later_turns_first: in a step where a later turn waits, first turns' running chunks sit
    that step out (app/engine/scheduler.py); off, every running chunk goes first."""
    kv_events: Bool = True
    """Prefill engines publish vLLM KV cache events and the KV index follows them (decode's are
    unread and off): off, the index knows prefill's cache from the router's predictions only."""
    prefix_hash_seed: Int = DEFAULT_HASH_SEED
    """PYTHONHASHSEED of every engine: vLLM's root block hash, which the router's hashes must share."""
    nixl_backends: tuple[Str, ...] = Field(default=("UCX",), min_length=1)
    """NIXL transfer backends: UCX here, LIBFABRIC on EFA. An engine replica stops at start, naming
    the missing library, if one does not load."""
    nixl_fallback_to_ucx: Bool = False
    """A requested backend that does not load is replaced by UCX instead of stopping the replica: a
    slow service (KV over TCP on EFA nodes) instead of a stopped one."""
    # ---- engines on CPU cores they share with the serving path (cpu, or cpu_tuning_on_gpu) ----
    cpu_tuning_on_gpu: Bool = False
    """Apply the shared-core tuning below on cuda too; by default it applies on cpu only."""
    bind_engine_cores: Bool = True
    """Pin each CPU engine's OpenMP threads to its own core: engines sharing a core wait for each other."""
    engine_nice: Int = Field(default=19, ge=0, le=19)
    """Each engine's processes run at this nice value, so the serving path's Python runs ahead of a
    prefill's compute; it acts only above the replicas' own (Ray's worker niceness). 0: inherited."""
    engine_busy_poll_s: Seconds = 0.001
    """How long an engine's worker and EngineCore spin on their shared-memory queue after each
    message before blocking: longer answers sooner, burning a core meanwhile."""
    engine_queue_recheck_ms: Count = 2
    """How often a busy reader of those queues, blocked, rechecks it: bounds what a lost notification
    costs while requests run."""
    engine_idle_recheck_ms: Count = 100
    """The longest recheck of a reader idle for a while (it rechecks every 5 % of its idle time, from
    engine_queue_recheck_ms up to this): an idle engine's worker wakes this often; a notification
    lost after an idle spell costs up to this."""
    engine_idle_poll_s: Delay = 5.0
    """An engine holding only finished turns for remote readers polls its connector this often instead
    of stepping (0: vLLM's busy loop): longer saves CPU, and delays noticing a reader's release."""
    nixl_poll_delay_us: Natural = 10_000
    """NIXL's progress thread's periodic wakeup beside its workers' event fds, which wake it at once
    (NIXL rounds it up to whole milliseconds; 0, NIXL's own, spins a core per engine): shorter
    bounds what an event poll() misses costs a transfer, for more wakeups of an idle engine."""
    # ---- routing and conversations ----
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    """kv_aware, session_affinity, round_robin or least_loaded (app/turn/routing.py)."""
    cost_per_token: Weight = 1.0
    """kv_aware: cost of one prompt token prefill must compute."""
    load_weight: Weight = 0.5
    """kv_aware: cost of one prefill token already queued on the replica; higher spreads load at the
    expense of cache hits."""
    transfer_cost_per_token: Weight = 0.05
    """kv_aware: cost of one token pulled from decode instead of computed."""
    conversation_mode: RenderMode = RenderMode.PRESERVE
    """preserve: append each turn to the previous turn's exact tokens; template: re-render history."""
    conversation_ttl_s: Seconds = 1800.0
    """How long a finished turn's record can serve the next turn."""
    max_conversations: Count = 100_000
    """Records kept per router replica and in the KV index's shared copy (the oldest go first)."""
    conversation_store_mib: Count = 512
    """Bytes of records (tokens at 4 bytes each) per router replica and in the index's copy."""
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    limits: Limits = Field(default_factory=Limits)
    replica_runtime: ReplicaRuntime = Field(default_factory=ReplicaRuntime)
    # ---- tenants and access ----
    api_keys: Mapping[Str, Str] = Field(default_factory=dict)
    """API key -> tenant. Empty: every request is tenant "default". Set: unknown keys get 401. A key
    may be given as `sha256:<hex digest>`, so the config holds no key."""
    admin_api_keys: tuple[Str, ...] = ()
    """Keys that may read /admin/*; once api_keys or these are set, /admin answers no one else."""
    secrets_env: Str = ""
    """An environment variable holding `api_keys`, `admin_api_keys` and `salt_secret` as JSON, read
    where the graph is built (set it on every node), so that no key sits in a Serve config."""
    salt_secret: Str = ""
    """The secret each tenant's cache salt derives from; empty: drawn at random per deploy."""
    per_user_salt_tenants: tuple[Str, ...] = ()
    """Tenants whose cache salt is per user (the request's `user`): no KV shared between their users."""
    allow_open_api: Bool = False
    """Serve without api_keys on an HTTP host beyond loopback (a development server)."""
    openapi_docs: Bool = False
    """Serve /docs, /redoc and /openapi.json, without a key."""

    @model_validator(mode="after")
    def _relations(self) -> "AppConfig":
        groups = {name: getattr(self, name).engine_kwargs for name in GROUPS}
        scheduler = {name: self.scheduler_args(name) for name in GROUPS}
        refuse(relation_problems(self) + engine_kwargs_problems(self.engine_kwargs, groups, scheduler)
               + tool_strict_level_problems(self.tool_strict_level))
        return self

    def engine_kwargs_of(self, group: str) -> dict[str, Any]:
        """The vLLM engine arguments a group's engines get beyond the app's own: the device's
        defaults, then the top-level engine_kwargs, then the group's."""
        return {**default_engine_kwargs(self.device, self.model, self.engine_max_num_seqs), **self.engine_kwargs,
                **getattr(self, group).engine_kwargs}

    def scheduler_args(self, group: str) -> dict[str, Any]:
        """The group's arguments that vLLM's SchedulerConfig checks against each other."""
        kwargs = self.engine_kwargs_of(group)
        return {"max_num_seqs": self.engine_max_num_seqs, "max_model_len": self.max_model_len,
                **{key: kwargs[key] for key in SCHEDULER_ARGS if key in kwargs}}

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
        engines (a collision would hand one tenant another's KV), the faster xxhash for one tenant."""
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

    def model_path(self) -> Path:
        """The folder engines and the tokenizer load (the embedded model's build folder)."""
        if self.model == TINY_MODEL:
            return Path(os.path.expanduser(self.model_cache_dir)) / TINY_MODEL
        return Path(self.model)
