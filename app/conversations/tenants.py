"""Who is asking: API key ──digest──▶ tenant (/user, for tenants salted per user) ──HMAC──▶ cache salt.
The salt scopes vLLM's prefix cache, the KV index and conversation records, so one tenant can
neither hit nor time another's cached prefix. It is keyed with a server secret (`salt_secret`), so
nobody outside the server can compute a tenant's salt, hence its block hashes.

Keys are held only as sha256 digests (the config may give either a key or `sha256:<hex>` of it),
and a presented key is compared with every digest in constant time: neither a memory dump nor
the time an answer takes gives a key away. The frontend checks the key before it reads a body.
"""

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from app.config import AppConfig

DEFAULT_TENANT = "default"
DIGEST_PREFIX = "sha256:"
ADMIN_PREFIX = "/admin/"


class Unauthorized(PermissionError):
    """A missing or unknown API key while keys are configured: the server answers 401."""


class Forbidden(PermissionError):
    """A valid key without the right to this endpoint: the server answers 403."""


SECRET_NAMES = frozenset({"api_keys", "admin_api_keys", "salt_secret"})
"""What `secrets_env`'s JSON object may hold: the config keys that must not sit in a Serve config."""


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def stored_digest(entry: str) -> bytes:
    """A configured key as its digest: `sha256:<64 hex digits>` as given, anything else hashed."""
    if not entry.strip():
        raise ValueError("an API key must not be empty (it would admit requests that send no key)")
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


def cache_scope(tenant: str, user: str | None, per_user_tenants: tuple[str, ...]) -> str:
    """What may share cached KV: the tenant, or tenant/user for tenants salted per user."""
    return f"{tenant}/{user or ''}" if tenant in per_user_tenants else tenant


def cache_salt(scope: str, secret: str) -> str:
    return hmac.new(secret.encode(), f"kv-loop-tenant:{scope}".encode(), hashlib.sha256).hexdigest()


def _bearer(authorization: str | None) -> str:
    return (authorization or "").removeprefix("Bearer ").strip()


def with_secrets(config: AppConfig, environ: Mapping[str, str] = os.environ) -> AppConfig:
    """The config every replica gets: secrets read from `secrets_env`, API keys replaced by their
    digests (no replica's init args hold a key), and a salt secret drawn at random when none is
    given (caches then do not outlive a redeploy, which restarts every engine anyway). Idempotent:
    a digest stays a digest, a secret stays as drawn."""
    values = _secrets_from_env(config.secrets_env, environ) if config.secrets_env else {}
    api_keys, admin_keys = values.get("api_keys", config.api_keys), values.get("admin_api_keys", config.admin_api_keys)
    return replace(config, secrets_env="",
                   api_keys={_as_digest(key): tenant for key, tenant in api_keys.items()},
                   admin_api_keys=tuple(_as_digest(key) for key in admin_keys),
                   salt_secret=values.get("salt_secret", config.salt_secret) or secrets.token_hex(32))


def _secrets_from_env(name: str, environ: Mapping[str, str]) -> dict:
    if name not in environ:
        raise ValueError(f"secrets_env: the environment variable {name} is not set where the app is built "
                         "(set it on every node before `ray start`: docs/operations.md, Trust boundary)")
    try:
        values = json.loads(environ[name])
    except json.JSONDecodeError as exc:
        raise ValueError(f"secrets_env: {name} is not JSON: {exc.msg}") from None
    if not isinstance(values, dict) or set(values) - SECRET_NAMES:
        raise ValueError(f"secrets_env: {name} must hold a JSON object with keys among {sorted(SECRET_NAMES)}")
    return values


def _as_digest(entry: str) -> str:
    return DIGEST_PREFIX + stored_digest(entry).hex()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def open_api_refusal(config: AppConfig, http_host: str) -> str | None:
    """Why the app must not start: no API keys while Serve's HTTP listens beyond this machine, and
    no explicit `allow_open_api`. Serve's HAProxy ingress always listens on every interface."""
    if config.api_keys or config.allow_open_api or is_loopback(http_host):
        return None
    return (f"no api_keys configured and Serve's HTTP listens on {http_host!r}, beyond this machine: set api_keys "
            "(secrets_env) or, for a development server, allow_open_api=true")


def open_api_warning(api_keys: Mapping[str, str]) -> str | None:
    """The one warning a server started without keys logs: it answers anyone who can reach it."""
    if api_keys:
        return None
    return ("no api_keys configured: the API (and /admin) is open to anyone who can reach it, as tenant "
            f"{DEFAULT_TENANT!r}; set api_keys and admin_api_keys before exposing it")
