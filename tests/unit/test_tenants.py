import hashlib
import json

import pytest

from app.config import AppConfig, load_config
from app.conversations.tenants import (
    DEFAULT_TENANT,
    Forbidden,
    KeyRing,
    Unauthorized,
    cache_scope,
    open_api_refusal,
    open_api_warning,
    with_secrets,
)

KEYS = {"key-a": "tenant-a"}
OPEN = frozenset({"/health"})


def test_admin_endpoints_need_an_admin_key_once_keys_are_configured():
    KeyRing().require_admin(None)  # no keys at all: open, and the server said so at start
    ring = KeyRing.of(KEYS, ("root",))
    ring.require_admin("Bearer root")
    with pytest.raises(Forbidden):
        ring.require_admin("Bearer key-a")
    with pytest.raises(Unauthorized):
        KeyRing.of(KEYS, ()).require_admin(None)


def test_keys_are_held_as_sha256_digests_and_may_be_configured_as_digests():
    digest = hashlib.sha256(b"key-b").hexdigest()
    ring = KeyRing.of({**KEYS, f"sha256:{digest}": "tenant-b"}, ())
    assert ring.tenant_of("Bearer key-a") == "tenant-a" and ring.tenant_of("Bearer key-b") == "tenant-b"
    assert "key-a" not in repr(ring) and "key-b" not in repr(ring)
    with pytest.raises(Unauthorized):
        ring.tenant_of(f"Bearer sha256:{digest}")  # the digest itself is not a key
    with pytest.raises(ValueError, match="64 hex digits"):
        KeyRing.of({"sha256:abcd": "t"}, ())


def test_without_keys_every_request_is_the_default_tenant():
    assert KeyRing.of({}, ()).tenant_of(None) == DEFAULT_TENANT
    assert cache_scope(KeyRing().tenant_of("Bearer anything"), "u1", ()) == DEFAULT_TENANT


def test_every_path_but_the_open_ones_needs_a_key_and_admin_paths_an_admin_key():
    ring = KeyRing.of(KEYS, ("root",))
    ring.authenticate("/health", None, OPEN)
    ring.authenticate("/v1/chat/completions", "Bearer key-a", OPEN)
    refusals = [("/v1/chat/completions", None, Unauthorized), ("/docs", None, Unauthorized),
                ("/v1/models", "Bearer nope", Unauthorized), ("/admin/decisions", "Bearer key-a", Forbidden)]
    for path, key, refused in refusals:
        with pytest.raises(refused):
            ring.authenticate(path, key, OPEN)
    KeyRing().authenticate("/v1/chat/completions", None, OPEN)  # no keys: open, as before


def test_a_server_without_keys_warns_once_that_it_is_open():
    assert "open to anyone" in open_api_warning({})
    assert open_api_warning(KEYS) is None


def test_replicas_get_key_digests_and_a_salt_secret_never_the_keys():
    sealed = with_secrets(AppConfig(api_keys={"key-a": "tenant-a"}, admin_api_keys=("root",)), environ={})
    digest = hashlib.sha256(b"key-a").hexdigest()
    assert sealed.api_keys == {f"sha256:{digest}": "tenant-a"} and "root" not in sealed.admin_api_keys
    assert len(sealed.salt_secret) == 64 and with_secrets(sealed, environ={}) == sealed  # idempotent
    assert KeyRing.of(sealed.api_keys, sealed.admin_api_keys).tenant_of("Bearer key-a") == "tenant-a"
    assert with_secrets(AppConfig(), environ={}).salt_secret != with_secrets(AppConfig(), environ={}).salt_secret


def test_secrets_come_from_the_environment_variable_the_config_names():
    secrets = {"api_keys": {"key-b": "tenant-b"}, "admin_api_keys": ["root"], "salt_secret": "s3cret"}
    sealed = with_secrets(AppConfig(secrets_env="KV_LOOP_SECRETS"), environ={"KV_LOOP_SECRETS": json.dumps(secrets)})
    assert KeyRing.of(sealed.api_keys, ()).tenant_of("Bearer key-b") == "tenant-b"
    assert sealed.salt_secret == "s3cret" and sealed.secrets_env == ""
    with pytest.raises(ValueError, match="KV_LOOP_SECRETS is not set"):
        with_secrets(AppConfig(secrets_env="KV_LOOP_SECRETS"), environ={})
    with pytest.raises(ValueError, match="keys among"):
        with_secrets(AppConfig(secrets_env="S"), environ={"S": '{"api_key": {}}'})


def test_an_empty_key_is_refused_rather_than_admitting_requests_without_one():
    assert load_config({"admin_api_keys": ""}).admin_api_keys == ()  # `admin_api_keys=` sets none
    with pytest.raises(ValueError, match="must not be empty"):
        KeyRing.of({" ": "t"}, ())


def test_an_app_without_keys_refuses_to_listen_beyond_loopback_unless_told_it_is_for_development():
    assert open_api_refusal(AppConfig(), "127.0.0.1") is None and open_api_refusal(AppConfig(), "localhost") is None
    assert "allow_open_api" in open_api_refusal(AppConfig(), "0.0.0.0")
    assert open_api_refusal(AppConfig(allow_open_api=True), "0.0.0.0") is None
    assert open_api_refusal(AppConfig(api_keys={"k": "t"}), "0.0.0.0") is None
