"""The KV size per token comes from the model's config, for a model folder or a hub id."""

import json
from pathlib import Path

from app import metrics

QWEN3_32B = {"num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_size": 5120, "torch_dtype": "bfloat16"}


def test_a_model_folder_s_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    assert metrics.kv_bytes_per_token(tmp_path) == 2 * 64 * 8 * 128 * 2


def test_a_hub_id_reads_the_config_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """serve.yaml names `Qwen/Qwen3-32B`: no such folder on the node the router lands on."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    asked = []

    def download(repo_id: str, filename: str) -> str:
        asked.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    assert metrics.kv_bytes_per_token(Path("Qwen/Qwen3-32B")) == 2 * 64 * 8 * 128 * 2
    assert asked == [("Qwen/Qwen3-32B", "config.json")]


def test_counter_increments_reach_ray_summed_once_per_flush(monkeypatch):
    from unittest.mock import MagicMock

    from app.protocol import Action, Reason, RoutingDecision

    made = {}
    monkeypatch.setattr("ray.serve.metrics.Counter", lambda name, *a, **k: made.setdefault(name, MagicMock()))
    monkeypatch.setattr("ray.serve.metrics.Gauge", lambda name, *a, **k: made.setdefault(name, MagicMock()))
    monkeypatch.setattr("ray.serve.metrics.Histogram", lambda name, *a, **k: made.setdefault(name, MagicMock()))
    turn_metrics = metrics.TurnMetrics(kv_bytes_per_token=4)
    decision = RoutingDecision("p0", Action.PULL, Reason.PULL_SAVES_TOKENS, tokens_local=32, tokens_pullable=64,
                               threshold=32)
    for _ in range(3):
        turn_metrics.record_turn(decision, prompt_tokens=100, cached_tokens=96, pulled_tokens=64)
        turn_metrics.record_horizon("p0", 12.0)
    assert not made["kv_loop_prompt_tokens"].inc.called and not made["kv_loop_eviction_horizon_s"].set.called
    turn_metrics.flush()
    by_source = {c.args[1]["source"]: c.args[0] for c in made["kv_loop_prompt_tokens"].inc.call_args_list}
    assert by_source == {"pulled": 192, "local": 96, "computed": 12}
    made["kv_loop_bytes_pulled"].inc.assert_called_once_with(3 * 64 * 4, {})
    made["kv_loop_eviction_horizon_s"].set.assert_called_once_with(12.0, {"prefill_replica": "p0"})
    turn_metrics.flush()
    assert made["kv_loop_bytes_pulled"].inc.call_count == 1
