"""The engine adapter: the only code that turns AppConfig into vLLM/NIXL settings and KVHandoff
into vLLM's kv_transfer_params (and back). Prefill and decode replicas each hold one Engine.

    AppConfig ──engine_env/engine_args──▶ AsyncLLM(NixlConnector, bidirectional)
    KVHandoff ──to_pull_params──▶ kv_transfer_params ──from_vllm_params──▶ KVHandoff
"""

import asyncio
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from app.config import AppConfig, Device, EngineGroupConfig
from app.engine.idle_poll import IDLE_POLL_ENV
from app.engine.nixl_worker import POLL_DELAY_ENV
from app.engine.ports import free_port
from app.engine.process import plugin_env
from app.metrics import kv_bytes_per_token
from app.protocol import EngineEndpoint, EngineTiming, KVHandoff, LoadReport, Role, SamplingSettings, TokenLogprobs

DEAD_ENGINE_POLL_S = 0.1
"""How often a request waiting on the engine checks that the engine process lives."""


MIN_MEASURED_TOKENS = 32
"""A prefill measures the engine's compute cost only when it computed at least this many tokens."""
COST_SMOOTHING = 0.2


class LoadTracker:
    """Keeps the engine's LoadReport current: vLLM's scheduler stats every step, its finished
    prefills and its NIXL transfers for the measured costs."""

    def __init__(self, kv_bytes_per_token: int, probe_window: int = 1, ranks: int = 1,
                 nixl_backends: tuple[str, ...] = ()) -> None:
        self.report = LoadReport(nixl_backends=nixl_backends)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.ranks = ranks
        """The engine's workers (tensor x pipeline parallel): vLLM reports each one's transfers."""
        self.probes: deque[float] = deque(maxlen=probe_window)
        """The last probes' costs (s a token); the least of them stands."""
        self.measured_at = 0.0
        """When the compute cost was last measured (time.monotonic())."""
        self.stepped_at = 0.0
        """When the last step's stats came (time.monotonic())."""

    def observe_step(self, running: int, waiting: int, kv_cache_usage: float, now: float | None = None) -> None:
        """Each step's stats; the time since the step before is a step's wall time if requests ran
        through it (else the engine was idle in between)."""
        now = time.monotonic() if now is None else now
        step_s = self.report.step_s
        if self.report.num_running_reqs and self.stepped_at:
            step_s = _smoothed(step_s, now - self.stepped_at)
        self.stepped_at = now
        self.report = replace(self.report, num_running_reqs=running, num_waiting_reqs=waiting,
                              kv_cache_usage=kv_cache_usage, step_s=step_s)

    def observe_prefill(self, seconds: float, computed_tokens: int, others_in_engine: int) -> None:
        """A finished prefill's time (vLLM's `prefill_time`) per token it computed, taken only when it
        ran alone: beside other requests a prefill's time includes theirs, and that cost times the
        queued tokens counted the queue twice (measured at 64 conversations: 600 us against 60-100
        alone, and every first turn's estimate three times its measured time)."""
        if computed_tokens >= MIN_MEASURED_TOKENS and seconds > 0 and others_in_engine == 0:
            cost = _smoothed(self.report.compute_s_per_token, seconds / computed_tokens)
            self.report = replace(self.report, compute_s_per_token=cost)
            self.measured_at = time.monotonic()

    def observe_probe(self, seconds_per_token: float) -> None:
        """A timed prefill the engine ran alone; the least of the recent probes is its cost. An
        idle engine's probe is slowed only by other processes (in a sweep, other systems under
        load: 115-740 us a token, against 64-146 on an idle machine), which its turns may never
        meet; the app's own load reaches the estimate through the turns' calibration instead."""
        self.probes.append(seconds_per_token)
        self.report = replace(self.report, compute_s_per_token=min(self.probes))
        self.measured_at = time.monotonic()

    def observe_transfers(self, stats: dict[str, Any]) -> None:
        """NIXL's transfer telemetry of this engine's reads (durations in s, sizes in bytes), one record
        per transfer per rank: the ranks' bytes add up to the tokens moved, and the ranks pull at once,
        so the time is the slowest rank's (their sum would make a pull at TP 8 look 8 times dearer)."""
        moved = sum(stats.get("bytes_transferred") or ())
        if moved and self.kv_bytes_per_token:
            seconds = slowest_rank_seconds(stats.get("transfer_duration") or [], self.ranks)
            cost = _smoothed(self.report.pull_s_per_token, seconds / (moved / self.kv_bytes_per_token))
            self.report = replace(self.report, pull_s_per_token=cost)


