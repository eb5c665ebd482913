"""Small builders for the messages the tests pass around (defined once, shared by unit tests)."""

from app.protocol import EngineEndpoint, KVHandoff, ReplicaInfo, RetainedBlocks, Role

BLOCK = 32


def endpoint(name: str = "decode-0") -> EngineEndpoint:
    return EngineEndpoint(engine_id=name, host="127.0.0.1", port=5600)


def handoff(num_tokens: int, expiry_time: float, name: str = "decode-0", request_id: str = "r1") -> KVHandoff:
    blocks = tuple(range(100, 100 + -(-num_tokens // BLOCK)))
    return KVHandoff(source=endpoint(name), block_ids=(blocks,), num_tokens=num_tokens, request_id=request_id,
                     expiry_time=expiry_time, engine_expiry=expiry_time)


def retained(token_ids: list[int], expiry_time: float, replica_id: str = "d0", request_id: str = "r1",
             num_prompt_tokens: int | None = None) -> RetainedBlocks:
    return RetainedBlocks(replica_id=replica_id, handoff=handoff(len(token_ids), expiry_time, request_id=request_id),
                          token_ids=tuple(token_ids), num_prompt_tokens=num_prompt_tokens or len(token_ids))


def replica(replica_id: str, role: Role = Role.PREFILL, prefix_caching: bool = True) -> ReplicaInfo:
    return ReplicaInfo(replica_id=replica_id, role=role, endpoint=endpoint(replica_id),
                       prefix_caching=prefix_caching, block_size=BLOCK)
