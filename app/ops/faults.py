"""Real faults for a running app, and the wait for it to be whole again: kill a replica's actor,
SIGKILL a replica's process or its vLLM engine process, kill the KV index or a router replica.

driver (tests/integration/test_faults.py, benchmarks/faults.py) ──ray.kill / os.kill──▶ the app
Run it on the machine of the replica it hits (engine pids are local), in a driver connected to
the app's Ray.
"""

import os
import signal
import time
from collections.abc import Callable

import httpx

from app.ops.launch import APP_NAME
from app.protocol import DecodeRequest, EngineStatus, SamplingSettings

SERVE_NAMESPACE = "serve"
FAULTS = ("kill_decode_replica", "sigkill_decode_replica", "sigkill_decode_engine", "sigkill_prefill_engine",
          "kill_index")
"""The faults between turns that `inject` knows, by name."""
DEPLOYMENTS = {"decode": "decode", "prefill": "prefill", "index": "KVIndexServer", "router": "router",
               "frontend": "frontend"}


def replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(deployment: str) -> str:
    """Kill one replica's actor (Serve starts another); returns the killed actor's name."""
    import ray

    name = replica_names(deployment)[0]
    ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
    return name


def engine_status(deployment: str) -> EngineStatus:
    from ray import serve

    return serve.get_deployment_handle(deployment, APP_NAME).status.remote().result(timeout_s=30)


def sigkill_replica(deployment: str) -> str:
    """SIGKILL one replica's process, as the OOM killer does (Serve starts another); returns the
    killed actor's name."""
    name = replica_names(deployment)[0]
    os.kill(_actor_pid(name), signal.SIGKILL)
    return name


def engine_pids(deployment: str) -> list[int]:
    """The vLLM engine-core processes under a replica's actor, found from the process tree (no call
    to the replica, which may be busy or being replaced)."""
    import psutil

    children = psutil.Process(_actor_pid(replica_names(deployment)[0])).children(recursive=True)
    return [c.pid for c in children if "EngineCore" in " ".join([c.name(), *c.cmdline()])]


def _actor_pid(name: str) -> int:
    from ray._private.state import actors  # the GCS's actor table: no dashboard needed

    return next(a["Pid"] for a in actors().values() if a["Name"] == name and a["State"] == "ALIVE")


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie has exited)."""
    import psutil

    def live(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [pid for pid in pids if live(pid)]


def sigkill_engine(deployment: str) -> str:
    """SIGKILL the vLLM engine-core process of a replica (the replica lives on, its engine dead);
    returns the replica's actor name (Serve replaces the replica once its health check fails)."""
    name = replica_names(deployment)[0]
    os.kill(engine_pids(deployment)[0], signal.SIGKILL)
    return name


def inject(fault: str) -> str:
    """One named fault (see FAULTS); returns the actor name of the replica hit."""
    action, _, part = fault.partition("_")
    role, _, target = part.partition("_")
    deployment = DEPLOYMENTS[role]
    if action == "sigkill":
        return sigkill_engine(deployment) if target == "engine" else sigkill_replica(deployment)
    return kill_replica(deployment)


def probe_decode_usage(tokens: int = 8) -> EngineStatus:
    """Run one tiny request on decode so its engine steps, then read its stats (vLLM refreshes them
    only when it steps): the pool's use with nothing else running, plus the probe's one block."""
    from ray import serve

    handle = serve.get_deployment_handle(DEPLOYMENTS["decode"], APP_NAME).options(stream=True)
    request = DecodeRequest(request_id=f"probe-{time.monotonic_ns()}", prompt_token_ids=tuple(range(11, 11 + tokens)),
                            cache_salt="probe", sampling=SamplingSettings(max_tokens=1, temperature=0.0),
                            handoff=None, retain=False)
    for _ in handle.generate.remote(request):
        pass
    return engine_status(DEPLOYMENTS["decode"])


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.25) -> float:
    """Seconds until `predicate()` held; TimeoutError past `timeout_s` (exceptions count as not yet)."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - the part being waited for is still restarting
            pass
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not recovered within {timeout_s:g} s")
        time.sleep(poll_s)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def serve_replicas() -> dict[str, list[dict]]:
    """The controller's own view of each deployment's replicas (actor_name, state): unlike the
    named actors, it still lists a killed replica until the controller has noticed and replaced it."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=30)
    return {name: d["replicas"] for name, d in details["applications"][APP_NAME]["deployments"].items()}


def wait_whole(url: str, gone: tuple[str, ...] = (), timeout_s: float = 300.0) -> float:
    """Wait until the controller has replaced the replicas named in `gone`, every deployment is
    healthy with only running replicas, each engine group's engine answers alive and the router
    sees one live engine per replica of each group."""
    from ray import serve

    def whole() -> bool:
        app = serve.status().applications[APP_NAME]
        if any(d.status != "HEALTHY" for d in app.deployments.values()):
            return False
        replicas = serve_replicas()
        if any(r["state"] != "RUNNING" or r["actor_name"] in gone for rs in replicas.values() for r in rs):
            return False
        if not all(engine_status(role).alive for role in ("prefill", "decode")):
            return False
        live = health(url).get("live_engines", {})
        return all(live.get(role, 0) == len(replicas[role]) for role in ("prefill", "decode"))

    return wait_until(whole, timeout_s, poll_s=1.0)
