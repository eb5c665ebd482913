"""kuberay.yaml is a RayService that KubeRay and Ray accept, for the layout and app of cluster.yaml + serve.yaml, and
the NetworkPolicy that opens only Serve's HTTP port beyond the RayService's own pods."""

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# A pruned copy of KubeRay's RayService CRD schema; the file says where from and how to regenerate it.
CRD = yaml.safe_load((Path(__file__).with_name("data") / "rayservice_crd_extract.yaml").read_text())
ENGINE_GROUPS = ("prefill", "decode")
# p5en.48xlarge: 16 network cards, one EFA interface each (cluster.yaml attaches them all).
P5EN_EFA_DEVICES = 16


# Ray's token authentication and the app's secrets come from Secrets the manifest names but does not hold.
RAY_TOKEN_SECRET = "kv-loop-ray-token"
APP_SECRETS = {"name": "kv-loop-secrets", "key": "secrets.json"}
SECRETS_ENV = "KV_LOOP_SECRETS"
SERVE_PORT, DASHBOARD_PORT = 8000, 8265
# The KubeRay operator's pods, as its Helm chart labels them, in the namespace docs/kuberay.md installs it in.
OPERATOR = ({"kubernetes.io/metadata.name": "kuberay-system"}, {"app.kubernetes.io/name": "kuberay-operator"})


def _documents() -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all((ROOT / "kuberay.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    assert len(by_kind) == len(documents)
    return by_kind


@pytest.fixture
def service() -> dict:
    return _documents()["RayService"]


@pytest.fixture
def policy() -> dict:
    return _documents()["NetworkPolicy"]


@pytest.fixture
def app_args(service) -> dict:
    from ray.serve.schema import ServeDeploySchema

    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])).applications
    return app.args


