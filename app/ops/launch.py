"""Start the graph on a local Ray for tests, benchmarks and notebooks: `start_local(config)` -> URL."""

import os

from app.config import TINY_MODEL, AppConfig
from app.engine.ports import free_port
from app.model.tiny import ensure_tiny_model
from deployments.graph import build_graph

APP_NAME = "kv-loop"
"""The Serve application's name, as serve.yaml and kuberay.yaml deploy it."""
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
WORKER_NICENESS_ENV, SERVING_NICENESS = "RAY_worker_niceness", 0
"""Ray starts its workers, so every Serve replica, at nice 15 by default. On the CPU layout the
serving path's Python then yields to the engines' compute only weakly (weights 36 to 15 against
engine_nice 19), and under load its hops outside the router wait behind prefill's compute and add
to every later turn's first token; at 0 they run ahead of it (docs/measurements.md)."""
CONTROL_LOOP_ENV, CONTROL_LOOP_INTERVAL_S = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5"
"""Serve's controller runs its control loop every 0.1 s by default, and each pass asks the GCS for
the cluster's nodes and resources, idle or not. Every 0.5 s Serve notices a replica that started,
died or failed its health check up to 0.4 s later (the health checks stay every
limits.health_check_period_s); Ray reads it where it starts, like the two above."""


def start_local(config: AppConfig, num_cpus: int = 4) -> str:
    """Ray with logical CPUs enough for the engine bundles, Serve on a free loopback port, the app."""
    url = start_serve(num_cpus)
    replace_app(config)
    return url


def worker_niceness() -> int:
    """The nice value of the Ray workers started from this process (SERVING_NICENESS unless the
    environment sets another)."""
    return int(os.environ.setdefault(WORKER_NICENESS_ENV, str(SERVING_NICENESS)))


def start_serve(num_cpus: int = 4, haproxy: bool = True) -> str:
    """A local Ray and Serve with no application yet; returns the ingress URL. `haproxy`: Serve's
    HAProxy ingress, which forwards each request straight to the router replica's own HTTP server;
    off: Serve's Python proxy actor, one more process each way (docs/measurements.md, "Ingress")."""
    import ray
    from ray import serve

    # Serve reads these from its environment, which it inherits from the Ray started here. HAProxy's
    # own stats and metrics ports are fixed by default: free ones let another Serve run beside.
    worker_niceness()
    os.environ.setdefault(CONTROL_LOOP_ENV, CONTROL_LOOP_INTERVAL_S)
    os.environ.update({HAPROXY_ENV: "1" if haproxy else "0",
                       "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port("127.0.0.1")),
                       "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port("127.0.0.1"))})
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def replace_app(config: AppConfig) -> None:
    """Run the graph for `config` at / on the running Serve, stopping the one there first."""
    from ray import serve

    if config.model == TINY_MODEL:
        ensure_tiny_model(config.model_path())
    delete_app()
    serve.run(build_graph(config), name=APP_NAME, route_prefix="/")


def delete_app() -> None:
    from ray import serve

    serve.delete(APP_NAME)


def stop_local() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
