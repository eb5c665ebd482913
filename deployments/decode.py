"""Decode group: reads prefill's KV over NIXL (or, for a short append, computes the prompt itself
from its prefix cache), streams tokens, and ends with the block metadata of the sequence it keeps
for the next turn. router ──DecodeRequest──▶ here ──ReplyChunk…──▶ router.
"""

from collections.abc import AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig

from app.engine import from_vllm_params, hold_params, to_vllm_params
from app.protocol import DecodeRequest, ReplyChunk, RetainedBlocks, Role
from deployments.engine_replica import EngineReplica
from deployments.targeted_router import TargetedRequestRouter


class DecodeFailed(RuntimeError):
    pass


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=TargetedRequestRouter))
class DecodeServer(EngineReplica):
    role = Role.DECODE

    async def decode(self, request: DecodeRequest) -> AsyncIterator[ReplyChunk]:
        computes_prompt = request.handoff is None
        params = hold_params() if computes_prompt else to_vllm_params(request.handoff, Role.DECODE)
        generated: list[int] = []
        stream = self.engine.generate(request.request_id, request.prompt_token_ids, request.cache_salt,
                                      request.sampling, params)
        async for output in stream:
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                raise DecodeFailed(f"decode of {request.request_id} failed in the engine")
            generated.extend(completion.token_ids)
            retained = self._retained(request, generated, output.kv_transfer_params) if output.finished else None
            yield ReplyChunk(token_ids=tuple(completion.token_ids), text=completion.text,
                             finish_reason=completion.finish_reason, retained=retained,
                             num_cached_tokens=output.num_cached_tokens if computes_prompt else None)

    def _retained(self, request: DecodeRequest, generated: list[int], params) -> RetainedBlocks | None:
        if not params or not params.get("remote_block_ids"):
            return None
        handoff = from_vllm_params(params, self.config.retention_ttl_s if request.handoff is None else None)
        sequence = (*request.prompt_token_ids, *generated)
        return RetainedBlocks(replica_id=self.replica_id, handoff=handoff,
                              token_ids=sequence[:handoff.num_tokens],
                              num_prompt_tokens=len(request.prompt_token_ids))