def slowest_rank_seconds(durations: list[float], ranks: int) -> float:
    """The time of the slowest rank's transfers. vLLM lists the ranks' records one rank after another
    (KVOutputAggregator extends rank 0's NixlKVConnectorStats with each other rank's), so `durations`
    splits into `ranks` contiguous equal parts when its length divides. Otherwise the ranks finished
    different numbers of transfers in the step and their records cannot be told apart: the total over
    all ranks then stands, which never understates the slowest rank's time (a dear pull makes placement
    recompute: slower, never wrong)."""
    per_rank, uneven = divmod(len(durations), ranks)
    if uneven:
        return sum(durations)
    return max(sum(durations[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))


def _smoothed(previous: float, sample: float) -> float:
    return sample if previous == 0 else previous + COST_SMOOTHING * (sample - previous)


def load_logger_factory(load: LoadTracker):
    """A vLLM stat-logger factory that feeds each step's stats to `load`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            finished = iteration_stats.finished_requests if iteration_stats else ()
            if len(finished) == 1:
                others = scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs
                load.observe_prefill(finished[0].prefill_time,
                                     finished[0].num_prompt_tokens - finished[0].num_cached_tokens, others)
            load.observe_step(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                              scheduler_stats.kv_cache_usage)
            if scheduler_stats.kv_connector_stats:
                load.observe_transfers(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger


@dataclass(frozen=True)
class EngineIdentity:
    role: Role
    engine_id: str
    host: str
    port: int
    cpu_cores: tuple[int, ...]
    """One core per rank, on CPU where cores are bound; empty otherwise."""

    @property
    def engine_events_endpoint(self) -> str:
        """Where vLLM publishes its KV cache events: an ipc socket, on the node only (they carry every
        tenant's prompt token ids). Its replica reads them there and pushes the KV index their block
        hashes only (app/kv_events.forward); no event socket is on the network, and the node's other
        users cannot enter its folder."""
        return f"ipc://{private_socket_dir()}/events-{self.engine_id}"


def private_socket_dir() -> str:
    """This user's folder for the engines' ipc sockets, mode 0700. One that exists with another
    owner or wider access (made by someone else to read the sockets) is refused."""
    path = os.path.join(tempfile.gettempdir(), f"kv-loop-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    found = os.stat(path)
    if found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise PermissionError(f"{path} must belong to uid {os.getuid()} with mode 0700 (it holds the KV event "
                              f"sockets, which carry prompt token ids); found uid {found.st_uid}, "
                              f"mode {oct(found.st_mode & 0o777)}")
    return path


def assign_identity(config: AppConfig, role: Role, rank: int, host: str) -> EngineIdentity:
    """A unique engine id and side-channel port per replica; a core of its own per engine rank where
    there is one. Prefill takes cores from the first up, decode from the last down: replicas that
    autoscaling adds to either group meet the other group's only when every core has a rank."""
    cores, ranks = os.cpu_count() or 1, config.engine_world_size
    first = rank * ranks
    indices = [first + i if role == Role.PREFILL else cores - 1 - first - i for i in range(ranks)]
    bound = config.device == Device.CPU and config.bind_engine_cores
    return EngineIdentity(role=role, engine_id=f"{role.value}-{rank}-{uuid.uuid4().hex[:8]}",
                          host=host, port=free_port(host),
                          cpu_cores=tuple(i % cores for i in indices) if bound else ())


def engine_plugin_env(config: AppConfig) -> dict[str, str]:
    """What app/engine/process.py reads in a CPU engine's processes (the benchmark's peers get it too)."""
    return plugin_env(config.engine_nice, config.engine_busy_poll_s, config.engine_queue_recheck_ms)


def engine_env(config: AppConfig, group: EngineGroupConfig, identity: EngineIdentity) -> dict[str, str]:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": identity.host,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(identity.port),
           # vLLM derives its root block hash from this; the router hashes with the same seed.
           "PYTHONHASHSEED": str(config.prefix_hash_seed),
           # Full block hashes in KV events, so they equal the router's (not their low 64 bits).
           "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
    if config.device == Device.CPU:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(group.kv_cache_gib)
    if config.tunes_shared_cpu:
        env.update({POLL_DELAY_ENV: str(config.nixl_poll_delay_us), IDLE_POLL_ENV: str(config.engine_idle_poll_s),
                    **engine_plugin_env(config)})
    if identity.cpu_cores:
        # vLLM's CPU workers take one "|"-separated core list per rank.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, identity.cpu_cores))
    return env


def engine_args(config: AppConfig, group: EngineGroupConfig, identity: EngineIdentity):
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    transfer = KVTransferConfig(
        kv_connector="NixlConnector", kv_role="kv_both", engine_id=identity.engine_id,
        kv_buffer_device=config.device.value, kv_load_failure_policy="fail",
        kv_connector_extra_config={
            "bidirectional_kv_xfer": True,
            "backends": list(config.nixl_backends),
            # The router decides pull vs recompute; the engine must not second-guess it.
            "kv_recompute_threshold": 0,
            "decoder_kv_blocks_ttl": config.retention_ttl_s,
            # How long an engine holds blocks it computed for a reader: on prefill the handoff to
            # decode; on decode the turns it prefilled itself, which the next turn's prefill may pull.
            # Decode heartbeats prefill's leases every (its lease / 6) s, well inside prefill's
            # extension of 2/3 of its lease (AppConfig checks the margin).
            "kv_lease_duration": int(config.retention_ttl_s) if identity.role == Role.DECODE
            else int(config.handoff_lease_s),
        })
    path = str(config.model_path())
    return AsyncEngineArgs(
        **config.engine_kwargs,
        model=path, tokenizer=path, served_model_name=[config.model_name], dtype=config.engine_dtype,
        reasoning_parser=config.reasoning_parser,  # a grammar starts where the reasoning ends
        max_logprobs=config.limits.max_logprobs,
        block_size=config.block_size, max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager, enable_prefix_caching=group.prefix_caching,
        prefix_caching_hash_algo=config.prefix_hash_algo,
        tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
        distributed_executor_backend=config.executor_backend,
        gpu_memory_utilization=group.gpu_memory_utilization,
        num_gpu_blocks_override=group.num_gpu_blocks_override or None,
        stream_interval=config.stream_interval_tokens, max_num_seqs=config.engine_max_num_seqs,
        max_num_batched_tokens=group.max_batched_tokens,
        long_prefill_token_threshold=group.long_prefill_tokens,
        scheduling_policy=scheduling_policy(config), scheduler_cls=scheduler_class(config),
        kv_transfer_config=transfer,
        worker_extension_cls="app.engine.nixl_worker.NixlWorkerExtension" if config.tunes_shared_cpu else "",
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=identity.engine_events_endpoint)
        if publishes_kv_events(config, identity.role) else None,
        disable_log_stats=False)


def publishes_kv_events(config: AppConfig, role: Role) -> bool:
    """Whether an engine of `role` publishes KV cache events (AppConfig.kv_events: prefill only)."""
    return config.kv_events and role == Role.PREFILL


def scheduling_policy(config: AppConfig) -> str:
    """vLLM's scheduling policy of every engine (the benchmark's peers' too)."""
    return "priority" if config.later_turns_first else "fcfs"


def scheduler_class(config: AppConfig) -> str | None:
    """vLLM's scheduler class of every engine (the peers' too): app/engine/scheduler.py's, or vLLM's own (None).
    On the CPU vLLM turns async scheduling off, so the synchronous scheduler is the one it would pick."""
    if not (config.later_turns_first and config.later_turns_before_chunks):
        return None
    return "app.engine.scheduler." + ("LaterTurnsFirstScheduler" if config.device == Device.CPU
                               else "LaterTurnsFirstAsyncScheduler")


def sampling_params(settings: SamplingSettings, kv_transfer_params: dict[str, Any]):
    """vLLM's SamplingParams of a request; its constructor refuses what vLLM would not run (the
    router builds them with this same function to refuse a request before any engine sees it)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # not `from vllm`: 4 us a call

    structured = StructuredOutputsParams(
        regex=settings.regex, json=settings.json_schema, json_object=settings.json_object or None,
        structural_tag=settings.structural_tag) if settings.grammar else None
    allowed = settings.allowed_token_ids
    # from_optional: vLLM's own mapping of request values (logit_bias keys to token ids, clamped)
    return SamplingParams.from_optional(
        max_tokens=settings.max_tokens, min_tokens=settings.min_tokens, temperature=settings.temperature,
        top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p, seed=settings.seed,
        presence_penalty=settings.presence_penalty, frequency_penalty=settings.frequency_penalty,
        repetition_penalty=settings.repetition_penalty, stop=list(settings.stop) or None,
        stop_token_ids=list(settings.stop_token_ids) or None, bad_words=list(settings.bad_words) or None,
        include_stop_str_in_output=settings.include_stop_str_in_output, ignore_eos=settings.ignore_eos,
        logit_bias=dict(settings.logit_bias) or None, allowed_token_ids=None if allowed is None else list(allowed),
        skip_special_tokens=settings.skip_special_tokens,
        spaces_between_special_tokens=settings.spaces_between_special_tokens, logprobs=settings.logprobs,
        structured_outputs=structured, extra_args={"kv_transfer_params": kv_transfer_params})


def token_logprobs(completion: Any) -> tuple[TokenLogprobs, ...] | None:
    """vLLM's logprobs of a completion's new tokens as plain tuples (they cross deployments)."""
    if completion.logprobs is None:
        return None
    return tuple(tuple((token_id, p.logprob, p.rank, p.decoded_token) for token_id, p in step.items())
                 for step in completion.logprobs)


# ---- kv_transfer_params, both directions ------------------------------------------------------
def hold_params() -> dict[str, Any]:
    """Params that make an engine compute the prompt itself and, when the request finishes, hold
    its blocks for a remote reader (the engine's lease; vLLM updates the dict in place)."""
    return {"do_remote_decode": True}


def to_vllm_params(handoff: KVHandoff, reader: Role) -> dict[str, Any]:
    """Params that make `reader` read `handoff`'s blocks: decode reads prefill's
    (do_remote_prefill); prefill reads decode's (do_remote_decode, bidirectional)."""
    params: dict[str, Any] = {
        "remote_block_ids": [list(group) for group in handoff.block_ids],
        "remote_engine_id": handoff.source.engine_id, "remote_request_id": handoff.request_id,
        "remote_host": handoff.source.host, "remote_port": handoff.source.port,
        "tp_size": handoff.source.tp_size, "remote_num_tokens": handoff.num_tokens}
    if reader == Role.DECODE:
        params.update(do_remote_prefill=True, do_remote_decode=False)
    else:
        params.update(do_remote_prefill=False, do_remote_decode=True)
        if handoff.engine_expiry is not None:
            params["remote_blocks_expiry_time"] = handoff.engine_expiry
    return params


def from_vllm_params(params: dict[str, Any], hold_s: float | None = None) -> KVHandoff:
    """The engine's returned params as a handoff; its expiry (the owner's monotonic clock, same
    host) becomes Unix time so the router can compare it with its own clock. `hold_s`: the
    engine's lease, for holds whose params carry no deadline (those of hold_params requests)."""
    engine_expiry = params.get("remote_blocks_expiry_time")
    if engine_expiry is None and hold_s is not None:
        engine_expiry = time.perf_counter() + hold_s
    expiry = time.time() + (engine_expiry - time.perf_counter()) if engine_expiry else 0.0
    source = EngineEndpoint(engine_id=params["remote_engine_id"], host=params["remote_host"],
                            port=int(params["remote_port"]), tp_size=int(params.get("tp_size", 1)))
    return KVHandoff(source=source, block_ids=tuple(tuple(g) for g in params["remote_block_ids"]),
                     num_tokens=int(params.get("remote_num_tokens") or 0),
                     request_id=params["remote_request_id"], expiry_time=expiry,
                     engine_expiry=engine_expiry)


def engine_timing(output: Any, called_at: float) -> EngineTiming | None:
    """The first output's way through the engine (`called_at`: time.monotonic() of the call; vLLM's
    engine-core timestamps are on the same monotonic clock)."""
    stats = output.metrics
    if stats is None or not stats.first_token_ts:
        return None
    ms = lambda seconds: round(seconds * 1e3, 2)  # noqa: E731
    return EngineTiming(admit_ms=ms(stats.queued_ts - called_at), queued_ms=ms(stats.scheduled_ts - stats.queued_ts),
                        step_ms=ms(stats.first_token_ts - stats.scheduled_ts),
                        deliver_ms=ms(time.monotonic() - stats.first_token_ts))


class EngineDied(RuntimeError):
    """The engine process died while a request waited on it."""


async def while_alive(outputs: AsyncIterator[Any], is_dead: Callable[[], bool], poll_s: float) -> AsyncIterator[Any]:
    """`outputs`, failing within `poll_s` once `is_dead()`: a request sent just as the engine process
    dies would otherwise wait for vLLM's own cleanup (seconds) before it learns. Closing this
    (the caller cancelled) cancels the pending read, which makes vLLM abort the request."""
    iterator, pending = outputs.__aiter__(), None
    try:
        while True:
            pending = asyncio.ensure_future(iterator.__anext__())
            while not (await asyncio.wait({pending}, timeout=poll_s))[0]:
                if is_dead():
                    raise EngineDied("the engine process died")
            try:
                output = pending.result()
            except StopAsyncIteration:
                return
            yield output
    finally:
        if pending is not None and not pending.done():
            pending.cancel()


class Engine:
    """One in-process vLLM AsyncLLM with a NIXL connector, as prefill or decode."""

    def __init__(self, config: AppConfig, role: Role, rank: int, host: str) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        group = config.prefill if role == Role.PREFILL else config.decode
        self.identity = assign_identity(config, role, rank, host)
        os.environ.update(engine_env(config, group, self.identity))
        self.endpoint = EngineEndpoint(engine_id=self.identity.engine_id, host=host,
                                       port=self.identity.port, tp_size=config.tensor_parallel_size)
        self.tracker = LoadTracker(kv_bytes_per_token(config.model_path()), config.placement.probe_window,
                                   config.engine_world_size, config.nixl_backends)
        # RayPrometheusStatLogger: vLLM's own metrics through Ray's endpoint (the dashboard's engine panels).
        self.llm = AsyncLLM.from_engine_args(engine_args(config, group, self.identity),
                                             stat_loggers=[load_logger_factory(self.tracker), RayPrometheusStatLogger])
        cache = self.llm.vllm_config.cache_config
        self.pool_blocks = cache.num_gpu_blocks or 0
        self.pool_tokens = self.pool_blocks * cache.block_size
        self.in_flight, self.quiet_since = 0, time.monotonic()

    @property
    def load(self) -> LoadReport:
        """The engine's load and measured costs as of its last step."""
        return self.tracker.report

    async def generate(self, request_id: str, prompt_token_ids: tuple[int, ...], cache_salt: str,
                       settings: SamplingSettings, kv_transfer_params: dict[str, Any],
                       priority: int = 0) -> AsyncIterator[Any]:
        """The request's outputs (deltas); EngineDied within DEAD_ENGINE_POLL_S of the engine's death."""
        self.in_flight += 1
        try:
            async with aclosing(self._outputs(request_id, prompt_token_ids, cache_salt, settings,
                                              kv_transfer_params, priority)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self.in_flight -= 1
            self.quiet_since = time.monotonic()

    def _outputs(self, request_id: str, prompt_token_ids: tuple[int, ...], cache_salt: str,
                 settings: SamplingSettings, kv_transfer_params: dict[str, Any], priority: int = 0
                 ) -> AsyncIterator[Any]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(settings, kv_transfer_params)
        params.output_kind = RequestOutputKind.DELTA
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids), cache_salt=cache_salt)
        outputs = self.llm.generate(prompt, params, request_id, priority=priority)
        return while_alive(outputs, lambda: self.llm.errored, DEAD_ENGINE_POLL_S)

    async def probe_compute_cost(self, num_tokens: int, runs: int = 2) -> None:
        """Time `runs` prefills of `num_tokens` fresh tokens (the last counts: the first pays
        first-call costs) and take it as the measured compute cost, so placement has a number
        before any real turn."""
        self.tracker.observe_probe(await self._timed_prefills(num_tokens, runs) / num_tokens)

    async def refresh_compute_cost(self, num_tokens: int, quiet_s: float, max_age_s: float) -> bool:
        """Re-time the compute cost if no request has run for `quiet_s` and the last measurement is
        older than `max_age_s`: a cost measured only from real turns goes stale on the side that
        gets none (a decode cost timed while the other engine started kept every turn off decode).
        A request that arrives during the probe voids it. True if the cost was re-measured."""
        now = time.monotonic()
        if self.in_flight or now - self.quiet_since < quiet_s or now - self.tracker.measured_at < max_age_s:
            return False
        seconds = await self._timed_prefills(num_tokens, 1)
        if self.in_flight or self.quiet_since > now:
            return False
        self.tracker.observe_probe(seconds / num_tokens)
        return True

    async def _timed_prefills(self, num_tokens: int, runs: int) -> float:
        """Seconds the last of `runs` one-token generations of `num_tokens` fresh tokens took."""
        settings = SamplingSettings(max_tokens=1, temperature=0.0)
        seconds = 0.0
        for _ in range(runs):
            salt = uuid.uuid4().hex  # nothing cached, nothing shared with real requests
            started = time.perf_counter()
            async for _output in self._outputs(f"probe-{salt}", tuple(range(1, num_tokens + 1)), salt, settings, {}):
                pass
            seconds = time.perf_counter() - started
        return seconds

    async def release(self, handoff: KVHandoff) -> None:
        """Tell the owner of `handoff` it will not be read, so it frees the blocks now, not at TTL."""
        params = {**to_vllm_params(handoff, Role.PREFILL), "do_remote_prefill": True, "do_remote_decode": False}
        await self.llm.notify_kv_transfer_request_rejected(f"release-{uuid.uuid4().hex}", params)

    def shutdown(self) -> None:
        self.llm.shutdown()
