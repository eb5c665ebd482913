import dataclasses
import typing

import pytest
from pydantic import Strict, ValidationError

from app.config import AppConfig, Device, Limits, load_config


def test_defaults_run_the_tiny_model_on_cpu():
    config = AppConfig()
    assert config.device == Device.CPU and config.model_name == "tiny-qwen3"
    assert config.engine_kwargs_of("prefill") == {"stream_interval": 4, "kv_cache_memory_bytes": 1 << 30,
                                                  "enforce_eager": True, "max_num_batched_tokens": 512,
                                                  "dtype": "float32"}
    assert config.prefill.replicas == 1 and config.decode.replicas == 1
    assert load_config() == config == load_config({})


def test_serve_args_are_typed_and_dotted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("retention_ttl_s: 30\ndecode: {replicas: 2}\n")
    config = load_config({"config": str(path), "prefill.prefix_caching": "false", "block_size": "64",
                          "decode.bundle_resources": "{efa: 1}"})
    assert config.retention_ttl_s == 30 and config.decode.replicas == 2 and config.block_size == 64
    assert config.prefill.prefix_caching is False
    assert dict(config.decode.bundle_resources) == {"efa": 1}


def test_a_cli_string_is_read_by_its_key_s_type():
    config = load_config({"served_model_name": "123", "admin_api_keys": "a, b", "nixl_backends": "[UCX, LIBFABRIC]",
                          "reverse_pull": "no", "limits.prefill_timeout_s": "1e3", "device": "cuda",
                          "routing_policy": "round_robin", "api_keys": '{"k": "t"}', "tool_call_parser": ""})
    assert config.served_model_name == "123", "a string key keeps its text"
    assert config.admin_api_keys == ("a", "b") and config.nixl_backends == ("UCX", "LIBFABRIC")
    assert config.reverse_pull is False and config.limits.prefill_timeout_s == 1000.0
    assert config.device == Device.CUDA and config.routing_policy.value == "round_robin"
    assert dict(config.api_keys) == {"k": "t"} and config.tool_call_parser == ""
    assert load_config({"admin_api_keys": ""}).admin_api_keys == ()
    entries = load_config({"api_keys.k1": "123", "prefill.bundle_resources.efa": "1"})
    assert dict(entries.api_keys) == {"k1": "123"} and dict(entries.prefill.bundle_resources) == {"efa": 1}


