"""cluster.yaml's layout on one machine, as Ray's own tests run clusters (ray.cluster_utils.Cluster).

    python -m tests.integration.cluster_layout --out result.json --workdir DIR

A head and one worker node per worker type of cluster.yaml, each worker carrying that type's custom
resource (prefill_node, decode_node), under Ray's token authentication as cluster.yaml starts them;
serve.yaml's application deployed the way `serve run serve.yaml` deploys it (the controller builds it
from import_path and args), with only what this machine lacks overridden; one conversation through
it and the same prompts through the oracle; drivers from outside (no token, a wrong one) trying to
reach the cluster. Writes what it saw as JSON for tests/integration/test_cluster_layout.py to judge.

Run it in its own process (the test does): it starts and stops its own Ray, under its own
RAY_TMPDIR, so no `ray.init()` elsewhere on the machine connects to it and it connects to no other.
"""

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
HEAD_CPUS = 1
WORKER_CPUS = 1
"""Logical CPUs per worker node: one engine bundle's worth, as serve.yaml sizes them here."""
MAX_TOKENS = 24
APP_READY_TIMEOUT_S = 240
API_KEY = "cluster-test-key"
"""The one API and admin key of the deployed app, given as serve.yaml gets its keys: `secrets_env`."""
# Longer than the conftest's: serve.yaml pulls only when that saves 512 tokens or more.
SYSTEM_PROMPT = "You are a helpful assistant. " + " ".join(
    f"Rule {i}: the router keeps an index of which replica holds which blocks, and until when." for i in range(50))


def machine_args(model_cache_dir: str) -> dict[str, Any]:
    """What serve.yaml's args must become on this 2-core CPU machine: the embedded model on CPU
    with UCX, one logical CPU and no GPU per engine. Prefill's prefix cache is off (cache loss, as
    in the integration conftest), so every history token prefill does not compute is a pull.
    A CPU engine's batch, streams and probe (vLLM's CPU default of 128 sequences, one router).
    Everything else, bundle_resources included, stays as serve.yaml has it."""
    return {"model": "tiny-qwen3", "model_cache_dir": model_cache_dir, "device": "cpu", "engine_kwargs": {},
            "tensor_parallel_size": 1, "block_size": 32, "max_model_len": 4096,
            "nixl_backends": ["UCX"], "engine_max_num_seqs": 128, "router_replicas": 1,
            "placement": {"probe_tokens": 256},
            "prefill": {"cpus_per_replica": 1, "prefix_caching": False},
            "decode": {"cpus_per_replica": 1}}


def merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


def worker_node_types() -> dict[str, dict[str, float]]:
    """cluster.yaml's worker node types and their custom resources (the head carries none)."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    return {name: spec["resources"] for name, spec in config["available_node_types"].items()
            if name != config["head_node_type"]}


def serve_config(model_cache_dir: str, port: int) -> dict:
    """serve.yaml with machine_args over its application's args. Serve's own options: an HTTP port
    of our own (the host stays Serve's default, every interface, which HAProxy on one node needs to
    reach a router replica on another), and one ingress for the machine instead of one per node:
    the nodes share this machine's ports, and a second HAProxy on the same port cannot start."""
    config = yaml.safe_load((ROOT / "serve.yaml").read_text())
    app = config["applications"][0]
    app["args"] = merged(app["args"], machine_args(model_cache_dir))
    config["http_options"] = {**config.get("http_options", {}), "port": port}
    config["proxy_location"] = "HeadOnly"
    return config


def start_cluster():
    """Each worker node on an address of its own, a loopback alias (Linux routes all of 127/8
    locally): what a process binds on its node's address is reachable only there, so a peer that
    dials the wrong node's address fails here as it would across machines."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
    for i, resources in enumerate(worker_node_types().values()):
        cluster.add_node(num_cpus=WORKER_CPUS, resources=resources, node_ip_address=f"127.0.0.{i + 2}")
    cluster.wait_for_nodes()
    return cluster


def deploy(config: dict):
    """What `serve run serve.yaml` does: Serve with the config's HTTP options, then the controller
    imports app:graph and calls it with the args."""
    from ray.serve._private import api
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = api.serve_start(http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location)
    client.deploy_apps(schema)


def wait_until_healthy(url: str, app_name: str) -> None:
    from ray import serve

    deadline = time.monotonic() + APP_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app_name)
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}")
        if status is not None and status.status == "RUNNING" and _health(url) == "ok":
            return
        time.sleep(1)
    raise TimeoutError(f"{app_name} not healthy after {APP_READY_TIMEOUT_S} s: {serve.status()}")


def _health(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).json().get("status")
    except (httpx.HTTPError, ValueError):
        return None


def placements() -> dict[str, Any]:
    """Every node's custom resources, and the node of every live Serve replica actor."""
    import ray
    from ray._private.state import actors

    nodes = {n["NodeID"]: {"address": n["NodeManagerAddress"],
                           "resources": {k: v for k, v in n["Resources"].items() if k.endswith("_node")}}
             for n in ray.nodes() if n["Alive"]}
    replicas = []
    for actor in actors().values():
        if actor["State"] == "ALIVE" and actor["Name"].startswith("SERVE_REPLICA::"):
            _app, deployment, replica_id = actor["Name"].removeprefix("SERVE_REPLICA::").split("#")
            replicas.append({"deployment": deployment, "replica_id": replica_id,
                             "node_id": actor["Address"]["NodeID"], "pid": actor["Pid"]})
    return {"nodes": nodes, "replicas": replicas}


