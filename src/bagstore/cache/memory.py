"""An in-process level-2 cache: an LRU dictionary bounded in entries and bytes.

Every datastore of one process that names ``cache="memory"`` shares the same
instance (``memory://NAME`` names another one), so that two datastores on one
store in one process see each other's invalidations.  It is *not* shared between
processes: with several processes writing one store, use memcached or Redis.

    >>> c = MemoryCache(max_entries=2)
    >>> c.add_many({"a": b"1"}, ttl=60)
    >>> c.get_many(["a", "b"])["a"][0]
    b'1'
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MemoryCache", "shared"]


class MemoryCache:
    """A thread-safe LRU of bytes with TTLs; compare-and-set under its lock."""

    errors: tuple[type[BaseException], ...] = ()

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be positive")
        self.name = f"memory (max {max_entries} entries)"
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, tuple[bytes, float, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)

    # -- internals (lock held) -----------------------------------------------------
    def _live(self, key: str, now: float) -> tuple[bytes, float, int] | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry[1] and entry[1] <= now:
            self._drop(key)
            return None
        return entry

    def _drop(self, key: str) -> None:
        value = self._data.pop(key)[0]
        self._bytes -= len(key) + len(value)

    def _store(self, key: str, value: bytes, ttl: float, now: float) -> None:
        if key in self._data:
            self._drop(key)
        self._data[key] = (value, now + ttl if ttl > 0 else 0.0, next(self._tokens))
        self._bytes += len(key) + len(value)
        while self._data and (len(self._data) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._data)))

    # -- the Cache protocol --------------------------------------------------------
    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, Any]]:
        now = time.monotonic()
        out: dict[str, tuple[bytes, Any]] = {}
        with self._lock:
            for key in keys:
                entry = self._live(key, now)
                if entry is not None:
                    self._data.move_to_end(key)
                    out[key] = (entry[0], entry[2])
        return out

    def add_many(self, items: Mapping[str, bytes], ttl: int) -> None:
        now = time.monotonic()
        with self._lock:
            for key, value in items.items():
                if self._live(key, now) is None:
                    self._store(key, value, ttl, now)

    def set_many(self, items: Mapping[str, bytes], ttl: int) -> list[str]:
        now = time.monotonic()
        with self._lock:
            for key, value in items.items():
                self._store(key, value, ttl, now)
        return []

    def cas(self, key: str, token: Any, value: bytes, ttl: int) -> bool:
        now = time.monotonic()
        with self._lock:
            entry = self._live(key, now)
            if entry is None or entry[2] != token:
                return False
            self._store(key, value, ttl, now)
            return True

    def bump(self, keys: Sequence[str], now_us: int, ttl: int) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                entry = self._live(key, now)
                try:
                    value = int(entry[0]) + 1 if entry is not None else now_us
                    left = entry[1] - now if entry is not None and entry[1] else ttl
                except ValueError:
                    value, left = now_us, ttl
                self._store(key, str(value).encode(), left, now)

    def close(self) -> None:
        """Nothing to close (a shared instance outlives the datastores using it)."""

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._data:
                    self._drop(key)

    # -- extras --------------------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._data)


_shared: dict[str, MemoryCache] = {}
_shared_lock = threading.Lock()


def shared(name: str = "default", max_entries: int | None = None) -> MemoryCache:
    """The process-wide memory cache called ``name`` (made on first use)."""
    with _shared_lock:
        cache = _shared.get(name)
        if cache is None:
            cache = _shared[name] = MemoryCache(max_entries or 100_000)
        return cache
