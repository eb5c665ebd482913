"""Who is asking: API key ──digest──▶ tenant (/user, for tenants salted per user) ──▶ cache salt.
The salt scopes vLLM's prefix cache, the KV index and conversation records, so one tenant can
neither hit nor time another's cached prefix.

Keys are held only as sha256 digests (the config may give either a key or `sha256:<hex>` of it),
and a presented key is compared with every digest in constant time: neither a memory dump nor
the time an answer takes gives a key away. The frontend checks the key before it reads a body.
"""

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import xxhash

DEFAULT_TENANT = "default"
DIGEST_PREFIX = "sha256:"
ADMIN_PREFIX = "/admin/"


class Unauthorized(PermissionError):
    """A missing or unknown API key while keys are configured: the server answers 401."""


class Forbidden(PermissionError):
    """A valid key without the right to this endpoint: the server answers 403."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def stored_digest(entry: str) -> bytes:
    """A configured key as its digest: `sha256:<64 hex digits>` as given, anything else hashed."""
    if not entry.startswith(DIGEST_PREFIX):
        return key_digest(entry)
    digest = bytes.fromhex(entry.removeprefix(DIGEST_PREFIX))
    if len(digest) != hashlib.sha256().digest_size:
        raise ValueError(f"an API key given as {DIGEST_PREFIX}<hex> must hold 64 hex digits")
    return digest


@dataclass(frozen=True)
class KeyRing:
    """The configured keys as digests: each API key's tenant, and the admin keys."""

    tenants: Mapping[bytes, str] = field(default_factory=dict)
    admins: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, api_keys: Mapping[str, str], admin_keys: Iterable[str]) -> "KeyRing":
        return cls({stored_digest(key): tenant for key, tenant in api_keys.items()},
                   tuple(stored_digest(key) for key in admin_keys))

    def tenant_of(self, authorization: str | None) -> str:
        """The key's tenant; DEFAULT_TENANT when no API keys are configured (the API is open)."""
        if not self.tenants:
            return DEFAULT_TENANT
        digest = _match(self.tenants, _bearer(authorization))
        if digest is None:
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
        return self.tenants[digest]

    def require_admin(self, authorization: str | None) -> None:
        """Admin endpoints answer only admin keys once any key is configured (open like the API otherwise)."""
        if not self.tenants and not self.admins:
            return
        key = _bearer(authorization)
        if _match(self.admins, key) is None:
            refused = Forbidden if _match(self.tenants, key) is not None else Unauthorized
            raise refused("an admin API key is required for /admin")

    def authenticate(self, path: str, authorization: str | None, open_paths: frozenset[str]) -> None:
        """Raise Unauthorized/Forbidden unless `authorization` may reach `path`: every path but
        `open_paths` (health, and the API docs when served) needs a key, /admin/* an admin key."""
        if path in open_paths:
            return
        if path.startswith(ADMIN_PREFIX):
            self.require_admin(authorization)
        else:
            self.tenant_of(authorization)


def _match(digests: Iterable[bytes], key: str) -> bytes | None:
    """The stored digest that is the key's, compared with every one (no early exit)."""
    presented, found = key_digest(key), None
    for digest in digests:
        if hmac.compare_digest(digest, presented):
            found = digest
    return found


def cache_scope(authorization: str | None, user: str | None, keys: KeyRing, per_user_tenants: tuple[str, ...]) -> str:
    """What may share cached KV: the tenant, or tenant/user for tenants salted per user."""
    tenant = keys.tenant_of(authorization)
    return f"{tenant}/{user or ''}" if tenant in per_user_tenants else tenant


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
