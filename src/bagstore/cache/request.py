"""Level 1: a per-request dictionary, held in a context variable.

``with ds.request():`` opens one (a nested block reuses the outer one); every
datastore read inside the block keeps what it read there -- entity rows (and
their decoded dicts), ids known to be absent, query pages -- and the next read
of the same thing costs a dictionary lookup.  Writes in the block replace their
entities' entries and drop the pages.  The dictionary is dropped when the block
exits.  Like Yupoo's PHP array, it is a snapshot for one request: a write made
by *another* process during the block is not seen by reads the block already
made (reads it has not made yet go to level 2 and the database as usual).

Context variables follow threads and asyncio tasks: a thread started inside the
block does not share it.

    >>> with request() as rc:
    ...     current() is rc
    True
    >>> current() is None
    True
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from bagstore.backends.base import Stored

__all__ = ["RequestCache", "copy_entity", "current", "entity_copy", "request"]


class RequestCache:
    """One request's level-1 entries, keyed by level-2 key."""

    __slots__ = ("entities", "lists")

    def __init__(self) -> None:
        #: entity key -> [Stored or None (absent), then, once decoded: the dict,
        #: keys holding flat lists, keys holding nested values] (see entity_copy)
        self.entities: dict[str, list[Any]] = {}
        #: page key -> (ids, next cursor)
        self.lists: dict[str, tuple[list[bytes], str | None]] = {}

    def put_entity(self, key: str, stored: Stored | None) -> None:
        self.entities[key] = [stored]


_current: ContextVar[RequestCache | None] = ContextVar("bagstore_request_cache", default=None)


def current() -> RequestCache | None:
    """The open request's level-1 cache, or None outside ``request()``."""
    return _current.get()


@contextmanager
def request() -> Iterator[RequestCache]:
    """Open a level-1 cache for the block (or reuse the one already open)."""
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    rc = RequestCache()
    token = _current.set(rc)
    try:
        yield rc
    finally:
        _current.reset(token)


def _copy_list(v: list[Any]) -> list[Any]:
    out = v.copy()
    for i, x in enumerate(out):
        t = type(x)
        if t is dict:
            out[i] = copy_entity(x)
        elif t is list:
            out[i] = _copy_list(x)
    return out


_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


def entity_copy(entry: list[Any], decode: Any) -> dict[str, Any]:
    """A fresh copy of a level-1 entry's entity, decoding it the first time.

    The first call also notes which keys hold flat lists (copied with
    ``list.copy``) and which hold nested values (copied deeply), so that a hit
    costs a ``dict.copy`` and a list copy or two.
    """
    if len(entry) == 1:
        decoded = decode(entry[0].body)
        flat: list[str] = []
        deep: list[str] = []
        for k, v in decoded.items():
            t = type(v)
            if t is list:
                (flat if all(type(x) in _SCALARS for x in v) else deep).append(k)
            elif t is dict:
                deep.append(k)
        entry += [decoded, flat, deep]
    out: dict[str, Any] = entry[1].copy()
    for k in entry[2]:
        out[k] = out[k].copy()
    for k in entry[3]:
        v = out[k]
        out[k] = copy_entity(v) if type(v) is dict else _copy_list(v)
    return out


def copy_entity(entity: dict[str, Any]) -> dict[str, Any]:
    """A copy of a decoded entity deep enough that changing it changes nothing
    cached: dicts and lists are copied, scalars (all immutable) shared."""
    out = entity.copy()
    for k, v in out.items():
        t = type(v)
        if t is dict:
            out[k] = copy_entity(v)
        elif t is list:
            out[k] = _copy_list(v)
    return out