def converse(url: str) -> list[dict[str, Any]]:
    """The integration suite's conversation, every turn through prefill (no short appends on decode)."""
    from openai import OpenAI

    from tests.integration.conftest import USER_TURNS, run_conversation

    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    turns = run_conversation(client, SYSTEM_PROMPT, USER_TURNS, MAX_TOKENS, prefill_on_decode=False)
    return [{"request_id": t.request_id, "prompt_ids": t.prompt_ids, "output_ids": t.output_ids,
             "cached_tokens": t.cached_tokens, "ttft_s": t.ttft_s} for t in turns]


def run(workdir: Path) -> dict[str, Any]:
    import ray

    from app.config import load_config
    from app.engine.ports import free_port
    from app.model.tiny import ensure_tiny_model

    port = free_port("127.0.0.1")
    config = serve_config(str(workdir / "models"), port)
    app_config = load_config(config["applications"][0]["args"])
    ensure_tiny_model(app_config.model_path())  # once here, not raced by three replicas
    started = time.monotonic()
    cluster = start_cluster()
    cluster_up_s = time.monotonic() - started
    try:
        ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
        result = drive(config, app_config, f"http://127.0.0.1:{port}", started)
        result["timings"]["cluster_up_s"] = cluster_up_s
        return result
    finally:
        stopping = time.monotonic()
        ray.shutdown()
        cluster.shutdown()  # the engines' processes go with their raylets
        print(f"cluster stopped in {time.monotonic() - stopping:.1f} s", flush=True)


def drive(config: dict, app_config, url: str, started: float) -> dict[str, Any]:
    """Deploy, converse, ask the oracle, and collect what the test judges."""
    import ray
    from ray import serve

    from app.metrics import kv_bytes_per_token
    from app.ops.oracle import start_reference

    app_name, timings = config["applications"][0]["name"], {}
    deploy(config)
    reference = start_reference(app_config)  # starts beside the app's engines
    wait_until_healthy(url, app_name)
    timings["app_healthy_s"] = time.monotonic() - started
    turns = converse(url)
    timings["conversation_s"] = time.monotonic() - started - timings["app_healthy_s"]
    expected = ray.get(reference.generate.remote([t["prompt_ids"] for t in turns], MAX_TOKENS))
    decisions = httpx.get(f"{url}/admin/decisions", params={"n": 1000}, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()
    index_stats = serve.get_deployment_handle("KVIndexServer", app_name).stats.remote().result(timeout_s=30)
    outside = {name: outside_driver(ray.get_runtime_context().gcs_address, app_name, env)
               for name, env in OUTSIDERS.items()}
    return {**placements(), "turns": turns, "reference_ids": expected, "index_stats": index_stats,
            "outside_drivers": outside,
            "decisions": {d["request_id"]: d for d in decisions}, "timings": timings,
            "block_size": app_config.block_size, "kv_bytes_per_token": kv_bytes_per_token(app_config.model_path()),
            "bundle_resources": {"prefill": dict(app_config.prefill.bundle_resources),
                                 "decode": dict(app_config.decode.bundle_resources)}}


OUTSIDERS = {"no_token": {"RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None},
             "wrong_token": {"RAY_AUTH_TOKEN": secrets.token_hex(32)}}
"""Drivers from outside the app: one that knows no token, one with a token of its own."""
OUTSIDE_DRIVER = """
import sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="serve", log_to_driver=False)
index = serve.get_deployment_handle("KVIndexServer", sys.argv[2])
print("took:", index.take_all.remote([("any", "any")]).result(timeout_s=30))
"""


def outside_driver(gcs_address: str, app_name: str, env_changes: dict[str, str | None]) -> dict[str, Any]:
    """An attacker's driver on the cluster network: joins Ray and calls the KV index's `take_all`."""
    env = {k: v for k, v in {**os.environ, **env_changes}.items() if v is not None}
    try:
        done = subprocess.run([sys.executable, "-c", OUTSIDE_DRIVER, gcs_address, app_name], env=env,
                              capture_output=True, text=True, timeout=90)
        return {"exit": done.returncode, "said": (done.stdout + done.stderr)[-2000:]}
    except subprocess.TimeoutExpired as timeout:
        return {"exit": None, "said": f"timed out: {str(timeout.stderr)[-1000:]}"}


def isolate_ray() -> Path:
    """This process's Ray apart from any other on the machine: a temp dir of its own (where Ray
    records "the latest cluster", which a bare ray.init() elsewhere would otherwise join) and no
    inherited address. Serve's HAProxy ingress, as cluster.yaml starts Ray, with free stats and
    metrics ports (fixed by default; another Serve may be running here). The app's secrets in the
    variable serve.yaml names and Ray's token authentication, set before any node starts, as
    cluster.yaml sets them on every node."""
    from app.engine.ports import free_port
    from app.ops.launch import HAPROXY_ENV

    ray_tmp = Path(tempfile.mkdtemp(prefix="kvlc-"))  # short: Ray's socket paths live under it
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update({"RAY_TMPDIR": str(ray_tmp), HAPROXY_ENV: "1",
                       "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                       "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port("127.0.0.1")),
                       "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port("127.0.0.1")),
                       yaml.safe_load((ROOT / "serve.yaml").read_text())["applications"][0]["args"]["secrets_env"]:
                           json.dumps({"api_keys": {API_KEY: "default"}, "admin_api_keys": [API_KEY]})})
    return ray_tmp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--keep-ray-logs", action="store_true")
    args = parser.parse_args()
    ray_tmp = isolate_ray()
    started = time.monotonic()
    result = run(args.workdir)
    result["timings"]["total_s"] = time.monotonic() - started
    args.out.write_text(json.dumps(result))
    if not args.keep_ray_logs:
        shutil.rmtree(ray_tmp, ignore_errors=True)  # kept when the run failed: Ray's logs are there


if __name__ == "__main__":
    main()