def test_a_section_given_whole_merges_with_the_file_and_a_value_mapping_replaces(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("limits: {retry_after_s: 3}\nprefill: {bundle_resources: {a: 1}}\n")
    args = {"config": str(path), "limits": {"max_messages": 10}, "prefill.bundle_resources": "{b: 2}",
            "autoscaling": {"router": {"max_replicas": 3}}, "limits.max_stop_chars": "9"}
    config = load_config(args)
    assert (config.limits.retry_after_s, config.limits.max_messages, config.limits.max_stop_chars) == (3, 10, 9)
    assert dict(config.prefill.bundle_resources) == {"b": 2} and config.autoscaling.router.max_replicas == 3
    assert args["limits"] == {"max_messages": 10}, "the caller's args are not written into"


@pytest.mark.parametrize("yaml_text, message", [
    ("prefill:\n  replicas: 1.5\n", "prefill.replicas must be an integer, got 1.5"),
    ("prefill:\n  replicas: '2'\n", "prefill.replicas must be an integer, got '2'"),
    ("prefill:\n  replicas: true\n", "prefill.replicas must be an integer, got True"),
    ("model: 7\n", "model must be a string, got 7"),
    ("reasoning_parser:\n", "reasoning_parser must be a string, got None"),
    ("decode: {prefix_caching: 1}\n", "decode.prefix_caching must be true or false, got 1"),
    ("retention_ttl_s: '60'\n", "retention_ttl_s must be a number, got '60'"),
    ("limits: {retry_after_s: 2.5}\n", "limits.retry_after_s must be an integer, got 2.5"),
    ("nixl_backends: UCX\n", "nixl_backends must be a list, got 'UCX'"),
    ("nixl_backends: [1]\n", r"nixl_backends\[0\] must be a string, got 1"),
    ("prefill: 2\n", "prefill must be a mapping of keys, got 2"),
    ("device: gpu\n", "device must be one of 'cpu' or 'cuda', got 'gpu'"),
    ("decode: {bundle_resources: {efa: one}}\n", "decode.bundle_resources.efa must be a number, got 'one'"),
])
def test_a_yaml_value_of_the_wrong_type_is_refused_by_its_dotted_key(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message):
        load_config({"config": str(path)})


@pytest.mark.parametrize("args, message", [
    ({"prefill.replicas": "1.5"}, "prefill.replicas must be an integer, got 1.5"),
    ({"prefill.replicas": "two"}, "prefill.replicas must be an integer, got 'two'"),
    ({"limits.bookkeeping_timeout_s": "soon"}, "limits.bookkeeping_timeout_s must be a number, got 'soon'"),
    ({"reverse_pull": "maybe"}, "reverse_pull must be true or false, got 'maybe'"),
    ({"autoscaling.decode.enabled": "2"}, "autoscaling.decode.enabled must be true or false, got '2'"),
])
def test_a_cli_value_that_does_not_parse_is_refused_by_its_dotted_key(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


@pytest.mark.parametrize("args, path", [
    ({"nope": "1"}, "nope"), ({"prefill.nope": "1"}, "prefill.nope"),
    ({"limits.retry_afer_s": "3"}, "limits.retry_afer_s"),
    ({"autoscaling.router.target": "3"}, "autoscaling.router.target"),
    ({"limits": {"nope": 1}}, "limits.nope"),
])
def test_an_unknown_key_is_refused_with_its_path(args, path):
    with pytest.raises(ValueError, match=f"unknown config key {path}$"):
        load_config(args)


def test_every_problem_is_listed_in_one_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prefill: {replicas: 1.5, nope: 1}\nlimits: {retry_after_s: -1}\n")
    with pytest.raises(ValueError) as refused:
        load_config({"config": str(path), "model": "m", "block_size": "x"})
    message = str(refused.value)
    assert message.startswith("invalid config: ") and "\n" not in message
    for part in ("prefill.replicas must be an integer", "unknown config key prefill.nope",
                 "limits.retry_after_s must be >= 0", "block_size must be an integer, got 'x'"):
        assert part in message, part


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- model\n")
    with pytest.raises(ValueError, match="must hold a mapping of keys"):
        load_config({"config": str(path)})


@pytest.mark.parametrize("args, message", [
    ({"block_size": "16"}, "block_size must be a multiple of 32 on CPU"),
    ({"retention_ttl_s": "1", "expiry_margin_s": "5"}, "retention_ttl_s must exceed expiry_margin_s"),
    ({"tool_pause_s": "200"}, "tool_pause_s must be <= retention_ttl_s"),
    ({"prefill.replicas": "0"}, "prefill.replicas must be >= 1, got 0"),
    ({"decode.engine_kwargs": "{long_prefill_token_threshold: 9000}"},
     r"decode: vLLM's SchedulerConfig: long_prefill_token_threshold \(9000\) cannot be greater"),
    ({"engine_max_num_seqs": "256", "prefill.engine_kwargs": "{max_num_batched_tokens: 128}"},
     r"prefill: vLLM's SchedulerConfig: max_num_batched_tokens \(128\) must be greater than or equal"),
    ({"decode.engine_kwargs": "{kv_cache_dtype: fp8}"}, "decode.engine_kwargs: \\['kv_cache_dtype'\\] shape the KV"),
    ({"placement.probe_tokens": "16"}, "placement.probe_tokens must be >= 32"),
    ({"engine_nice": "20"}, "engine_nice must be <= 19"),
    ({"nixl_backends": ""}, "nixl_backends must have at least 1"),
    ({"tool_strict_level": "schema"}, "tool_strict_level: Unknown tool strict level 'schema'"),
])
def test_bad_config_is_refused_with_the_reason(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_every_limit_is_typed_config_and_checked():
    config = load_config({"limits.router_max_ongoing_requests": "512", "limits.retry_after_s": "3"})
    assert config.limits.router_max_ongoing_requests == 512 and config.limits.retry_after_s == 3
    with pytest.raises(ValueError, match="limits.prefill_timeout_s must be > 0"):
        load_config({"limits.prefill_timeout_s": "0"})
    with pytest.raises(ValueError, match="limits: registration_ttl_s must be >= 2 x heartbeat_interval_s"):
        load_config({"limits.registration_ttl_s": "1"})


def test_limits_that_follow_from_others_are_derived_or_checked_against_them():
    limits = load_config({"limits.router_max_ongoing_requests": "200", "limits.router_max_queued_requests": "20",
                          "limits.heartbeat_interval_s": "2", "limits.registration_ttl_s": "8"}).limits
    assert limits.router_holds == 220 and limits.index_sweep_interval_s == 2
    assert limits.quiet_poll_interval_s == 8 / 3, "a registration survives one lost renewal"
    with pytest.raises(ValueError, match="suspect_replica_s must be >= registration_ttl_s \\+ heartbeat_interval_s"):
        load_config({"limits.registration_ttl_s": "10"})
    with pytest.raises(ValueError, match="index_wait_at_start_s must be >= bookkeeping_timeout_s"):
        load_config({"limits.index_wait_at_start_s": "1"})
    with pytest.raises(ValueError, match="limits.engine_max_ongoing_requests must be >= engine_max_num_seqs"):
        load_config({"engine_max_num_seqs": "256"})


def test_decode_heartbeats_come_well_inside_prefill_s_lease_extension():
    config = AppConfig()
    heartbeat_s, extension_s = int(config.retention_ttl_s) // 6, config.handoff_lease_s * 2 // 3
    assert heartbeat_s * 3 <= extension_s
    with pytest.raises(ValueError, match="lease"):
        load_config({"handoff_lease_s": "30"})


def test_sections_are_frozen_and_a_changed_copy_is_checked_again():
    config = AppConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.router_replicas = 2  # type: ignore[misc]
    assert dataclasses.replace(config, router_replicas=2).router_replicas == 2
    with pytest.raises(ValidationError, match="router_replicas"):
        dataclasses.replace(config, router_replicas=0)
    with pytest.raises(ValidationError, match="block_size"):
        AppConfig(block_size="64")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="registration_ttl_s"):
        Limits(registration_ttl_s=1.0)


def _leaves(cls, prefix=""):
    for name, kind in typing.get_type_hints(cls, include_extras=True).items():
        base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
        if dataclasses.is_dataclass(base):
            yield from _leaves(base, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", kind, base


def test_every_scalar_key_is_strict():
    """A key added as a bare `int` would take "2" and 2.5 silently: every scalar goes through app/config/types.py."""
    loose = [path for path, kind, base in _leaves(AppConfig) if base in (int, float, bool, str)
             and not any(isinstance(meta, Strict) and meta.strict for meta in typing.get_args(kind)[1:])]
    assert loose == []
