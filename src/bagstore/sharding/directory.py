"""The directory shard map (Yupoo's): each shard key is assigned a bucket at its
first write, recorded in the catalog, and cached.

A key goes to the least-loaded bucket (fewest keys of its kind) when first
seen; afterwards its bucket changes only by :meth:`Directory.migrate` steps,
during which the key is marked ``MIGRATING`` and writes to it get the
retryable ``KeyMigrating``.  Cached entries live ``ttl`` seconds, so a
migration waits that long after marking a key before it copies anything.

Keys are the order-preserving encodings of :mod:`bagstore.keys`; one longer
than 255 bytes is stored as its 32-byte BLAKE2b digest.
"""

from __future__ import annotations

import threading
import time
from hashlib import blake2b

from bagstore.backends import Backend
from bagstore.errors import KeyMigrating

__all__ = ["MIGRATING", "NORMAL", "Directory"]

NORMAL, MIGRATING = 0, 1
_TABLE = "bagstore_directory"
_LOADS = "bagstore_bucket_keys"


def directory_key(key: bytes) -> bytes:
    return key if len(key) <= 255 else b"\xff#" + blake2b(key, digest_size=32).digest()


class Directory:
    """Key -> bucket assignments of one kind, through the catalog."""

    def __init__(self, catalog: Backend, kind: str, buckets: int, ttl: float) -> None:
        self.catalog = catalog
        self.kind = kind
        self.buckets = buckets
        self.ttl = ttl
        self._cache: dict[bytes, tuple[int, int, float]] = {}
        self._loads: list[int] | None = None
        self._lock = threading.Lock()

    def lookup(self, key: bytes) -> tuple[int, int] | None:
        """``(bucket, state)`` of a key, or None if it has none yet."""
        k = directory_key(key)
        hit = self._cache.get(k)
        if hit is not None and time.monotonic() - hit[2] < self.ttl:
            return hit[0], hit[1]
        rows = self.catalog.select_all(_TABLE, ("bucket", "state"), {"kind": self.kind, "skey": k})
        if not rows:
            self._cache.pop(k, None)
            return None
        bucket, state = int(rows[0][0]), int(rows[0][1])
        self._cache[k] = (bucket, state, time.monotonic())
        return bucket, state

    def bucket_for_write(self, key: bytes) -> int:
        """The key's bucket, assigning the least-loaded one at first write;
        raises KeyMigrating while the key is being migrated."""
        found = self.lookup(key)
        if found is None:
            found = self._assign(key)
        bucket, state = found
        if state == MIGRATING:
            raise KeyMigrating(f"shard key {key!r} of kind {self.kind!r} is being migrated")
        return bucket

    def _assign(self, key: bytes) -> tuple[int, int]:
        k = directory_key(key)
        with self._lock:
            loads = self._read_loads()
            bucket = min(range(self.buckets), key=loads.__getitem__)
            self.catalog.insert_ignore(
                _TABLE, ("kind", "skey", "bucket", "state"), [(self.kind, k, bucket, NORMAL)]
            )
            found = self.lookup(key)
            assert found is not None
            if found[0] == bucket:  # ours, not a concurrent process's
                loads[bucket] += 1
                self._count(bucket, +1)
            return found

    def _read_loads(self) -> list[int]:
        if self._loads is None:
            loads = [0] * self.buckets
            for b, n in self.catalog.select_all(_LOADS, ("bucket", "n"), {"kind": self.kind}):
                loads[int(b)] = int(n)
            self._loads = loads
        return self._loads

    def _count(self, bucket: int, delta: int) -> None:
        key = {"kind": self.kind, "bucket": bucket}
        rows = self.catalog.select_all(_LOADS, ("n",), key)
        n = (int(rows[0][0]) if rows else 0) + delta
        self.catalog.upsert(_LOADS, key, {"n": n})

    def set(self, key: bytes, bucket: int, state: int) -> None:
        k = directory_key(key)
        self.catalog.upsert(
            _TABLE, {"kind": self.kind, "skey": k}, {"bucket": bucket, "state": state}
        )
        self._cache.pop(k, None)

    def moved(self, old: int, new: int) -> None:
        """Keep the load counts true after a key moved buckets."""
        with self._lock:
            self._count(old, -1)
            self._count(new, +1)
            self._loads = None
