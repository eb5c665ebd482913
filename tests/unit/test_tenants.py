import hashlib

import pytest

from app.tenants import DEFAULT_TENANT, Forbidden, KeyRing, Unauthorized, cache_scope, open_api_warning

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
    assert cache_scope("Bearer anything", "u1", KeyRing(), ()) == DEFAULT_TENANT


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
