"""The engines: one group's replicas and what each gets, and vLLM's engine arguments.

An engine argument the app reads (or must give every engine the same way) is an app key; every
other vLLM argument passes through `engine_kwargs` unchanged, checked against vLLM's EngineArgs.
"""

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from app.config.types import Bool, Count, Float, Natural, Share, Str, section

TINY_MODEL = "tiny-qwen3"


class Device(str, enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


@section
class EngineGroupConfig:
    """One engine role (prefill or decode): how many replicas and what each one gets."""

    replicas: Count = 1
    """Engine replicas in this group; each is a Serve replica holding one vLLM AsyncLLM."""
    cpus_per_replica: Float = Field(default=1.0, gt=0)
    """Logical CPUs in the replica's placement-group bundle (its GPUs follow from the parallelism)."""
    bundle_resources: Mapping[Str, Float] = Field(default_factory=dict)
    """Extra custom resources per bundle, e.g. {"efa": 1} or a node-type label resource."""
    prefix_caching: Bool = True
    """vLLM's prefix caching (the KV index reads it): off emulates cache loss, so every history token
    prefill does not compute is a pull."""
    kv_cache_gib: Count = 1
    """CPU only: the KV pool in GiB (VLLM_CPU_KVCACHE_SPACE): more holds more conversations' KV, in RAM."""
    gpu_memory_utilization: Share = 0.9
    """GPU only: vLLM's share of GPU memory; what is left after the weights is the KV pool."""
    num_gpu_blocks_override: Natural = 0
    """Force the KV pool to this many blocks (0: vLLM sizes it); a small pool creates cache loss."""
    max_batched_tokens: Count = 512
    """Tokens one engine step computes at most (vLLM's max_num_batched_tokens); longer prompts are
    chunked. Every request in the engine waits for the step in flight, so lower shortens each
    stream's next token and a short append's first, and stretches a long prompt over more steps."""
    long_prefill_tokens: Natural = 0
    """The most tokens of one prompt a step takes while other requests wait or run (vLLM's
    long_prefill_token_threshold; 0: no cap). A cap lets an append start beside a long prompt's
    chunk, and gives each step's budget to fewer tokens of that prompt."""


APP_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "served_model_name", "dtype", "block_size", "max_model_len", "enforce_eager",
    "enable_prefix_caching", "prefix_caching_hash_algo", "tensor_parallel_size", "pipeline_parallel_size",
    "distributed_executor_backend", "gpu_memory_utilization", "num_gpu_blocks_override", "stream_interval",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "scheduling_policy",
    "scheduler_cls", "kv_transfer_config", "worker_extension_cls", "kv_events_config", "disable_log_stats",
    "reasoning_parser", "max_logprobs"})
"""The vLLM engine arguments the app's engine settings set from the app's own keys (a test keeps them
equal); `engine_kwargs` refuses them."""


def engine_kwargs_problems(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """Names in `engine_kwargs` that vLLM's EngineArgs lacks or that the app sets itself. vLLM is
    imported only when there are any: the default config loads without it."""
    if not engine_kwargs:
        return []
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_kwargs) - known)
    owned = sorted(set(engine_kwargs) & APP_ENGINE_ARGS)
    return ([f"engine_kwargs: vLLM's EngineArgs has no {unknown}"] if unknown else []) + (
        [f"engine_kwargs: {owned} are set by the app from its own keys (docs/configuration.md)"] if owned else [])
