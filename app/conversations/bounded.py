"""An LRU bounded by count and by bytes: the storage of the conversation records and of the stored
responses. When it is full, a tenant past its share of the bytes loses its own oldest entries
first, so one tenant's long conversations cannot push out the others'; while there is room, any
tenant may use it."""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class RecordBounds:
    ttl_s: float
    max_records: int
    max_bytes: int
    tenant_bytes: int
    """A tenant's share: past it, that tenant's oldest go first when the store is full (max_bytes
    without tenants)."""


class TenantLRU(Generic[V]):
    """Oldest first by insertion; `on_drop(key, value)` runs for every entry that leaves."""

    def __init__(self, bounds: RecordBounds, on_drop: Callable[[str, V], None] = lambda key, value: None) -> None:
        self.bounds, self.on_drop = bounds, on_drop
        self._entries: OrderedDict[str, tuple[V, str, int]] = OrderedDict()  # key -> (value, tenant, bytes)
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.nbytes = 0

    def put(self, key: str, value: V, tenant: str, nbytes: int) -> None:
        self.drop(key)
        self._entries[key] = (value, tenant, nbytes)
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = None
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + nbytes
        self.nbytes += nbytes
        bounds = self.bounds
        while len(self._entries) > 1 and (len(self._entries) > bounds.max_records or self.nbytes > bounds.max_bytes):
            self.drop(self._victim())

    def _victim(self) -> str:
        """The oldest entry of the tenant furthest past its share, else the oldest of all."""
        largest = max(self._tenant_bytes, key=self._tenant_bytes.__getitem__)
        if self._tenant_bytes[largest] > self.bounds.tenant_bytes:
            return next(iter(self._by_tenant[largest]))
        return next(iter(self._entries))

    def get(self, key: str | None) -> V | None:
        entry = self._entries.get(key) if key else None
        return entry[0] if entry is not None else None

    def drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        value, tenant, nbytes = entry
        self.nbytes -= nbytes
        self._tenant_bytes[tenant] -= nbytes
        del self._by_tenant[tenant][key]
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant], self._tenant_bytes[tenant]
        self.on_drop(key, value)

    def __len__(self) -> int:
        return len(self._entries)
