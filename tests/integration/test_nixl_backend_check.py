"""An app asking for NIXL's LIBFABRIC backend on a node without libfabric: each engine replica refuses
to start, before its vLLM engine, and Serve's deploy fails with the missing library's name.
Replaces the session's app when the suite runs it (own_app: after every test on it); run alone, it
starts a Ray and Serve of its own, since the deploy fails before any engine starts."""

import os
from dataclasses import replace

import pytest
import ray
from ray import serve

from app.ops.launch import APP_NAME, delete_app, replace_app, start_serve, stop_local
from tests.integration.conftest import INGRESS_DRAIN_ENV

pytestmark = [pytest.mark.integration, pytest.mark.own_app]


@pytest.fixture(scope="module")
def running_serve():
    """The session's Serve if the suite started it, else one of this module's own, shut down after."""
    own = not ray.is_initialized()
    if own:
        os.environ.setdefault(INGRESS_DRAIN_ENV, "1")  # the failed app's ingress need not drain 30 s
        start_serve()
    yield
    delete_app()
    if own:
        stop_local()


def test_engine_replicas_without_libfabric_refuse_to_start_naming_it(running_serve, app_config):
    with pytest.raises(RuntimeError, match=f"Deploying application {APP_NAME} failed"):
        replace_app(replace(app_config, nixl_backends=("LIBFABRIC",)))
    deployments = serve.status().applications[APP_NAME].deployments
    # The first engine deployment to fail fails the deploy; the other may still be retrying.
    failed = {name: status.message for name, status in deployments.items() if status.status == "DEPLOY_FAILED"}
    assert failed and set(failed) <= {"prefill", "decode"}, failed
    assert all(deployments[name].status != "HEALTHY" for name in ("prefill", "decode"))
    for name, message in failed.items():
        for named in ("LIBFABRIC does not load", "libfabric.so.1", "AWS EFA installer", "nixl_fallback_to_ucx"):
            assert named in message, (name, named, message)
