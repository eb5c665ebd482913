"""The engines: one group's replicas and what each gets, and vLLM's engine arguments.

An engine argument the app reads (or must give every engine the same way) is an app key; every
other vLLM argument passes through `engine_kwargs` unchanged, checked against vLLM's EngineArgs.
"""

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from app.config.types import Bool, Count, Float, Str, section

TINY_MODEL = "tiny-qwen3"
GROUPS = ("prefill", "decode")


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
    engine_kwargs: Mapping[Str, Any] = Field(default_factory=dict)
    """vLLM engine arguments for this group's engines only, over the top-level `engine_kwargs`
    (e.g. {"max_num_batched_tokens": 8192} on prefill, {"kv_cache_memory_bytes": 4294967296})."""


APP_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "served_model_name", "block_size", "max_model_len",
    "enable_prefix_caching", "prefix_caching_hash_algo", "tensor_parallel_size", "pipeline_parallel_size",
    "distributed_executor_backend", "max_num_seqs", "scheduling_policy",
    "scheduler_cls", "kv_transfer_config", "worker_extension_cls", "kv_events_config", "disable_log_stats",
    "reasoning_parser", "max_logprobs"})
"""The vLLM engine arguments the app's engine settings set from the app's own keys (a test keeps them
equal); `engine_kwargs` refuses them."""


SCHEDULER_ARGS = ("max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill",
                  "max_num_partial_prefills", "max_long_partial_prefills")
"""Engine arguments that vLLM's SchedulerConfig checks against max_num_seqs and max_model_len."""

SAME_IN_EVERY_GROUP = frozenset({"dtype", "kv_cache_dtype", "quantization", "revision", "hf_overrides"})
"""Engine arguments that shape the KV's bytes: a pull copies blocks between the groups as they are, so
these are set once, in the top-level `engine_kwargs`."""


def default_engine_kwargs(device: Device, model: str, max_num_seqs: int) -> dict[str, Any]:
    """The engine arguments the app defaults, under every `engine_kwargs`. Decode streams its first
    token at once, then every 4 (stream_interval): each chunk is two Serve hops. On CPU: a KV pool of
    1 GiB of RAM per engine, no graph capture, and a step of 512 tokens (a quarter of vLLM's CPU
    default), so that a step in flight delays every stream's next token less; at least max_num_seqs,
    as vLLM requires. The embedded model runs in float32, which vLLM's "auto" would narrow."""
    if device != Device.CPU:
        return {"stream_interval": 4}
    return {"stream_interval": 4, "kv_cache_memory_bytes": 1 << 30, "enforce_eager": True,
            "max_num_batched_tokens": max(512, max_num_seqs), **({"dtype": "float32"} if model == TINY_MODEL else {})}


def engine_kwargs_problems(top: Mapping[str, Any], groups: Mapping[str, Mapping[str, Any]],
                           scheduler: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What vLLM's own code refuses in the engine arguments the config names: names its EngineArgs
    lacks, names the app sets itself, and each group's scheduler arguments (`scheduler`, merged)
    as vLLM's SchedulerConfig checks them. vLLM is imported only when the config names any: the
    defaults load without it and satisfy vLLM by construction."""
    if not top and not any(groups.values()):
        return []
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    problems = []
    for where, kwargs in {"engine_kwargs": top, **{f"{g}.engine_kwargs": k for g, k in groups.items()}}.items():
        unknown, owned = sorted(set(kwargs) - known), sorted(set(kwargs) & APP_ENGINE_ARGS)
        shared = sorted(set(kwargs) & SAME_IN_EVERY_GROUP) if where != "engine_kwargs" else []
        problems += [f"{where}: vLLM's EngineArgs has no {unknown}"] if unknown else []
        problems += [f"{where}: {owned} are set by the app from its own keys (docs/configuration.md)"] if owned else []
        problems += [f"{where}: {shared} shape the KV that pulls copy between groups: set them in the "
                     f"top-level engine_kwargs"] if shared else []
    return problems + [f"{group}: {problem}" for group, args in scheduler.items()
                       if (problem := _scheduler_problem(args))]


def tool_strict_level_problems(level: str) -> list[str]:
    """What vLLM's own parsing of `--tool-strict-level` refuses in `tool_strict_level`; vLLM is
    imported only for a level other than its default."""
    if level == "auto":
        return []
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

    try:
        ToolStrictLevel.from_name(level)
    except ValueError as error:
        return [f"tool_strict_level: {error}"]
    return []


def _scheduler_problem(args: Mapping[str, Any]) -> str:
    from pydantic import ValidationError
    from vllm.config import SchedulerConfig

    try:
        SchedulerConfig(**args, is_encoder_decoder=False)
    except ValidationError as error:
        return "vLLM's SchedulerConfig: " + "; ".join(e["msg"].removeprefix("Value error, ") for e in error.errors())
    return ""
