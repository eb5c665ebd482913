"""Prefill group: computes a prompt's KV, or pulls the leading blocks from a decode replica over
NIXL, and holds it for decode to read; samples the turn's first token when the router asks.
router ──PrefillRequest──▶ here ──PrefillResult──▶ router
"""

import time
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.engine.adapter import engine_timing, from_vllm_params, hold_params, to_vllm_params, token_logprobs
from app.protocol import PrefillRequest, PrefillResult, ReplyChunk, Role, SamplingSettings
from deployments.autoscaling import QUEUED_PREFILL_TOKENS, QueuedTokens
from deployments.engine_replica import EngineReplica
from deployments.targeted_router import TargetedRequestRouter

PROBE = SamplingSettings(max_tokens=1, temperature=0.0)
"""Without first_token: one greedy token, discarded; decode samples the turn's first token."""


class KVPullFailed(RuntimeError):
    """The engine could not read the planned blocks; the router recomputes instead."""


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=TargetedRequestRouter))
class PrefillServer(EngineReplica):
    role = Role.PREFILL

    async def __init__(self, config, index) -> None:
        await super().__init__(config, index)
        self.queued_tokens = QueuedTokens()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        return {**await super().record_autoscaling_stats(), QUEUED_PREFILL_TOKENS: self.queued_tokens.mean_since_read()}

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        # do_remote_decode: keep the prompt's blocks for decode; the pull fields (if any) make
        # prefill read the history's blocks from decode first.
        params = to_vllm_params(request.pull, Role.PREFILL) if request.pull else hold_params()
        called_at, timing, deltas = time.monotonic(), None, []
        stream = self.engine.generate(request.request_id, request.prompt_token_ids, request.cache_salt,
                                      engine_settings(request, self.config.block_size), params, request.priority)
        queued = len(request.prompt_token_ids) - (request.pull.num_tokens if request.pull else 0)
        self.queued_tokens.add(queued)
        try:
            async for output in stream:
                timing = timing or engine_timing(output, called_at)
                deltas.append(output)
        finally:
            self.queued_tokens.add(-queued)
        final = deltas[-1] if deltas else None
        if final is None or final.outputs[0].finish_reason == "error" or not final.kv_transfer_params:
            raise KVPullFailed(f"prefill of {request.request_id} failed (pull planned: {request.pull is not None})")
        first = first_chunk(deltas, request.first_token.max_tokens) if request.first_token else None
        # Decode reads the prompt's blocks, and the first token's when it continues from it.
        decode_tokens = len(request.prompt_token_ids) + (first is not None and first.finish_reason is None)
        handoff = from_vllm_params(final.kv_transfer_params).prefix(decode_tokens, self.config.block_size)
        return PrefillResult(replica_id=self.replica_id, handoff=handoff,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_cached_tokens=final.num_cached_tokens or 0,
                             pool_tokens=self.engine.pool_tokens, first_chunk=first, engine_timing=timing)


def engine_settings(request: PrefillRequest, block_size: int) -> SamplingSettings:
    """One token, or two when the prompt fills its last block: decode, continuing after the first
    token, reads as many blocks as prompt + first token fill and recomputes that token's KV,
    so that block must exist on prefill, and only sampling a second token writes it."""
    if request.first_token is None:
        return PROBE
    tokens = min(request.first_token.max_tokens, 2 if len(request.prompt_token_ids) % block_size == 0 else 1)
    return replace(request.first_token, max_tokens=tokens, min_tokens=min(request.first_token.min_tokens, tokens))


def first_chunk(deltas: list[Any], turn_max_tokens: int) -> ReplyChunk | None:
    """The turn's first token, if it came alone and with its text (a token that ends inside a
    UTF-8 character, or an unprinted special token, has none yet: decode then samples it).
    Its finish reason is the turn's only when the turn ends there, not at prefill's own limit."""
    first = deltas[0].outputs[0]
    if len(first.token_ids) != 1 or not first.text:
        return None
    ends = first.finish_reason == "stop" or (first.finish_reason == "length" and turn_max_tokens == 1)
    return ReplyChunk(token_ids=tuple(first.token_ids), text=first.text,
                      finish_reason=first.finish_reason if ends else None, logprobs=token_logprobs(first))
