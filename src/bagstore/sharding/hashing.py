"""Pure, stable key -> bucket hashing. No I/O.

A key is hashed with BLAKE2b (8-byte digest, big-endian integer) modulo the
bucket count.  The function must never change: every stored row's location
depends on it.

    >>> bucket_of(bytes(16), 1024)
    14
"""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["bucket_of"]


def bucket_of(key: bytes, buckets: int) -> int:
    """The bucket (0 <= b < buckets) of a key given as bytes."""
    return int.from_bytes(blake2b(key, digest_size=8).digest(), "big") % buckets
