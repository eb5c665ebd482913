import pytest

from app.tenants import Forbidden, Unauthorized, open_api_warning, require_admin

KEYS = {"key-a": "tenant-a"}


def test_admin_endpoints_need_an_admin_key_once_keys_are_configured():
    require_admin(None, {}, ())  # no keys at all: open, and the server said so at start
    require_admin("Bearer root", KEYS, ("root",))
    with pytest.raises(Forbidden):
        require_admin("Bearer key-a", KEYS, ("root",))
    with pytest.raises(Unauthorized):
        require_admin(None, KEYS, ())


def test_a_server_without_keys_warns_once_that_it_is_open():
    assert "open to anyone" in open_api_warning({})
    assert open_api_warning(KEYS) is None
