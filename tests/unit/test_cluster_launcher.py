"""cluster.yaml: a valid Ray cluster-launcher config that brings up a working cluster, on the image docker/Dockerfile
builds (read here, since the image cannot be built without Docker and network; its own last step checks the rest)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "/home/ray/kv-loop"
VENV_RAY = f"{PROJECT}/.venv/bin/ray"
# p5en.48xlarge: 16 network cards, one EFA (EFAv3) each, 3200 Gbps in all (AWS's instance specifications).
P5EN_EFA_INTERFACES = 16
GPU_NODE_TYPES = ("prefill_gpu", "decode_gpu")
# Options that only make sense where the EFA devices and GPUs are; `docker run` on the CPU head fails on a device
# it does not have.
GPU_ONLY_DOCKER_OPTIONS = re.compile(r"--device|--gpus|/dev/infiniband|IPC_LOCK|--privileged")
VENV_AWS = f"{PROJECT}/.venv/bin/aws"
# AWS Secrets Manager secrets every node reads when Ray starts: Ray's token, and the app's secrets (serve.yaml's
# secrets_env names the variable).
RAY_TOKEN_SECRET, APP_SECRETS_SECRET, SECRETS_ENV = "kv-loop/ray-token", "kv-loop/secrets", "KV_LOOP_SECRETS"


def _config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _prepared() -> dict:
    """The config as `ray up` uses it: Ray's AWS defaults filled in for every key the file leaves out."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(_config())


def _header() -> list[str]:
    lines = (ROOT / "cluster.yaml").read_text().splitlines()
    return [line.lstrip("# ").rstrip() for line in lines[:next(i for i, line in enumerate(lines)
                                                               if not line.startswith("#"))]]


def test_cluster_yaml_passes_rays_own_schema():
    from ray.autoscaler._private.util import validate_config

    validate_config(_prepared())
    node_types = _config()["available_node_types"]
    assert node_types["prefill_gpu"]["resources"] == {"prefill_node": 1}
    assert node_types["decode_gpu"]["resources"] == {"decode_node": 1}


def test_the_ray_dashboard_stays_off_public_interfaces():
    config = _config()
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head


class _Host:
    """Stands in for Ray's SSH runner under its DockerCommandRunner: records what Ray would run on the node and
    answers its probes as a fresh node would (Docker installed, no container yet; the NVIDIA runtime on GPU nodes)."""

    def __init__(self, gpus: bool):
        self.gpus, self.commands = gpus, []
        self.cluster_name, self.ssh_user = "kv-loop", "ubuntu"

    def run(self, cmd, with_output=False, **_):
        self.commands.append(cmd)
        runtimes = "nvidia:{nvidia-container-runtime [] <nil>} " if self.gpus else ""
        out = ("/usr/bin/docker" if "command -v docker" in cmd
               else "false" if ".State.Running" in cmd
               else json.dumps(["HOME=/home/ray"]) if ".Config.Env" in cmd
               else f"map[{runtimes}runc:{{runc [] <nil>}}]" if ".Runtimes" in cmd
               else "MemAvailable: 130000000 kB" if "meminfo" in cmd
               else "")
        return out.encode() if with_output else None


def _docker_run(as_head: bool, node_type: str) -> list[str]:
    """The `docker run` Ray's launcher issues on a new node of this type, through Ray's own code: the provider's
    command runner, the docker config as Ray picks it (the head: the top-level one; a worker: merged with its node
    type's, as StandardAutoscaler._get_node_specific_docker_config does) and DockerCommandRunner.run_init."""
    from ray.autoscaler.node_provider import NodeProvider

    config = _prepared()
    docker = dict(config["docker"])
    if not as_head:
        docker.update(config["available_node_types"][node_type].get("docker", {}))
    runner = NodeProvider(config["provider"], config["cluster_name"]).get_command_runner(
        "", node_type, config["auth"], config["cluster_name"], subprocess, False, docker)
    runner.ssh_command_runner = host = _Host(gpus=not as_head)
    runner.run_init(as_head=as_head, file_mounts=config["file_mounts"], sync_run_yet=True)
    (run,) = [c for c in host.commands if c.startswith("docker run")]
    return shlex.split(run)


def test_the_cpu_head_gets_no_device_options_and_the_gpu_nodes_get_efa():
    config = _config()
    head = _docker_run(as_head=True, node_type=config["head_node_type"])
    assert config["docker"]["image"] in head
    assert not [word for word in head if GPU_ONLY_DOCKER_OPTIONS.search(word)], head
    assert not GPU_ONLY_DOCKER_OPTIONS.search(" ".join(config["docker"].get("run_options", [])))
    for node_type in GPU_NODE_TYPES:
        worker = " ".join(_docker_run(as_head=False, node_type=node_type))
        for option in ("--device=/dev/infiniband", "--cap-add=IPC_LOCK", "--ulimit memlock=-1:-1",
                       "--shm-size=64g", "--runtime=nvidia"):
            assert option in worker, (node_type, option)


