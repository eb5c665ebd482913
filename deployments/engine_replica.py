"""What prefill and decode replicas share: build the model if needed, start the engine, keep the
KV index told that it lives (a heartbeat), stream whole turns, and report a dead engine at once.

config ──▶ Engine(role, rank) ──ReplicaInfo every heartbeat──▶ kv_index
router ──DecodeRequest──▶ generate() ──ReplyChunk…, the last with RetainedBlocks──▶ router
prefill: engine ──KV cache events (node-local ipc)──▶ here ──KVEvents, block hashes only──▶ kv_index
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from logging.handlers import MemoryHandler

import ray
from ray import serve

from app.config import TINY_MODEL, AppConfig
from app.engine.adapter import Engine, engine_timing, from_vllm_params, hold_params, to_vllm_params, token_logprobs
from app.engine.nixl_backends import resolve_backends
from app.engine.settings import publishes_kv_events
from app.engine.versions import check_supported
from app.kv import events as kv_events
from app.model.tiny import ensure_tiny_model
from app.protocol import DecodeRequest, EngineStatus, KVHandoff, ReplicaInfo, ReplyChunk, RetainedBlocks, Role
from deployments.autoscaling import KV_CACHE_USAGE, RUNNING_SEQS, WAITING_SEQS

logger = logging.getLogger("ray.serve")


class GenerationFailed(RuntimeError):
    pass


def _serve_log_targets() -> dict[MemoryHandler, logging.Handler]:
    return {h: h.target for h in logger.handlers if isinstance(h, MemoryHandler) and h.target is not None}


def _reattach(targets: dict[MemoryHandler, logging.Handler]) -> None:
    """Starting an engine applies logging.config.dictConfig (vLLM's and NIXL's setup), which closes
    every handler in the process: Serve's replica log buffer lost its file, and nothing the replica
    logged after its engine started was written. The file handler reopens on its next record."""
    for handler, target in targets.items():
        if handler.target is None:
            handler.setTarget(target)


class EngineReplica:
    """Base of the prefill and decode deployments: one engine, known to the KV index while it lives."""

    role: Role
    kept_released = 0
    """Sequences kept for next turns and released before their TTL (decode's)."""

    async def __init__(self, config: AppConfig, index) -> None:
        log_targets = _serve_log_targets()  # before anything imports NIXL or configures vLLM
        check_supported()  # the private vLLM/NIXL/Ray hooks this app relies on, before anything starts
        # A NIXL backend that does not load stops the replica here, naming the missing library, rather
        # than inside vLLM's connector once the engine is up; the engine gets the backends that load.
        config = replace(config, nixl_backends=resolve_backends(config))
        if config.model == TINY_MODEL:
            ensure_tiny_model(config.model_path())
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # Heartbeats and decode's trimming over gRPC, as the router's calls: through Ray's actor calls,
        # decode's trimming to its pool share costs both decode and the index more CPU a reply than over
        # gRPC (docs/measurements.md).
        self.config, self.index = config, index.options(_by_reference=False)
        self.request_arrived = asyncio.Event()
        """Set by every request (generate); what waits for work while the engine is idle clears it."""
        self.engine = Engine(config, self.role, context.rank.rank, ray.util.get_node_ip_address())
        group = config.prefill if self.role == Role.PREFILL else config.decode
        self.info = ReplicaInfo(replica_id=self.replica_id, role=self.role, endpoint=self.engine.endpoint,
                                prefix_caching=group.prefix_caching, block_size=config.block_size)
        # Before the KV events flow and the index knows this replica: the probe is seen by nobody.
        await self.engine.probe_compute_cost(config.placement.probe_tokens)
        loop = asyncio.get_event_loop()
        if publishes_kv_events(config, self.role):
            # The engine's events stay on the node: the index gets their block hashes, over its handle.
            kv_events.preload()
            pusher = kv_events.Pusher(self.replica_id, self.index.apply_kv_events.remote,
                                      config.limits.bookkeeping_timeout_s, config.limits.kv_events_push_interval_s,
                                      config.limits.kv_events_retry_pause_s)
            self._events = loop.create_task(kv_events.forward(self.engine.identity.engine_events_endpoint, pusher))
        _reattach(log_targets)
        await index.register.remote(self.beat())
        self._heartbeat = loop.create_task(self._heartbeat_forever())
        self._cost_refresh = loop.create_task(self._refresh_cost_forever())

    async def _heartbeat_forever(self) -> None:
        """Renew the registration while the engine lives; a dead engine falls out of the index within
        its registration TTL (and the router routes around it sooner, from the failed call)."""
        limits, sent, sent_at = self.config.limits, None, 0.0
        while not self.engine.llm.errored:
            beat = self.beat()
            if beat != sent or time.monotonic() - sent_at >= limits.quiet_poll_interval_s:
                try:
                    await asyncio.wait_for(self.index.register.remote(beat), limits.bookkeeping_timeout_s)
                    sent, sent_at = beat, time.monotonic()
                except Exception as exc:  # noqa: BLE001 - the index is restarting: the next beat re-registers
                    logger.warning("heartbeat to the KV index failed: %s", type(exc).__name__)
            await asyncio.sleep(limits.heartbeat_interval_s)
        logger.error("engine of replica %s is dead: heartbeats stopped, health checks fail", self.replica_id)

    async def _refresh_cost_forever(self) -> None:
        placement = self.config.placement
        while not self.engine.llm.errored:
            await asyncio.sleep(placement.cost_refresh_quiet_s)
            try:
                if await self.engine.refresh_compute_cost(placement.probe_tokens, placement.cost_refresh_quiet_s,
                                                          placement.cost_refresh_s):
                    logger.debug("compute cost re-timed: %.1f us/token", self.engine.load.compute_s_per_token * 1e6)
            except Exception as exc:  # noqa: BLE001 - the engine died: health checks and heartbeats say so
                logger.warning("compute cost probe failed: %s", type(exc).__name__)

    def beat(self) -> ReplicaInfo:
        """This replica with its engine's current load and costs."""
        return replace(self.info, load=self.engine.load)

    async def generate(self, request: DecodeRequest) -> AsyncIterator[ReplyChunk]:
        """Stream a reply: read prefill's handoff first, or compute the prompt here (its prefix cache
        serves what it holds). Cancelling the call aborts the engine request and frees its blocks."""
        self.request_arrived.set()
        computes_prompt = request.handoff is None
        if computes_prompt:
            params = hold_params() if request.retain else {}
        else:
            params = to_vllm_params(request.handoff, Role.DECODE)
        generated: list[int] = []
        called_at = time.monotonic()
        stream = self.engine.generate(request.request_id, request.prompt_token_ids, request.cache_salt,
                                      request.sampling, params, request.priority)
        async for output in stream:
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                raise GenerationFailed(f"{request.request_id} failed in the engine")
            timing = engine_timing(output, called_at) if computes_prompt and not generated else None
            generated.extend(completion.token_ids)
            retained = self._retained(request, generated, output.kv_transfer_params) if output.finished else None
            yield ReplyChunk(token_ids=tuple(completion.token_ids), text=completion.text,
                             finish_reason=completion.finish_reason, retained=retained,
                             num_cached_tokens=output.num_cached_tokens if computes_prompt else None,
                             engine_timing=timing, logprobs=token_logprobs(completion))

    def _retained(self, request: DecodeRequest, generated: list[int], params) -> RetainedBlocks | None:
        if not params or not params.get("remote_block_ids"):
            return None
        handoff = from_vllm_params(params, self.config.retention_ttl_s if request.handoff is None else None)
        sequence = (*request.prompt_token_ids, *generated)
        retained = RetainedBlocks(replica_id=self.replica_id, handoff=handoff,
                                  token_ids=sequence[:handoff.num_tokens],
                                  num_prompt_tokens=len(request.prompt_token_ids), tenant=request.tenant,
                                  paused_until=time.time() + request.tool_pause_s if request.tool_pause_s else 0.0)
        self.on_retained(retained)
        return retained

    def on_retained(self, retained: RetainedBlocks) -> None:
        """A finished sequence this engine now holds for the next turn (decode tracks them)."""

    async def release(self, handoff: KVHandoff) -> None:
        """Tell the engine that owns `handoff` (another replica) that nobody will read it."""
        await self.engine.release(handoff)

    async def check_health(self) -> None:
        await self.engine.llm.check_health()

    async def status(self) -> EngineStatus:
        load, manager = self.engine.load, self.engine.llm.engine_core.resources.engine_manager
        return EngineStatus(replica_id=self.replica_id, role=self.role, alive=not self.engine.llm.errored,
                            num_running_reqs=load.num_running_reqs, num_waiting_reqs=load.num_waiting_reqs,
                            kv_cache_usage=load.kv_cache_usage, pool_blocks=self.engine.pool_blocks,
                            kept_blocks=self.kept_blocks(time.time()), kept_released=self.kept_released,
                            engine_pids=tuple(p.pid for p in getattr(manager, "processes", ())))

    def kept_blocks(self, now: float) -> int:
        return 0

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom-metrics hook, called only when the group autoscales: the engine's load
        as vLLM last stepped (an idle engine's last step stands), for deployments/autoscaling.py's policies."""
        load = self.engine.load
        return {RUNNING_SEQS: load.num_running_reqs, WAITING_SEQS: load.num_waiting_reqs,
                KV_CACHE_USAGE: load.kv_cache_usage}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
