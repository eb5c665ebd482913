"""What prefill and decode replicas share: build the model if needed, start the engine, register.

config ──▶ Engine(role, rank) ──ReplicaInfo──▶ kv_index
"""

import ray
from ray import serve

from app.config import TINY_MODEL, AppConfig
from app.engine import Engine
from app.model.tiny import ensure_tiny_model
from app.protocol import KVHandoff, ReplicaInfo, Role


class EngineReplica:
    """Base of the prefill and decode deployments: one engine, known to the KV index."""

    role: Role

    async def __init__(self, config: AppConfig, index) -> None:
        if config.model == TINY_MODEL:
            ensure_tiny_model(config.model_path())
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.config, self.index = config, index
        self.engine = Engine(config, self.role, context.rank.rank, ray.util.get_node_ip_address())
        group = config.prefill if self.role == Role.PREFILL else config.decode
        await index.register.remote(ReplicaInfo(
            replica_id=self.replica_id, role=self.role, endpoint=self.engine.endpoint,
            prefix_caching=group.prefix_caching, block_size=config.block_size,
            events_endpoint=self.engine.identity.events_endpoint if config.kv_events else ""))

    async def release(self, handoff: KVHandoff) -> None:
        """Tell the engine that owns `handoff` (another replica) that nobody will read it."""
        await self.engine.release(handoff)

    async def check_health(self) -> None:
        await self.engine.llm.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