def _ray_invocations(commands: list[str]) -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each call of ray in the commands (a command may chain others before it with &&)."""
    calls = []
    for command in commands:
        words = shlex.split(command)
        while "&&" in words:
            words = words[words.index("&&") + 1:]
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
        if words[len(env)].endswith("/ray"):
            calls.append((env, words[len(env):]))
    return calls


def test_every_start_command_runs_the_venvs_ray():
    """Ray runs these through `bash --login -i`, whose ~/.bashrc (Ray's image) puts conda's ray first: only the
    venv's has vLLM, the app and boto3 for the autoscaler. `ray start` as Ray's own CLI parses it."""
    from ray.scripts.scripts import start

    config = _config()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        calls = _ray_invocations(config[key])
        assert [argv[0] for _, argv in calls] == [VENV_RAY] * len(calls) and len(calls) == 2, key
        ((env, argv),) = [(env, argv) for env, argv in calls if argv[1] == "start"]
        assert env == {"RAY_SERVE_ENABLE_HA_PROXY": "1"}, key
        params = start.make_context("ray start", argv[2:]).params
        if key.startswith("head"):
            assert params["head"] and params["dashboard_host"] == "127.0.0.1" and params["autoscaling_config"]
        else:
            assert params["address"] == "$RAY_HEAD_IP:6379"


def test_ray_token_authentication_is_on_in_every_container():
    """RAY_AUTH_MODE in the container's environment reaches `ray start` and also the shells of `ray exec`, whose
    `serve deploy` and preflight must send the token too; Ray turns it on only with the variable set."""
    config = _config()
    for as_head, node_type in [(True, config["head_node_type"]), *[(False, t) for t in GPU_NODE_TYPES]]:
        run = _docker_run(as_head=as_head, node_type=node_type)
        assert "--env=RAY_AUTH_MODE=token" in run, node_type
    # The token is a file (the start commands write it), never a value on a command line.
    assert "RAY_AUTH_TOKEN" not in " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])


FAKE_AWS = """#!/bin/bash
# Answers only the call the start commands make (a secret's value, from $SECRET_<id>).
expected="secretsmanager get-secret-value --region --secret-id --query SecretString --output text"
[ "$1 $2 $3 $5 $7 $8 $9 ${10}" = "$expected" ] && [ "$4" = "$REGION" ] || { echo "unexpected: aws $*" >&2; exit 2; }
[ "$6" = "$FAIL" ] && { echo "AccessDenied: $6" >&2; exit 254; }
printf '%s\\n' "$(printenv "SECRET_${6//[^a-z]/_}")"
"""
FAKE_RAY = """#!/bin/bash
echo "$* | ${KV_LOOP_SECRETS+set} | ${KV_LOOP_SECRETS} | ${RAY_SERVE_ENABLE_HA_PROXY}" >> "$HOME/ray-calls"
"""
APP_SECRETS = {"api_keys": {"k": "t"}, "salt_secret": "with spaces and 'quotes'"}


def _run_start_commands(tmp_path: Path, key: str, fail: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    """Run a node type's start commands as Ray does (each in its `bash --login -i` wrapper, under one more shell, as
    `docker exec` runs it; the first that fails stops the node), with stand-ins for the venv's aws, which prints the
    secret (or fails for the secret id `fail`), and ray, which records its argv and the environment the app reads."""
    from ray.autoscaler._private.command_runner import _with_interactive

    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    for directory in (home, bin_dir):
        directory.mkdir(exist_ok=True)
    (home / ".bashrc").write_text("")
    for name, script in (("aws", FAKE_AWS), ("ray", FAKE_RAY)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1", "FAIL": fail,
           "REGION": _config()["provider"]["region"], "SECRET_kv_loop_ray_token": "the-ray-token",
           "SECRET_kv_loop_secrets": json.dumps(APP_SECRETS)}
    result = None
    for command in _config()[key]:
        command = command.replace(f"{PROJECT}/.venv/bin/", f"{bin_dir}/")
        result = subprocess.run(" ".join(_with_interactive(command)), shell=True, executable="/bin/bash",
                                capture_output=True, text=True, timeout=30, env=env)
        if result.returncode:
            break
    return result, home


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_every_node_reads_the_token_and_the_apps_secrets_before_ray_starts(tmp_path, key):
    """Serve builds the app in a task on any node: the variable must be in the environment of every node's `ray start`,
    which all its Ray processes inherit. Ray reads the token from ~/.ray/auth_token, readable by its owner only."""
    result, home = _run_start_commands(tmp_path, key)
    assert result.returncode == 0, result.stderr
    token = home / ".ray" / "auth_token"
    assert token.read_text().strip() == "the-ray-token" and token.stat().st_mode & 0o077 == 0
    stop, start = (home / "ray-calls").read_text().splitlines()
    assert stop.startswith("stop |")
    argv, is_set, value, haproxy = start.split(" | ")
    assert argv.startswith("start ") and is_set == "set" and haproxy == "1"
    assert json.loads(value) == APP_SECRETS
    serve = yaml.safe_load((ROOT / "serve.yaml").read_text())
    assert {app["args"]["secrets_env"] for app in serve["applications"]} == {SECRETS_ENV}


@pytest.mark.parametrize("secret", [RAY_TOKEN_SECRET, APP_SECRETS_SECRET])
def test_a_node_whose_secret_cannot_be_read_does_not_start_ray(tmp_path, secret):
    result, home = _run_start_commands(tmp_path, "worker_start_ray_commands", fail=secret)
    assert result.returncode != 0 and "AccessDenied" in result.stderr
    assert [call.split(" | ")[0] for call in (home / "ray-calls").read_text().splitlines()] == ["stop"]


def test_ray_creates_no_security_group_and_no_instance_profile_of_its_own():
    """Ray's AWS bootstrap creates a group for each node type without SecurityGroupIds (NetworkInterfaces' Groups are
    copied into it first), admitting SSH from 0.0.0.0/0; and, for a head without IamInstanceProfile, a role with
    S3 and EC2 full access. Here every node type names the one group docs/gpu.md has you create, and the head its
    own profile."""
    config = _config()
    groups = set()
    for name, node_type in config["available_node_types"].items():
        node = node_type["node_config"]
        per_node = [node["SecurityGroupIds"]] if "SecurityGroupIds" in node else [
            interface["Groups"] for interface in node["NetworkInterfaces"]]
        assert per_node and all(per_node), name
        groups.update(group for ids in per_node for group in ids)
        assert "IamInstanceProfile" in node, name
    assert len(groups) == 1 and "security_group" not in config["provider"]
    docs = (ROOT / "docs" / "gpu.md").read_text()
    assert "kv-loop-head" in docs and "secretsmanager:GetSecretValue" in docs
    assert f"--name {RAY_TOKEN_SECRET}" in docs and f"--name {APP_SECRETS_SECRET}" in docs


def test_the_image_is_not_shadowed_or_reinstalled_at_boot():
    """Ray bind-mounts file_mounts into the container (a checkout over /home/ray/kv-loop would hide the image's
    venv), and its AWS defaults pip-install into the image's conda Python unless the config says otherwise."""
    config = _prepared()
    for target in config["file_mounts"]:
        assert not (PROJECT + "/").startswith(target.rstrip("/") + "/"), target
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        assert config[key] == [], key


