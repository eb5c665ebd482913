"""The engine adapter: one vLLM AsyncLLM per prefill or decode replica, and the only code that turns a
KVHandoff into vLLM's kv_transfer_params (and back). Its settings come from app/engine/settings.py, its load
reports from app/engine/load.py.

    AppConfig ──settings.engine_env/engine_args──▶ AsyncLLM(NixlConnector, bidirectional)
    KVHandoff ──to_vllm_params──▶ kv_transfer_params ──from_vllm_params──▶ KVHandoff
"""

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from app.config import AppConfig
from app.engine.load import LoadTracker, load_logger_factory
from app.engine.settings import assign_identity, engine_args, engine_env
from app.metrics import kv_bytes_per_token
from app.protocol import EngineEndpoint, EngineTiming, KVHandoff, LoadReport, Role, SamplingSettings, TokenLogprobs


def sampling_params(settings: SamplingSettings, kv_transfer_params: dict[str, Any]):
    """vLLM's SamplingParams of a request; its constructor refuses what vLLM would not run (the
    router builds them with this same function to refuse a request before any engine sees it)."""
    from vllm.sampling_params import SamplingParams  # `from vllm` imports lazily per call

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
        structured_outputs=structured_outputs(settings), extra_args={"kv_transfer_params": kv_transfer_params})


def structured_outputs(settings: SamplingSettings):
    """vLLM's StructuredOutputsParams of the settings' grammar; None without one."""
    from vllm.sampling_params import StructuredOutputsParams

    if not settings.grammar:
        return None
    return StructuredOutputsParams(regex=settings.regex, json=settings.json_schema,
                                   json_object=settings.json_object or None, structural_tag=settings.structural_tag)


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
        os.environ.update(engine_env(config, self.identity))
        self.endpoint = EngineEndpoint(engine_id=self.identity.engine_id, host=host,
                                       port=self.identity.port, tp_size=config.tensor_parallel_size)
        self.tracker = LoadTracker(kv_bytes_per_token(config.model_path()), config.placement.probe_window,
                                   config.engine_world_size, config.nixl_backends, config.placement.probe_tokens)
        # RayPrometheusStatLogger: vLLM's own metrics through Ray's endpoint (the dashboard's engine panels).
        self.llm = AsyncLLM.from_engine_args(engine_args(config, group, self.identity),
                                             stat_loggers=[load_logger_factory(self.tracker), RayPrometheusStatLogger])
        cache = self.llm.vllm_config.cache_config
        self.pool_blocks = cache.num_gpu_blocks or 0
        self.pool_tokens = self.pool_blocks * cache.block_size
        self.in_flight, self.quiet_since = 0, time.monotonic()
        self.dead_poll_s = config.limits.engine_dead_poll_s

    @property
    def load(self) -> LoadReport:
        """The engine's load and measured costs as of its last step."""
        return self.tracker.report

    async def generate(self, request_id: str, prompt_token_ids: tuple[int, ...], cache_salt: str,
                       settings: SamplingSettings, kv_transfer_params: dict[str, Any],
                       priority: int = 0) -> AsyncIterator[Any]:
        """The request's outputs (deltas); EngineDied within limits.engine_dead_poll_s of the engine's death."""
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
        return while_alive(outputs, lambda: self.llm.errored, self.dead_poll_s)

    async def probe_compute_cost(self, num_tokens: int, runs: int = 2) -> None:
        """Time `runs` prefills of `num_tokens` fresh tokens (the last counts: the first pays
        first-call costs) and take it as the measured compute cost, so placement has a number
        before any real turn."""
        self.tracker.observe_probe(await self._timed_prefills(num_tokens, runs) / num_tokens)

    async def refresh_compute_cost(self, num_tokens: int, quiet_s: float, max_age_s: float) -> bool:
        """Re-time the compute cost if no request has run for `quiet_s` and the last measurement is
        older than `max_age_s`: a cost measured only from real turns goes stale on the side that
        gets none (a decode cost timed while the other engine starts keeps every turn off decode).
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
