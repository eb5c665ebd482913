"""cluster.yaml is a valid Ray cluster config, and serve.yaml builds the graph without starting it."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_passes_rays_own_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    node_types = config["available_node_types"]
    assert node_types["prefill_gpu"]["resources"] == {"prefill_node": 1}
    assert node_types["decode_gpu"]["resources"] == {"decode_node": 1}


def test_the_ray_dashboard_stays_off_public_interfaces():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head


def test_serve_yaml_builds_the_gpu_graph():
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve.yaml").read_text()))
    app_schema = schema.applications[0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_schema.import_path), app_schema.args)
    deployments = {d.name: d for d in _deployments(app)}
    assert set(deployments) == {"frontend", "router", "prefill", "decode", "KVIndexServer"}
    prefill = deployments["prefill"]._deployment_config
    assert deployments["prefill"]._replica_config.placement_group_bundles == [
        {"CPU": 16.0, "GPU": 8.0, "prefill_node": 1}]
    assert deployments["decode"]._replica_config.placement_group_bundles[0]["decode_node"] == 1
    assert prefill.num_replicas == 1


def _deployments(app):
    """Walk the bound graph: the ingress and every deployment bound into its arguments."""
    seen, stack = [], [app._bound_deployment]
    while stack:
        deployment = stack.pop()
        seen.append(deployment)
        for arg in deployment.init_args:
            if hasattr(arg, "_bound_deployment"):
                stack.append(arg._bound_deployment)
    return list({d.name: d for d in seen}.values())


def test_every_deployment_takes_its_limits_and_runtime_from_the_config_not_serve_s_defaults():
    from app.config import load_config
    from app.graph import build_graph

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
