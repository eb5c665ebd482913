"""serve.yaml's engine deployments placed on a Ray cluster whose nodes advertise 8 GPUs each and
cluster.yaml's node-type resources; in each placed replica vLLM's own checks accept the engine, and
refuse the shape the app shipped before (the executor left for vLLM to choose). The scenario
(tests/integration/gpu_placement.py) runs in a process and a Ray of its own, before the shared app."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def placed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu") / "result.json"
    command = [sys.executable, "-m", "tests.integration.gpu_placement", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=TIMEOUT_S, start_new_session=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("group", ["prefill", "decode"])
def test_each_engine_replica_holds_its_node_s_eight_gpus_and_vllm_accepts_it(placed, group):
    replica = placed["replicas"][group]
    assert placed["nodes"][replica["node_id"]] == {f"{group}_node": 1.0}, "on its own node type"
    assert replica["gpu_ids"] == list(range(8)) and replica["cuda_visible_devices"] == "0,1,2,3,4,5,6,7"
    assert replica["problems"] == []


@pytest.mark.parametrize("group", ["prefill", "decode"])
def test_with_the_executor_left_to_vllm_it_refuses_the_placement(placed, group):
    (problem,) = placed["replicas"][group]["problems_executor_unset"]
    assert "Placement group bundle cannot have more than 1 GPU" in problem
