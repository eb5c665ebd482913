"""Before a deploy: will this Serve config start where it is going?

    python -m app.ops.preflight serve.yaml                 # a Serve config, as `serve deploy` takes it
    python -m app.ops.preflight kuberay.yaml               # a KubeRay RayService: its serveConfigV2
    python -m app.ops.preflight serve.yaml --address auto  # also: can the running cluster's nodes hold it

The graph is built as `serve deploy` builds it (Ray's schema, then `app:graph` with the args), so a
config the app refuses fails here with the app's message. Each engine group's placement bundle is
then reserved on a throwaway local Ray node that advertises what the bundles ask for, and in it,
as in the engine's replica, vLLM's own executor selection and placement-group checks run
(`ParallelConfig`, and `initialize_ray_cluster` where vLLM picks its Ray executor) against the
target device. A RayService's worker groups, read by Ray's own KubeRay autoscaler code, and with
--address the cluster's live nodes, must each have a node that holds each engine bundle.
Exit 0 if every check passed; 1 with the problems, each naming the config key to change.
"""

import argparse
import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.config import AppConfig, Device
from app.protocol import Role

PLACEMENT_TIMEOUT_S = 60.0
"""How long a bundle may wait for a node on the throwaway Ray before it counts as unplaceable."""
ENGINE_DEPLOYMENTS = {"prefill": Role.PREFILL, "decode": Role.DECODE}


@dataclass(frozen=True)
class EngineGroupPlan:
    """What Serve will ask Ray for, for one engine group's replica: the deployment's own options."""

    role: Role
    config: AppConfig
    bundles: tuple[dict[str, float], ...]
    actor_options: dict[str, Any]

    @property
    def keys(self) -> str:
        """The config keys that decide this group's placement, for messages."""
        name = self.role.value
        return f"tensor_parallel_size, pipeline_parallel_size, {name}.cpus_per_replica, {name}.bundle_resources"


# ---- the Serve config, built as `serve deploy` builds it -----------------------------------------
def serve_config(path: Path) -> tuple[dict, dict | None]:
    """The Serve config in `path` and, for a RayService manifest (beside other objects, such as its
    NetworkPolicy), its RayCluster spec."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for document in documents:
        if document.get("kind") == "RayService":
            return yaml.safe_load(document["spec"]["serveConfigV2"]), document["spec"].get("rayClusterConfig")
    return documents[0], None


def build_applications(config: dict) -> list[Any]:
    """Every application of the config, built by Serve's own code path for `serve deploy`."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    for name in secrets_set_elsewhere(config):
        print(f"preflight: {name} (secrets_env) is not set here; the app reads it on the cluster's nodes, "
              "where `ray start` ran", file=sys.stderr)
        os.environ[name] = "{}"  # build without keys: the layout does not depend on them
    return [call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
            for app in schema.applications]


def deployments(app) -> list[Any]:
    """Walk the bound graph: the ingress and every deployment bound into its arguments."""
    seen, stack = {}, [app._bound_deployment]
    while stack:
        deployment = stack.pop()
        seen.setdefault(deployment.name, deployment)
        stack.extend(arg._bound_deployment for arg in deployment.init_args if hasattr(arg, "_bound_deployment"))
    return list(seen.values())


def engine_plans(app) -> list[EngineGroupPlan]:
    plans = []
    for deployment in deployments(app):
        if deployment.name in ENGINE_DEPLOYMENTS:
            replica = deployment._replica_config
            plans.append(EngineGroupPlan(role=ENGINE_DEPLOYMENTS[deployment.name], config=deployment.init_args[0],
                                         bundles=tuple(replica.placement_group_bundles),
                                         actor_options=dict(replica.ray_actor_options)))
    return plans


# ---- vLLM's checks, run where the engine would run -----------------------------------------------
def vllm_placement_problems(config: AppConfig, role: Role) -> list[str]:
    """vLLM's executor selection and placement checks for this engine, run in the calling process as
    if it were the engine's replica on the target device. Call it inside the placed replica (or a
    task in its bundle): vLLM reads the current placement group and the visible devices there."""
    from vllm.config import ParallelConfig

    from app.engine.settings import assign_identity, engine_args

    args = engine_args(config, config.prefill if role == Role.PREFILL else config.decode,
                       assign_identity(config, role, 0, "127.0.0.1"))
    try:
        with target_platform(config.device) as platform:
            parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                      pipeline_parallel_size=args.pipeline_parallel_size,
                                      distributed_executor_backend=args.distributed_executor_backend)
            if parallel.use_ray:
                from vllm.v1.executor.ray_utils import initialize_ray_cluster

                initialize_ray_cluster(parallel)
            elif config.device == Device.CUDA and platform.device_count() < parallel.world_size:
                return [f"{role.value}: vLLM's {parallel.distributed_executor_backend} executor needs "
                        f"{parallel.world_size} GPUs in its replica, which holds {platform.device_count()}"]
    except ValueError as exc:
        return [f"{role.value}: vLLM refuses the engine's placement: {exc}"]
    return []


