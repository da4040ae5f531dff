"""The level-2 cache protocol, the byte formats stored in it, and the counters.

A level-2 cache (memcached, Redis, or the in-process ``memory`` one) stores
bytes under ASCII keys.  bagstore puts four kinds of value there, each starting
with :data:`MAGIC` and a tag byte, each carrying a CRC-32 so that garbage (a
foreign value, a truncated one, random bytes) reads as a miss, never as data:

``E`` entity
    ``MAGIC E version:u64 updated:i64 crc:u32 body`` -- the codec body, with the
    row's ``version`` and ``updated``; the CRC covers the entity id too, so an
    entry copied under another id is refused.
``M`` put marker / ``G`` gone marker
    ``MAGIC M|G version:u64 nonce:8 crc:u32`` -- written by a writer *after* its
    commit in place of the entity (see :mod:`bagstore.cache.layer`): "this
    entity is at least at ``version``" (``G``: "was deleted; a body below
    ``version`` is older than the delete").  A reader replaces a marker only by
    compare-and-set, with a body whose version is at least the marker's.
``L`` list
    ``MAGIC L cursor_len:u32 crc:u32 cursor ids`` -- one page of a query: the
    entity ids (16 bytes each) and the next cursor; the CRC covers the key.

Revision counters are plain decimal integers (memcached ``incr`` needs that).

    >>> value = encode_entity(b"i" * 16, Stored(b"body", 3, 17))
    >>> decode_value(b"i" * 16, value)
    Stored(body=b'body', version=3, updated=17)
    >>> decode_value(b"j" * 16, value) is None  # wrong id: garbage
    True
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from bagstore.backends.base import Stored

__all__ = [
    "MAGIC",
    "Cache",
    "CacheStats",
    "CacheUnavailable",
    "LevelStats",
    "Marker",
    "decode_list",
    "decode_value",
    "encode_entity",
    "encode_list",
    "encode_marker",
]

MAGIC = b"\xb5\x01"
_ENTITY = struct.Struct(">3sQqI")  # magic+tag, version, updated, crc
_MARKER = struct.Struct(">3sQ8sI")  # magic+tag, version, nonce, crc
_LIST = struct.Struct(">3sII")  # magic+tag, cursor length, crc
_E, _M, _G, _L = MAGIC + b"E", MAGIC + b"M", MAGIC + b"G", MAGIC + b"L"
ID_BYTES = 16


class CacheUnavailable(Exception):
    """A cache server did not take a write, or failed so recently that the
    client stays away from it for now."""


@dataclass(frozen=True, slots=True)
class Marker:
    """A writer's lease on an entity key: fill only with ``version`` or newer."""

    version: int
    gone: bool


def encode_entity(entity_id: bytes, stored: Stored) -> bytes:
    """The cache value of one entity row."""
    head = struct.pack(">Qq", stored.version, stored.updated)
    crc = zlib.crc32(stored.body, zlib.crc32(head, zlib.crc32(entity_id)))
    return _E + head + struct.pack(">I", crc) + stored.body


def encode_marker(version: int, *, gone: bool = False) -> bytes:
    """A fresh marker (a random nonce makes two markers of one version differ)."""
    nonce = os.urandom(8)
    tag = _G if gone else _M
    crc = zlib.crc32(tag + struct.pack(">Q", version) + nonce)
    return _MARKER.pack(tag, version, nonce, crc)


def decode_value(entity_id: bytes, value: bytes) -> Stored | Marker | None:
    """An entity entry or a marker; None for anything else (garbage)."""
    tag = value[:3]
    if tag == _E:
        body = entity_body(entity_id, value)
        if body is None:
            return None
        _, version, updated, _ = _ENTITY.unpack_from(value)
        return Stored(body, version, updated)
    if tag in (_M, _G) and len(value) == _MARKER.size:
        _, version, _nonce, crc = _MARKER.unpack(value)
        if zlib.crc32(value[:-4]) != crc:
            return None
        return Marker(version, tag == _G)
    return None


