"""serve.yaml builds the graph without starting it, and every deployment takes its options from the config."""

from pathlib import Path

from app.ops.preflight import deployments as _deployments

ROOT = Path(__file__).resolve().parents[2]


def test_serve_yaml_builds_the_gpu_graph_with_one_bundle_per_engine_holding_its_gpus():
    from app.ops.preflight import build_applications, serve_config

    (app,) = build_applications(serve_config(ROOT / "serve.yaml")[0])
    deployments = {d.name: d for d in _deployments(app)}
    assert set(deployments) == {"frontend", "router", "prefill", "decode", "KVIndexServer"}
    for role in ("prefill", "decode"):
        replica = deployments[role]._replica_config
        assert replica.placement_group_bundles == [{"CPU": 16.0, "GPU": 8.0, f"{role}_node": 1}]
        assert replica.placement_group_strategy == "STRICT_PACK"
        # The replica holds the bundle's GPUs; vLLM's multiprocessing executor runs the 8 ranks under it.
        assert replica.ray_actor_options["num_gpus"] == 8
        assert deployments[role].init_args[0].executor_backend == "mp"
        assert deployments[role]._deployment_config.num_replicas == 1


def test_every_deployment_takes_its_limits_and_runtime_from_the_config_not_serve_s_defaults():
    from app.config import load_config
    from deployments.graph import build_graph

    config = load_config({"limits.drain_timeout_s": "45", "limits.health_check_period_s": "3"})
    deployments = {d.name: d for d in _deployments(build_graph(config))}
    limits = config.limits
    holds = limits.router_max_ongoing_requests + limits.router_max_queued_requests
    ongoing = {"frontend": 2 * holds, "router": limits.router_max_ongoing_requests,
               "prefill": limits.engine_max_ongoing_requests, "decode": limits.engine_max_ongoing_requests,
               "KVIndexServer": limits.index_max_ongoing_requests}
    for name, deployment in deployments.items():
        options = deployment._deployment_config
        assert options.max_ongoing_requests == ongoing[name], name
        assert (options.graceful_shutdown_timeout_s, options.health_check_period_s,
                options.health_check_timeout_s) == (45, 3, limits.health_check_timeout_s), name
        assert options.logging_config["enable_access_log"] is False, name
        env = deployment._replica_config.ray_actor_options["runtime_env"]["env_vars"]
        assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0", name
        assert options.max_queued_requests > 0, name
