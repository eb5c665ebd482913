"""Who is asking: API key ──▶ tenant (/user, for tenants salted per user) ──▶ cache salt.
The salt scopes vLLM's prefix cache, the KV index and conversation records, so one tenant can
neither hit nor time another's cached prefix."""

from collections.abc import Mapping

import xxhash

DEFAULT_TENANT = "default"


class Unauthorized(PermissionError):
    """A missing or unknown API key while keys are configured: the router answers 401."""


class Forbidden(PermissionError):
    """A valid key without the right to this endpoint: the router answers 403."""


def require_admin(authorization: str | None, api_keys: Mapping[str, str], admin_keys: tuple[str, ...]) -> None:
    """Admin endpoints answer only admin keys once keys are configured (open like the API otherwise)."""
    if not api_keys and not admin_keys:
        return
    key = _bearer(authorization)
    if key not in admin_keys:
        raise (Forbidden if key in api_keys else Unauthorized)("an admin API key is required for /admin")


def cache_scope(authorization: str | None, user: str | None, api_keys: Mapping[str, str],
                per_user_tenants: tuple[str, ...]) -> str:
    """What may share cached KV: the tenant, or tenant/user for tenants salted per user."""
    tenant = tenant_of(authorization, api_keys)
    return f"{tenant}/{user or ''}" if tenant in per_user_tenants else tenant


def tenant_of(authorization: str | None, api_keys: Mapping[str, str]) -> str:
    if not api_keys:
        return DEFAULT_TENANT
    key = _bearer(authorization)
    if key not in api_keys:
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
    return api_keys[key]


def cache_salt(scope: str) -> str:
    return xxhash.xxh3_128_hexdigest(f"kv-loop-tenant:{scope}".encode())


def _bearer(authorization: str | None) -> str:
    return (authorization or "").removeprefix("Bearer ").strip()


def open_api_warning(api_keys: Mapping[str, str]) -> str | None:
    """The one warning a server started without keys logs: it answers anyone who can reach it."""
    if api_keys:
        return None
    return ("no api_keys configured: the API (and /admin) is open to anyone who can reach it, as tenant "
            f"{DEFAULT_TENANT!r}; set api_keys and admin_api_keys before exposing it")
