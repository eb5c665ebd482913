"""The systems users would pick instead of this project, started with the same model and engine
settings: one plain vLLM OpenAI server (aggregated, prefix caching on) and Ray Serve LLM's
`build_pd_openai_app` (the standard prefill/decode flow: no reverse pull)."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import httpx

from app.config import AppConfig
from app.engine.nixl_worker import POLL_DELAY_ENV
from app.engine.ports import free_port
from app.engine.settings import engine_plugin_env, scheduler_class, scheduling_policy
from app.ops.launch import worker_niceness

SERVE_LLM_APP = "serve-llm-pd"
SERVE_LLM_PREFIX = "/serve-llm"


def _wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not become healthy")


def peer_engine_kwargs(config: AppConfig, group: str) -> dict:
    """The engine settings every peer shares with this app's `group` engines, as vLLM's engine arguments."""
    return {**config.engine_kwargs_of(group), "block_size": config.block_size, "max_model_len": config.max_model_len,
            "enable_prompt_tokens_details": True,
            "max_num_seqs": config.engine_max_num_seqs,
            "scheduling_policy": scheduling_policy(config),
            **({"scheduler_cls": cls} if (cls := scheduler_class(config)) else {}), **peer_parsers(config)}


def peer_parsers(config: AppConfig) -> dict:
    """The app's tool and reasoning parsers, as vLLM's server arguments (Serve LLM takes them
    among its engine arguments)."""
    tools = {"enable_auto_tool_choice": True, "tool_call_parser": config.tool_call_parser,
             "tool_strict_level": config.tool_strict_level}
    return {**(tools if config.tool_call_parser else {}),
            **({"reasoning_parser": config.reasoning_parser} if config.reasoning_parser else {})}


def plain_vllm_command(config: AppConfig, port: int) -> list[str]:
    """vLLM's OpenAI server with the peers' engine settings, prefix caching on; its step budget is
    the app's prefill group's (the engine that computes the prompts)."""
    kwargs = {**peer_engine_kwargs(config, "prefill"), "enable_prefix_caching": True,
              "host": "127.0.0.1", "port": port}
    flags = [flag for key, value in kwargs.items() for flag in cli_flag(key, value)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(config.model_path()),
            "--served-model-name", config.model_name, *flags]


def cli_flag(key: str, value) -> list[str]:
    """One engine argument as vLLM's server flags: booleans as --x / --no-x, mappings as JSON."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, json.dumps(dict(value)) if isinstance(value, Mapping) else str(value)]


@contextmanager
def plain_vllm(config: AppConfig) -> Iterator[str]:
    """vLLM's own OpenAI server on one engine (all cores, this app's pool, stream interval and engine
    priority): the single-engine ideal. Yields its URL."""
    port = free_port("127.0.0.1")
    command, niceness = plain_vllm_command(config, port), worker_niceness()
    # The app's priorities too: its API server at Ray's worker niceness, as every Serve replica, and
    # its engine processes at the app's engine_nice (this package's vLLM plugin lowers their own).
    server = subprocess.Popen(command, env={**os.environ, **engine_plugin_env(config)},
                              preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, niceness),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(f"{url}/health", 600, alive=lambda: server.poll() is None)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def serve_llm_pd_args(config: AppConfig) -> dict:
    """`build_pd_openai_app` args for one prefill and one decode engine with this app's engine
    settings (model, dtype, block size, pools, prefix caching, NIXL over UCX with the same poll
    delay, engine priority), each engine on its own core."""

    def llm_config(name: str, core: int) -> dict:
        group = getattr(config, name)
        transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                    "kv_connector_extra_config": {"backends": list(config.nixl_backends)}}
        engine = {**peer_engine_kwargs(config, name), "enable_prefix_caching": group.prefix_caching,
                  "kv_transfer_config": transfer, "worker_extension_cls": "app.engine.nixl_worker.NixlWorkerExtension"}
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), POLL_DELAY_ENV: str(config.nixl_poll_delay_us),
               **engine_plugin_env(config)}
        return {"model_loading_config": {"model_id": config.model_name, "model_source": str(config.model_path())},
                "accelerator_config": {"kind": "cpu"}, "placement_group_config": {"bundles": [{"CPU": 1}]},
                "engine_kwargs": engine, "runtime_env": {"env_vars": env}, "log_engine_metrics": True,
                # The engine's bundle holds the replica too, as in this app: one logical CPU per engine.
                "deployment_config": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}}

    cores = os.cpu_count() or 1
    return {"prefill_config": llm_config("prefill", 0), "decode_config": llm_config("decode", 1 % cores),
            # The engine replicas take the logical CPUs; the ingress is I/O only (as this app's router).
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}


@contextmanager
def serve_llm_pd(config: AppConfig, proxy_url: str) -> Iterator[str]:
    """Ray Serve LLM's P/D app on the running Serve (beside no other engines), at SERVE_LLM_PREFIX."""
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    serve.run(build_pd_openai_app(serve_llm_pd_args(config)), name=SERVE_LLM_APP, route_prefix=SERVE_LLM_PREFIX)
    url = proxy_url + SERVE_LLM_PREFIX
    try:
        _wait_healthy(f"{url}/v1/models", 120)
        yield url
    finally:
        serve.delete(SERVE_LLM_APP)


def serve_llm_prefill_replica() -> str:
    """The replica id of Serve LLM's prefill deployment (the suffix of its actor's name)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{SERVE_LLM_APP}#Prefill:")]
    if len(names) != 1:
        raise RuntimeError(f"expected one Serve LLM prefill replica, found {names}")
    return names[0].rsplit("#", 1)[1]


def prompt_tokens_by_source(replica_id: str) -> dict[str, float]:
    """vLLM's per-source prompt token counters of one Serve LLM replica, from this node's Ray
    metrics endpoint (Serve LLM reports no per-request prefill hits)."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_vllm_prompt_tokens_by_source_total{") and f'ReplicaId="{replica_id}"' in line:
            source = line.split('source="', 1)[1].split('"', 1)[0]
            totals[source] = totals.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def prompt_tokens_since(replica_id: str, before: dict[str, float], expected: int,
                        timeout_s: float = 60) -> dict[str, int]:
    """Counter deltas once they account for `expected` prompt tokens (Ray exports them with a lag)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = prompt_tokens_by_source(replica_id)
        delta = {k: int(v - before.get(k, 0.0)) for k, v in now.items()}
        if sum(delta.values()) >= expected or time.monotonic() > deadline:
            return delta
        time.sleep(2)
