"""Who is asking: API key ──▶ tenant (/user, for tenants salted per user) ──▶ cache salt.
The salt scopes vLLM's prefix cache, the KV index and conversation records, so one tenant can
neither hit nor time another's cached prefix."""

from collections.abc import Mapping

import xxhash

DEFAULT_TENANT = "default"


class Unauthorized(PermissionError):
    """A missing or unknown API key while keys are configured: the router answers 401."""


def cache_scope(authorization: str | None, user: str | None, api_keys: Mapping[str, str],
                per_user_tenants: tuple[str, ...]) -> str:
    """What may share cached KV: the tenant, or tenant/user for tenants salted per user."""
    tenant = tenant_of(authorization, api_keys)
    return f"{tenant}/{user or ''}" if tenant in per_user_tenants else tenant


def tenant_of(authorization: str | None, api_keys: Mapping[str, str]) -> str:
    if not api_keys:
        return DEFAULT_TENANT
    key = (authorization or "").removeprefix("Bearer ").strip()
    if key not in api_keys:
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
    return api_keys[key]


def cache_salt(scope: str) -> str:
    return xxhash.xxh3_128_hexdigest(f"kv-loop-tenant:{scope}".encode())
