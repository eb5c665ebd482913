"""The NIXL backend check against this machine's real NIXL (UCX loads; LIBFABRIC's plugin lacks
libfabric.so.1), what a replica does with its answer, and /health's view of each engine's backends."""

import asyncio
import logging
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from app.config import AppConfig
from app.engine.nixl_backends import BackendCheck, check_backends, choose_backends, resolve_backends
from app.protocol import LoadReport, Membership
from app.turn.membership import LiveEngines

LIBFABRIC_ONLY = AppConfig(nixl_backends=("LIBFABRIC",))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_ucx_loads_and_libfabric_names_the_library_it_lacks():
    check = check_backends(["UCX", "LIBFABRIC"])
    assert check.loaded == ("UCX",)
    assert list(check.missing) == ["LIBFABRIC"] and "libfabric.so.1" in check.missing["LIBFABRIC"]


def test_a_backend_without_a_plugin_is_named_absent():
    assert "no plugin libplugin_NOSUCH.so" in check_backends(["NOSUCH"]).missing["NOSUCH"]


def test_the_probe_leaves_no_thread_behind():
    """NIXL's progress thread spins a core; the probe agent runs none and goes with its backends."""
    check_backends(["UCX"])  # NIXL's own import-time threads, once
    before = _threads()
    check_backends(["UCX", "LIBFABRIC"])
    assert _threads() == before


def test_a_missing_backend_stops_the_replica_naming_library_provider_and_config_keys():
    with pytest.raises(RuntimeError) as refused:
        resolve_backends(LIBFABRIC_ONLY)
    message = str(refused.value)
    for named in ("LIBFABRIC", "libfabric.so.1", "AWS EFA installer", "docker/Dockerfile", "libhwloc", "libefa",
                  "nixl_backends", "nixl_fallback_to_ucx: true"):
        assert named in message, named


def test_with_the_fallback_on_ucx_stands_in_with_a_warning_naming_the_cost(caplog):
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        assert resolve_backends(replace(LIBFABRIC_ONLY, nixl_fallback_to_ucx=True)) == ("UCX",)
    assert "LIBFABRIC" in caplog.text and "TCP" in caplog.text and "far slower" in caplog.text


def test_backends_that_load_are_used_as_asked():
    assert resolve_backends(AppConfig(nixl_backends=("UCX",))) == ("UCX",)
    assert choose_backends(["POSIX", "UCX"], BackendCheck(loaded=("POSIX", "UCX")), False) == ("POSIX", "UCX")


def test_the_fallback_replaces_only_the_missing_backends_once():
    check = BackendCheck(loaded=("UCX", "POSIX"), missing={"LIBFABRIC": "libfabric.so.1 missing"})
    assert choose_backends(["LIBFABRIC", "POSIX", "UCX"], check, True) == ("UCX", "POSIX")


def test_without_ucx_the_fallback_cannot_help():
    check = BackendCheck(missing={"LIBFABRIC": "libfabric.so.1 missing", "UCX": "libucp missing"})
    with pytest.raises(RuntimeError, match="UCX does not load") as refused:
        choose_backends(["LIBFABRIC"], check, True)
    assert "nixl_fallback_to_ucx: true" not in str(refused.value), "already on: not offered as the remedy"


def test_the_replica_stops_before_its_engine_or_builds_it_with_the_backends_that_load(monkeypatch):
    from deployments import engine_replica
    from deployments.prefill import PrefillServer

    built = []

    class EngineBuilt(Exception):
        pass

    def engine(config, *args):
        built.append(config.nixl_backends)
        raise EngineBuilt

    monkeypatch.setattr(engine_replica, "Engine", engine)
    monkeypatch.setattr(engine_replica, "ensure_tiny_model", lambda path: None)
    monkeypatch.setattr(engine_replica.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="p0"), rank=SimpleNamespace(rank=0))
    monkeypatch.setattr(engine_replica.serve, "get_replica_context", lambda: context)
    index = SimpleNamespace(options=lambda **_: index)
    replica = object.__new__(PrefillServer.func_or_class)
    with pytest.raises(RuntimeError, match="libfabric.so.1"):
        asyncio.run(engine_replica.EngineReplica.__init__(replica, LIBFABRIC_ONLY, index))
    assert built == [], "refused before any engine"
    with pytest.raises(EngineBuilt):
        asyncio.run(engine_replica.EngineReplica.__init__(
            replica, replace(LIBFABRIC_ONLY, nixl_fallback_to_ucx=True), index))
    assert built == [("UCX",)]


def test_health_lists_the_backends_each_group_s_live_engines_loaded():
    from deployments.router import Router

    engines = LiveEngines(suspect_s=5.0)
    engines.update(Membership(prefill=("p0",), decode=("d0", "d1"),
                              loads={"p0": LoadReport(nixl_backends=("LIBFABRIC",)),
                                     "d0": LoadReport(nixl_backends=("UCX",))}))
    engines.suspect("d1")
    router = object.__new__(Router.func_or_class)
    router.loop = SimpleNamespace(engines=engines)
    assert asyncio.run(router.health()) == {
        "status": "ok", "live_engines": {"prefill": 1, "decode": 1},
        "nixl_backends": {"prefill": ["LIBFABRIC"], "decode": ["UCX"]}}


def test_the_engine_s_load_carries_its_backends_in_every_heartbeat():
    from app.engine.load import LoadTracker

    tracker = LoadTracker(1024, nixl_backends=("UCX",))
    tracker.observe_step(2, 0, 0.1)
    tracker.observe_transfers({"transfer_duration": [0.01], "bytes_transferred": [1024 * 100]})
    assert tracker.report.nixl_backends == ("UCX",)
