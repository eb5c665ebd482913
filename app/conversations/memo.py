"""What the router built or checked for a request's tools and grammar, remembered by the sha256 of
what it was built from. An agent loop sends the same tools, tool choice and format every turn, and
building their grammar (vLLM's parser) and having vLLM check it cost about a millisecond of every
tool turn's time to first token; both are pure functions of those fields and the replica's model."""

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Memo(Generic[T]):
    """The last `size` results, least recently used out first. Keyed by sha256: an input crafted to
    collide with another, and so to skip its own check, is infeasible. Shared by the event loop and
    the render thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._results: OrderedDict[bytes, T] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> T | None:
        key = _key(text)
        with self._lock:
            result = self._results.get(key)
            if result is not None:
                self._results.move_to_end(key)
            return result

    def put(self, text: str, result: T) -> None:
        with self._lock:
            self._results[_key(text)] = result
            if len(self._results) > self.size:
                self._results.popitem(last=False)

    def get_or_make(self, text: str, make: Callable[[], T]) -> T:
        """The remembered result, else make()'s, remembered (an exception is not)."""
        if (result := self.get(text)) is None:
            self.put(text, result := make())
        return result


def _key(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()