def test_the_nodes_run_the_dockerfile_image_from_the_registry_they_log_in_to():
    config = _config()
    image = config["docker"]["image"]
    registry, _, name = image.partition("/")
    assert name == _kuberay_image() and config["docker"]["pull_before_run"]
    (login,) = config["initialization_commands"]
    assert "docker login" in login and login.split()[-1] == registry


def test_the_deploy_line_is_ray_exec_of_the_venvs_preflight_and_serve_deploy():
    header = _header()
    assert not [line for line in header if "ray submit" in line]
    (deploy,) = [line for line in header if "serve deploy" in line]
    words = shlex.split(deploy)
    assert words[:3] == ["ray", "exec", "cluster.yaml"]
    assert words[3] == (f"cd {PROJECT} && .venv/bin/python -m app.ops.preflight serve.yaml "
                        "&& .venv/bin/serve deploy serve.yaml")
    assert f"`{deploy}`" in (ROOT / "docs" / "kuberay.md").read_text()


def test_each_gpu_node_attaches_one_efa_per_network_card_as_many_as_kuberay_requests():
    config = _config()
    for node_type in GPU_NODE_TYPES:
        node = config["available_node_types"][node_type]["node_config"]
        assert node["InstanceType"] == "p5en.48xlarge"
        interfaces = sorted(node["NetworkInterfaces"], key=lambda i: i["NetworkCardIndex"])
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(P5EN_EFA_INTERFACES))
        assert [(i["DeviceIndex"], i["InterfaceType"]) for i in interfaces] == (
            [(0, "efa")] + [(1, "efa-only")] * (P5EN_EFA_INTERFACES - 1))
    service = _kuberay_service()
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["vpc.amazonaws.com/efa"]) == P5EN_EFA_INTERFACES, group["groupName"]


