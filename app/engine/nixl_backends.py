"""Which NIXL transfer backends an engine can use, decided before its engine starts.

config.nixl_backends ──check_backends (a probe NIXL agent)──▶ BackendCheck(loaded, missing)
BackendCheck ──choose_backends──▶ the backends the engine uses, or RuntimeError naming what is missing
NIXL itself skips a backend whose plugin does not load ("Skipping backend registration ... missing
plugin"), and vLLM's connector then dies on a KeyError deep inside the engine; checked here, a replica
stops at once and says which library is missing, or falls back to UCX when the config allows it.
"""

import ctypes
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from app.config import AppConfig

logger = logging.getLogger("ray.serve")

FALLBACK_BACKEND = "UCX"
"""The backend NIXL's wheel bundles with everything it links (UCX's own libraries)."""
PLUGIN_DIR_ENV = "NIXL_PLUGIN_DIR"
"""A folder NIXL searches for backend plugins before its wheel's own."""
PROVIDERS = {"LIBFABRIC": "LIBFABRIC needs libfabric, libhwloc and libefa on the node, which the AWS EFA installer "
                          "provides (docker/Dockerfile runs it, with --skip-kmod in a container)."}
"""What installs the libraries a backend's plugin links but NIXL's wheel does not bundle."""


@dataclass(frozen=True)
class BackendCheck:
    """Each requested backend, as NIXL could create it or not on this node."""

    loaded: tuple[str, ...] = ()
    missing: Mapping[str, str] = field(default_factory=dict)
    """Backend -> why it does not load: the library its plugin lacks (the loader's error), or that
    the plugin is absent."""


def check_backends(requested: Iterable[str]) -> BackendCheck:
    """Create each backend on a probe agent, as vLLM's connector will in the engine: NIXL's answer
    decides, since only NIXL knows how it loads its plugins (here its POSIX plugin loads through NIXL
    although a bare dlopen of the file fails). A backend NIXL refuses is then explained by a dlopen
    of its plugin file, which names the first library the plugin lacks. UCX is created too, not
    assumed from its file: a plugin that loads can still fail to start, and the probe is cheap
    because the agent runs no progress thread (NIXL's spins a core, FIELD-NOTES),
    and nothing outlives this call: the agent and every backend it created go when it returns."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"kv-loop-backend-check-{os.getpid()}",
                       nixl_agent_config(enable_prog_thread=False, backends=[]))
    failures = {name: _creation_failure(agent, name) for name in dict.fromkeys(requested)}
    dirs = plugin_dirs(sys.modules[nixl_agent.__module__])
    missing = {name: why_plugin_fails(name, dirs, failure) for name, failure in failures.items() if failure}
    return BackendCheck(loaded=tuple(name for name, failure in failures.items() if not failure), missing=missing)


def _creation_failure(agent, name: str) -> str:
    """NIXL's error creating backend `name` on `agent` ("" if it was created)."""
    try:
        agent.create_backend(name)
    except Exception as error:  # noqa: BLE001 - NIXL raises its own types (nixlNotFoundError, ...)
        return f"{type(error).__name__}: {error}"
    return ""


def plugin_dirs(binding: ModuleType) -> tuple[Path, ...]:
    """Where NIXL looks for backend plugins: NIXL_PLUGIN_DIR if set, then the folder its wheel ships
    beside the loaded binding module (nixl_cu13._api -> site-packages/nixl_cu13.libs/nixl)."""
    package = Path(binding.__file__).parent
    bundled = package.parent / f"{package.name}.libs" / "nixl"
    configured = os.environ.get(PLUGIN_DIR_ENV)
    return (Path(configured), bundled) if configured else (bundled,)


def why_plugin_fails(name: str, dirs: Sequence[Path], failure: str) -> str:
    """Why NIXL could not create backend `name` (`failure`: NIXL's own error, which says no more
    than NIXL_ERR_NOT_FOUND): the dynamic loader's error for its plugin file names the missing library."""
    filename = f"libplugin_{name}.so"
    path = next((d / filename for d in dirs if (d / filename).is_file()), None)
    if path is None:
        return f"no plugin {filename} in {', '.join(map(str, dirs))}"
    try:
        ctypes.CDLL(str(path))
    except OSError as error:
        return f"{filename} does not load: {error}"
    return f"{filename} loads, but NIXL could not create the backend ({failure})"


def choose_backends(requested: Sequence[str], check: BackendCheck, fallback_to_ucx: bool) -> tuple[str, ...]:
    """The requested backends if all load; with `fallback_to_ucx`, UCX in place of those that do not
    (and a warning); else RuntimeError."""
    unusable = [name for name in requested if name not in check.loaded]
    if not unusable:
        return tuple(requested)
    if not fallback_to_ucx or FALLBACK_BACKEND not in check.loaded:
        raise RuntimeError(refusal(check.missing, fallback_to_ucx))
    logger.warning(fallback_warning({name: check.missing[name] for name in unusable}))
    return tuple(dict.fromkeys(FALLBACK_BACKEND if name in unusable else name for name in requested))


def resolve_backends(config: AppConfig) -> tuple[str, ...]:
    """The NIXL backends this node's engine uses for `config` (UCX is checked too when it may stand in)."""
    candidates = (*config.nixl_backends, FALLBACK_BACKEND) if config.nixl_fallback_to_ucx else config.nixl_backends
    return choose_backends(config.nixl_backends, check_backends(candidates), config.nixl_fallback_to_ucx)


def refusal(missing: Mapping[str, str], fallback_to_ucx: bool) -> str:
    """Which backends do not load and why, what provides their libraries, and the config keys that decide."""
    providers = [PROVIDERS[name] for name in missing if name in PROVIDERS]
    remedy = "Set nixl_backends to backends that load here"
    if not fallback_to_ucx:
        remedy += ", or nixl_fallback_to_ucx: true to accept UCX (slower pulls on EFA nodes: KV over TCP)"
    return " ".join([f"NIXL backend {_reasons(missing)}.", *providers, f"{remedy}."])


def fallback_warning(unusable: Mapping[str, str]) -> str:
    return (f"NIXL backend {_reasons(unusable)}: using {FALLBACK_BACKEND} instead (nixl_fallback_to_ucx). On EFA "
            "nodes UCX without libefa moves KV over TCP: pulls are far slower, and placement then avoids them.")


def _reasons(missing: Mapping[str, str]) -> str:
    return "; ".join(f"{name} does not load ({why})" for name, why in missing.items())
