"""AppConfig ──▶ vLLM and NIXL settings for one engine: its identity (ports, sockets), its environment and its
engine arguments. The only code that reads the app's config on the engine side."""

import os
import tempfile
import uuid
from dataclasses import dataclass

from app.config import AppConfig, Device, EngineGroupConfig
from app.engine.idle_poll import IDLE_POLL_ENV
from app.engine.nixl_worker import POLL_DELAY_ENV
from app.engine.ports import free_port
from app.engine.process import plugin_env
from app.protocol import Role


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
    return plugin_env(config.engine_nice, config.engine_busy_poll_s, config.engine_queue_recheck_ms,
                      config.engine_idle_recheck_ms)


def engine_env(config: AppConfig, identity: EngineIdentity) -> dict[str, str]:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": identity.host,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(identity.port),
           # vLLM derives its root block hash from this; the router hashes with the same seed.
           "PYTHONHASHSEED": str(config.prefix_hash_seed),
           # Full block hashes in KV events, so they equal the router's (not their low 64 bits).
           "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
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
        **config.engine_kwargs_of(identity.role.value),
        model=path, tokenizer=path, served_model_name=[config.model_name],
        reasoning_parser=config.reasoning_parser,  # a grammar starts where the reasoning ends
        max_logprobs=config.limits.max_logprobs,
        block_size=config.block_size, max_model_len=config.max_model_len,
        enable_prefix_caching=group.prefix_caching,
        prefix_caching_hash_algo=config.prefix_hash_algo,
        tensor_parallel_size=config.tensor_parallel_size, pipeline_parallel_size=config.pipeline_parallel_size,
        distributed_executor_backend=config.executor_backend,
        max_num_seqs=config.engine_max_num_seqs,
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