# docker/Dockerfile, read instruction by instruction.

def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined, heredoc bodies kept."""
    lines, instructions = (ROOT / "docker" / "Dockerfile").read_text().splitlines(), []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = re.search(r'<<-?"?(\w+)"?', line)
        if heredoc:
            end = lines.index(heredoc.group(1), i)
            line, i = line + "\n" + "\n".join(lines[i:end]), end + 1
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args))
    return instructions


def _runs() -> list[str]:
    return [args for keyword, args in _dockerfile() if keyword == "RUN"]


def _kuberay_service() -> dict:
    (service,) = [d for d in yaml.safe_load_all((ROOT / "kuberay.yaml").read_text()) if d and d["kind"] == "RayService"]
    return service


def _kuberay_image() -> str:
    cluster = _kuberay_service()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    (image,) = {group["template"]["spec"]["containers"][0]["image"] for group in groups}
    return image


def test_the_image_is_rays_of_the_version_pyproject_and_kuberay_pin():
    from packaging.requirements import Requirement

    (base,) = [args for keyword, args in _dockerfile() if keyword == "FROM"]
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-cu\d+", base)
    assert match, base
    version = match.group(1)
    service = _kuberay_service()
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == version
    pyproject = (ROOT / "pyproject.toml").read_text()
    (ray,) = [Requirement(r) for r in re.findall(r'"(ray\[serve\][^"]*)"', pyproject)]
    assert version in ray.specifier and f">={version}" in str(ray.specifier)
    project_version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert _kuberay_image() == f"kv-loop:{project_version}"


def test_the_image_installs_efa_for_a_container_and_the_project_in_its_venv():
    runs = _runs()
    (installer,) = [run for run in runs if "efa_installer.sh" in run]
    flags = shlex.split(installer.split("efa_installer.sh", 1)[1].split(";")[0])
    assert {"-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"} <= set(flags)
    assert "VALIDSIG" in installer and "gpg" in installer  # the pinned tarball's signature, by AWS's key
    assert re.search(r"apt-get install [^;]*\blibhwloc15\b", installer)
    args = {keyword + " " + args.split("=", 1)[0]: args for keyword, args in _dockerfile() if keyword == "ARG"}
    assert re.fullmatch(r"EFA_INSTALLER_VERSION=\d+\.\d+\.\d+", args["ARG EFA_INSTALLER_VERSION"])
    env = dict(args.split("=", 1) for keyword, args in _dockerfile() if keyword == "ENV")
    assert env["PATH"].split(":")[0] == f"{PROJECT}/.venv/bin"
    assert "/opt/amazon/efa/lib" in env["LD_LIBRARY_PATH"].split(":")
    assert [run for run in runs if re.match(r"\./install\.sh gpu\b", run)]
    # The AWS CLI cluster.yaml's start commands read the secrets with, in the venv (Ray's image has none).
    assert [run for run in runs if re.search(r"\.venv/bin/pip install [^&]*\bawscli\b", run)]
    assert any(f"export PATH={PROJECT}/.venv/bin:$PATH" in run and ".bashrc" in run for run in runs)
    # The build ends by proving it: the check script must pass in the finished image.
    assert _dockerfile()[-1] == ("RUN", "kv-loop-check-image")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored or ".venv" in ignored  # else `COPY . .` puts a local (CPU) venv over the image's


def _check_script() -> str:
    (copy,) = [args for keyword, args in _dockerfile() if keyword == "COPY" and "kv-loop-check-image" in args]
    return copy.split("\n", 1)[1]


def _run_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "kv-loop-check-image"
    script.write_text(_check_script())
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KV_LOOP_VENV": sys.prefix, **env})


def test_the_image_check_fails_where_nixls_libfabric_plugin_cannot_load(tmp_path):
    """This machine has NIXL but no EFA libraries: the image's last step must refuse it, naming the library."""
    if "libfabric.so.1" in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout:
        pytest.skip("libfabric is installed here")
    result = _run_check(tmp_path)
    assert result.returncode != 0
    assert re.search(r"libplugin_LIBFABRIC\.so: .*libfabric\.so\.1 => not found", result.stderr), result.stderr


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc for stand-in libraries")
def test_the_image_check_passes_the_plugin_once_libfabric_and_hwloc_resolve(tmp_path):
    libs = tmp_path / "libs"
    libs.mkdir()
    for soname in ("libfabric.so.1", "libhwloc.so.15"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(libs / soname), f"-Wl,-soname,{soname}"],
                       input="int kv_loop_stand_in;", text=True, check=True)
    result = _run_check(tmp_path, LD_LIBRARY_PATH=str(libs))
    assert "LIBFABRIC" not in result.stderr, result.stderr
