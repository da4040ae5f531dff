"""The rows of an entities table as bagstore handles them in Python:
:class:`EntityRow` (as written) and :class:`Stored` (as read back), and their
makers at C's speed."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from itertools import repeat
from typing import NamedTuple

__all__ = ["EntityRow", "Stored", "entity_row", "entity_rows"]


class EntityRow(NamedTuple):
    """One row of an entities table as bagstore writes it (a tuple: a batch
    makes one per entity)."""

    id: bytes
    bucket: int
    updated: int  # microseconds since the Unix epoch, UTC
    body: bytes


#: ``EntityRow`` of a tuple of its four fields, at C's speed (namedtuple's
#: own ``_make`` does ``tuple.__new__(cls, iterable)`` from Python).
entity_row = partial(tuple.__new__, EntityRow)


def entity_rows(
    ids: Iterable[bytes], buckets: Iterable[int], updated: int, bodies: Iterable[bytes]
) -> list[EntityRow]:
    """``[EntityRow(i, b, updated, body) ...]`` of a batch, built in one pass
    of C (a put_many's 500 rows)."""
    return list(map(entity_row, zip(ids, buckets, repeat(updated), bodies)))


class Stored(NamedTuple):
    """An entity row as read back: encoded body, version, updated (µs)."""

    body: bytes
    version: int
    updated: int
