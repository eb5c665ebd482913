"""cluster.yaml's layout run for real on one machine: a head and a prefill_node and a decode_node
worker (ray.cluster_utils.Cluster), serve.yaml's application with only what this machine lacks
overridden. What a single-node run cannot show: each engine on its node type, KV pulled from one
node's engine into another's, and the same tokens as one plain engine.

The scenario (tests/integration/cluster_layout.py) runs in a process of its own, with a Ray of its
own: this pytest process may already be a driver of the suite's shared local Ray. It runs before
every other integration test (conftest orders it first), so the two apps don't share 2 cores.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.kv.hashing import common_prefix_len

pytestmark = [pytest.mark.integration, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420


def run_scenario(workdir: Path) -> dict:
    out = workdir / "result.json"
    command = [sys.executable, "-m", "tests.integration.cluster_layout", "--out", str(out), "--workdir", str(workdir)]
    # A session of its own: on a timeout the whole group goes (driver, raylets, workers, engines).
    process = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        code = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"the cluster scenario took over {TIMEOUT_S} s")
    assert code == 0, f"the cluster scenario failed (exit {code}); its Ray logs are kept under $TMPDIR/kvlc-*"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict:
    result = run_scenario(tmp_path_factory.mktemp("cluster"))
    print("cluster layout timings:", {k: round(v, 1) for k, v in result["timings"].items()})
    return result


def _node_of(layout: dict, deployment: str) -> list[str]:
    return [r["node_id"] for r in layout["replicas"] if r["deployment"] == deployment]


def _replicas_on(layout: dict, node_id: str) -> set[str]:
    return {r["replica_id"] for r in layout["replicas"] if r["node_id"] == node_id}


def test_each_engine_lands_on_the_node_type_its_bundle_names(layout):
    nodes = layout["nodes"]
    assert sorted(sorted(n["resources"]) for n in nodes.values()) == [[], ["decode_node"], ["prefill_node"]]
    assert len({n["address"] for n in nodes.values()}) == 3, "every node on an address of its own"
    for group in ("prefill", "decode"):
        (resource,) = layout["bundle_resources"][group]  # serve.yaml's bundle_resources, unchanged
        placed = _node_of(layout, group)
        assert placed and all(resource in nodes[node]["resources"] for node in placed), (group, placed, nodes)
    assert all(_node_of(layout, d) for d in ("frontend", "router", "KVIndexServer")), "the CPU-only parts run too"


def test_later_turns_pull_the_history_from_the_decode_node(layout):
    turns, decisions, block = layout["turns"], layout["decisions"], layout["block_size"]
    (prefill_node,), (decode_node,) = _node_of(layout, "prefill"), _node_of(layout, "decode")
    assert prefill_node != decode_node
    assert decisions[turns[0]["request_id"]]["action"] == "recompute"
    for previous, current in zip(turns, turns[1:]):
        decision = decisions[current["request_id"]]
        # The only decode engine is on the decode node; the prefill replica that read is on the prefill node.
        assert decision["action"] == "pull" and decision["pull_source"].startswith("decode-"), decision
        assert decision["prefill_replica"] in _replicas_on(layout, prefill_node)
        shared = common_prefix_len(current["prompt_ids"], previous["prompt_ids"] + previous["output_ids"])
        full_blocks = min(shared, len(current["prompt_ids"]) - 1) // block * block
        assert full_blocks <= current["cached_tokens"] <= shared
        assert decision["pulled_tokens"] == current["cached_tokens"], "prefill's cache is off: all of it was pulled"
        assert decision["pulled_tokens"] >= decision["threshold"], "serve.yaml's own threshold, met"


def test_the_conversation_s_tokens_are_those_of_one_plain_engine(layout):
    assert [t["output_ids"] for t in layout["turns"]] == layout["reference_ids"]


def test_drivers_without_the_clusters_ray_token_reach_nothing(layout):
    """Under cluster.yaml's token authentication, a driver on the cluster network that lacks Ray's
    token (none, or one of its own) cannot join the cluster, so cannot call the KV index."""
    for name, outcome in layout["outside_drivers"].items():
        assert outcome["exit"] not in (0, None), f"{name}: {outcome['said']}"
        assert "took:" not in outcome["said"], name
        assert "auth" in outcome["said"].lower() or "token" in outcome["said"].lower(), outcome["said"]
