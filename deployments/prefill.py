"""Prefill group: computes a prompt's KV, or pulls the leading blocks from a decode replica over
NIXL, and holds it for decode to read. router ──PrefillRequest──▶ here ──PrefillResult──▶ router.
"""

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.engine import from_vllm_params, to_vllm_params
from app.protocol import KVHandoff, PrefillRequest, PrefillResult, Role, SamplingSettings
from deployments.engine_replica import EngineReplica
from deployments.targeted_router import TargetedRequestRouter


class KVPullFailed(RuntimeError):
    """The engine could not read the planned blocks; the router recomputes instead."""


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=TargetedRequestRouter))
class PrefillServer(EngineReplica):
    role = Role.PREFILL

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        # do_remote_decode: keep the prompt's blocks for decode; the pull fields (if any) make
        # prefill read the history's blocks from decode first.
        params = to_vllm_params(request.pull, Role.PREFILL) if request.pull else {"do_remote_decode": True}
        final = None
        stream = self.engine.generate(request.request_id, request.prompt_token_ids, request.cache_salt,
                                      SamplingSettings(max_tokens=1, temperature=0.0), params)
        async for output in stream:
            final = output
        if final is None or final.outputs[0].finish_reason == "error" or not final.kv_transfer_params:
            raise KVPullFailed(f"prefill of {request.request_id} failed (pull planned: {request.pull is not None})")
        return PrefillResult(replica_id=self.replica_id, handoff=from_vllm_params(final.kv_transfer_params),
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_cached_tokens=final.num_cached_tokens or 0,
                             pool_tokens=self.engine.pool_tokens)

    async def release(self, handoff: KVHandoff) -> None:
        await self.engine.release(handoff)
