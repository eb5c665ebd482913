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