def _groups(service: dict) -> dict[str, dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in a pod's first container


def test_manifest_passes_the_rayservice_crd_schema(service):
    assert (service["apiVersion"], service["kind"]) == (CRD["apiVersion"], CRD["kind"])
    jsonschema.validate(service, CRD["schema"])
    # KubeRay's own metadata check: a DNS-1035 label short enough for the RayCluster name it derives.
    name = service["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 47


def test_every_group_has_the_fields_kuberay_needs(service):
    assert isinstance(service["spec"]["serveConfigV2"], str)
    for name, group in _groups(service).items():
        assert isinstance(group["rayStartParams"], dict), name
        assert all(c["name"] and c["image"] for c in group["template"]["spec"]["containers"]), name
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert group["groupName"] and 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # The head Service gets these ports: workers join through gcs-server, the operator deploys the app through
    # dashboard, and without a port named serve KubeRay creates no serve Service.
    ports = {p["name"]: p["containerPort"] for p in _ray_container(_groups(service)["head"])["ports"]}
    assert (ports["gcs-server"], ports["dashboard"], ports["serve"]) == (6379, 8265, 8000)


def test_serve_config_is_serve_yaml(service):
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == yaml.safe_load((ROOT / "serve.yaml").read_text())


def test_app_args_build_the_gpu_config(app_args):
    from app.config import Device, load_config

    config = load_config(app_args)
    assert config.device == Device.CUDA and config.nixl_backends == ("LIBFABRIC",)
    for role in ENGINE_GROUPS:
        group = getattr(config, role)
        assert config.gpus_per_engine == config.tensor_parallel_size and dict(group.bundle_resources) == {
            f"{role}_node": 1}


def test_each_engine_bundle_fits_its_own_worker_group_only(service, app_args):
    """Read the groups as Ray's KubeRay autoscaler does: only the prefill group can host a prefill bundle."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    from app.config import load_config

    ray_cluster = {"metadata": {"name": "kv-loop", "namespace": "default"},
                   "spec": service["spec"]["rayClusterConfig"]}
    node_types = _derive_autoscaling_config_from_ray_cr(ray_cluster)["available_node_types"]
    config = load_config(app_args)
    for role in ENGINE_GROUPS:
        group = getattr(config, role)
        bundle = {"CPU": group.cpus_per_replica, "GPU": config.gpus_per_engine, **group.bundle_resources}
        fits = {name for name, node in node_types.items()
                if all(node["resources"].get(key, 0) >= amount for key, amount in bundle.items())}
        assert fits == {role}


@pytest.mark.parametrize("role", ENGINE_GROUPS)
def test_custom_resource_param_reaches_ray_start_intact(service, role):
    from ray._private.utils import parse_resources_json
    from ray.autoscaler._private.cli_logger import cf, cli_logger
    from ray.scripts.scripts import start

    value = _groups(service)[role]["rayStartParams"]["resources"]
    expected = {f"{role}_node": 1}
    # KubeRay merges accelerator resources into it: getResourcesMap in ray-operator/controllers/ray/common/pod.go
    # trims quotes and backticks, then parses JSON.
    assert json.loads(value.strip("'\"` ")) == expected
    # KubeRay then runs `ray start --resources=<value>` under /bin/bash -c; shlex splits the words as bash would.
    params = start.make_context("ray start", shlex.split(f"--address=head:6379 --resources={value}")).params
    assert parse_resources_json(params["resources"], cli_logger, cf) == expected


def test_gpu_groups_get_eight_gpus_and_efa(service, app_args):
    for role in ENGINE_GROUPS:
        container = _ray_container(_groups(service)[role])
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == app_args["tensor_parallel_size"] == 8
        assert int(limits["vpc.amazonaws.com/efa"]) == P5EN_EFA_DEVICES
        assert container["resources"]["requests"] == limits  # extended resources need requests == limits
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["FI_PROVIDER"] == "efa"
    assert "nvidia.com/gpu" not in _ray_container(_groups(service)["head"])["resources"]["limits"]


def test_haproxy_ingress_is_on_in_every_ray_container(service):
    for name, group in _groups(service).items():
        env = {e["name"]: e.get("value") for e in _ray_container(group).get("env", [])}
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", name


def test_dashboard_is_not_exposed_outside_the_cluster(service):
    head = _groups(service)["head"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress", False)


def test_only_the_gpu_pods_get_efa_devices_and_memory_pinning(service):
    """The EFA device plugin gives a pod its /dev/infiniband devices for vpc.amazonaws.com/efa; the head has none."""
    for name, group in _groups(service).items():
        pod = group["template"]["spec"]
        container = _ray_container(group)
        capabilities = container.get("securityContext", {}).get("capabilities", {}).get("add", [])
        efa = container.get("resources", {}).get("limits", {}).get("vpc.amazonaws.com/efa")
        host_paths = [v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v]
        assert not container.get("securityContext", {}).get("privileged"), name
        assert not [path for path in host_paths if path.startswith("/dev/")], name
        if name == "head":
            assert capabilities == [] and efa is None, name
        else:
            assert capabilities == ["IPC_LOCK"] and int(efa) == P5EN_EFA_DEVICES, name


def test_every_pod_runs_the_image_docker_file_builds(service):
    images = {_ray_container(group)["image"] for group in _groups(service).values()}
    (image,) = images
    header = [line for line in (ROOT / "kuberay.yaml").read_text().splitlines() if line.startswith("#")]
    assert any("docker/Dockerfile" in line for line in header)
    docs = (ROOT / "docs" / "kuberay.md").read_text()
    assert f"docker build -f docker/Dockerfile -t {image} ." in docs
    assert not [line for line in docs.splitlines() if line.startswith("FROM ")]  # no second, inline recipe


def test_the_manifest_holds_the_rayservice_and_its_network_policy_and_no_secret():
    documents = _documents()
    assert set(documents) == {"RayService", "NetworkPolicy"}  # the Secrets are created by hand, not shipped
    assert documents["NetworkPolicy"]["apiVersion"] == "networking.k8s.io/v1"


def test_ray_token_authentication_is_on_for_every_node_from_one_secret(service):
    """KubeRay (v1.6+) sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from the Secret on every Ray container and sends
    the token to the dashboard itself; a value in a container's env would win (it fills in only missing ones)."""
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": RAY_TOKEN_SECRET}
    for name, group in _groups(service).items():
        names = {e["name"] for e in _ray_container(group).get("env", [])}
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, name
    docs = (ROOT / "docs" / "kuberay.md").read_text()
    assert f"kubectl create secret generic {RAY_TOKEN_SECRET} --from-file=auth_token=" in docs
    assert "RAY_AUTH_MODE=token" in docs  # what a client (notebook, ray job submit) sets besides the token


def test_every_ray_container_gets_the_apps_secrets_from_the_secret(service, app_args):
    """Serve builds the graph in a task on any node, so every node's Ray processes need the variable."""
    from app.conversations.tenants import SECRET_NAMES

    assert app_args["secrets_env"] == SECRETS_ENV
    assert not SECRET_NAMES & set(app_args)  # no key or salt in the Serve config
    for name, group in _groups(service).items():
        env = {e["name"]: e for e in _ray_container(group)["env"]}
        assert env[SECRETS_ENV] == {"name": SECRETS_ENV, "valueFrom": {"secretKeyRef": APP_SECRETS}}, name
    header = [line for line in (ROOT / "kuberay.yaml").read_text().splitlines() if line.startswith("#")]
    assert any(f"kubectl create secret generic {APP_SECRETS['name']} --from-file={APP_SECRETS['key']}" in line
               for line in header)


# The NetworkPolicy, read with the semantics of networking.k8s.io/v1 for the fields it uses (no Kubernetes schema is
# available offline: the fields are checked against the ones this reader knows, so nothing goes unread).
POLICY_FIELDS = {"podSelector", "policyTypes", "ingress"}
RULE_FIELDS, PEER_FIELDS, PORT_FIELDS = {"from", "ports"}, {"podSelector", "namespaceSelector"}, {"protocol", "port"}


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def _admits(policy: dict, namespace: dict | None, pod: dict | None, port: int, protocol: str = "TCP") -> bool:
    """Whether a connection to `port` of a selected pod is admitted from a pod with labels `pod` in a namespace with
    labels `namespace` (the policy's own namespace: None), or from outside the cluster's pods (both None)."""
    spec = policy["spec"]
    for rule in spec["ingress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p.get("protocol", "TCP") == protocol and p["port"] == port for p in ports):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            if pod is None:
                continue  # only ipBlock peers admit traffic from outside the pods; the policy has none
            if "namespaceSelector" in peer:
                in_namespace = namespace is not None and _selects(peer["namespaceSelector"], namespace)
            else:
                in_namespace = namespace is None
            if in_namespace and _selects(peer.get("podSelector", {}), pod):
                return True
    return False


def test_the_network_policy_uses_only_fields_this_test_reads(policy):
    spec = policy["spec"]
    assert set(spec) <= POLICY_FIELDS
    for rule in spec["ingress"]:
        assert set(rule) <= RULE_FIELDS, rule
        assert all(set(peer) <= PEER_FIELDS for peer in rule.get("from", [])), rule
        assert all(set(port) <= PORT_FIELDS and isinstance(port["port"], int) for port in rule.get("ports", [])), rule


def test_the_network_policy_selects_every_pod_of_the_rayservice(service, policy):
    """By a label of the pod templates: KubeRay's own ray.io/cluster holds the generated RayCluster name
    (kv-loop-xxxxx), new with every NewCluster upgrade, and it lets no template override its ray.io/ labels."""
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress open: the model download, the registry
    selector = spec["podSelector"]
    assert selector["matchLabels"] and not [key for key in selector["matchLabels"] if key.startswith("ray.io/")]
    for name, group in _groups(service).items():
        assert _selects(selector, group["template"]["metadata"]["labels"]), name


def test_the_network_policy_admits_serve_from_anywhere_everything_from_its_pods_and_nothing_else(service, policy):
    pods = policy["spec"]["podSelector"]["matchLabels"]
    head_ports = {p["name"]: p["containerPort"] for p in _ray_container(_groups(service)["head"])["ports"]}
    assert (head_ports["serve"], head_ports["dashboard"]) == (SERVE_PORT, DASHBOARD_PORT)
    # Ray's GCS, client server, dashboard agent, a worker's port, a NIXL side channel, a Serve replica's gRPC port.
    ports = [SERVE_PORT, DASHBOARD_PORT, 6379, 8080, 10001, 52365, 10002, 23456, 45678]
    for port in ports:
        assert _admits(policy, None, pods, port), port  # the RayService's own pods: everything
        assert _admits(policy, None, pods, port, "UDP"), port
    other_pod, other_namespace = {"app": "notebook"}, {"kubernetes.io/metadata.name": "other"}
    for source in [(None, None), (None, other_pod), (other_namespace, other_pod), (other_namespace, pods)]:
        assert [port for port in ports if _admits(policy, *source, port)] == [SERVE_PORT], source
    # The operator deploys serveConfigV2 and reads Serve's status through the dashboard, and nothing else.
    assert [port for port in ports if _admits(policy, *OPERATOR, port)] == [SERVE_PORT, DASHBOARD_PORT]
    assert [port for port in ports if _admits(policy, {"kubernetes.io/metadata.name": "default"}, OPERATOR[1], port)
            ] == [SERVE_PORT]
    docs = (ROOT / "docs" / "kuberay.md").read_text()
    assert f"--namespace {OPERATOR[0]['kubernetes.io/metadata.name']}" in docs
