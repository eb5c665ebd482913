"""`python -m app.ops.preflight` on the shipped GPU configs and on broken ones, as a user runs it before
a deploy: exit 0 on serve.yaml and kuberay.yaml; exit 1 naming the key to change otherwise. Each run
starts a throwaway Ray of its own (in its own temp dir), before the shared app starts."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def preflight(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="kvpf-")}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "app.ops.preflight", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("name", ["serve.yaml", "kuberay.yaml"])
def test_the_shipped_gpu_configs_pass(name):
    result = preflight(ROOT / name)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.rstrip().endswith(f"{name}: ok")


def _serve_yaml_with(tmp_path: Path, **args) -> Path:
    config = yaml.safe_load((ROOT / "serve.yaml").read_text())
    config["applications"][0]["args"].update(args)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_limits_below_what_the_engines_run_fail_naming_the_keys(tmp_path):
    result = preflight(_serve_yaml_with(tmp_path, limits={}))
    assert result.returncode == 1
    assert "limits.engine_max_ongoing_requests must be >= engine_max_num_seqs" in result.stderr


def test_an_engine_bigger_than_a_worker_group_s_node_fails_naming_the_keys(tmp_path):
    service = next(d for d in yaml.safe_load_all((ROOT / "kuberay.yaml").read_text()) if d["kind"] == "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    serve_config["applications"][0]["args"]["pipeline_parallel_size"] = 2  # 16 GPUs an engine, 8 a pod
    service["spec"]["serveConfigV2"] = yaml.safe_dump(serve_config)
    path = tmp_path / "kuberay.yaml"
    path.write_text(yaml.safe_dump(service))
    result = preflight(path)
    assert result.returncode == 1
    for group in ("prefill", "decode"):
        assert (f"{group}: no worker group of the RayCluster holds the bundle" in result.stderr
                and f"pipeline_parallel_size, {group}.cpus_per_replica" in result.stderr), result.stderr[-2000:]
