"""serve.yaml's engine deployments placed on a Ray cluster shaped like cluster.yaml's GPU nodes.

    python -m tests.integration.gpu_placement --out result.json

A head and one worker per worker type of cluster.yaml, each advertising 8 GPUs and its node-type
resource, as a p5en.48xlarge node does (ray.cluster_utils.Cluster: Ray schedules the GPUs as on a
real node and sets each replica's CUDA_VISIBLE_DEVICES; nothing runs on them). The engine
deployments are serve.yaml's, built as `serve deploy` builds them, with every Serve and actor
option unchanged; only the class is a probe that, in the placed replica, runs vLLM's executor
selection and placement checks (app/ops/preflight.py) instead of starting an engine: once with the
app's engine arguments and once with the executor left for vLLM to choose, the shape that vLLM
refused. Writes what each replica saw as JSON for test_gpu_placement.py to judge.
"""

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from app.ops.launch import HAPROXY_ENV
from tests.integration.cluster_layout import isolate_ray, worker_node_types

ROOT = Path(__file__).resolve().parents[2]
GPUS_PER_NODE = 8
CPUS_PER_NODE = 32
"""Logical CPUs: enough for a 16-CPU engine bundle, as a p5en's 192 are."""
READY_TIMEOUT_S = 120


class EngineProbe:
    """In place of an engine replica: what vLLM would say inside it."""

    def __init__(self, config, role) -> None:
        import os

        import ray

        from app import config as app_config
        from app.ops.preflight import vllm_placement_problems

        self.seen = {"node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                     "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                     "problems": vllm_placement_problems(config, role)}
        app_config.AppConfig.executor_backend = property(lambda _: None)  # this probe's process only
        self.seen["problems_executor_unset"] = vllm_placement_problems(config, role)

    def report(self) -> dict[str, Any]:
        return self.seen


def run() -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from app.ops.preflight import build_applications, deployments, serve_config

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for resources in worker_node_types().values():
        cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE, resources=resources)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
        config, _ = serve_config(ROOT / "serve.yaml")
        (app,) = build_applications(config)
        seen = {}
        for deployment in deployments(app):
            if deployment.name in ("prefill", "decode"):
                probe = deployment.options(func_or_class=EngineProbe, autoscaling_config=None, num_replicas=1)
                handle = serve.run(probe.bind(*deployment.init_args[:1], _role(deployment.name)),
                                   name=deployment.name, route_prefix=None, blocking=False)
                seen[deployment.name] = _report(handle)
        nodes = {n["NodeID"]: {k: v for k, v in n["Resources"].items() if k.endswith("_node")}
                 for n in ray.nodes() if n["Alive"]}
        return {"replicas": seen, "nodes": nodes}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _role(name: str):
    from app.protocol import Role

    return Role.PREFILL if name == "prefill" else Role.DECODE


def _report(handle) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            return handle.report.remote().result(timeout_s=30)
        except Exception:  # noqa: BLE001 - the replica is still being placed
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    isolate_ray()
    # The probes are reached by handle only; no ingress (a probe deployed alone is its app's ingress,
    # where HAProxy refuses the engine deployments' targeted request router).
    os.environ.pop(HAPROXY_ENV)
    args.out.write_text(json.dumps(run()))


if __name__ == "__main__":
    main()