@contextlib.contextmanager
def target_platform(device: Device) -> Iterator[Any]:
    """vLLM's platform as the engine sees it on its node. On cuda, vLLM's CudaPlatform cannot load in
    the CPU build, so a Platform of vLLM's interface stands in, with CudaPlatform's Ray device key
    and visibility variable and the devices Ray made visible to this process. On cpu, vLLM's own."""
    from vllm import platforms

    if device != Device.CUDA:
        yield platforms.current_platform
        return
    from vllm.config import parallel
    from vllm.platforms.interface import Platform, PlatformEnum
    from vllm.v1.executor import ray_utils

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]

    class TargetCuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        ray_device_key = "GPU"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        @classmethod
        def device_count(cls) -> int:
            return len(visible)

    # vLLM's modules bind the platform at import, and vllm.platforms resolves it for later imports.
    holders = ((parallel, "current_platform"), (ray_utils, "current_platform"), (platforms, "_current_platform"))
    saved = [getattr(module, name) for module, name in holders]
    stand_in = TargetCuda()
    for module, name in holders:
        setattr(module, name, stand_in)
    try:
        yield stand_in
    finally:
        for (module, name), platform in zip(holders, saved):
            setattr(module, name, platform)


def placed_problems(plans: list[EngineGroupPlan]) -> list[str]:
    """Reserve each group's bundles on the connected Ray and run vLLM's checks in a task placed
    there with the replica actor's own resources (so Ray sets its visible devices as for the replica)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    problems = []
    check = ray.remote(vllm_placement_problems)
    for plan in plans:
        group = placement_group(list(plan.bundles), strategy="STRICT_PACK")
        try:
            if not group.wait(PLACEMENT_TIMEOUT_S):
                problems.append(f"{plan.role.value}: no node holds the bundle {list(plan.bundles)} (keys: {plan.keys})")
                continue
            options = {key: plan.actor_options[key] for key in ("num_cpus", "num_gpus", "resources")
                       if key in plan.actor_options}
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
            problems += ray.get(check.options(scheduling_strategy=strategy, **options).remote(plan.config, plan.role))
        finally:
            remove_placement_group(group)
    return problems


def local_node_resources(plans: list[EngineGroupPlan]) -> dict[str, float]:
    """One node that holds every group's bundles at once: what the throwaway Ray advertises."""
    total: Counter = Counter()
    for plan in plans:
        for bundle in plan.bundles:
            total.update(bundle)
    return dict(total)


def on_throwaway_ray(plans: list[EngineGroupPlan]) -> list[str]:
    import ray

    node = local_node_resources(plans)
    custom = {k: v for k, v in node.items() if k not in ("CPU", "GPU")}
    # "local": a Ray of its own even where one already runs on this machine.
    ray.init(address="local", num_cpus=int(node.get("CPU", 1)) + 1, num_gpus=int(node.get("GPU", 0)), resources=custom,
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        return placed_problems(plans)
    finally:
        ray.shutdown()


# ---- where the cluster must hold the groups ------------------------------------------------------
def fits(bundle: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(key, 0) >= amount for key, amount in bundle.items() if amount)


def unheld_problems(plans: list[EngineGroupPlan], nodes: dict[str, dict[str, float]], where: str) -> list[str]:
    """Each engine bundle must fit one node (STRICT_PACK) of `nodes`, name -> total resources."""
    return [f"{plan.role.value}: no {where} holds the bundle {bundle} (keys: {plan.keys})"
            for plan in plans for bundle in plan.bundles if not any(fits(bundle, n) for n in nodes.values())]


def kuberay_worker_groups(cluster_spec: dict) -> dict[str, dict[str, float]]:
    """The RayCluster's node types as Ray's KubeRay autoscaler derives them from the pods' specs."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    ray_cluster = {"metadata": {"name": "preflight", "namespace": "default"}, "spec": cluster_spec}
    node_types = _derive_autoscaling_config_from_ray_cr(ray_cluster)["available_node_types"]
    return {name: node["resources"] for name, node in node_types.items()}


def live_nodes(address: str) -> dict[str, dict[str, float]]:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
    finally:
        ray.shutdown()


# ---- the command ---------------------------------------------------------------------------------
def secrets_set_elsewhere(config: dict) -> list[str]:
    """The applications' `secrets_env` variables this shell lacks."""
    names = {app.get("args", {}).get("secrets_env") for app in config.get("applications", [])}
    return sorted(name for name in names if name and name not in os.environ)


def preflight(path: Path, address: str | None = None) -> list[str]:
    """Every problem found with the config in `path`; empty if it will start."""
    config, cluster_spec = serve_config(path)
    try:
        plans = [plan for app in build_applications(config) for plan in engine_plans(app)]
    except ValueError as exc:  # the app's config checks and Ray's schema name the keys
        return [str(exc)]
    problems = []
    if cluster_spec is not None:
        problems += unheld_problems(plans, kuberay_worker_groups(cluster_spec), "worker group of the RayCluster")
    if address:
        problems += unheld_problems(plans, live_nodes(address), f"live node of the cluster at {address}")
    return problems + on_throwaway_ray(plans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.ops.preflight", description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="a Serve config (serve.yaml) or a KubeRay RayService manifest")
    parser.add_argument("--address", help="a running Ray cluster whose live nodes must hold the engine groups")
    args = parser.parse_args(argv)
    problems = preflight(args.config, args.address)
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    print(f"preflight: {args.config}: " + ("FAILED" if problems else "ok"), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
