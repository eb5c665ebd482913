"""The GPU layout's config and engine arguments, as the engine would get them on a GPU node."""

from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from app.config import APP_ENGINE_ARGS, AppConfig, Device, Limits, load_config
from app.engine.settings import assign_identity, engine_args, engine_env
from app.protocol import Role

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_config() -> AppConfig:
    return load_config(yaml.safe_load((ROOT / "serve.yaml").read_text())["applications"][0]["args"])


def _args(config: AppConfig, role: Role = Role.PREFILL):
    group = config.prefill if role == Role.PREFILL else config.decode
    return engine_args(config, group, assign_identity(config, role, 0, "127.0.0.1"))


def test_an_engine_s_ranks_run_under_its_replica_on_the_gpus_it_holds(gpu_config):
    args = _args(gpu_config)
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (8, "mp")
    assert gpu_config.gpus_per_engine == 8
    assert _args(AppConfig()).distributed_executor_backend == "uni"
    assert replace(AppConfig(), tensor_parallel_size=2, pipeline_parallel_size=2).executor_backend == "mp"


def test_the_cpu_tuning_is_off_on_cuda_unless_a_key_turns_it_on(gpu_config):
    env = engine_env(gpu_config, assign_identity(gpu_config, Role.PREFILL, 0, "127.0.0.1"))
    assert not [name for name in env if name.startswith("KV_LOOP_") or name.startswith("VLLM_CPU_")], env
    assert _args(gpu_config).worker_extension_cls == ""
    tuned = replace(gpu_config, cpu_tuning_on_gpu=True)
    env = engine_env(tuned, assign_identity(tuned, Role.PREFILL, 0, "127.0.0.1"))
    assert {"KV_LOOP_ENGINE_NICE", "KV_LOOP_NIXL_POLL_DELAY_US", "KV_LOOP_IDLE_POLL_S"} <= set(env)
    cpu = AppConfig()
    assert "KV_LOOP_ENGINE_NICE" in engine_env(cpu, assign_identity(cpu, Role.PREFILL, 0, "127.0.0.1"))
    assert _args(cpu).worker_extension_cls == "app.engine.nixl_worker.NixlWorkerExtension"


def test_cpu_engines_bind_one_core_per_rank_prefill_from_the_first_decode_from_the_last(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    config = replace(AppConfig(), tensor_parallel_size=2)
    prefill = engine_env(config, assign_identity(config, Role.PREFILL, 0, "127.0.0.1"))
    decode = engine_env(config, assign_identity(config, Role.DECODE, 0, "127.0.0.1"))
    assert (prefill["VLLM_CPU_OMP_THREADS_BIND"], decode["VLLM_CPU_OMP_THREADS_BIND"]) == ("0|1", "3|2")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(
        replace(config, bind_engine_cores=False),
        assign_identity(replace(config, bind_engine_cores=False), Role.PREFILL, 0, "127.0.0.1"))


def test_engine_kwargs_pass_through_to_vllm_and_are_checked_against_its_engine_args():
    config = load_config({"engine_kwargs": '{"kv_cache_dtype": "fp8", "seed": 7}'})
    args = _args(config)
    assert (args.kv_cache_dtype, args.seed) == ("fp8", 7)
    with pytest.raises(ValueError, match=r"EngineArgs has no \['kv_cache_dtpye'\]"):
        load_config({"engine_kwargs": '{"kv_cache_dtpye": "fp8"}'})
    with pytest.raises(ValueError, match=r"\['max_num_seqs'\] are set by the app"):
        load_config({"engine_kwargs": '{"max_num_seqs": 8}'})
    group = load_config({"engine_kwargs": "{enforce_eager: false, max_num_batched_tokens: 1024}",
                         "decode.engine_kwargs": "{max_num_batched_tokens: 256}"})
    decode = _args(group, Role.DECODE)
    assert (decode.enforce_eager, decode.max_num_batched_tokens) == (False, 256), "the group's go over the top level"
    assert _args(group).max_num_batched_tokens == 1024


def test_the_arguments_the_app_owns_are_exactly_those_engine_args_sets():
    from vllm.engine.arg_utils import AsyncEngineArgs

    defaults = AsyncEngineArgs()
    args = _args(AppConfig())
    set_by_app = {f.name for f in fields(AsyncEngineArgs) if getattr(args, f.name) != getattr(defaults, f.name)}
    # Those that happen to equal vLLM's default are still set by the app: the listed set may be larger.
    # The device's defaults are pass-through engine_kwargs, which a config may override.
    assert set_by_app - set(AppConfig().engine_kwargs_of("decode")) <= APP_ENGINE_ARGS, set_by_app - APP_ENGINE_ARGS
    assert not APP_ENGINE_ARGS & set(AppConfig().engine_kwargs_of("decode"))
    for name in APP_ENGINE_ARGS:
        assert name in {f.name for f in fields(AsyncEngineArgs)}, name


@pytest.mark.parametrize("args, message", [
    ({"engine_max_num_seqs": "1024"}, "limits.engine_max_ongoing_requests must be >= engine_max_num_seqs"),
    ({"engine_max_num_seqs": "256", "limits.engine_max_ongoing_requests": "256", "decode.replicas": "2"},
     "router_replicas \\* limits.router_max_ongoing_requests must be >= decode.replicas \\* engine_max_num_seqs"),
    ({"pipeline_parallel_size": "0"}, "pipeline_parallel_size must be >= 1"),
])
def test_limits_that_contradict_each_other_are_refused_at_load(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_the_shipped_gpu_config_admits_what_its_engines_run(gpu_config):
    limits: Limits = gpu_config.limits
    assert gpu_config.device == Device.CUDA
    assert limits.engine_max_ongoing_requests >= gpu_config.engine_max_num_seqs
    assert gpu_config.router_replicas * limits.router_max_ongoing_requests >= (
        gpu_config.decode.replicas * gpu_config.engine_max_num_seqs)