def entity_body(entity_id: bytes, value: bytes) -> bytes | None:
    """The body of an intact entity entry, else None (a marker, garbage): what
    :func:`decode_value` checks, without building its result."""
    if value[:3] != _E or len(value) < _ENTITY.size:
        return None
    crc = _ENTITY.unpack_from(value)[3]
    body = value[_ENTITY.size :]
    head = value[3 : _ENTITY.size - 4]  # version and updated
    return body if zlib.crc32(body, zlib.crc32(head, zlib.crc32(entity_id))) == crc else None


def encode_list(key: str, ids: Sequence[bytes], cursor: str | None) -> bytes:
    """The cache value of one query page."""
    raw_cursor = b"" if cursor is None else b"\x01" + cursor.encode()
    payload = raw_cursor + b"".join(ids)
    crc = zlib.crc32(payload, zlib.crc32(key.encode()))
    return _LIST.pack(_L, len(raw_cursor), crc) + payload


def decode_list(key: str, value: bytes) -> tuple[list[bytes], str | None] | None:
    """``(ids, cursor)`` from a list entry; None for garbage."""
    if value[:3] != _L or len(value) < _LIST.size:
        return None
    _, cursor_len, crc = _LIST.unpack_from(value)
    payload = value[_LIST.size :]
    if zlib.crc32(payload, zlib.crc32(key.encode())) != crc or cursor_len > len(payload):
        return None
    raw_cursor, ids = payload[:cursor_len], payload[cursor_len:]
    if len(ids) % ID_BYTES:
        return None
    try:
        cursor = raw_cursor[1:].decode() if raw_cursor else None
    except UnicodeDecodeError:
        return None
    return [ids[i : i + ID_BYTES] for i in range(0, len(ids), ID_BYTES)], cursor


@runtime_checkable
class Cache(Protocol):
    """What the caching layer needs from a level-2 cache client.

    Values are bytes, keys ASCII strings without spaces.  Methods raise the
    client's own exceptions (listed in ``errors``): the layer catches exactly
    those, counts them and reads the database instead.  ``get_many`` returns a
    compare-and-set token with each value (memcached's ``gets`` unique, or the
    value itself where the compare-and-set compares values).
    """

    #: A short description for status output, e.g. ``memcached 127.0.0.1:11211``.
    name: str
    #: The exception classes a failing server raises through this client.
    errors: tuple[type[BaseException], ...]

    def get_many(self, keys: Sequence[str]) -> dict[str, tuple[bytes, Any]]:
        """``{key: (value, cas token)}`` of the keys present."""
        ...

    def add_many(self, items: Mapping[str, bytes], ttl: int) -> None:
        """Store each value only where its key is absent (no reply awaited)."""
        ...

    def set_many(self, items: Mapping[str, bytes], ttl: int) -> list[str]:
        """Store the values, waiting for the replies; return the keys not stored."""
        ...

    def cas(self, key: str, token: Any, value: bytes, ttl: int) -> bool:
        """Replace the value only if it is still the one ``token`` was read with."""
        ...

    def bump(self, keys: Sequence[str], now_us: int, ttl: int) -> None:
        """Increment revision counters; a missing one (or garbage) starts at
        ``now_us`` and lives ``ttl`` seconds (an increment keeps the TTL)."""
        ...

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove keys (tests and tools; the layer never deletes: it sets markers)."""
        ...

    def close(self) -> None:
        """Close connections (a shared in-process cache may ignore this)."""
        ...


class LevelStats:
    """Counters of one cache level (thread-safe)."""

    FIELDS = ("hits", "misses", "fills", "invalidations", "errors")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = self.fills = self.invalidations = self.errors = 0

    def add(
        self,
        *,
        hits: int = 0,
        misses: int = 0,
        fills: int = 0,
        invalidations: int = 0,
        errors: int = 0,
    ) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.fills += fills
            self.invalidations += invalidations
            self.errors += errors

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {f: getattr(self, f) for f in self.FIELDS}


class CacheStats:
    """Counters of both levels: ``l1`` (per request) and ``l2`` (the cache server)."""

    def __init__(self) -> None:
        self.l1 = LevelStats()
        self.l2 = LevelStats()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"l1": self.l1.as_dict(), "l2": self.l2.as_dict()}
