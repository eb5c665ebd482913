import pytest

from app.config import AppConfig, Device, load_config


def test_defaults_run_the_tiny_model_on_cpu():
    config = AppConfig()
    assert config.device == Device.CPU and config.model_name == "tiny-qwen3"
    assert config.engine_dtype == "float32"
    assert config.prefill.replicas == 1 and config.decode.replicas == 1


def test_serve_args_are_typed_and_dotted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("retention_ttl_s: 30\ndecode: {replicas: 2}\n")
    config = load_config({"config": str(path), "prefill.prefix_caching": "false", "block_size": "64",
                          "decode.bundle_resources": "{efa: 1}"})
    assert config.retention_ttl_s == 30 and config.decode.replicas == 2 and config.block_size == 64
    assert config.prefill.prefix_caching is False
    assert dict(config.decode.bundle_resources) == {"efa": 1}


@pytest.mark.parametrize("args, message", [
    ({"nope": "1"}, "unknown config keys"),
    ({"block_size": "16"}, "multiple of 32"),
    ({"reverse_pull": "maybe"}, "expected a boolean"),
    ({"retention_ttl_s": "1", "expiry_margin_s": "5"}, "retention_ttl_s must exceed"),
    ({"prefill.replicas": "0"}, "replicas must be >= 1"),
    ({"max_model_len": "4096", "prefill.num_gpu_blocks_override": "128"}, "plus one block"),
])
def test_bad_config_is_refused_with_the_reason(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_every_limit_is_typed_config_and_checked():
    config = load_config({"limits.router_max_ongoing_requests": "512", "limits.retry_after_s": "3"})
    assert config.limits.router_max_ongoing_requests == 512 and config.limits.retry_after_s == 3
    with pytest.raises(ValueError, match="limits.prefill_timeout_s must be > 0"):
        load_config({"limits.prefill_timeout_s": "0"})
    with pytest.raises(ValueError, match="twice limits.heartbeat_interval_s"):
        load_config({"limits.registration_ttl_s": "1"})


def test_decode_heartbeats_come_well_inside_prefill_s_lease_extension():
    config = AppConfig()
    heartbeat_s, extension_s = int(config.retention_ttl_s) // 6, config.handoff_lease_s * 2 // 3
    assert heartbeat_s * 3 <= extension_s
    with pytest.raises(ValueError, match="lease"):
        load_config({"handoff_lease_s": "30"})
